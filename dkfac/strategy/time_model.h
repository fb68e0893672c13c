#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "dkfac/options.h"
#include "dkfac/phase.h"
#include "dkfac/strategy/rates.h"
#include "dkfac/strategy/step_plan.h"

/// Predicted K-FAC time of a StepPlan from measured Rates, and strategy auto's choice among the
/// strategies' plans (docs/STRATEGIES.md, "Choosing automatically"). Pure: no tensors, no processes.
namespace dkfac::strategy {

/// Steps between factor updates and between second-order updates (Options' two intervals at the step of
/// interest). A step s is a factor step when s % factor_update_steps == 0, a second-order step when
/// s % inv_update_steps == 0.
struct Intervals {
  int64_t factor_update_steps = 1;
  int64_t inv_update_steps = 1;
};

/// Seconds per step of each K-FAC phase, averaged over the intervals.
struct PhaseSeconds {
  double factor_build = 0;       ///< building and folding the factors this rank builds (factor steps)
  double factor_comm = 0;        ///< factor allreduces, as the plan groups them (factor steps)
  /// this rank's eigendecompositions / inverses (second-order steps); with StepPlan::second_order_lag, what the
  /// steps pay for them (predict_time)
  double decomposition = 0;
  double second_order_comm = 0;  ///< broadcasts inside this rank's column (second-order steps)
  double precondition = 0;       ///< this rank's preconditioning products (every step)
  double gradient_comm = 0;      ///< V broadcasts along this rank's row (every step)
  double total() const;
};

/// A plan's predicted time. K-FAC's own time only: forward, backward, the data-parallel gradient allreduce
/// and the optimizer are the same for every strategy and are not modelled.
struct TimePrediction {
  std::vector<PhaseSeconds> ranks;  ///< each rank's own work per phase, without waiting for others
  /// The job's K-FAC seconds per step: ranks run their work and meet at every collective the plan names
  /// (the factor allreduce over the world, second-order broadcasts in each column, V broadcasts in each
  /// row, and the next step's gradient allreduce), where each waits for the slowest of its group. A phase
  /// without a collective carries its imbalance into the next meeting. Ranks of one node that compute at
  /// the same time share its speed (Rates::parallel_ranks); a rank that waits at a collective does not
  /// compute. Collectives are not overlapped with computation (on CPUs over loopback the transport runs on
  /// the cores that compute; docs/STRATEGIES.md).
  double step_seconds = 0;

