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

  std::vector<size_t> order(layers.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
    const auto& lx = layers[x];
    const auto& ly = layers[y];
    return cost(lx.a_dim, lx.a_diagonal, balance) + cost(lx.g_dim, lx.g_diagonal, balance) >
           cost(ly.a_dim, ly.a_diagonal, balance) + cost(ly.g_dim, ly.g_diagonal, balance);
  });
  std::vector<int> column_ids(columns.size());
  std::iota(column_ids.begin(), column_ids.end(), 0);
  for (size_t index : order) {
    const double a_cost = cost(layers[index].a_dim, layers[index].a_diagonal, balance);
    const double g_cost = cost(layers[index].g_dim, layers[index].g_diagonal, balance);
    const size_t c = argmin(column_load, column_ids);
    column_load[c] += a_cost + g_cost;
    auto& l = out.layers[index];
    l.grad_workers = columns[c];
    if (colocate) {
      const int rank = columns[c][argmin(rank_load, columns[c])];
      l.a_worker = l.g_worker = rank;
      rank_load[rank] += a_cost + g_cost;
    } else {
      // Larger factor first, so that the smaller one fills the other rank.
      const bool a_first = a_cost >= g_cost;
      int& first = a_first ? l.a_worker : l.g_worker;
      int& second = a_first ? l.g_worker : l.a_worker;
      first = columns[c][argmin(rank_load, columns[c])];
      rank_load[first] += a_first ? a_cost : g_cost;
      second = columns[c][argmin(rank_load, columns[c])];
      rank_load[second] += a_first ? g_cost : a_cost;
    }
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
    factors.push_back({layers[i].a_dim, i, true, layers[i].a_diagonal});
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
