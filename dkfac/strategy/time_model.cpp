#include "dkfac/strategy/time_model.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <limits>
#include <numeric>
#include <optional>
#include <sstream>

#include <c10/util/Exception.h>

#include "dkfac/comm/packing.h"
#include "dkfac/strategy/candidates.h"
#include "dkfac/numbers.h"
#include "dkfac/strategy/prediction.h"

namespace dkfac::strategy {
namespace {

// Milliseconds as the tables and messages here print them (dkfac/numbers.h).
constexpr auto ms = &milliseconds;


/// The factor reduction's seconds per factor step, grouped as the plan's reduction groups them.
/// `build_seconds` per slot (A in layer order, then G in reverse layer order: the pipeline's ready order).
/// Groups started from the capture hooks before the last factor is ready (every bucket or SPD-KFAC group
/// but the last) run while the ranks compute backward, at the busy link's cost (Rates::allreduce_busy).
/// Owner placement's factors (StepPlan::factor_destination) are a reduce over each row of k = P / W ranks, priced as
/// a ring's: half the row's allreduce start-ups, and its bytes term times k / (2 (k - 1)) (a reduce sends N bytes per
/// rank, an allreduce 2 (k - 1) / k N); then an allreduce of each owner's share among the W owners of a column.
double factor_comm_seconds(const StepPlan& plan, const Rates& rates, const std::vector<double>& build_seconds) {
  const int p = plan.world_size();
  std::vector<int64_t> bytes;
  std::vector<int> destinations;
  const size_t layers = plan.shapes.size();
  for (size_t slot = 0; slot < 2 * layers; ++slot) {
    const size_t layer = slot < layers ? slot : 2 * layers - 1 - slot;
    const auto& shape = plan.shapes[layer];
    const int64_t n = slot < layers ? shape.a_dim : shape.g_dim;
    const bool diagonal = slot < layers ? shape.a_diagonal : shape.g_diagonal;
    const bool absent = slot < layers && shape.a_shared_with >= 0;  // a follower's A: its leader's is sent
    bytes.push_back(absent ? 0 : rates.element_bytes() * comm::packed_length(n, plan.factor_triangles, diagonal));
    destinations.push_back(plan.factor_destination(layer));
  }
  std::vector<std::vector<size_t>> groups;
  switch (plan.reduction) {
    case FactorReduction::kNone:
      return 0.0;
    case FactorReduction::kAllreduce:
      groups = consecutive_groups(std::vector<int64_t>(bytes.size(), 1));
      break;
    case FactorReduction::kHookBuckets:
      groups = factor_buckets(bytes, destinations, static_cast<int64_t>(plan.bucket_cap_mb * 1024 * 1024));
      break;
    case FactorReduction::kSpdPipeline:
      if (!plan.fusion.empty()) {
        groups = consecutive_groups(plan.fusion);
      } else {
        // Profiled in a job: the factors' ready times there are their build times here, in ready order.
        std::vector<double> ready(bytes.size(), 0.0);
        std::partial_sum(build_seconds.begin(), build_seconds.end(), ready.begin());
        const double alpha = rates.allreduce_seconds(p, 0.0);
        const assign::AlphaBeta link{alpha, rates.allreduce_seconds(p, 1.0) - alpha};
        groups = consecutive_groups(assign::fuse_groups(ready, bytes, link));
      }
      break;
  }
  const bool from_hooks = plan.reduction != FactorReduction::kAllreduce;
  const int row = p / plan.grad_workers();
  double seconds = 0;
  double owned_bytes = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    double group_bytes = 0;
    for (const size_t slot : groups[g]) group_bytes += static_cast<double>(bytes.at(slot));
    if (group_bytes == 0) continue;  // only followers' A slots: nothing is sent
    const bool during_backward = from_hooks && g + 1 < groups.size();
    const bool to_owner = destinations.at(groups[g].front()) >= 0;
    const int ranks = to_owner ? row : p;
    const auto allreduce = [&](double b) {
      return during_backward ? rates.busy_allreduce_seconds(ranks, b) : rates.allreduce_seconds(ranks, b);
    };
    if (!to_owner) {
      seconds += allreduce(group_bytes);
      continue;
    }
    const double start_ups = allreduce(0.0);
    seconds += 0.5 * start_ups + (allreduce(group_bytes) - start_ups) * row / (2.0 * (row - 1));
    owned_bytes += group_bytes;
  }
  if (owned_bytes > 0 && plan.grad_workers() > 1) {
    seconds += rates.allreduce_seconds(plan.grad_workers(), owned_bytes / row);
  }
  return seconds;
}

/// Every rank in `groups` waits for the slowest of its group, then spends `cost[group index]`.
void meet(std::vector<double>& t, const std::vector<std::vector<int>>& groups, const std::vector<double>& cost) {
  for (size_t k = 0; k < groups.size(); ++k) {
    double latest = 0;
    for (int r : groups[k]) latest = std::max(latest, t[r]);
    for (int r : groups[k]) t[r] = latest + cost[k];
  }
}

/// Each rank r starts `work[r]` seconds (its speed alone) at t[r]; the ranks of one node (consecutive
/// groups of `per_node`) share `slots` full speeds: while n of them are busy each runs at min(1, slots / n).
/// Moves each t[r] to when its work ends.
void run_shared(std::vector<double>& t, const std::vector<double>& work, int per_node, double slots) {
  const int p = static_cast<int>(t.size());
  for (int first = 0; first < p; first += per_node) {
    const int last = std::min(p, first + per_node);
    std::vector<double> left(work.begin() + first, work.begin() + last);
    std::vector<bool> busy(left.size(), false);
    double now = std::numeric_limits<double>::infinity();
    for (int r = first; r < last; ++r) {
      if (left[r - first] > 0) now = std::min(now, t[r]);
    }
    while (std::isfinite(now)) {
      int active = 0;
      double next_start = std::numeric_limits<double>::infinity();
      for (int r = first; r < last; ++r) {
        if (left[r - first] <= 0) continue;
        if (t[r] <= now) {
          busy[r - first] = true;
          ++active;
        } else {
          next_start = std::min(next_start, t[r]);
        }
      }
      if (active == 0) {
        now = next_start;
        continue;
      }
      const double speed = std::min(1.0, slots / active);
      double step = next_start - now;
      for (int r = first; r < last; ++r) {
        if (busy[r - first] && left[r - first] > 0) step = std::min(step, left[r - first] / speed);
      }
      now += step;
      for (int r = first; r < last; ++r) {
        if (!busy[r - first] || left[r - first] <= 0) continue;
        left[r - first] -= speed * step;
        if (left[r - first] <= 1e-15 * std::max(1.0, work[r])) {
          left[r - first] = 0;
          t[r] = now;
        }
      }
      bool any = false;
      for (double x : left) any |= x > 0;
      if (!any) break;
    }
  }
}

}  // namespace

