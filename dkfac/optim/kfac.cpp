#include "dkfac/optim/kfac.h"

#include <algorithm>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>

#include "dkfac/comm/agreement.h"
#include "dkfac/math/eigen_adam.h"
#include "dkfac/math/graft.h"

namespace dkfac::optim {

namespace {

// Adam's (beta1, beta2, eps) and weight decay of a param group of AdamW or Adam; nullopt for any other options.
struct AdamGroup {
  double beta1, beta2, eps, weight_decay;
  bool amsgrad;
};

std::optional<AdamGroup> adam_group(const torch::optim::OptimizerOptions& options) {
  if (const auto* w = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) {
    return AdamGroup{std::get<0>(w->betas()), std::get<1>(w->betas()), w->eps(), w->weight_decay(), w->amsgrad()};
  }
  if (const auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&options)) {
    return AdamGroup{std::get<0>(a->betas()), std::get<1>(a->betas()), a->eps(), a->weight_decay(), a->amsgrad()};
  }
  return std::nullopt;
}

// The base's state written to bytes, to be put back where a load is refused.
std::string snapshot(const torch::optim::Optimizer& base) {
  torch::serialize::OutputArchive archive;
  base.save(archive);
  std::ostringstream bytes;
  archive.save_to(bytes);
  return bytes.str();
}

void put_back(torch::optim::Optimizer& base, const std::string& bytes) {
  base.state().clear();  // a load fills in the entries it saved: those a refused load added go first
  std::istringstream in(bytes);
  torch::serialize::InputArchive archive;
  archive.load_from(in);
  base.load(archive);
}

std::shared_ptr<torch::optim::Optimizer> checked(std::shared_ptr<torch::optim::Optimizer> base) {
  TORCH_CHECK(base != nullptr, "dkfac::optim::KFAC: the base optimizer is null");
  TORCH_CHECK(!base->param_groups().empty(), "dkfac::optim::KFAC: the base optimizer has no param groups");
  return base;
}

// `options` with its lr the base's first group's, read when the preconditioner reads it (each step): KL clipping's
// lr is then the one this step applies, as an LR scheduler last set it on the base.
Options lr_following(Options options, const std::shared_ptr<torch::optim::Optimizer>& base) {
  options.lr(std::function<double(int64_t)>(
      [base](int64_t) { return base->param_groups().at(0).options().get_lr(); }));
  return options;
}

}  // namespace

KFAC::KFAC(std::shared_ptr<torch::nn::Module> model, std::shared_ptr<torch::optim::Optimizer> base, Options options,
           std::shared_ptr<comm::Communicator> communicator, KFACOptions kfac_options)
    : base_(checked(std::move(base))), graft_(kfac_options.graft()), adam_follows_(options.eigen_adam()) {
  if (kfac_options.kfac_lr_follows()) options = lr_following(std::move(options), base_);
  preconditioner_ = std::make_shared<Preconditioner>(std::move(model), std::move(options), std::move(communicator));
  check_base();
  follow_adam_constants();
}

KFAC::KFAC(std::shared_ptr<Preconditioner> preconditioner, std::shared_ptr<torch::optim::Optimizer> base,
           KFACOptions kfac_options)
    : preconditioner_(std::move(preconditioner)), base_(checked(std::move(base))), graft_(kfac_options.graft()) {
  TORCH_CHECK(preconditioner_ != nullptr, "dkfac::optim::KFAC: the preconditioner is null");
  check_base();
}

void KFAC::check_base() const {
  TORCH_CHECK(dynamic_cast<const torch::optim::LBFGS*>(base_.get()) == nullptr,
              "dkfac::optim::KFAC: torch::optim::LBFGS re-evaluates its closure inside step(), and those gradients "
              "would not be preconditioned; wrap an optimizer that steps on the gradients it is given (SGD, Adam, "
              "AdamW, ...)");
  TORCH_CHECK(!(graft_ && preconditioner_->options().eigen_adam()), "dkfac::optim::KFAC: graft takes the length of the "
              "base optimizer's step; eigen_adam's step is Adam's own, with its own length: use one of them");
  check_adam_groups();
  std::set<const c10::TensorImpl*> optimized;
  for (const auto& group : base_->param_groups()) {
    for (const auto& p : group.params()) optimized.insert(p.unsafeGetTensorImpl());
  }
  std::vector<std::string> outside;
  const auto& layers = preconditioner_->layers();
  for (const auto& layer : layers) {
    const bool in = optimized.count(layer.weight().unsafeGetTensorImpl()) > 0 ||
                    (layer.bias().defined() && optimized.count(layer.bias().unsafeGetTensorImpl()) > 0);
    if (!in) outside.push_back(layer.name());
  }
  auto names = [&] {
    std::string out;
    for (size_t i = 0; i < outside.size() && i < 5; ++i) out += (i ? ", '" : "'") + outside[i] + "'";
    return out + (outside.size() > 5 ? ", ..." : "");
  };
  TORCH_CHECK(layers.empty() || outside.size() < layers.size(), "dkfac::optim::KFAC: none of the preconditioned "
              "layers has its parameters in the base optimizer's param groups (the preconditioner and the optimizer "
              "were built for different models or parameters?); layers: ", names());
  if (!outside.empty()) {
    TORCH_WARN("dkfac::optim::KFAC: ", outside.size(), " preconditioned layer(s) are not optimized by the base "
               "optimizer, so their preconditioned gradients are not applied: ", names());
  }
}

