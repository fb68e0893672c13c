#include "dkfac/strategy/step_plan.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <tuple>

#include <c10/util/Exception.h>

#include "dkfac/comm/packing.h"

namespace dkfac::strategy {
namespace {

std::string where(int rank) { return rank == assign::kEveryRank ? "every rank" : "rank " + std::to_string(rank); }

std::string ranks(const std::vector<int>& list) {
  std::string out = "{";
  for (size_t k = 0; k < list.size(); ++k) out += (k ? "," : "") + std::to_string(list[k]);
  return out + "}";
}

}  // namespace

const char* to_string(FactorReduction reduction) {
  switch (reduction) {
    case FactorReduction::kNone:
      return "none";
    case FactorReduction::kAllreduce:
      return "allreduce";
    case FactorReduction::kHookBuckets:
      return "hook-buckets";
    case FactorReduction::kSpdPipeline:
      return "spd-pipeline";
  }
  return "?";
}

StepPlan StepPlan::single_process(const std::vector<assign::LayerShape>& shapes, ComputeMethod method,
                                  Strategy strategy) {
  StepPlan plan;
  plan.strategy = strategy;
  plan.method = method;
  plan.shapes = shapes;
  plan.placement.world_size = 1;
  plan.placement.grad_workers = 1;
  plan.placement.layers.assign(shapes.size(), assign::LayerAssignment{0, 0, {0}});
  plan.flows.assign(shapes.size(), LayerFlow{});
  return plan;
}

bool stacks_layers(const Options& options) {
  return options.stack_layers() && (options.compute_method() == ComputeMethod::kInverse || options.eigen_adam() ||
                                    options.compute_eigenvalue_outer_product());
}

std::vector<StackGroup> stack_groups(const std::vector<StackCandidate>& layers) {
  std::vector<std::vector<size_t>> followers(layers.size());  // by the layer whose A side they share
  for (size_t j = 0; j < layers.size(); ++j) {
    if (layers[j].a_leader >= 0) followers[static_cast<size_t>(layers[j].a_leader)].push_back(j);
  }
  std::vector<StackGroup> groups;
  std::map<std::tuple<int64_t, int64_t, size_t, std::string>, size_t> index;  // (g, a, share, kind) -> group
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& layer = layers[i];
    if (layer.a_leader >= 0 || !layer.held || layer.diagonal) continue;
    std::vector<size_t> unit{i};
    bool whole = true;
    for (const auto j : followers[i]) {
      unit.push_back(j);
      const auto& follower = layers[j];
      whole = whole && follower.held && !follower.diagonal && follower.g_dim == layer.g_dim &&
              follower.kind == layer.kind;
    }
    if (!whole) continue;
    auto [at, added] = index.emplace(std::make_tuple(layer.g_dim, layer.a_dim, unit.size(), layer.kind),
                                     groups.size());
    if (added) groups.push_back(StackGroup{static_cast<int64_t>(unit.size()), {}, {}});
    auto& group = groups[at->second];
    group.units.push_back(i);
    group.members.insert(group.members.end(), unit.begin(), unit.end());
  }
  std::vector<StackGroup> kept;
  for (auto& group : groups) {
    if (group.members.size() >= 2) kept.push_back(std::move(group));
  }
  return kept;
}

std::vector<StackGroup> stack_groups(const StepPlan& plan, int rank) {
  std::vector<StackCandidate> candidates(plan.shapes.size());
  for (size_t i = 0; i < plan.shapes.size(); ++i) {
    const auto& s = plan.shapes[i];
    candidates[i] = {plan.preconditions(i, rank), s.g_dim, s.a_dim, s.a_diagonal || s.g_diagonal, s.a_shared_with, {}};
  }
  return stack_groups(candidates);
}

int64_t stacked_batch_units(int64_t g_dim, int64_t a_dim, int64_t share, int64_t element_bytes) {
  const int64_t unit_bytes = share * (g_dim * a_dim + (share > 1 ? a_dim * a_dim : 0)) * element_bytes;
  return std::max<int64_t>(1, kStackedBatchBytes / unit_bytes);
}