double PhaseSeconds::total() const {
  return factor_build + factor_comm + decomposition + second_order_comm + precondition + gradient_comm;
}

PhaseSeconds TimePrediction::slowest_phases() const {
  PhaseSeconds m;
  for (const auto& r : ranks) {
    m.factor_build = std::max(m.factor_build, r.factor_build);
    m.factor_comm = std::max(m.factor_comm, r.factor_comm);
    m.decomposition = std::max(m.decomposition, r.decomposition);
    m.second_order_comm = std::max(m.second_order_comm, r.second_order_comm);
    m.precondition = std::max(m.precondition, r.precondition);
    m.gradient_comm = std::max(m.gradient_comm, r.gradient_comm);
  }
  return m;
}

namespace {

/// What the steps pay for `decompose` seconds of second-order work computed beside them (Options::second_order_lag),
/// where the steps it runs beside compute `beside` seconds of their own: the share `cost` of it that they lose
/// (Rates::side_work_cost), or where it outlasts them, the wait at its installation, whichever is more.
double lagged_seconds(double decompose, double beside, double cost) {
  return std::max(cost * decompose, decompose - beside);
}

/// Rank `r`'s preconditioning products: each layer's at the rate's per-FLOP cost, and its fixed cost (launches,
/// allocations) once per layer, or with StepPlan::stack_layers once per batch of a group, the groups and batches as
/// LayerGroups and the Preconditioner form them (stack_groups, stacked_batch_units; gradients in the K-FAC tensors'
/// dtype here), a group's products at its padded widths (StepPlan::pad_widths).
double precondition_seconds(const StepPlan& plan, const Rates& rates, int r) {
  const auto& rate = rates.precondition;
  const auto& shapes = plan.shapes;
  double total = 0.0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const auto& s = shapes[i];
    if (plan.preconditions(i, r)) total += rate.seconds_for(s.g_dim, s.a_dim, plan.method);  // its fixed cost included
  }
  if (!plan.stack_layers) return total;
  for (const auto& group : stack_groups(plan, r)) {  // a batch's fixed cost in place of its layers'
    const auto& s = shapes[group.units.front()];
    const auto units = static_cast<int64_t>(group.units.size());
    const auto members = static_cast<double>(group.members.size());
    const int64_t g = padded_width(s.g_dim, plan.pad_widths);
    const int64_t a = padded_width(s.a_dim, plan.pad_widths);
    const int64_t per_batch = stacked_batch_units(g, a, group.share, rates.element_bytes());
    total += rate.seconds * (static_cast<double>((units + per_batch - 1) / per_batch) - members) +
             members * (rate.seconds_for(g, a, plan.method) - rate.seconds_for(s.g_dim, s.a_dim, plan.method));
  }
  return total;
}

