// Preconditioner's factor phase: the captured batches taken, averaged over ranks and folded into the running
// factors at step(), or folded in each layer's backward hook where nothing is averaged (Options::fold_in_hooks,
// docs/MATH.md section 1.8).
#include <mutex>
#include <utility>
#include <vector>

#include "dkfac/preconditioner.h"

namespace dkfac {

std::vector<std::pair<torch::Tensor, torch::Tensor>> Preconditioner::take_factor_batches(
    const std::vector<LayerFate>& fates) {
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches(layers_.size());
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (fates[i] != LayerFate::kPreconditioned || !executor_->builds_factors(i) || hook_folded_[i].defined()) continue;
    batches[i] = layers_[i].take_factor_batches();
  }
  return batches;
}

void Preconditioner::update_factors(std::vector<LayerFate>& fates) {
  PhaseClock::Span span(clock_, KfacPhase::kFactors);
  mark("factor update");
  // Layers whose passes this step were what a fold in their hooks waits for: armed for the next factor steps.
  std::vector<bool> steady(layers_.size(), false);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const auto& capture = layers_[i].capture();
    const auto k = options_.accumulation_steps();
    steady[i] = hook_fold_[i] == HookFold::kAtStep && may_fold_in_hooks(i) && !capture.interleaved() &&
                capture.folded_passes() == 0 && capture.a_count() == k && capture.g_count() == k;
  }
  auto batches = take_factor_batches(fates);
  // Averaged before the NaN check, so that every rank takes the same decision.
  clock_.collective(KfacPhase::kFactors, [&] { executor_->reduce_factors(batches); });
  const double decay = options_.factor_decay_at(steps_);
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (fates[i] == LayerFate::kPlainGradient || !executor_->keeps_factors(i)) continue;
    mark("factor update", static_cast<int64_t>(i));
    // Checked with the gradients, in guard_and_clip: a layer whose batch was not finite keeps its factors
    // and, this step, its plain gradient.
    auto& layer = layers_[i];
    if (hook_folded_[i].defined()) {  // in its backward hook, as below
      factor_ok_[i] = std::exchange(hook_folded_[i], torch::Tensor());
      layer.capture().clear();  // its folded passes counted
      continue;
    }
    if (group_of(i) < 0) {
      factor_ok_[i] = layer.fold_factors(batches[i].first, batches[i].second, decay);
    } else {
      // A shared-input group (its members' fates are one: spread_group_fates): fold_group, as the hooks do.
      const auto leader = static_cast<size_t>(group_of(i));
      if (leader == i) {
        const auto members = group_members(i);
        std::vector<std::pair<torch::Tensor, torch::Tensor>> held;
        for (const auto j : members) held.push_back(batches[j]);
        const auto ok = fold_group(members, held, decay);
        for (size_t m = 0; m < members.size(); ++m) factor_ok_[members[m]] = ok[m];
      }
    }
    if (!layer.has_factors()) {  // a first update that was not finite: known here already
      factor_ok_[i] = torch::Tensor();
      warn_factor_fallback(i);
      fates[i] = LayerFate::kPlainGradient;
      continue;
    }
    if (steady[i]) arm_hook_fold(i);
  }
  // A shared-input group is armed whole or not at all: a member left unarmed (its passes did not match, or its first
  // update was not finite) leaves the others to fold at step() too, so that all are steady again at a later update.
  std::vector<bool> group_armed(layers_.size(), true);  // by leader
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (group_of(i) >= 0 && hook_fold_[i] != HookFold::kArmed) group_armed[static_cast<size_t>(group_of(i))] = false;
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    const bool left = group_of(i) >= 0 && !group_armed[static_cast<size_t>(group_of(i))];
    if (left && hook_fold_[i] == HookFold::kArmed) disarm_hook_fold(i);
  }
}

bool Preconditioner::may_fold_in_hooks(size_t index) const {
  // Where step() would fold exactly what the hook has: nothing averaged over ranks, no rank's verdict on the layer
  // awaited, no loss scale that may skip the step (the scaler's skipped batch joins the next).
  return options_.fold_in_hooks() && executor_->plan().reduction == strategy::FactorReduction::kNone &&
         executor_->builds_factors(index) && executor_->keeps_factors(index) && !agrees_on_unused_layers() &&
         !options_.grad_scaler();
}

void Preconditioner::arm_hook_fold(size_t index) {
  hook_fold_[index] = HookFold::kArmed;
  // The capture outlives neither the preconditioner's layers nor its destructor, which disarms it.
  layers_[index].capture().set_fold([this, index] { return fold_in_hook(index); }, options_.accumulation_steps());
}

void Preconditioner::disarm_hook_folds() {
  for (size_t i = 0; i < layers_.size(); ++i) disarm_hook_fold(i);
}

void Preconditioner::disarm_hook_fold(size_t index) {
  if (hook_fold_[index] == HookFold::kArmed) hook_fold_[index] = HookFold::kAtStep;
  layers_[index].capture().set_fold(nullptr, 0);
}

