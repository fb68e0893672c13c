#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <tuple>

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include "dkfac/comm/communicator.h"
#include "dkfac/options.h"
#include "dkfac/preconditioner.h"

/// K-FAC as one optimizer for LibTorch training loops: the C++ counterpart of Python's `dkfac.optim.KFAC`.
namespace dkfac::optim {

/// How dkfac::optim::KFAC ties its preconditioner to its base optimizer.
struct KFACOptions {
  /// The preconditioner's `lr` (K-FAC uses it only in KL clipping, where it should be the lr the step applies) is
  /// the base optimizer's `param_groups()[0]` lr, read at each step(): a LibTorch LR scheduler stepping the base is
  /// followed. false: the Options' own lr (a value or a schedule). For a preconditioner KFAC builds (one built
  /// beforehand keeps its own lr).
  TORCH_ARG(bool, kfac_lr_follows) = true;
  /// Each preconditioned layer moves along K-FAC's direction by the length of the base's own step on its plain
  /// gradient (math::graft_block; the base's lr, moments and weight decay as without K-FAC); the other parameters
  /// take the base's step. The gradients left are the plain ones. Not with eigen_adam.
  TORCH_ARG(bool, graft) = false;
};

/// A base optimizer (torch::optim::SGD, AdamW, ...) whose step() first preconditions the gradients with K-FAC:
///
///   auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
///   dkfac::optim::KFAC opt(net, sgd, dkfac::Options().factor_update_steps(10).inv_update_steps(100));
///   torch::optim::StepLR scheduler(opt.base(), 30, 0.1);   // schedulers act on the base optimizer
///   // each step: opt.zero_grad(); loss.backward(); opt.step();
///
/// - step() is Preconditioner::step() then the base's step(). Before Options::start_preconditioning_step the base
///   steps on the plain gradients (the preconditioner builds its factors).
/// - With Options::eigen_adam the base must be torch::optim::AdamW (or Adam without weight decay), without amsgrad:
///   each preconditioned layer's parameter p of a param group with lr and weight_decay becomes
///   p (1 - lr weight_decay) - lr d, d the preconditioner's step in the K-FAC eigenbasis (docs/MATH.md section 8,
///   math::apply_decoupled_step), and the base steps the other parameters (the preconditioned ones have no
///   gradient during its step, so it keeps no state for them). Adam's betas and eps are those of the base's groups
///   holding preconditioned layers, read at each step (they must agree); a layer the preconditioner leaves its plain
///   gradient that step moves by lr times that gradient.
/// - save() / load() hold both halves; a load that is refused (either half) leaves both as they were.
/// The same object as Python's dkfac.optim.KFAC, over the same core: the two give the same numbers.
class KFAC {
 public:
  /// Builds a Preconditioner(model, options, communicator) for `base`, its lr following the base's when
  /// `kfac_options.kfac_lr_follows()`. Refuses, naming the problem, a base that re-evaluates its closure
  /// (torch::optim::LBFGS), an eigen_adam base that is not AdamW (or Adam without weight decay), and a base that
  /// optimizes none of the preconditioned layers (built for another model); warns of layers it leaves out.
  KFAC(std::shared_ptr<torch::nn::Module> model, std::shared_ptr<torch::optim::Optimizer> base,
       Options options = Options(), std::shared_ptr<comm::Communicator> communicator = nullptr,
       KFACOptions kfac_options = KFACOptions());
  /// Uses a built preconditioner, with its own lr (and, with eigen_adam, its own Adam constants).
  KFAC(std::shared_ptr<Preconditioner> preconditioner, std::shared_ptr<torch::optim::Optimizer> base,
       KFACOptions kfac_options = KFACOptions());

  /// Runs `closure` when given (grad mode on: the forward and backward that make the gradients), then the
  /// preconditioner's step and the base's step (without the closure). Returns the closure's loss, or an undefined
  /// tensor without one.
  torch::Tensor step(const std::function<torch::Tensor()>& closure = nullptr);
  /// The base's zero_grad.
  void zero_grad(bool set_to_none = true) { base_->zero_grad(set_to_none); }

  /// The base optimizer (give it to LR schedulers).
  torch::optim::Optimizer& base() { return *base_; }
  /// The preconditioner.
  Preconditioner& preconditioner() { return *preconditioner_; }

  /// Writes the base's state under "base" and the preconditioner's (Preconditioner::save: collective in a
  /// distributed job) under "kfac".
  void save(torch::serialize::OutputArchive& archive) const;
  /// Reads what save() wrote. An archive without either entry (a plain optimizer's, a preconditioner's) is refused
  /// naming it; the base's state is loaded, then the preconditioner's (Preconditioner::load: collective), and where
  /// either is refused (on any rank) the base's state is put back as it was and the error names the cause.
  void load(torch::serialize::InputArchive& archive);

 private:
  // The parameters of the preconditioned layers (weights, and biases where they have one).
  std::vector<torch::Tensor> preconditioned_parameters() const;
  // eigen_adam: the preconditioner's step, the base's on the other parameters, then AdamW's update of these.
  void eigen_adam_step();
  // KFACOptions::graft: the base's step on the plain gradients, each layer's put along K-FAC's direction.
  void grafted_step();
  // eigen_adam: the base's betas and eps, where its groups hold preconditioned layers, given to the preconditioner.
  void follow_adam_constants();
  // The base's kind: at construction (with the layers it optimizes).
  void check_base() const;
  // eigen_adam: every group AdamW's (or Adam's without weight decay), without amsgrad; at construction and each step.
  void check_adam_groups() const;

  std::shared_ptr<Preconditioner> preconditioner_;
  std::shared_ptr<torch::optim::Optimizer> base_;
  bool graft_ = false;
  bool adam_follows_ = false;
  std::optional<std::tuple<double, double, double>> adam_constants_;  // last given to the preconditioner
};

/// Writes `optimizer` to an archive (for torch::save).
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive, const KFAC& optimizer);
/// Reads `optimizer` from an archive (for torch::load).
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, KFAC& optimizer);

}  // namespace dkfac::optim