/// One plan's work per rank and its collectives on `rates`, from which predict_time and predict_step_seconds
/// simulate steps. `lag_steps` > 0 (StepPlan::second_order_lag): each update runs beside that many steps, and its
/// inverse step pays what the steps lose to it (lagged_seconds).
class StepSimulation {
 public:
  StepSimulation(const StepPlan& plan, const Rates& rates, int64_t batch_size, int64_t lag_steps)
      : plan_(plan), rates_(rates), p_(plan.world_size()) {
    TORCH_CHECK(batch_size >= 1, "batch_size must be >= 1, got ", batch_size);
    const size_t layers = plan.shapes.size();
    const bool eigen = plan.method == ComputeMethod::kEigen;
    const int64_t e = rates.element_bytes();
    build_.assign(p_, 0.0);
    decompose_.assign(p_, 0.0);
    full_.assign(p_, 0.0);
    refreshed_.assign(p_, 0.0);
    precondition_.assign(p_, 0.0);
    second_order_.assign(p_, 0.0);
    std::vector<double> slot_build(2 * layers, 0.0);  // one builder's seconds per factor, in ready order
    for (size_t i = 0; i < layers; ++i) {
      const auto& s = plan.shapes[i];
      const int64_t rows = batch_size * s.rows_per_sample;
      const double a_build = s.a_shared_with >= 0 ? 0.0 : rates.for_kernel(s.a_kernel).seconds_for(rows, s.a_dim);
      const double g_build = rates.for_kernel(s.g_kernel).seconds_for(rows, s.g_dim);
      const double fold = rates.fold.seconds_for(s.a_shared_with >= 0 ? 0 : s.a_dim, s.g_dim);  // a follower: G only
      slot_build[i] = a_build;
      slot_build[2 * layers - 1 - i] = g_build;
      const auto& flow = plan.flows[i];
      const int w = plan.grad_workers();
      const auto share = [&](int64_t n, bool diagonal) {  // a diagonal factor sends n values
        if (diagonal) return rates.broadcast_seconds(w, e * n);
        if (eigen) return rates.broadcast_seconds(w, e * n * n) + rates.broadcast_seconds(w, e * n);
        return rates.broadcast_seconds(w, e * comm::packed_length(n, plan.inverse_triangles));
      };
      for (int r = 0; r < p_; ++r) {
        if (plan.builds_factors(i, r)) build_[r] += a_build + g_build + fold;
        if (!plan.preconditions(i, r)) continue;
        // A diagonal factor's decomposition is a clamp of d values: priced as nothing.
        // Eigen with eigh_interval k: one full decomposition and k - 1 refreshes per k updates, averaged
        // (decompose_), and each kind alone (a profiled step's own: calibrate).
        const int64_t k = eigen ? plan.eigh_interval : 1;
        const auto decompose = [&](int64_t d) {
          decompose_[r] += rates.second_order_seconds(d, k);
          full_[r] += rates.decomposition.seconds_for(d);
          refreshed_[r] += rates.refresh_seconds(d);
        };
        if (plan.computes_a(i, r) && !s.a_diagonal) decompose(s.a_dim);
        if (plan.computes_g(i, r) && !s.g_diagonal) decompose(s.g_dim);
        if (flow.broadcast_a) second_order_[r] += share(s.a_dim, s.a_diagonal);
        if (flow.broadcast_g) second_order_[r] += share(s.g_dim, s.g_diagonal);
      }
    }
    for (int r = 0; r < p_; ++r) precondition_[r] = precondition_seconds(plan, rates, r);
    factor_comm_ = factor_comm_seconds(plan, rates, slot_build);
    if (plan.broadcast_gradients) {
      const int row = p_ / plan.grad_workers();
      for (const auto& s : plan.shapes) {
        gradient_comm_ += rates.broadcast_seconds(row, static_cast<double>(e * s.g_dim * s.a_dim));
      }
    }
    columns_ = plan.placement.columns();
    rows_ = plan.placement.rows();
    if (lag_steps <= 0) return;
    // Each kind of update is lagged on its own, then averaged as above: the price is not linear in D.
    for (int r = 0; r < p_; ++r) {
      const double beside = static_cast<double>(lag_steps) * (precondition_[r] + gradient_comm_);
      full_[r] = lagged_seconds(full_[r], beside, rates.side_work_cost);
      refreshed_[r] = lagged_seconds(refreshed_[r], beside, rates.side_work_cost);
      decompose_[r] = averaged_update_seconds(full_[r], refreshed_[r], eigen ? plan.eigh_interval : 1);
    }
  }

