#include "dkfac/strategy/auto.h"

#include <algorithm>
#include <sstream>
#include <utility>

#include <c10/util/Exception.h>

#include "dkfac/comm/communicator.h"

namespace dkfac::strategy {

namespace {

// Where a part runs the model's leading part's pick in place of its own (`own`): says so.
std::string leading_pick(const StrategyChoice& choice, size_t own) {
  return "  the pick of the model's leading part, which every part runs (this part's was " +
         choice.candidates.at(own).name + ")";
}

}  // namespace

AutoStrategy::AutoStrategy(std::shared_ptr<comm::Communicator> communicator)
    : communicator_(std::move(communicator)) {
  TORCH_CHECK(communicator_ && communicator_->size() > 1, "AutoStrategy needs several ranks");
}

void AutoStrategy::use_rates(Rates rates) {
  TORCH_CHECK(pending_, "use_rates: strategy auto already chose at the first step; give rates before it");
  rates.validate();
  given_rates_ = std::move(rates);
}

Options AutoStrategy::choose(const Options& requested, const std::vector<assign::LayerShape>& shapes, int64_t batch,
                             c10::Device device, c10::ScalarType dtype, int64_t step,
                             const ModelAgreement& with_model) {
  TORCH_CHECK(pending_, "strategy auto chose already");
  pending_ = false;
  requested_ = requested;
  const int world = communicator_->size();
  const auto rates = given_rates_ ? *given_rates_ : measure_rates(*communicator_, device, dtype, requested_.compute_method());
  auto choice = choose_strategy(shapes, world, requested_, rates, requested_.memory_budget(), batch,
                                {requested_.factor_update_steps_at(step), requested_.inv_update_steps_at(step)});
  choice.chosen = agree_on_choice(*communicator_, choice.chosen);
  const size_t own = choice.chosen;
  if (with_model) choice.chosen = with_model(choice.chosen);
  description_ = choice.describe() + "  batch " + std::to_string(batch) + " samples per rank per step, rates " +
                 (given_rates_ ? "given" : "measured now on " + std::to_string(world) + " ranks");
  if (with_model) {
    description_ += "\n" + (choice.chosen == own ? "  the model's other parts run it too" : leading_pick(choice, own));
  }
  if (requested_.auto_recheck_steps() > 0) {
    recheck_ = Recheck{rates, choice.pick().name, batch, step + 1, step + requested_.auto_recheck_steps(), {}};
  }
  return choice.apply(requested_);
}

void AutoStrategy::record(int64_t step, StepKind kind, const PhaseTimes& seconds) {
  TORCH_CHECK(profiles(step), "strategy auto does not profile step ", step);
  auto& p = recheck_->profiled;
  p.kinds.push_back(kind);
  p.seconds += seconds;
}

bool AutoStrategy::recheck_due(int64_t steps_done) const { return recheck_ && steps_done > recheck_->last_step; }

std::optional<Options> AutoStrategy::recheck(const std::vector<assign::LayerShape>& shapes,
                                             const StepPlan& running_plan, const Options& running,
                                             int64_t steps_done, const ModelAgreement& with_model) {
  TORCH_CHECK(recheck_due(steps_done), "strategy auto's re-check is not due at step ", steps_done);
  const Recheck check = *recheck_;
  recheck_.reset();
  // Every rank decides from the same figures: each compute phase as the slowest rank measured it (the step
  // waits for it), communication as the rank that waited least (the collectives' own time, as the model has it).
  const auto& mine = check.profiled;
  std::vector<double> mine_seconds;
  for (const auto phase : kCalibratedPhases) mine_seconds.push_back(mine.seconds[phase]);
  const auto all = comm::gather_over(*communicator_, comm::kWorld, mine_seconds);
  ProfiledSteps measured;
  measured.kinds = mine.kinds;
  for (size_t k = 0; k < kCalibratedPhases.size(); ++k) {
    const bool waits = kCalibratedPhases[k] == KfacPhase::kCommunication;
    double& seconds = measured.seconds[kCalibratedPhases[k]];
    seconds = all.front()[k];
    for (const auto& rank : all) seconds = waits ? std::min(seconds, rank[k]) : std::max(seconds, rank[k]);
  }
  const auto scales = calibrate(running_plan, check.rates, check.batch, measured);
  std::ostringstream report;
  report << "strategy auto re-checked after " << measured.kinds.size() << " profiled steps (" << check.first_step
         << " to " << check.last_step << "): measured / predicted " << scales.describe();
  std::optional<Options> switch_to;
  const bool within = scales.within(kRecheckTolerance);
  bool keep = within;
  if (with_model) keep = with_model(keep ? 1 : 0) == 1;  // the leading part's decision, whatever this one measured
  if (keep && within) {
    report << "; all within " << kRecheckTolerance * 100 << "%: kept " << check.picked;
  } else if (keep) {
    report << "; the model's leading part kept its pick, which every part runs: kept " << check.picked;
  } else {
    auto choice = choose_strategy(shapes, communicator_->size(), requested_, scaled(check.rates, scales),
                                  requested_.memory_budget(), check.batch,
                                  {requested_.factor_update_steps_at(steps_done),
                                   requested_.inv_update_steps_at(steps_done)});
    prefer_running(choice, running);
    choice.chosen = agree_on_choice(*communicator_, choice.chosen);
    const size_t own = choice.chosen;
    if (with_model) choice.chosen = with_model(choice.chosen);
    report << "; chose again with the rates scaled so:\n" << choice.describe();
    if (choice.chosen != own) report << leading_pick(choice, own) << "\n";
    if (runs_as(choice.pick(), running)) {
      report << "  kept " << choice.pick().name;
    } else {
      switch_to = choice.apply(requested_);
      report << "  switched to " << choice.pick().name << " from step " << steps_done;
    }
  }
  report << "\n";
  description_ += (description_.empty() || description_.back() == '\n' ? "" : "\n") + report.str();
  last_report_ = report.str();
  return switch_to;
}

}  // namespace dkfac::strategy