StepPlan make_step_plan(const std::vector<assign::LayerShape>& shapes, int world_size, const Options& options,
                        int64_t measured_redundant_dim, int replicated_shard_ranks) {
  options.validate();
  TORCH_CHECK(world_size >= 1, "world size must be >= 1, got ", world_size);
  for (const auto& shape : shapes) {
    TORCH_CHECK(shape.a_dim >= 1 && shape.g_dim >= 1 && shape.rows_per_sample >= 1, "layer '", shape.name,
                "': its factor widths and rows per sample must be >= 1, got a ", shape.a_dim, ", g ", shape.g_dim,
                ", rows per sample ", shape.rows_per_sample);
  }
  TORCH_CHECK(options.strategy(), "strategy auto has no plan of its own: choose_strategy "
              "(strategy/time_model.h) picks kaisa, spd or dp first, as the Preconditioner does at its first step");
  if (world_size == 1) {
    auto plan = StepPlan::single_process(shapes, options.compute_method(), *options.strategy());
    plan.approx = options.kfac_approx();
    plan.eigen_adam = options.eigen_adam();
    plan.eigh_interval = options.eigh_interval();
    plan.second_order_lag = options.second_order_lag();
    plan.stack_layers = stacks_layers(options);
    plan.pad_widths = plan.stack_layers ? options.pad_widths() : 1;
    return plan;
  }
  StepPlan plan;
  plan.approx = options.kfac_approx();
  plan.eigen_adam = options.eigen_adam();
  plan.strategy = *options.strategy();
  plan.method = options.compute_method();
  plan.eigh_interval = options.eigh_interval();
  plan.second_order_lag = options.second_order_lag();
  plan.stack_layers = stacks_layers(options);
  plan.pad_widths = plan.stack_layers ? options.pad_widths() : 1;
  plan.shapes = shapes;
  switch (plan.strategy) {
    case Strategy::kKaisa:
      plan.placement = assign::assign_kaisa(shapes, world_size, options.grad_worker_fraction(),
                                            options.balance(),
                                            options.colocate_factors());
      plan.reduction = options.update_factors_in_hook() ? FactorReduction::kHookBuckets : FactorReduction::kAllreduce;
      plan.bucket_cap_mb = options.update_factors_in_hook() ? options.allreduce_bucket_cap_mb() : 0.0;
      plan.factor_triangles = plan.inverse_triangles = options.symmetric_comm();
      break;
    case Strategy::kSpd:
      plan.redundant_dim = options.spd().redundant_dim() >= 0 ? options.spd().redundant_dim() : measured_redundant_dim;
      TORCH_CHECK(plan.redundant_dim >= 0, "SPD-KFAC needs its redundancy threshold: set SpdOptions::redundant_dim "
                  "or measure it (strategy::StepExecutor does)");
      plan.placement = assign::assign_spd(shapes, world_size, plan.redundant_dim);
      plan.reduction = FactorReduction::kSpdPipeline;
      plan.factor_triangles = plan.inverse_triangles = true;
      plan.fusion = options.spd().fusion();
      plan.profile_steps = plan.fusion.empty() ? options.spd().profile_steps() : 0;
      break;
    case Strategy::kDp:
      plan.placement = assign::assign_dp(shapes, world_size);
      plan.reduction = FactorReduction::kNone;  // each owner keeps the factors of its own batch
      break;
  }
  const int w = plan.placement.grad_workers;
  plan.broadcast_gradients = w < world_size;
  plan.sharded_placement = options.sharded_placement();
  TORCH_CHECK(replicated_shard_ranks >= 0 && (replicated_shard_ranks == 0 || world_size % replicated_shard_ranks == 0),
              "the shard group of ", replicated_shard_ranks, " ranks does not divide the world size ", world_size);
  plan.shard_ranks = plan.sharded_placement == ShardedPlacement::kOwner ? world_size / w
                     : replicated_shard_ranks > 0                      ? replicated_shard_ranks
                                                                       : world_size;
  for (size_t i = 0; i < plan.placement.layers.size(); ++i) {
    const auto& placed = plan.placement.layers[i];
    LayerFlow flow;
    flow.owner_rows = shapes[i].sharded && plan.sharded_placement == ShardedPlacement::kOwner;
    if (plan.strategy == Strategy::kDp) flow.factor_builder = placed.a_worker;
    flow.broadcast_a = w > 1 && placed.a_worker != assign::kEveryRank && shapes[i].a_shared_with < 0;
    flow.broadcast_g = w > 1 && placed.g_worker != assign::kEveryRank;
    plan.flows.push_back(flow);
  }
  return plan;
}