  /// One step of the given kind: ranks add their work and meet at the plan's collectives; the end of the
  /// slowest rank (the next gradient allreduce waits for it).
  /// An inverse step's decompositions: averaged over eigh_interval (predict_time), or of a step known to decompose
  /// in full or to refresh (a profiled step).
  enum class Decompositions { kAverage, kFull, kRefresh };

  double step(bool factor_step, bool inverse_step, Decompositions which = Decompositions::kAverage) const {
    std::vector<double> t(p_, 0.0);
    if (factor_step) {
      share(t, build_);
      if (plan_.reduction != FactorReduction::kNone) {
        std::vector<int> world(p_);
        std::iota(world.begin(), world.end(), 0);
        meet(t, {world}, {factor_comm_});
      }
    }
    if (inverse_step) {
      share(t, which == Decompositions::kAverage ? decompose_ : which == Decompositions::kFull ? full_ : refreshed_);
      if (plan_.shares_second_order()) {
        std::vector<double> cost;
        for (const auto& c : columns_) cost.push_back(second_order_[c.front()]);
        meet(t, columns_, cost);
      }
    }
    share(t, precondition_);
    if (plan_.broadcast_gradients) meet(t, rows_, std::vector<double>(rows_.size(), gradient_comm_));
    return *std::max_element(t.begin(), t.end());
  }
  /// One step of a kind that ran (a profiled step): its decompositions in full, or refreshes.
  double step(const StepKind& kind) const {
    return step(kind.factor_step, kind.inverse_step, kind.refresh ? Decompositions::kRefresh : Decompositions::kFull);
  }

  /// Each rank's own work per phase, per step averaged over `intervals`.
  std::vector<PhaseSeconds> ranks(Intervals intervals) const {
    const double f = static_cast<double>(intervals.factor_update_steps);
    const double v = static_cast<double>(intervals.inv_update_steps);
    std::vector<PhaseSeconds> out;
    for (int r = 0; r < p_; ++r) {
      PhaseSeconds x;
      x.factor_build = build_[r] / f;
      x.factor_comm = factor_comm_ / f;
      x.decomposition = decompose_[r] / v;
      x.second_order_comm = second_order_[r] / v;
      x.precondition = precondition_[r];
      x.gradient_comm = gradient_comm_;
      out.push_back(x);
    }
    return out;
  }

 private:
  /// A node's busy ranks share its compute (rates.parallel_ranks full speeds per rates.ranks_per_node ranks).
  void share(std::vector<double>& t, const std::vector<double>& work) const {
    const int per_node = std::max(1, rates_.ranks_per_node);
    const double slots = std::max(1.0, rates_.parallel_ranks);
    if (slots >= per_node) {
      for (int r = 0; r < p_; ++r) t[r] += work[r];
    } else {
      run_shared(t, work, per_node, slots);
    }
  }

