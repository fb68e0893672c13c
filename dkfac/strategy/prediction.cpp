#include "dkfac/strategy/prediction.h"

#include <algorithm>
#include <set>

#include "dkfac/comm/packing.h"

namespace dkfac::strategy {
namespace {

double cube(int64_t n) { return static_cast<double>(n) * n * n; }

}  // namespace

std::vector<RankCost> predict(const StepPlan& plan, int64_t element_bytes, int64_t batch_size) {
  const int64_t e = element_bytes;
  const bool eigen = plan.method == ComputeMethod::kEigen;
  // A diagonal factor (assign::LayerShape::a_diagonal) is n values everywhere: sent, held, and its
  // eigenvalues or inverse; it has no eigenvectors and no decomposition.
  const auto factor_entries = [&](int64_t n, bool diagonal) {
    return comm::packed_length(n, plan.factor_triangles, diagonal);
  };
  // What a second-order broadcast carries: eigenvectors and eigenvalues, or an inverse (maybe a triangle).
  const auto second_order_entries = [&](int64_t n, bool diagonal) {
    return eigen && !diagonal ? n * n + n : comm::packed_length(n, plan.inverse_triangles, diagonal);
  };
  const auto held = [](int64_t n, bool diagonal) { return diagonal ? n : n * n; };
  // Two products per dense side (one with the inverse method); a diagonal side scales in place (g a).
  const auto precondition_flops = [&](int64_t g, int64_t a, bool da, bool dg) {
    const double ga = static_cast<double>(g) * a;
    const double sides = static_cast<double>((dg ? 0 : g) + (da ? 0 : a));
    return (eigen ? 4.0 : 2.0) * ga * sides + (da || dg ? ga : 0.0);
  };
  std::vector<RankCost> out(plan.world_size());
  for (int rank = 0; rank < plan.world_size(); ++rank) {
    auto& r = out[rank];
    std::set<size_t> in_flight_a;  // the A factors counted in in_flight_bytes, by the layer that holds each
    for (size_t i = 0; i < plan.shapes.size(); ++i) {
      const auto& shape = plan.shapes[i];
      const auto& flow = plan.flows[i];
      const int64_t a = shape.a_dim;
      const int64_t g = shape.g_dim;
      const bool da = shape.a_diagonal;
      const bool dg = shape.g_diagonal;
      // A follower of a shared-input group builds, sends and holds no A of its own (its leader's counts it).
      const bool own_a = shape.a_shared_with < 0;
      const int64_t a_held = own_a ? held(a, da) : 0;
      if (plan.reduction != FactorReduction::kNone) {
        const int64_t sent = e * ((own_a ? factor_entries(a, da) : 0) + factor_entries(g, dg));
        r.factor_bytes += sent;
        // Owner placement: an owner's row sum goes on to the column's other owners (an allreduce among W ranks).
        if (plan.factor_destination(i) >= 0 && plan.grad_workers() > 1 && plan.preconditions(i, rank)) {
          r.factor_bytes += sent;
        }
      }
      if (plan.builds_factors(i, rank)) {
        const double rows = static_cast<double>(batch_size * shape.rows_per_sample);
        r.factor_flops += 2.0 * rows * static_cast<double>(a_held + held(g, dg));
      }
      if (plan.keeps_factors(i, rank)) r.memory_bytes += e * (a_held + held(g, dg));
      // Second-order state: held by the layer's grad workers; each part computed by its worker.
      if (plan.preconditions(i, rank)) {
        // The eigen denominator [g, a] is not held with eigen_adam (Adam's step does not use the eigenvalues).
        const int64_t denominator = plan.eigen_adam ? 0 : g * a;
        const int64_t a_state = !own_a ? 0 : eigen ? held(a, da) + (da ? 0 : a) : held(a, da);
        const int64_t g_state = eigen ? held(g, dg) + (dg ? 0 : g) : held(g, dg);
        r.memory_bytes += e * (a_state + g_state + (eigen ? denominator : 0));
        if (plan.second_order_lag > 0 && (plan.computes_a(i, rank) || plan.computes_g(i, rank))) {
          // New: the sides this rank computes (a follower computes no A), and the denominator where it computes
          // both; a side it receives is broadcast into the state at installation, not held beside it.
          const bool new_a = plan.computes_a(i, rank), new_g = plan.computes_g(i, rank);
          r.in_flight_bytes += e * ((new_a ? a_state : 0) + (new_g ? g_state : 0) +
                                    (eigen && new_a && new_g ? denominator : 0));
          if (plan.keeps_factors(i, rank)) {
            // Its A once per group: a follower whose leader this rank does not update keeps the leader's A too.
            const auto a_holder = static_cast<size_t>(own_a ? static_cast<int>(i) : shape.a_shared_with);
            r.in_flight_bytes += e * (held(g, dg) + (in_flight_a.insert(a_holder).second ? held(a, da) : 0));
          }
        }
        if (plan.eigen_adam) r.memory_bytes += 2 * e * g * a + 4;  // Adam's m and v, and its float32 step count
        const double per_decomposition = eigen ? 9.0 : 1.0;
        if (plan.computes_a(i, rank) && !da) r.decomposition_flops += per_decomposition * cube(a);
        if (plan.computes_g(i, rank) && !dg) r.decomposition_flops += per_decomposition * cube(g);
        if (flow.broadcast_a) r.second_order_bytes += e * second_order_entries(a, da);
        if (flow.broadcast_g) r.second_order_bytes += e * second_order_entries(g, dg);
        r.precondition_flops += precondition_flops(g, a, da, dg);
      }
      // A sharded layer's gradient, by ShardedPlacement, over a row of S ranks holding g a / S values each:
      // owner: the owner receives S - 1 shards and sends them back preconditioned, every other rank sends and
      // receives its own; replicated: every rank all-gathers the S - 1 shards it lacks, then V as the plan says.
      if (shape.sharded) {
        const int64_t s = std::max(1, plan.shard_ranks);
        if (flow.owner_rows) {
          const bool owner = plan.placement.grad_source_for(i, rank) == rank;
          r.gradient_bytes += 2 * e * g * a * (owner ? s - 1 : 1) / s;
          continue;
        }
        r.gradient_bytes += e * g * a * (s - 1) / s;
      }
      if (plan.broadcast_gradients) r.gradient_bytes += e * g * a;
    }
    if (plan.stack_layers && plan.pad_widths > 1) {
      // Options::pad_widths: each group's stacks at its padded widths (LayerGroups), and its products on them.
      for (const auto& group : stack_groups(plan, rank)) {
        const auto& shape = plan.shapes[group.units.front()];
        const int64_t a = shape.a_dim, g = shape.g_dim;
        const int64_t pa = padded_width(a, plan.pad_widths), pg = padded_width(g, plan.pad_widths);
        const auto units = static_cast<int64_t>(group.units.size());
        const auto members = static_cast<int64_t>(group.members.size());
        r.stack_padding_bytes +=
            e * (units * (pa * pa - a * a) +
                 members * ((pg * pg - g * g) + (eigen && !plan.eigen_adam ? pg * pa - g * a : 0)));  // no denominator
        r.precondition_flops += static_cast<double>(members) *
                                (precondition_flops(pg, pa, false, false) - precondition_flops(g, a, false, false));
      }
      r.memory_bytes += r.stack_padding_bytes;
    }
    r.memory_bytes += r.in_flight_bytes;
  }
  return out;
}

}  // namespace dkfac::strategy