bool StepPlan::builds_factors(size_t layer, int rank) const {
  const int builder = flows.at(layer).factor_builder;
  return builder == assign::kEveryRank || builder == rank;
}

bool StepPlan::keeps_factors(size_t layer, int rank) const {
  if (!flows.at(layer).owner_rows) return builds_factors(layer, rank);
  // The layer's owners (one per row) and whoever decomposes a part: those that receive a part inside a column
  // know from their factors that the layer has some (StepExecutor::share_second_order).
  return preconditions(layer, rank) || computes_a(layer, rank) || computes_g(layer, rank);
}

int StepPlan::factor_destination(size_t layer) const {
  // A row of 2: a reduce moves an allreduce's bytes (N per rank on a ring either way), and Gloo's took 1.1-1.2x
  // its time on 16-64 MiB here (bench/reduce_vs_allreduce.py): the owners take the world's average then.
  if (!flows.at(layer).owner_rows || world_size() / grad_workers() < kFewestRanksToReduce) return -1;
  return placement.column_of(placement.layers.at(layer).grad_workers.front());
}

std::vector<std::vector<size_t>> consecutive_groups(const std::vector<int64_t>& sizes) {
  std::vector<std::vector<size_t>> groups;
  size_t slot = 0;
  for (const int64_t size : sizes) {
    groups.emplace_back();
    for (int64_t k = 0; k < size; ++k) groups.back().push_back(slot++);
  }
  return groups;
}

std::vector<std::vector<size_t>> factor_buckets(const std::vector<int64_t>& bytes,
                                                const std::vector<int>& destinations, int64_t cap_bytes) {
  TORCH_CHECK(bytes.size() == destinations.size(), "factor_buckets: ", bytes.size(), " slots' bytes but ",
              destinations.size(), " destinations");
  std::vector<int> seen;  // in the order of their first slot
  for (const int d : destinations) {
    if (std::find(seen.begin(), seen.end(), d) == seen.end()) seen.push_back(d);
  }
  std::vector<std::vector<size_t>> buckets;
  for (const int d : seen) {
    std::vector<size_t> slots;
    std::vector<int64_t> sizes;
    for (size_t s = 0; s < destinations.size(); ++s) {
      if (destinations[s] != d) continue;
      slots.push_back(s);
      sizes.push_back(bytes[s]);
    }
    auto at = slots.begin();
    for (const int64_t n : comm::bucket_groups(sizes, cap_bytes)) {
      buckets.emplace_back(at, at + n);
      at += n;
    }
  }
  std::sort(buckets.begin(), buckets.end(), [](const auto& x, const auto& y) { return x.front() < y.front(); });
  return buckets;
}

size_t StepPlan::sharded_layers() const {
  size_t n = 0;
  for (const auto& shape : shapes) n += shape.sharded ? 1 : 0;
  return n;
}

bool StepPlan::computes_a(size_t layer, int rank) const {
  if (layer < shapes.size() && shapes[layer].a_shared_with >= 0) return false;  // its leader's A
  const int worker = placement.layers.at(layer).a_worker;
  return worker == rank || worker == assign::kEveryRank;
}

bool StepPlan::computes_g(size_t layer, int rank) const {
  const int worker = placement.layers.at(layer).g_worker;
  return worker == rank || worker == assign::kEveryRank;
}

bool StepPlan::shares_second_order() const {
  for (const auto& flow : flows) {
    if (flow.broadcast_a || flow.broadcast_g) return true;
  }
  return false;
}

