#include "dkfac/assign/assignment.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include <c10/util/Exception.h>

namespace dkfac::assign {
namespace {

double cost(int64_t dim, Balance balance) {
  const double d = static_cast<double>(dim);
  return balance == Balance::kCompute ? d * d * d : d * d;
}

/// A diagonal factor's second-order work and state are d (a reciprocal or a clamp of d values).
double cost(int64_t dim, bool diagonal, Balance balance) {
  return diagonal ? static_cast<double>(dim) : cost(dim, balance);
}

size_t argmin(const std::vector<double>& values, const std::vector<int>& among) {
  size_t best = 0;
  for (size_t i = 1; i < among.size(); ++i) {
    if (values[among[i]] < values[among[best]]) best = i;
  }
  return best;
}

}  // namespace

std::vector<std::vector<int>> Assignment::columns() const {
  const int per_row = world_size / grad_workers;
  std::vector<std::vector<int>> out(per_row);
  for (int rank = 0; rank < world_size; ++rank) out[rank % per_row].push_back(rank);
  return out;
}

std::vector<std::vector<int>> Assignment::rows() const {
  const int per_row = world_size / grad_workers;
  std::vector<std::vector<int>> out(grad_workers);
  for (int rank = 0; rank < world_size; ++rank) out[rank / per_row].push_back(rank);
  return out;
}

bool Assignment::is_grad_worker(size_t layer, int rank) const {
  const auto& w = layers.at(layer).grad_workers;
  return std::binary_search(w.begin(), w.end(), rank);
}

int Assignment::grad_source_for(size_t layer, int rank) const {
  return layers.at(layer).grad_workers.at(row_of(rank));
}

DistributedStrategy Assignment::distributed_strategy() const {
  if (grad_workers == world_size) return DistributedStrategy::kCommOpt;
  return grad_workers == 1 ? DistributedStrategy::kMemOpt : DistributedStrategy::kHybridOpt;
}

const char* to_string(DistributedStrategy strategy) {
  switch (strategy) {
    case DistributedStrategy::kCommOpt:
      return "comm-opt";
    case DistributedStrategy::kHybridOpt:
      return "hybrid-opt";
    case DistributedStrategy::kMemOpt:
      return "mem-opt";
  }
  return "unknown";
}

Assignment kaisa_layout(int world_size, double grad_worker_fraction, bool colocate_factors) {
  TORCH_CHECK(world_size >= 1, "world size must be >= 1, got ", world_size);
  TORCH_CHECK(grad_worker_fraction >= 0.0 && grad_worker_fraction <= 1.0,
              "grad_worker_fraction must be in [0, 1] (0: 1/P), got ", grad_worker_fraction);
  Assignment out;
  out.world_size = world_size;
  // std::lround rounds halves away from zero (Python's round() would take P = 5, f = 0.9 to W = 4).
  out.grad_workers = std::max(1, static_cast<int>(std::lround(world_size * grad_worker_fraction)));
  TORCH_CHECK(world_size % out.grad_workers == 0, "grad_worker_fraction ", grad_worker_fraction, " gives W=",
              out.grad_workers, " gradient workers, which does not divide the world size ", world_size);
  out.grad_worker_fraction = grad_worker_fraction == 0.0 ? 1.0 / world_size : grad_worker_fraction;
  // kfac_pytorch's rule: MEM-OPT keeps A and G of a layer on its one grad worker.
  out.colocate_factors = colocate_factors || out.distributed_strategy() == DistributedStrategy::kMemOpt;
  return out;
}

int grad_worker_count(int world_size, double grad_worker_fraction) {
  return kaisa_layout(world_size, grad_worker_fraction, /*colocate_factors=*/true).grad_workers;
}

std::string fraction_name(int grad_workers, int world_size) {
  return grad_workers == world_size ? "1" : "1/" + std::to_string(world_size / grad_workers);
}

Assignment assign_kaisa(const std::vector<LayerShape>& layers, int world_size, double grad_worker_fraction,
                        Balance balance, bool colocate) {
  Assignment out = kaisa_layout(world_size, grad_worker_fraction, colocate);
  if (out.colocate_factors != colocate) {
    TORCH_WARN("grad_worker_fraction=1/world_size (MEM_OPT) requires colocate_factors=True; enabling it");
  }
  colocate = out.colocate_factors;
  out.layers.resize(layers.size());
  const auto columns = out.columns();
  std::vector<double> column_load(columns.size(), 0.0);
  std::vector<double> rank_load(world_size, 0.0);

  // Units of placement: a layer, or a shared-input group (its leader first, then its followers); each unit's
  // factors as (cost, layer, is A), its one A first.
  struct Factor {
    double cost;
    size_t layer;
    bool is_a;
  };
  std::vector<std::vector<Factor>> units;
  std::vector<size_t> unit_of(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& l = layers[i];
    const int leader = l.a_shared_with;
    TORCH_CHECK(leader < static_cast<int>(i) && (leader < 0 || layers[leader].a_shared_with < 0), "layer ", i, " ('",
                l.name, "') shares the A factor of layer ", leader, ", which is not an earlier group leader");
    if (leader < 0) {
      unit_of[i] = units.size();
      units.push_back({{cost(l.a_dim, l.a_diagonal, balance), i, true}});
    }
    const size_t unit = unit_of[leader < 0 ? i : static_cast<size_t>(leader)];
    units[unit].push_back({cost(l.g_dim, l.g_diagonal, balance), i, false});
  }
  const auto total = [](const std::vector<Factor>& unit) {
    double sum = 0.0;
    for (const auto& f : unit) sum += f.cost;
    return sum;
  };
  std::vector<size_t> order(units.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return total(units[x]) > total(units[y]); });
  std::vector<int> column_ids(columns.size());
  std::iota(column_ids.begin(), column_ids.end(), 0);
  for (size_t u : order) {
    auto unit = units[u];
    const size_t c = argmin(column_load, column_ids);
    column_load[c] += total(unit);
    for (const auto& f : unit) out.layers[f.layer].grad_workers = columns[c];
    if (colocate) {
      const int rank = columns[c][argmin(rank_load, columns[c])];
      for (const auto& f : unit) out.layers[f.layer].a_worker = out.layers[f.layer].g_worker = rank;
      rank_load[rank] += total(unit);
    } else {
      // Larger factor first, so that the smaller ones fill the other ranks (A first on a tie).
      std::stable_sort(unit.begin(), unit.end(), [](const Factor& x, const Factor& y) { return x.cost > y.cost; });
      for (const auto& f : unit) {
        const int rank = columns[c][argmin(rank_load, columns[c])];
        (f.is_a ? out.layers[f.layer].a_worker : out.layers[f.layer].g_worker) = rank;
        rank_load[rank] += f.cost;
      }
    }
    // A group's followers decompose no A: their leader's rank holds the one they share.
    const size_t leader = units[u].front().layer;  // the unit as built: its A first
    for (const auto& f : unit) out.layers[f.layer].a_worker = out.layers[leader].a_worker;
  }
  return out;
}

