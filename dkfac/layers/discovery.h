#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dkfac/layers/factor_capture.h"

namespace dkfac {

/// A module a front end found while walking its model (the C++ front end: a dkfac::nn module; Python: a
/// torch.nn.Linear or Conv2d leaf), for the one rule set that decides which are preconditioned.
struct ModuleCandidate {
  std::string name;        ///< as the model names it (named_modules)
  std::string class_name;  ///< its class as the front end's users know it ("Linear", "NonDynamicallyQuantizableLinear")
  LayerKind kind = LayerKind::kLinear;
  bool trainable = true;   ///< every parameter requires grad
  int64_t groups = 1;      ///< Conv2d: groups (K-FAC's Conv2d needs 1)
  /// Why the front end cannot precondition it ("" when it can): a sparse Embedding. Such a layer keeps its plain
  /// gradient, with a warning giving the reason.
  std::string plain_gradient_reason;
  /// The other modules holding one of its parameters (tied weights: GPT-2's lm_head and wte). Its gradient sums
  /// every use, and its own factors describe one: it keeps its plain gradient, with a warning naming them.
  std::vector<std::string> tied_to;
};

/// The candidates to precondition, as indices in their order. Rules, the same for both front ends:
/// - a module whose parameters do not all require grad (frozen) is left alone, silently;
/// - a grouped Conv2d, a candidate with a plain_gradient_reason, or one whose parameters are tied to other
///   modules keeps its plain gradient, with a warning naming it and why (TORCH_WARN);
/// - a module is skipped when one of `skip_layers` (ECMAScript regular expressions, searched) matches its name,
///   its kind ("Linear", "Conv2d") or its class name; a pattern that matches no candidate is warned about,
///   listing the candidates;
/// - none left is an error (c10::Error) naming `model`.
/// `reasons`, when given, receives for every candidate not chosen why not (frozen, the warning's reason, or the
/// skip_layers pattern that matched it), for the front end's list of what keeps its plain gradient.
std::vector<size_t> choose_layers(const std::vector<ModuleCandidate>& candidates,
                                  const std::vector<std::string>& skip_layers, const std::string& model,
                                  std::vector<std::string>* reasons = nullptr);

/// Whether one of `skip_layers` (ECMAScript regular expressions, searched, as choose_layers applies them) matches
/// one of `texts` (a module's name, kind or class name): for a front end's modules of kinds it has no factors for.
/// An invalid pattern is an error naming it.
bool skip_layers_match(const std::vector<std::string>& skip_layers, const std::vector<std::string>& texts);

/// Options::shared_input_layers as groups: for each of `names` (the registered layers, in model order), the index
/// of the first layer of its group (the group's leader, which holds the shared A factor), or -1 where the layer
/// is in no group (or leads one). A pattern's first capture group marks where member names differ: the layers a
/// pattern matches (searched) whose names agree once that text is replaced by "*" form one group; a group of one
/// layer shares nothing. Refused (c10::Error): a layer two patterns put in different groups. Warned: a pattern
/// that forms no group of two, listing the names it matched.
std::vector<int> input_groups(const std::vector<std::string>& names, const std::vector<std::string>& patterns);

}  // namespace dkfac