std::string StepPlan::describe(bool per_layer) const {
  std::ostringstream out;
  const int p = world_size();
  const int w = grad_workers();
  if (p == 1) {
    out << "step plan: single process, " << to_string(method) << "; every layer's factors, second order and "
        << "preconditioning here, nothing communicated\n";
    if (approx == KfacApprox::kReduce) out << "  K-FAC reduce: a Linear over a sequence builds one factor row per sample\n";
  } else {
    out << "step plan: " << system_name(strategy) << " (" << dkfac::to_string(strategy) << "), P=" << p << " W=" << w
        << " (" << p / w << (p / w == 1 ? " column), " : " columns), ") << to_string(method) << "\n";
    out << "  factors: ";
    switch (reduction) {
      case FactorReduction::kNone:
        out << "each layer's owner builds them from its own batch; not reduced";
        break;
      case FactorReduction::kAllreduce:
        out << "built on every rank, averaged over the world in step(), one allreduce per factor";
        break;
      case FactorReduction::kHookBuckets:
        out << "built on every rank, averaged over the world from the capture hooks in ";
        if (bucket_cap_mb > 0) {
          out << "buckets of <= " << bucket_cap_mb << " MiB";
        } else {
          out << "one collective per factor";
        }
        break;
      case FactorReduction::kSpdPipeline:
        out << "built on every rank, averaged over the world from the capture hooks, ";
        if (fusion.empty()) {
          out << "fused by the measured alpha-beta model after " << profile_steps << " profiled factor step(s)";
        } else {
          out << "fused in the given groups of [";
          for (size_t k = 0; k < fusion.size(); ++k) out << (k ? ", " : "") << fusion[k];
          out << "] factors";
        }
        break;
    }
    if (reduction != FactorReduction::kNone) out << (factor_triangles ? ", upper triangles" : ", full matrices");
    if (approx == KfacApprox::kReduce) out << "; K-FAC reduce: a Linear over a sequence builds one row per sample";
    out << "\n  second order: ";
    if (!shares_second_order()) {
      out << "each part computed where it is used; nothing broadcast";
    } else {
      out << "broadcast inside columns from the rank that computed it ("
          << (method == ComputeMethod::kEigen ? "eigenvectors and eigenvalues"
                                               : inverse_triangles ? "inverses as upper triangles" : "full inverses")
          << ")";
    }
    if (redundant_dim >= 0) out << "; factors of dim <= " << redundant_dim << " decomposed on every rank";
    out << "\n  preconditioned gradients: "
        << (broadcast_gradients ? "broadcast along rows from each layer's grad worker" : "computed on every rank")
        << "\n";
    if (const size_t n = sharded_layers(); n > 0) {
      out << "  sharded layers (" << n << " of " << shapes.size() << "): " << dkfac::to_string(sharded_placement)
          << (sharded_placement == ShardedPlacement::kOwner
                  ? ": each row of " + std::to_string(p / w) + " ranks gathers a layer's gradient shards to its grad "
                    "worker there, which alone keeps its factors and second order, preconditions, and scatters the "
                    "rows back" +
                    (reduction == FactorReduction::kNone || p / w < kFewestRanksToReduce ? std::string()
                     : "; the row's factors are summed into it (a reduce" +
                           (w > 1 ? ", then an allreduce among the layer's " + std::to_string(w) + " owners"
                                  : std::string()) + ")")
                  : ": every rank gathers each gradient (all-gather), preconditions as above, and keeps its rows")
          << "\n";
    }
  }
  size_t followers = 0;
  for (const auto& shape : shapes) followers += shape.a_shared_with >= 0 ? 1 : 0;
  if (followers > 0) {
    out << "  shared inputs: " << followers << " layer(s) share the A factor of an earlier layer that reads the same "
        << "input (built, reduced, decomposed and held once per group)\n";
  }
  for (size_t i = 0; per_layer && i < placement.layers.size(); ++i) {
    const auto& placed = placement.layers[i];
    const auto& flow = flows[i];
    out << "  " << (i < shapes.size() ? shapes[i].name : std::to_string(i));
    if (i < shapes.size()) {
      const auto& s = shapes[i];
      out << " [a=" << s.a_dim << (s.a_diagonal ? " diagonal" : "") << ", g=" << s.g_dim
          << (s.g_diagonal ? " diagonal" : "") << "]";
    }
    out << ": factors on " << (flow.owner_rows && flow.factor_builder == assign::kEveryRank ? "every rank, kept where decomposed"
                                                                                    : where(flow.factor_builder))
        << "; A ";
    if (i < shapes.size() && shapes[i].a_shared_with >= 0) {
      const auto leader = static_cast<size_t>(shapes[i].a_shared_with);
      out << "shared with " << (leader < shapes.size() ? shapes[leader].name : std::to_string(leader));
    } else {
      out << "on " << where(placed.a_worker) << (flow.broadcast_a ? " (broadcast)" : "");
    }
    out << ", G on " << where(placed.g_worker)
        << (flow.broadcast_g ? " (broadcast)" : "") << "; grad workers " << ranks(placed.grad_workers) << "\n";
  }
  return out.str();
}

}  // namespace dkfac::strategy
