#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "dkfac/assign/assignment.h"
#include "dkfac/options.h"
#include "dkfac/strategy/rates.h"
#include "dkfac/strategy/step_plan.h"
#include "dkfac/strategy/time_model.h"

namespace dkfac::comm {
class Communicator;
}  // namespace dkfac::comm

namespace dkfac::strategy {

/// Where the ranks of a data-parallel group hold one part of a model split over other ranks as well (tensor-parallel
/// slices, pipeline stages), whose parts must run one strategy: returns, on every rank, the value one leading rank
/// of the model's parts gave (the others' are ignored). Collective over those ranks. Empty: no such parts.
using ModelAgreement = std::function<size_t(size_t)>;

/// Strategy auto on several ranks, from the first choice to the re-check: it owns the rates, the choice, the
/// profile of the steps after it, their reduction over the ranks and the re-check. The Preconditioner asks it
/// once before a step (choose, at the first) and once after (record; recheck when due), and replaces its
/// executor when told to. Every call that communicates is collective: every rank makes it at the same step.
/// With a ModelAgreement, every decision (the pick, whether the re-check chooses again, its pick) is the leading
/// part's, agreed after its own group's.
class AutoStrategy {
 public:
  /// `communicator` spans more than one rank.
  explicit AutoStrategy(std::shared_ptr<comm::Communicator> communicator);

  /// The rates to choose from instead of measuring them at the first step; throws once the choice is made.
  void use_rates(Rates rates);
  /// True until choose() ran.
  bool choice_pending() const { return pending_; }

  /// The first choice, at step `step`, for `requested` (the options in force, which ask for kStrategyAuto):
  /// measures this machine's rates (unless given; collective), chooses with choose_strategy from the layers'
  /// `shapes` and `batch` samples per rank per step, agrees on rank 0's pick (collective) and returns the
  /// options to run (StrategyChoice::apply). The re-check chooses for `requested` again.
  Options choose(const Options& requested, const std::vector<assign::LayerShape>& shapes, int64_t batch,
                 c10::Device device, c10::ScalarType dtype, int64_t step, const ModelAgreement& with_model = {});

  /// True when step `step` is one the re-check profiles (its times are to be record()ed).
  bool profiles(int64_t step) const { return recheck_ && step >= recheck_->first_step && step <= recheck_->last_step; }
  /// After profiled step `step` (profiles(step)) ran as `kind`, with this rank's seconds per phase.
  void record(int64_t step, StepKind kind, const PhaseTimes& seconds);
  /// True when step `steps_done` - 1 was the last profiled step and the re-check has not run.
  bool recheck_due(int64_t steps_done) const;
  /// The re-check (collective): scales the choice's rates by what the slowest rank measured per phase
  /// (communication: the rank that waited least) against `running_plan`'s prediction (calibrate); where a scale
  /// is off by more than kRecheckTolerance, chooses again with the scaled rates. Returns the options to switch
  /// to from step `steps_done`, or nothing to keep running `running`.
  std::optional<Options> recheck(const std::vector<assign::LayerShape>& shapes, const StepPlan& running_plan,
                                 const Options& running, int64_t steps_done, const ModelAgreement& with_model = {});

  /// The choice in words (StrategyChoice::describe and where its rates came from), followed after the re-check
  /// by what it measured and decided; "" before the choice.
  const std::string& description() const { return description_; }
  /// The last re-check's part of description().
  const std::string& last_report() const { return last_report_; }

 private:
  std::shared_ptr<comm::Communicator> communicator_;
  Options requested_;  // choose()'s
  bool pending_ = true;
  std::optional<Rates> given_rates_;
  std::string description_;
  std::string last_report_;
  /// The re-check's inputs, from the choice until it runs.
  struct Recheck {
    Rates rates;                 // those the choice was made with
    std::string picked;          // the candidate picked with them
    int64_t batch = 1;           // samples per rank per step
    int64_t first_step = 0;      // the profiled steps: first_step .. last_step
    int64_t last_step = 0;
    ProfiledSteps profiled;      // this rank's
  };
  std::optional<Recheck> recheck_;
};

}  // namespace dkfac::strategy
