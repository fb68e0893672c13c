#include "dkfac/layers/discovery.h"

#include <map>
#include <regex>

#include <c10/util/Exception.h>

namespace dkfac {

namespace {

std::vector<std::regex> skip_patterns(const std::vector<std::string>& skip_layers) {
  std::vector<std::regex> patterns;
  for (const auto& pattern : skip_layers) {
    try {
      patterns.emplace_back(pattern);
    } catch (const std::regex_error& e) {
      TORCH_CHECK(false, "skip_layers pattern '", pattern, "' is not a valid regular expression: ", e.what());
    }
  }
  return patterns;
}

}  // namespace

bool skip_layers_match(const std::vector<std::string>& skip_layers, const std::vector<std::string>& texts) {
  for (const auto& pattern : skip_patterns(skip_layers)) {
    for (const auto& text : texts) {
      if (std::regex_search(text, pattern)) return true;
    }
  }
  return false;
}

std::vector<size_t> choose_layers(const std::vector<ModuleCandidate>& candidates,
                                  const std::vector<std::string>& skip_layers, const std::string& model,
                                  std::vector<std::string>* reasons) {
  if (reasons != nullptr) reasons->assign(candidates.size(), "");
  const auto patterns = skip_patterns(skip_layers);
  std::vector<bool> used(patterns.size(), false);
  std::string listed;  // "'fc1' (Linear)" of every candidate a pattern could match
  std::vector<size_t> chosen;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const auto& c = candidates[i];
    auto set_aside = [&](std::string why) {
      if (reasons != nullptr) (*reasons)[i] = std::move(why);
    };
    if (!c.trainable) {
      set_aside("frozen (a parameter does not require grad)");
      continue;
    }
    const std::string kind = to_string(c.kind);
    // A front end's own reason first (a weight-normed grouped Conv1d is named for its weight norm).
    if (c.kind == LayerKind::kConv2d && c.groups != 1 && c.plain_gradient_reason.empty()) {
      TORCH_WARN("dkfac: layer '", c.name, "' is a grouped ", c.class_name, " (groups=", c.groups,
                 "); it keeps its plain gradient");
      set_aside("a grouped " + c.class_name + " (groups=" + std::to_string(c.groups) + ")");
      continue;
    }
    std::string reason = c.plain_gradient_reason;
    if (reason.empty() && !c.tied_to.empty()) {
      std::string others;
      for (const auto& other : c.tied_to) others += (others.empty() ? "'" : ", '") + other + "'";
      reason = "tied to " + others + " (one Parameter in several modules: its gradient sums every use, and one "
               "module's factors describe only its own use)";
    }
    if (!reason.empty()) {
      TORCH_WARN("dkfac: layer '", c.name, "' (", c.class_name, ") keeps its plain gradient: ", reason);
      set_aside(reason);
      continue;
    }
    listed += (listed.empty() ? "'" : ", '") + c.name + "' (" + c.class_name + ")";
    bool skipped = false;
    for (size_t p = 0; p < patterns.size(); ++p) {
      const bool match = std::regex_search(c.name, patterns[p]) || std::regex_search(kind, patterns[p]) ||
                         std::regex_search(c.class_name, patterns[p]);
      if (match && !skipped) set_aside("skip_layers pattern '" + skip_layers[p] + "'");
      if (match) used[p] = skipped = true;
    }
    if (!skipped) chosen.push_back(i);
  }
  for (size_t p = 0; p < patterns.size(); ++p) {
    if (used[p]) continue;
    TORCH_WARN("dkfac: skip_layers pattern '", skip_layers[p], "' matches no layer, so it skips nothing; patterns are ",
               "searched (ECMAScript regular expressions) in these layer names, kinds and classes: ", listed);
  }
  TORCH_CHECK(!chosen.empty(), "found no Linear, Conv2d or Embedding layer to precondition in ", model,
              " (after skip_layers, frozen parameters and layers that keep their plain gradient)");
  return chosen;
}

std::vector<int> input_groups(const std::vector<std::string>& names, const std::vector<std::string>& patterns) {
  std::vector<int> leader(names.size(), -1);
  std::vector<std::string> grouped_by(names.size());  // the pattern that put each layer in a group of two or more
  for (const auto& pattern : patterns) {
    const std::regex re(pattern);  // Options::validate checked it
    std::map<std::string, std::vector<size_t>> groups;  // the name with the captured text as "*" -> members
    std::string matched;
    for (size_t i = 0; i < names.size(); ++i) {
      std::smatch m;
      if (!std::regex_search(names[i], m, re) || !m[1].matched) continue;
      const auto at = static_cast<size_t>(m.position(1));
      groups[names[i].substr(0, at) + "*" + names[i].substr(at + static_cast<size_t>(m.length(1)))].push_back(i);
      matched += (matched.empty() ? "'" : ", '") + names[i] + "'";
    }
    bool formed = false;
    for (const auto& [key, members] : groups) {
      if (members.size() < 2) continue;
      formed = true;
      for (size_t k = 0; k < members.size(); ++k) {
        const size_t i = members[k];
        TORCH_CHECK(grouped_by[i].empty(), "shared_input_layers: layer '", names[i], "' is in a group of pattern '",
                    grouped_by[i], "' and of pattern '", pattern, "'; a layer reads one input, so it belongs to one "
                    "group");
        grouped_by[i] = pattern;
        if (k > 0) leader[i] = static_cast<int>(members[0]);
      }
    }
    if (!formed) {
      TORCH_WARN("dkfac: shared_input_layers pattern '", pattern, "' forms no group of two or more layers, so it ",
                 "shares nothing; it matched ", matched.empty() ? std::string("no layer") : matched,
                 " (members' names must agree outside the pattern's capture group)");
    }
  }
  return leader;
}

}  // namespace dkfac