void KFAC::check_adam_groups() const {
  const auto& groups = base_->param_groups();
  if (preconditioner_->options().eigen_adam()) {
    for (size_t i = 0; i < groups.size(); ++i) {
      const auto adam = adam_group(groups[i].options());
      TORCH_CHECK(adam.has_value(), "dkfac::optim::KFAC: eigen_adam runs Adam in the K-FAC eigenbasis and AdamW on "
                  "the other parameters: the base optimizer must be torch::optim::AdamW (or Adam); param group ", i,
                  " has other options");
      TORCH_CHECK(adam->weight_decay == 0.0 || dynamic_cast<const torch::optim::AdamWOptions*>(&groups[i].options()),
                  "dkfac::optim::KFAC: eigen_adam with torch::optim::Adam: param group ", i, " has weight_decay ",
                  adam->weight_decay, ", Adam's L2 penalty (added to the gradient); eigen_adam decays weights as "
                  "AdamW does: use torch::optim::AdamW");
      TORCH_CHECK(!adam->amsgrad, "dkfac::optim::KFAC: eigen_adam: param group ", i,
                  " has amsgrad, which Adam in the eigenbasis does not do; turn it off");
    }
  }
}

std::vector<torch::Tensor> KFAC::preconditioned_parameters() const {
  std::vector<torch::Tensor> out;
  for (const auto& layer : preconditioner_->layers()) {
    for (const auto& p : {layer.weight(), layer.bias()}) {
      if (p.defined()) out.push_back(p);
    }
  }
  return out;
}

torch::Tensor KFAC::step(const std::function<torch::Tensor()>& closure) {
  torch::Tensor loss;
  if (closure) {
    torch::AutoGradMode grad_mode(true);
    loss = closure();
  }
  // Before start_preconditioning_step the preconditioner builds its factors and leaves every gradient plain: the
  // base's own step on all of them, as below.
  const bool preconditions = preconditioner_->steps() >= preconditioner_->options().start_preconditioning_step();
  if (preconditions && preconditioner_->options().eigen_adam()) {
    eigen_adam_step();
  } else if (preconditions && graft_) {
    grafted_step();
  } else {
    preconditioner_->step();
    base_->step();
  }
  return loss;
}

void KFAC::follow_adam_constants() {
  if (!adam_follows_) return;
  std::set<const c10::TensorImpl*> known;
  for (const auto& p : preconditioned_parameters()) known.insert(p.unsafeGetTensorImpl());
  std::optional<std::pair<std::tuple<double, double, double>, size_t>> seen;
  const auto& groups = base_->param_groups();
  for (size_t i = 0; i < groups.size(); ++i) {
    const bool holds = std::any_of(groups[i].params().begin(), groups[i].params().end(),
                                   [&](const torch::Tensor& p) { return known.count(p.unsafeGetTensorImpl()) > 0; });
    const auto adam = adam_group(groups[i].options());
    if (!holds || !adam) continue;
    const auto constants = std::make_tuple(adam->beta1, adam->beta2, adam->eps);
    if (!seen) {
      seen = std::make_pair(constants, i);
    } else {
      TORCH_CHECK(seen->first == constants, "dkfac::optim::KFAC: eigen_adam runs one Adam over every preconditioned "
                  "layer: param groups ", seen->second, " and ", i, " hold preconditioned layers with (beta1, beta2, "
                  "eps) (", std::get<0>(seen->first), ", ", std::get<1>(seen->first), ", ", std::get<2>(seen->first),
                  ") and (", adam->beta1, ", ", adam->beta2, ", ", adam->eps, "); give those layers one group (or the "
                  "same betas and eps)");
    }
  }
  if (seen && seen->first != adam_constants_) {
    const auto [beta1, beta2, eps] = seen->first;
    preconditioner_->set_adam_constants(beta1, beta2, eps);
    adam_constants_ = seen->first;
  }
}

