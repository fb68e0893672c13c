#include "dkfac/assign/plan.h"

namespace dkfac::assign {
namespace {

int64_t triangle(int64_t n) { return n * (n + 1) / 2; }

double cube(int64_t n) { return static_cast<double>(n) * n * n; }

}  // namespace

std::vector<RankPlan> predict(const Assignment& assignment, const std::vector<LayerShape>& layers,
                              const PlanInputs& inputs) {
  using Flow = PlanInputs::Flow;
  const int world = assignment.world_size;
  const int64_t e = inputs.element_bytes;
  const bool triangles = inputs.symmetric_comm || inputs.flow == Flow::kSpd;
  const auto sent = [&](int64_t n) { return triangles ? triangle(n) : n * n; };
  std::vector<RankPlan> out(world);
  for (int rank = 0; rank < world; ++rank) {
    auto& r = out[rank];
    for (size_t i = 0; i < layers.size(); ++i) {
      const auto& shape = layers[i];
      const auto& placed = assignment.layers[i];
      const int64_t a = shape.a_dim;
      const int64_t g = shape.g_dim;
      const bool owner = placed.a_worker == rank;
      const bool holds_factors = inputs.flow != Flow::kDp || owner;
      const bool preconditions = assignment.is_grad_worker(i, rank);
      if (inputs.flow != Flow::kDp) r.factor_bytes += e * (sent(a) + sent(g));
      if (holds_factors) {
        const double rows = static_cast<double>(inputs.batch_size * shape.rows_per_sample);
        r.factor_flops += 2.0 * rows * (static_cast<double>(a) * a + static_cast<double>(g) * g);
        r.memory_bytes += e * (a * a + g * g);
      }
      // Second-order state: held by the layer's grad workers; each part computed by its worker.
      if (preconditions) {
        r.memory_bytes += e * (inputs.eigen ? a * a + a + g * g + g + g * a : a * a + g * g);
        const double per_eigen = inputs.eigen ? 9.0 : 1.0;
        const int workers[2] = {placed.a_worker, placed.g_worker};
        const int64_t dims[2] = {a, g};
        for (int k = 0; k < 2; ++k) {
          if (workers[k] == rank || workers[k] == kEveryRank) r.decomposition_flops += per_eigen * cube(dims[k]);
          const bool broadcast = assignment.grad_workers > 1 && workers[k] != kEveryRank;
          if (!broadcast) continue;
          const bool symmetric = !inputs.eigen && (inputs.symmetric_comm || inputs.flow == Flow::kSpd);
          r.second_order_bytes +=
              e * (inputs.eigen ? dims[k] * dims[k] + dims[k] : symmetric ? triangle(dims[k]) : dims[k] * dims[k]);
        }
        const double ga = static_cast<double>(g) * a;
        r.precondition_flops += (inputs.eigen ? 4.0 : 2.0) * ga * static_cast<double>(g + a);
      }
      if (assignment.grad_workers < world) r.gradient_bytes += e * g * a;
    }
  }
  return out;
}

}  // namespace dkfac::assign