  /// Each phase's largest time over the ranks (what a table of phases shows per candidate).
  PhaseSeconds slowest_phases() const;
};

/// The predicted time of `plan` with `batch_size` samples per rank per step. Factors are priced at the rate
/// of the kernel that builds them (each shape's a_kernel and g_kernel, Rates::for_kernel) on each shape's
/// rows_per_sample, plus Rates::fold per layer built; bucketed factor allreduces are grouped as
/// comm::bucket_groups groups them, SPD-KFAC's as its fusion says (or, left to profiling, by
/// assign::fuse_groups with the factors' build times as their ready times and the allreduce link). `rates.method` should be the plan's method
/// (decomposition and preconditioning times are for it).
///
/// StepPlan::second_order_lag = k > 0 (each update after the first computed beside the steps, docs/MATH.md section
/// 2.8): a rank's decompositions of D seconds run beside the next w = min(k, inv_update_steps) steps (the next
/// inverse step installs an update still in flight), in which the rank computes W = w x its non-update step's own
/// work (preconditioning and V broadcasts). The inverse step pays max(Rates::side_work_cost x D, D - W): the share
/// of D the steps lose beside it, or, where D outlasts W, the wait at installation (booked on the inverse step,
/// though it falls k steps later). With eigh_interval, full decompositions and refreshes are priced so each, then
/// averaged. Forward and backward, which the model does not know, lengthen the window too, so D - W is an upper
/// bound on the wait, where the side work runs at its own speed beside the steps (a low-priority stream behind
/// kernels that fill the device runs slower). The broadcasts of the update stay priced on its inverse step (they
/// run at installation, once per update all the same); the first update, which runs at once, is not in the average.
TimePrediction predict_time(const StepPlan& plan, const Rates& rates, int64_t batch_size, Intervals intervals);

/// A step's kind: whether it updates the factors, the second-order state, both or neither.
struct StepKind {
  bool factor_step = true;
  bool inverse_step = true;
  /// An inverse step that refreshed the eigenbases (Options::eigh_interval) rather than decompose in full: priced
  /// at the refresh's rate.
  bool refresh = false;
};

/// The seconds of one step of `kind`, as predict_time simulates each step (its step_seconds averages them); under
/// StepPlan::second_order_lag the window of an inverse step is the plan's whole lag (predict_time's is at most the
/// inverse interval).
double predict_step_seconds(const StepPlan& plan, const Rates& rates, int64_t batch_size, StepKind kind);

/// The phases the time model prices, each by its own group of rates (scaled): factors (the factor kernels and the
/// fold), second order (decompositions), preconditioning, communication (the links). The apply phase is not
/// modelled.
inline constexpr std::array<KfacPhase, 4> kCalibratedPhases = {KfacPhase::kFactors, KfacPhase::kSecondOrder,
                                                               KfacPhase::kPrecondition, KfacPhase::kCommunication};

/// Factors by which measured times differ from a prediction, per calibrated phase (kCalibratedPhases; 1 for the
/// others).
struct RateScales : PhaseArray<double> {
  RateScales() { values.fill(1.0); }
  /// Scales given per phase, 1 for the others.
  static RateScales of(std::initializer_list<std::pair<KfacPhase, double>> scales);
  /// Every scale within 1 +- tolerance.
  bool within(double tolerance) const;
  /// "factors x1.31, second order x0.97, preconditioning x1.02, communication x2.4" (3 significant digits).
  std::string describe() const;
};

/// How far from its prediction a phase measured in a job may be (as a RateScales scale) before strategy auto
/// chooses again (Options::auto_recheck_steps): the 20% that bench/strategies.py holds predictions to.
constexpr double kRecheckTolerance = 0.2;
// Its prose, "20%", in auto_recheck_steps' help (dkfac/options.h) and KFACPreconditioner's docstring
// (python/dkfac/preconditioner.py): the build stops here when the constant changes without them.
static_assert(kRecheckTolerance == 0.2, "update the 20% of auto_recheck_steps' help and of the Python docstring");

/// How much faster than the running plan the re-check's pick must be predicted for the job to switch to it: the
/// 5% within which the benchmark asks the pick to be of the measured best.
constexpr double kRecheckGain = 0.05;

/// `rates` with each group's rates (every coefficient of them) multiplied by its scale.
Rates scaled(const Rates& rates, const RateScales& scales);

/// What a job measured over a few steps of one plan: each step's kind, and seconds per K-FAC phase summed over
/// them, as the Preconditioner's PhaseClock counts them (collectives under communication only).
struct ProfiledSteps {
  std::vector<StepKind> kinds;
  PhaseTimes seconds;
};

/// A group of rates measured at less than this share of the profiled K-FAC phases keeps its scale: so little
/// time is mostly noise (a plan that hardly communicates says little about its links).
constexpr double kLeastCalibratedShare = 0.1;

/// Measured over predicted per group of rates, for `plan` with `batch_size` samples per rank: each group's
/// prediction is the plan's steps of `measured.kinds` simulated with that group's rates alone (sharing and
/// waiting as predict_time has them). A group predicted at 0, or measured under kLeastCalibratedShare of the
/// calibrated phases' sum, keeps scale 1; so do the decompositions under StepPlan::second_order_lag, where a step
/// measures an installation's wait rather than them. Under the lag the time the side work takes from the steps is
/// measured in the phases it runs beside, whose scales then count it once more beside predict_time's share of D, and
/// a wait longer than predicted is not seen: both are left as they are (docs/MATH.md section 2.8). Pure.
RateScales calibrate(const StepPlan& plan, const Rates& rates, int64_t batch_size, const ProfiledSteps& measured);

/// No limit for choose_strategy's memory budget.
constexpr int64_t kNoMemoryBudget = 0;

/// One strategy that strategy auto considers, with its prediction (as JSON: tools/common/report_json.h).
struct Candidate {
  std::string name;         ///< "kaisa f=1/2 (W=2) triangles", "spd", "dp", ...
  Options options;          ///< the base options with this candidate's strategy, fraction and symmetric_comm
  StepPlan plan;            ///< make_step_plan(shapes, world, options) (SPD-KFAC: its redundancy threshold
                            ///< from the rates, as its executor would measure it)
  TimePrediction time;
  int64_t memory_bytes = 0;  ///< K-FAC state of the rank holding most (strategy::predict)
  bool fits = true;          ///< memory_bytes <= the budget
};

/// What choose_strategy decided.
struct StrategyChoice {
  std::vector<Candidate> candidates;  ///< every candidate, in the order they were built
  size_t chosen = 0;                  ///< index into candidates
  bool fits = true;                   ///< false: no candidate fits the budget (chosen is the least memory)
  std::string reason;                 ///< one sentence: why this candidate

