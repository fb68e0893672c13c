#include "dkfac/strategy/candidates.h"

#include <algorithm>

#include <c10/util/Exception.h>

#include "dkfac/assign/assignment.h"

namespace dkfac::strategy {
namespace {

std::string kaisa_name(int grad_workers, int world_size, bool triangles) {
  return "kaisa f=" + assign::fraction_name(grad_workers, world_size) + " (W=" + std::to_string(grad_workers) + ")" +
         (triangles ? " triangles" : "");
}

std::string spd_name(const Options& options) {
  const int64_t threshold = options.spd().redundant_dim();
  return threshold < 0 ? "spd" : "spd (redundant dim <= " + std::to_string(threshold) + ")";
}

}  // namespace

std::vector<NamedOptions> candidates(int world_size, const Options& base, const CandidateSpace& space) {
  TORCH_CHECK(world_size >= 1, "world size must be >= 1, got ", world_size);
  const int p = world_size;
  std::vector<int> workers;
  if (space.grad_workers.empty()) {
    for (int w = p; w >= 1; --w) {
      if (p % w == 0) workers.push_back(w);
    }
  }
  for (const int w : space.grad_workers) {
    TORCH_CHECK(w >= 1 && w <= p && p % w == 0, "KAISA's grad workers W must divide the world size ", p, ", got ", w);
    if (std::find(workers.begin(), workers.end(), w) == workers.end()) workers.push_back(w);
  }
  const Options replicated = Options(base).sharded_placement(ShardedPlacement::kReplicated);
  std::vector<NamedOptions> out;
  for (const int w : workers) {
    const double f = static_cast<double>(w) / p;
    std::vector<bool> layouts = {base.symmetric_comm()};
    if (space.both_layouts) layouts = {false, true};
    for (const bool triangles : layouts) {
      out.push_back({kaisa_name(w, p, triangles),
                     Options(replicated).strategy(Strategy::kKaisa).grad_worker_fraction(f).symmetric_comm(triangles)});
    }
  }
  if (base.unused_layer_policy() != UnusedLayerPolicy::kSkip) {
    const auto spd = Options(replicated).strategy(Strategy::kSpd).grad_worker_fraction(1.0).symmetric_comm(true);
    out.push_back({spd_name(spd), spd});
  }
  out.push_back({"dp", Options(replicated).strategy(Strategy::kDp).grad_worker_fraction(1.0).symmetric_comm(false)});
  if (space.shard_ranks > 0) {
    const int s = space.shard_ranks;
    TORCH_CHECK(s <= p && p % s == 0, "the shard group of ", s, " ranks must divide the world size ", p);
    for (auto& c : out) c.name += ", replicated";
    const int replicas = p / s;
    const Options owner = Options(base).sharded_placement(ShardedPlacement::kOwner);
    out.push_back({"owner (kaisa, W=" + std::to_string(replicas) + ")",
                   Options(owner).strategy(Strategy::kKaisa).grad_worker_fraction(static_cast<double>(replicas) / p)});
    if (replicas == 1) {
      out.push_back({"owner (dp)", Options(owner).strategy(Strategy::kDp).grad_worker_fraction(1.0)});
    }
  }
  return out;
}

}  // namespace dkfac::strategy