Assignment assign_spd(const std::vector<LayerShape>& layers, int world_size, int64_t redundant_dim) {
  TORCH_CHECK(world_size >= 1, "world size must be >= 1, got ", world_size);
  Assignment out;
  out.world_size = world_size;
  out.grad_workers = world_size;
  out.colocate_factors = false;  // A and G are placed one by one
  out.layers.resize(layers.size());
  std::vector<int> everyone(world_size);
  std::iota(everyone.begin(), everyone.end(), 0);
  // Factors as (dimension, layer, is_a), largest first; ties keep layer order, A before G.
  struct Factor {
    int64_t dim;
    size_t layer;
    bool is_a;
    bool diagonal;  // decomposed on every rank, whatever its width: d values, nothing worth a broadcast
  };
  std::vector<Factor> factors;
  for (size_t i = 0; i < layers.size(); ++i) {
    out.layers[i].grad_workers = everyone;
    if (layers[i].a_shared_with < 0) factors.push_back({layers[i].a_dim, i, true, layers[i].a_diagonal});
    factors.push_back({layers[i].g_dim, i, false, layers[i].g_diagonal});
  }
  std::stable_sort(factors.begin(), factors.end(), [](const Factor& x, const Factor& y) { return x.dim > y.dim; });
  std::vector<double> load(world_size, 0.0);
  for (const auto& f : factors) {
    int worker = kEveryRank;
    if (f.dim > redundant_dim && !f.diagonal) {
      worker = everyone[argmin(load, everyone)];
      load[worker] += cost(f.dim, Balance::kCompute);
    }
    (f.is_a ? out.layers[f.layer].a_worker : out.layers[f.layer].g_worker) = worker;
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i].a_shared_with >= 0) out.layers[i].a_worker = out.layers[layers[i].a_shared_with].a_worker;
  }
  return out;
}

Assignment assign_dp(const std::vector<LayerShape>& layers, int world_size) {
  return assign_kaisa(layers, world_size, 1.0 / world_size, Balance::kCompute, /*colocate=*/true);
}

int64_t redundant_dim_threshold(double seconds_per_cubed_dim, const AlphaBeta& link, double bytes_per_entry) {
  // (c d^3 - alpha - beta b d^2) / d^2 increases with d: once a dimension fails, every larger one does.
  int64_t best = 0;
  for (int64_t d = 1; d <= (int64_t{1} << 16); ++d) {
    const double x = static_cast<double>(d);
    if (seconds_per_cubed_dim * x * x * x > link.seconds(bytes_per_entry * x * x)) break;
    best = d;
  }
  return best;
}

std::vector<int64_t> fuse_groups(const std::vector<double>& ready_seconds, const std::vector<int64_t>& bytes,
                                 const AlphaBeta& link) {
  TORCH_CHECK(ready_seconds.size() == bytes.size(), "fuse_groups: ", ready_seconds.size(), " ready times for ",
              bytes.size(), " tensors");
  std::vector<int64_t> groups;
  if (bytes.empty()) return groups;
  double link_free = 0.0;  // when the previous group's collective ends
  double group_ready = ready_seconds[0];
  double group_bytes = static_cast<double>(bytes[0]);
  int64_t group_size = 1;
  for (size_t i = 1; i < bytes.size(); ++i) {
    const double b = static_cast<double>(bytes[i]);
    const double current_end = std::max(group_ready, link_free) + link.seconds(group_bytes);
    const double separate_end = std::max(ready_seconds[i], current_end) + link.seconds(b);
    const double merged_end = std::max(ready_seconds[i], link_free) + link.seconds(group_bytes + b);
    if (merged_end <= separate_end) {
      group_ready = std::max(group_ready, ready_seconds[i]);
      group_bytes += b;
      ++group_size;
    } else {
      groups.push_back(group_size);
      link_free = current_end;
      group_ready = ready_seconds[i];
      group_bytes = b;
      group_size = 1;
    }
  }
  groups.push_back(group_size);
  return groups;
}

}  // namespace dkfac::assign