  const StepPlan& plan_;
  const Rates& rates_;
  int p_;
  std::vector<double> build_, decompose_, full_, refreshed_, precondition_, second_order_;
  double factor_comm_ = 0;
  double gradient_comm_ = 0;
  std::vector<std::vector<int>> columns_, rows_;
};

}  // namespace

TimePrediction predict_time(const StepPlan& plan, const Rates& rates, int64_t batch_size, Intervals intervals) {
  TORCH_CHECK(intervals.factor_update_steps >= 1 && intervals.inv_update_steps >= 1,
              "intervals must be >= 1, got factor_update_steps ", intervals.factor_update_steps,
              " and inv_update_steps ", intervals.inv_update_steps);
  // An update in flight is installed at the next inverse step if that comes before its lag's end.
  const StepSimulation simulation(plan, rates, batch_size,
                                  std::min(plan.second_order_lag, intervals.inv_update_steps));
  const double f = static_cast<double>(intervals.factor_update_steps);
  const double v = static_cast<double>(intervals.inv_update_steps);
  const double both = 1.0 / static_cast<double>(std::lcm(intervals.factor_update_steps, intervals.inv_update_steps));
  const double factor_only = 1.0 / f - both;
  const double inverse_only = 1.0 / v - both;
  const double neither = 1.0 - both - factor_only - inverse_only;

  TimePrediction out;
  out.step_seconds = both * simulation.step(true, true) + factor_only * simulation.step(true, false) +
                     inverse_only * simulation.step(false, true) + neither * simulation.step(false, false);
  out.ranks = simulation.ranks(intervals);
  return out;
}

double predict_step_seconds(const StepPlan& plan, const Rates& rates, int64_t batch_size, StepKind kind) {
  return StepSimulation(plan, rates, batch_size, plan.second_order_lag).step(kind);
}

Rates scaled(const Rates& rates, const RateScales& scales) {
  // Each calibrated phase's group of rates (kCalibratedPhases).
  Rates r = rates;
  const double factors = scales[KfacPhase::kFactors];
  for (const auto kernel : math::kFactorKernels) {
    FactorRate& rate = r.for_kernel(kernel);
    rate.seconds *= factors;
    rate.per_entry *= factors;
    rate.per_flop *= factors;
  }
  r.fold.seconds *= factors;
  r.fold.per_entry *= factors;
  const double decomposition = scales[KfacPhase::kSecondOrder];
  for (double& seconds : r.decomposition.seconds) seconds *= decomposition;
  r.decomposition.latency *= decomposition;
  r.decomposition.per_cubed_dim *= decomposition;
  for (double& seconds : r.refresh.seconds) seconds *= decomposition;
  r.refresh.latency *= decomposition;
  r.refresh.per_cubed_dim *= decomposition;
  r.precondition.seconds *= scales[KfacPhase::kPrecondition];
  r.precondition.per_flop *= scales[KfacPhase::kPrecondition];
  for (auto* link : {&r.allreduce, &r.allreduce_busy, &r.broadcast}) {
    link->alpha *= scales[KfacPhase::kCommunication];
    link->beta *= scales[KfacPhase::kCommunication];
  }
  return r;
}

RateScales RateScales::of(std::initializer_list<std::pair<KfacPhase, double>> scales) {
  RateScales out;
  for (const auto& [phase, scale] : scales) out[phase] = scale;
  return out;
}

bool RateScales::within(double tolerance) const {
  for (const auto phase : kCalibratedPhases) {
    if (std::abs((*this)[phase] - 1.0) > tolerance) return false;
  }
  return true;
}

std::string RateScales::describe() const {
  std::ostringstream out;
  out << std::setprecision(3);
  for (size_t k = 0; k < kCalibratedPhases.size(); ++k) {
    out << (k ? ", " : "") << words(kCalibratedPhases[k]) << " x" << (*this)[kCalibratedPhases[k]];
  }
  return out.str();
}