void KFAC::eigen_adam_step() {
  check_adam_groups();  // groups added since (Optimizer::add_param_group) are held to the same rules
  follow_adam_constants();
  preconditioner_->step();
  std::set<const c10::TensorImpl*> preconditioned;
  for (const auto& p : preconditioned_parameters()) preconditioned.insert(p.unsafeGetTensorImpl());
  // Each group's preconditioned parameters with a step, and those steps; taken out of the gradients, so that the
  // base steps the other parameters alone.
  auto& groups = base_->param_groups();
  std::vector<std::vector<torch::Tensor>> stepped(groups.size()), directions(groups.size());
  for (size_t k = 0; k < groups.size(); ++k) {
    for (auto& p : groups[k].params()) {
      if (preconditioned.count(p.unsafeGetTensorImpl()) > 0 && p.grad().defined()) {
        stepped[k].push_back(p);
        directions[k].push_back(p.grad());
        p.mutable_grad() = torch::Tensor();
      }
    }
  }
  auto restore = [&] {
    for (size_t k = 0; k < groups.size(); ++k) {
      for (size_t i = 0; i < stepped[k].size(); ++i) stepped[k][i].mutable_grad() = directions[k][i];
    }
  };
  try {
    base_->step();
  } catch (...) {
    restore();
    throw;
  }
  restore();
  for (size_t k = 0; k < groups.size(); ++k) {
    if (stepped[k].empty()) continue;
    const auto adam = adam_group(groups[k].options());
    math::apply_decoupled_step(stepped[k], directions[k], groups[k].options().get_lr(),
                               adam ? adam->weight_decay : 0.0);
  }
}

void KFAC::grafted_step() {
  std::vector<std::vector<torch::Tensor>> blocks, plain;  // each layer's weight and bias with a gradient
  for (const auto& layer : preconditioner_->layers()) {
    blocks.emplace_back();
    plain.emplace_back();
    for (const auto& p : {layer.weight(), layer.bias()}) {
      if (p.defined() && p.grad().defined()) {
        blocks.back().push_back(p);
        plain.back().push_back(p.grad().clone());
      }
    }
  }
  preconditioner_->step();
  std::vector<std::vector<torch::Tensor>> directions(blocks.size()), before(blocks.size());
  {
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < blocks.size(); ++k) {
      for (size_t i = 0; i < blocks[k].size(); ++i) {
        auto& p = blocks[k][i];
        directions[k].push_back(p.grad().clone());
        before[k].push_back(p.detach().clone());
        p.mutable_grad().copy_(plain[k][i]);  // the base steps on the plain gradients
      }
    }
  }
  base_->step();
  for (size_t k = 0; k < blocks.size(); ++k) math::graft_block(blocks[k], before[k], directions[k]);
}

void KFAC::save(torch::serialize::OutputArchive& archive) const {
  torch::serialize::OutputArchive base_archive, kfac_archive;
  base_->save(base_archive);
  preconditioner_->save(kfac_archive);
  archive.write("base", base_archive);
  archive.write("kfac", kfac_archive);
}

void KFAC::load(torch::serialize::InputArchive& archive) {
  torch::serialize::InputArchive base_archive, kfac_archive;
  for (auto [key, nested] : {std::make_pair("base", &base_archive), std::make_pair("kfac", &kfac_archive)}) {
    TORCH_CHECK(archive.try_read(key, *nested), "dkfac::optim::KFAC::load: the archive has no '", key, "' entry, so "
                "it is not a dkfac::optim::KFAC's (a plain optimizer's or a Preconditioner's archive?); nothing was "
                "loaded");
  }
  const auto before = snapshot(*base_);
  std::string refusal;
  try {
    base_->load(base_archive);
  } catch (const std::exception& e) {
    refusal = std::string("the base optimizer's state was refused: ") + e.what();
  }
  // Every rank goes on to the preconditioner's (collective) load only where every rank's base took its state.
  const auto& communicator = preconditioner_->communicator();
  if (communicator && communicator->size() > 1) refusal = comm::first_refusal(*communicator, refusal);
  if (!refusal.empty()) {
    put_back(*base_, before);
    TORCH_CHECK(false, "dkfac::optim::KFAC::load: ", refusal, "; nothing was loaded");
  }
  try {
    preconditioner_->load(kfac_archive);  // refused on every rank alike, changing nothing, or taken
  } catch (...) {
    put_back(*base_, before);
    throw;
  }
}

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive, const KFAC& optimizer) {
  optimizer.save(archive);
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, KFAC& optimizer) {
  optimizer.load(archive);
  return archive;
}

}  // namespace dkfac::optim