  const Candidate& pick() const { return candidates.at(chosen); }
  /// `base` with the chosen strategy, grad_worker_fraction and symmetric_comm set, memory_budget (spent on
  /// the choice) 0, and for SPD-KFAC without a redundancy threshold the one its prediction used (from the
  /// rates); all else untouched.
  Options apply(const Options& base) const;
  /// The table of every candidate (predicted ms per step and memory) and the reason, in words.
  std::string describe() const;
};

/// True when `candidate` is the strategy `running` runs (strategy, grad_worker_fraction, symmetric_comm).
bool runs_as(const Candidate& candidate, const Options& running);

/// The re-check's decision for a job running `running`'s strategy, on `choice` made again with scaled rates:
/// switching gathers and re-places the K-FAC state, so a pick predicted less than kRecheckGain faster than
/// the running candidate (when that fits the budget) gives way to it, and `choice.reason` says so. Else
/// unchanged. Pure.
void prefer_running(StrategyChoice& choice, const Options& running);

/// strategy auto's choice for a job of `world_size` ranks on layers `shapes`, among candidates(P, base)
/// (candidates.h): KAISA at every W dividing P (f = W/P: 1, the divisors between, 1/P), each with and without
/// symmetric_comm; SPD-KFAC; DP-KFAC. Each candidate's StepPlan comes from make_step_plan (the one place a strategy's behaviour is
/// written) with `base` otherwise unchanged; its time from predict_time, its memory from predict. The pick is
/// the fastest candidate whose K-FAC memory per rank fits `memory_budget_bytes` (kNoMemoryBudget: any);
/// equal predicted times (within 1e-9 relative) go to less memory, then to the earlier candidate. When none
/// fits, the candidate with the least memory (then the fastest), and `fits` is false. Pure given the rates:
/// every rank that calls it with the same arguments gets the same choice.
///
/// What strategy::AutoStrategy (auto.h) does for the Preconditioner with Options' strategy auto at its first
/// step (dkfac train --strategy auto and Python's strategy='auto' go through it):
///  1. rates = measure_rates(communicator, device, dtype, method) on every rank at once (collective; every
///     rank gets the same averaged numbers), or Rates read from a file written earlier;
///  2. choice = choose_strategy(shapes, P, options, rates, budget, batch, {factor, inv intervals at step 0});
///  3. to be safe against a rank computing a different answer (different inputs, floating point), agree on
///     rank 0's: chosen = agree_on_choice(communicator, choice.chosen) (one 8-byte broadcast from rank 0;
///     measure_rates already made the rates equal);
///  4. options = choice.apply(options) with that index, log choice.describe() on rank 0, and build the
///     StepExecutor from those options (SPD-KFAC with the threshold its prediction used).
StrategyChoice choose_strategy(const std::vector<assign::LayerShape>& shapes, int world_size, const Options& base,
                               const Rates& rates, int64_t memory_budget_bytes, int64_t batch_size,
                               Intervals intervals);

}  // namespace dkfac::strategy