bool Preconditioner::may_fold_now(size_t index) const {
  // Left to step() (nothing taken): a weight or bias frozen since, which check_layers names; a layer without factors
  // (loaded so), whose first update step() decides on the host.
  const auto& layer = layers_[index];
  return hook_fold_[index] == HookFold::kArmed && layer.trainable() && layer.has_factors();
}

bool Preconditioner::fold_in_hook(size_t index) {
  // On the thread that ran the layer's backward hook, while step() waits for the backward pass to end.
  if (group_of(index) >= 0) return fold_group_in_hook(static_cast<size_t>(group_of(index)));
  if (!may_fold_now(index)) return false;
  auto& layer = layers_[index];
  const double decay = options_.factor_decay_at(steps_);  // a schedule that throws takes nothing
  auto [a, g] = layer.take_factor_batches();
  hook_folded_[index] = layer.fold_factors(a, g, decay);
  return true;
}

bool Preconditioner::fold_group_in_hook(size_t leader) {
  // In the hook of whichever member's passes come in last, once every member's have, each given the one input
  // (check_shared_inputs refuses the step otherwise: nothing is taken); else a member's hook that comes later does
  // it, or step(), which then sees exactly these batches. The same folds as update_factors', in its order.
  // Members' hooks run on the thread of their device's backward pass, so one at a time; held anyway, so that two
  // hooks never both find the group complete.
  static std::mutex group_fold;
  const std::lock_guard<std::mutex> lock(group_fold);
  const auto members = group_members(leader);
  const auto passes = static_cast<size_t>(options_.accumulation_steps());
  for (const auto j : members) {
    const auto& capture = layers_[j].capture();
    if (!may_fold_now(j) || !capture.fold_ready() || capture.input_passes() != passes ||
        !capture.input_mismatch(nullptr).empty()) {
      return false;
    }
  }
  const double decay = options_.factor_decay_at(steps_);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  for (const auto j : members) batches.push_back(layers_[j].take_factor_batches());
  const auto ok = fold_group(members, batches, decay);
  for (size_t m = 0; m < members.size(); ++m) {
    hook_folded_[members[m]] = ok[m];
    layers_[members[m]].capture().mark_folded();
  }
  return true;
}

std::vector<torch::Tensor> Preconditioner::fold_group(
    const std::vector<size_t>& members, const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches,
    double decay) {
  // The leader (members[0]) folds the one A where its batch and every member's G batch are finite: as each
  // member's own A would fold with its G (fold_factors), whenever the members' batches are finite or not together
  // (a loss scale's overflow reaches them all). Each member folds its G where its G and the A batch are finite, and
  // is usable where both are. (A G that alone is not finite keeps the group's A, where separate factors would fold
  // the others'.)
  const auto a_finite = torch::isfinite(batches[0].first).all();
  auto every_g = a_finite;
  for (const auto& batch : batches) every_g = every_g.logical_and(torch::isfinite(batch.second).all());
  const size_t leader = members[0];
  layers_[leader].fold_factor(/*a=*/true, batches[0].first, decay, every_g);
  std::vector<torch::Tensor> ok;
  for (size_t m = 0; m < members.size(); ++m) {
    auto& layer = layers_[members[m]];
    if (layer.follows_a()) layer.link_a(layers_[leader]);
    // No G before there is an A (a first update not folded): a layer never holds G alone.
    ok.push_back(layer.a_factor().defined() ? layer.fold_factor(/*a=*/false, batches[m].second, decay, a_finite)
                                            : every_g);
  }
  return ok;
}

void Preconditioner::drop_stale_hook_folds() {
  // A fold the step that followed did not take (its schedule made it no factor step after the captures were armed,
  // or the step failed or was reset): it stays in the factors, and nothing of its window is carried to the next.
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (layers_[i].capture().folded_passes() > 0) layers_[i].capture().clear();
  }
  std::fill(hook_folded_.begin(), hook_folded_.end(), torch::Tensor());
}

std::string Preconditioner::check_hook_fold(size_t index) {
  auto& capture = layers_[index].capture();
  const auto folded = capture.folded_passes();
  const auto forwards = capture.a_count(), backwards = capture.g_count();
  if (folded == 0 || (forwards == 0 && backwards == 0)) return "";
  // Passes after the ones its hook folded: the accumulation it was armed by changed. They are dropped (folding them
  // too would decay the factors twice in one step), and the layer folds at step() from now on.
  hook_fold_[index] = HookFold::kNever;
  capture.set_fold(nullptr, 0);
  capture.clear();
  return "ran " + std::to_string(forwards) + " forward and " + std::to_string(backwards) + " backward passes after " +
         "the " + std::to_string(folded) + " (accumulation_steps) its backward hook had folded into its factors this " +
         "step; they are dropped. It folds at step() from now on, averaging every pass (fold_in_hooks off folds every " +
         "layer there)";
}

}  // namespace dkfac