RateScales calibrate(const StepPlan& plan, const Rates& rates, int64_t batch_size, const ProfiledSteps& measured) {
  // Each group's predicted seconds over the profiled steps: the plan simulated with only that group's rates.
  const auto predicted = [&](KfacPhase only) {
    RateScales scales;
    for (const auto phase : kCalibratedPhases) scales[phase] = phase == only ? 1.0 : 0.0;
    const Rates r = scaled(rates, scales);
    const StepSimulation simulation(plan, r, batch_size, plan.second_order_lag);
    double seconds = 0;
    for (const auto& kind : measured.kinds) seconds += simulation.step(kind);
    return seconds;
  };
  double whole = 0;
  for (const auto phase : kCalibratedPhases) whole += measured.seconds[phase];
  RateScales out;
  for (const auto phase : kCalibratedPhases) {
    const double seconds = measured.seconds[phase];
    // Under second_order_lag a step's second-order time is an installation's wait, not the decompositions, whose
    // cost lands in the phases they run beside: the decomposition rates keep their scale.
    if (phase == KfacPhase::kSecondOrder && plan.second_order_lag > 0) continue;
    const bool enough = seconds > 0 && seconds >= kLeastCalibratedShare * whole;
    const double expected = enough ? predicted(phase) : 0.0;
    out[phase] = expected > 0 ? seconds / expected : 1.0;
  }
  return out;
}

Options StrategyChoice::apply(const Options& base) const {
  const Options& o = pick().options;
  Options out = Options(base)
                    .strategy(o.strategy())
                    .grad_worker_fraction(o.grad_worker_fraction())
                    .symmetric_comm(o.symmetric_comm())
                    .memory_budget(0);  // spent on the choice; it applies to strategy auto only
  if (o.strategy() == Strategy::kSpd && base.spd().redundant_dim() < 0) {
    out.spd(SpdOptions(base.spd()).redundant_dim(pick().plan.redundant_dim));  // the threshold predicted with
  }
  return out;
}

std::string StrategyChoice::describe() const {
  std::ostringstream out;
  out << "strategy auto: " << candidates.size() << " candidates; predicted K-FAC ms per step of the job "
      << "(slowest rank, waiting at collectives; averaged over the update intervals), phases as the max over ranks; "
         "memory = K-FAC state of the fullest rank\n";
  out << "    " << std::left << std::setw(30) << "candidate" << std::right << std::setw(10) << "step ms"
      << std::setw(9) << "factor" << std::setw(9) << "f-comm" << std::setw(9) << "decomp" << std::setw(9)
      << "2nd-comm" << std::setw(9) << "precond" << std::setw(9) << "V-comm" << std::setw(12) << "memory"
      << "\n";
  for (size_t k = 0; k < candidates.size(); ++k) {
    const auto& c = candidates[k];
    const PhaseSeconds m = c.time.slowest_phases();
    out << (k == chosen ? "  * " : c.fits ? "    " : "  - ") << std::left << std::setw(30) << c.name << std::right
        << std::setw(10) << ms(c.time.step_seconds) << std::setw(9) << ms(m.factor_build) << std::setw(9)
        << ms(m.factor_comm) << std::setw(9) << ms(m.decomposition) << std::setw(9) << ms(m.second_order_comm)
        << std::setw(9) << ms(m.precondition) << std::setw(9) << ms(m.gradient_comm) << std::setw(12)
        << human_bytes(static_cast<double>(c.memory_bytes)) << "\n";
  }
  out << "  (* the pick; - over the memory budget)\n  " << reason << "\n";
  return out.str();
}

bool runs_as(const Candidate& candidate, const Options& running) {
  return candidate.options.strategy() == running.strategy() &&
         candidate.options.grad_worker_fraction() == running.grad_worker_fraction() &&
         candidate.options.symmetric_comm() == running.symmetric_comm();
}

void prefer_running(StrategyChoice& choice, const Options& running) {
  const auto current = std::find_if(choice.candidates.begin(), choice.candidates.end(),
                                    [&](const Candidate& c) { return runs_as(c, running); });
  if (current == choice.candidates.end() || !current->fits || runs_as(choice.pick(), running)) return;
  if (choice.pick().time.step_seconds < (1 - kRecheckGain) * current->time.step_seconds) return;
  std::ostringstream why;
  why << "kept " << current->name << " (" << ms(current->time.step_seconds) << " ms): the fastest, "
      << choice.pick().name << " (" << ms(choice.pick().time.step_seconds) << " ms), is predicted less than "
      << kRecheckGain * 100 << "% faster, too little to switch for";
  choice.reason = why.str();
  choice.chosen = static_cast<size_t>(current - choice.candidates.begin());
}

