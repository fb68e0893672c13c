#include "dkfac/layers/discovery.h"

#include <regex>

#include <c10/util/Exception.h>

namespace dkfac {

std::vector<size_t> choose_layers(const std::vector<ModuleCandidate>& candidates,
                                  const std::vector<std::string>& skip_layers, const std::string& model) {
  std::vector<std::regex> patterns;
  for (const auto& pattern : skip_layers) {
    try {
      patterns.emplace_back(pattern);
    } catch (const std::regex_error& e) {
      TORCH_CHECK(false, "skip_layers pattern '", pattern, "' is not a valid regular expression: ", e.what());
    }
  }
  std::vector<bool> used(patterns.size(), false);
  std::string listed;  // "'fc1' (Linear)" of every candidate a pattern could match
  std::vector<size_t> chosen;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const auto& c = candidates[i];
    if (!c.trainable) continue;
    const std::string kind = to_string(c.kind);
    if (c.kind == LayerKind::kConv2d && c.groups != 1) {
      TORCH_WARN("dkfac: layer '", c.name, "' is a grouped Conv2d (groups=", c.groups,
                 "); it keeps its plain gradient");
      continue;
    }
    listed += (listed.empty() ? "'" : ", '") + c.name + "' (" + c.class_name + ")";
    bool skipped = false;
    for (size_t p = 0; p < patterns.size(); ++p) {
      const bool match = std::regex_search(c.name, patterns[p]) || std::regex_search(kind, patterns[p]) ||
                         std::regex_search(c.class_name, patterns[p]);
      if (match) used[p] = skipped = true;
    }
    if (!skipped) chosen.push_back(i);
  }
  for (size_t p = 0; p < patterns.size(); ++p) {
    if (used[p]) continue;
    TORCH_WARN("dkfac: skip_layers pattern '", skip_layers[p], "' matches no layer, so it skips nothing; patterns are ",
               "searched (ECMAScript regular expressions) in these layer names, kinds and classes: ", listed);
  }
  TORCH_CHECK(!chosen.empty(), "found no Linear or Conv2d layer to precondition in ", model,
              " (after skip_layers and frozen parameters)");
  return chosen;
}

}  // namespace dkfac