StrategyChoice choose_strategy(const std::vector<assign::LayerShape>& shapes, int world_size, const Options& base,
                               const Rates& rates, int64_t memory_budget_bytes, int64_t batch_size,
                               Intervals intervals) {
  TORCH_CHECK(world_size >= 1, "world size must be >= 1, got ", world_size);
  TORCH_CHECK(memory_budget_bytes >= 0, "memory budget must be >= 0 bytes (0: none), got ", memory_budget_bytes);
  rates.validate();
  TORCH_CHECK(rates.method == base.compute_method(), "the rates were measured for the ", to_string(rates.method),
              " method, but the options use ", to_string(base.compute_method()), ": measure them for it");
  const int p = world_size;
  StrategyChoice choice;
  for (auto& named : candidates(p, base)) {
    Candidate c;
    c.name = std::move(named.name);
    c.options = std::move(named.options.memory_budget(0));  // the budget is the choice's, not a candidate's option
    c.plan = make_step_plan(shapes, p, c.options, rates.spd_redundant_dim(p));
    c.time = predict_time(c.plan, rates, batch_size, intervals);
    for (const auto& r : predict(c.plan, rates.element_bytes(), batch_size)) {
      c.memory_bytes = std::max(c.memory_bytes, r.memory_bytes);
    }
    c.fits = memory_budget_bytes == kNoMemoryBudget || c.memory_bytes <= memory_budget_bytes;
    choice.candidates.push_back(std::move(c));
  }

  const auto& all = choice.candidates;
  const auto same_time = [](double x, double y) { return std::abs(x - y) <= 1e-9 * std::max(std::abs(x), std::abs(y)); };
  // Strictly better: faster, or as fast with less memory; earlier candidates win exact ties.
  const auto faster = [&](const Candidate& x, const Candidate& y) {
    if (!same_time(x.time.step_seconds, y.time.step_seconds)) return x.time.step_seconds < y.time.step_seconds;
    return x.memory_bytes < y.memory_bytes;
  };
  const auto smaller = [&](const Candidate& x, const Candidate& y) {
    if (x.memory_bytes != y.memory_bytes) return x.memory_bytes < y.memory_bytes;
    return !same_time(x.time.step_seconds, y.time.step_seconds) && x.time.step_seconds < y.time.step_seconds;
  };
  choice.fits = std::any_of(all.begin(), all.end(), [](const Candidate& c) { return c.fits; });
  std::optional<size_t> best;
  for (size_t k = 0; k < all.size(); ++k) {
    if (choice.fits && !all[k].fits) continue;
    if (!best || (choice.fits ? faster(all[k], all[*best]) : smaller(all[k], all[*best]))) best = k;
  }
  choice.chosen = *best;
  const auto& pick = all[choice.chosen];
  std::ostringstream why;
  const std::string budget = memory_budget_bytes == kNoMemoryBudget
                                 ? std::string("no memory budget")
                                 : "a memory budget of " + human_bytes(static_cast<double>(memory_budget_bytes)) +
                                       " per rank";
  if (choice.fits) {
    std::optional<size_t> next;
    size_t fitting = 0;
    for (size_t k = 0; k < all.size(); ++k) {
      if (!all[k].fits) continue;
      ++fitting;
      if (k != choice.chosen && (!next || faster(all[k], all[*next]))) next = k;
    }
    why << "picked " << pick.name << ": the fastest (" << ms(pick.time.step_seconds) << " ms) of the " << fitting
        << " of " << all.size() << " candidates that fit (" << budget << ")";
    if (next) {
      const double gain = all[*next].time.step_seconds - pick.time.step_seconds;
      why << "; next " << all[*next].name << " at " << ms(all[*next].time.step_seconds) << " ms (+"
          << std::fixed << std::setprecision(1)
          << (pick.time.step_seconds > 0 ? 100.0 * gain / pick.time.step_seconds : 0.0) << "%)";
    }
  } else {
    why << "no candidate fits " << budget << "; picked " << pick.name << ", the least memory ("
        << human_bytes(static_cast<double>(pick.memory_bytes)) << ", " << ms(pick.time.step_seconds) << " ms)";
  }
  why << "; " << p << " ranks x batch " << batch_size << ", factors every " << intervals.factor_update_steps
      << ", second order every " << intervals.inv_update_steps << " steps";
  choice.reason = why.str();
  return choice;
}

}  // namespace dkfac::strategy
