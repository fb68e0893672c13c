#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dkfac/math/factor_kernel.h"

/// Placement of K-FAC work on workers (docs/MATH.md section 5). Pure data and pure functions: no
/// communication, no tensors; printable and testable without any process.
namespace dkfac::assign {

/// What the greedy placement balances.
enum class Balance {
  kCompute,  ///< cost of a factor of dimension d is d^3 (eigendecomposition / inverse)
  kMemory,   ///< cost is d^2 (second-order state held)
};

/// Shape of one preconditioned layer.
struct LayerShape {
  std::string name;
  int64_t a_dim = 0;
  int64_t g_dim = 0;
  int64_t rows_per_sample = 1;  ///< rows each sample adds to the factors' input matrices (conv: H_out W_out)
  /// The kernels that build the A and G factors (what the time model prices them by): a Linear layer's
  /// covariances, or a Conv2d's math::conv2d_a_kernel and kConvGradient.
  math::FactorKernel a_kernel = math::FactorKernel::kCovariance;
  math::FactorKernel g_kernel = math::FactorKernel::kCovariance;
  /// Factors kept as their diagonal (KfacLayer::a_diagonal): d values, no decomposition, no eigenvectors.
  bool a_diagonal = false;
  bool g_diagonal = false;
  /// The gradient is sharded by output rows over each row of ranks (FSDP2, HSDP; KfacLayer::sharded).
  bool sharded = false;
  /// Options::shared_input_layers: the index of the earlier layer whose A factor this one shares (its group's
  /// first), or -1. A group is placed as one unit: one column, its A on one rank; a follower builds, reduces,
  /// decomposes, broadcasts and holds no A of its own.
  int a_shared_with = -1;
};

/// A factor decomposed redundantly by every rank (SPD-KFAC's small factors): nothing is broadcast.
constexpr int kEveryRank = -1;

/// Where one layer's K-FAC work runs.
struct LayerAssignment {
  int a_worker = 0;               ///< rank that decomposes/inverts A, or kEveryRank
  int g_worker = 0;               ///< rank that decomposes/inverts G, or kEveryRank
  std::vector<int> grad_workers;  ///< ranks that precondition this layer (its KAISA column), ascending
};

/// kfac_pytorch's names for KAISA's grid (its DistributedStrategy), by W: every rank preconditions every
/// layer (W = P), one rank per layer (W = 1 < P), or between.
enum class DistributedStrategy { kCommOpt, kHybridOpt, kMemOpt };

/// KAISA's W x (P/W) grid and the per-layer placement.
struct Assignment {
  int world_size = 1;
  int grad_workers = 1;  ///< W: ranks per column (gradient workers per layer)
  double grad_worker_fraction = 1.0;  ///< KAISA's f as given, 0 read as 1/P (kaisa_layout)
  bool colocate_factors = true;       ///< A and G of a layer on one rank of its column (kaisa_layout)
  std::vector<LayerAssignment> layers;

  /// kfac_pytorch's name for this grid: kCommOpt where W = P (one rank included), kMemOpt where W = 1 < P, else
  /// kHybridOpt.
  DistributedStrategy distributed_strategy() const;

  /// Column groups (share second-order state): {i, i + P/W, i + 2P/W, ...} for i < P/W.
  std::vector<std::vector<int>> columns() const;
  /// Row groups (share preconditioned gradients): {j*P/W, ..., j*P/W + P/W - 1} for j < W.
  std::vector<std::vector<int>> rows() const;
  /// Column index of `rank`, and row index of `rank`.
  int column_of(int rank) const { return rank % (world_size / grad_workers); }
  int row_of(int rank) const { return rank / (world_size / grad_workers); }
  /// True when `rank` preconditions layer `layer`.
  bool is_grad_worker(size_t layer, int rank) const;
  /// The grad worker of `layer` in `rank`'s row: it broadcasts V to that row.
  int grad_source_for(size_t layer, int rank) const;
};

/// KAISA's grid on `world_size` ranks for the options grad_worker_fraction f and colocate_factors, without
/// layers: the one place these rules live (assign_kaisa places on it; the front ends report it).
/// - W = max(1, round(P f)), halves rounded away from zero (P = 5, f = 0.9: W = 5), so f = 0 means 1/P (W = 1);
/// - grad_worker_fraction is f as given, or 1/P for f = 0;
/// - colocate_factors is forced on where W = 1 < P (MEM-OPT; kfac_pytorch's rule; assign_kaisa warns).
/// Pure: no warning, no process. Throws c10::Error unless f is in [0, 1] and W divides P.
Assignment kaisa_layout(int world_size, double grad_worker_fraction, bool colocate_factors);

/// W of kaisa_layout(world_size, grad_worker_fraction, ...).
int grad_worker_count(int world_size, double grad_worker_fraction);
/// KAISA's f = W / P as names print it: "1", or "1/(P/W)".
std::string fraction_name(int grad_workers, int world_size);

/// KAISA placement on kaisa_layout's grid, warning (TORCH_WARN) where that grid turns `colocate` on:
/// layers are placed largest first (greedy longest-processing-time). Each goes to the column with the least
/// load so far; within it, A and G go to its least-loaded rank together (`colocate`) or each factor
/// separately, larger first. Ties go to the lowest index. A shared-input group (LayerShape::a_shared_with) is
/// placed as one layer whose factors are its one A and every member's G.
Assignment assign_kaisa(const std::vector<LayerShape>& layers, int world_size, double grad_worker_fraction,
                        Balance balance = Balance::kCompute, bool colocate = true);

/// SPD-KFAC placement: every rank preconditions every layer (W = P). Factors (A and G separately) are
/// taken largest first; one of dimension <= `redundant_dim` is decomposed by every rank (kEveryRank),
/// a larger one goes to the rank with the least dim^3 load so far (ties to the lowest rank). A follower of a
/// shared-input group has no A of its own: its a_worker is its leader's.
Assignment assign_spd(const std::vector<LayerShape>& layers, int world_size, int64_t redundant_dim);

/// DP-KFAC placement: each layer has one owner (A and G together, W = 1), greedy largest-first on the
/// least dim^3-loaded rank. The owner alone builds the layer's factors, decomposes and preconditions.
Assignment assign_dp(const std::vector<LayerShape>& layers, int world_size);

/// kfac_pytorch's name of a grid, as grad_worker_fraction's named values spell it: "comm-opt", "hybrid-opt",
/// "mem-opt".
const char* to_string(DistributedStrategy strategy);

/// Transport cost model t(bytes) = alpha + beta * bytes (seconds).
struct AlphaBeta {
  double alpha = 0.0;
  double beta = 0.0;
  double seconds(double bytes) const { return alpha + beta * bytes; }
};

/// SPD-KFAC's redundancy threshold: the largest dimension d (0 if none) for which decomposing a d x d
/// factor (seconds_per_cubed_dim * d^3) costs no more than broadcasting its result of
/// `bytes_per_entry * d^2` bytes under `link`.
int64_t redundant_dim_threshold(double seconds_per_cubed_dim, const AlphaBeta& link, double bytes_per_entry);

/// SPD-KFAC's dynamic tensor fusion. Tensors become ready in order at `ready_seconds` (non-decreasing)
/// with `bytes` each; collectives run one at a time on one link. Walking the tensors in order, the next
/// tensor joins the current group when sending the merged group finishes no later than sending the
/// current group now and the next tensor after it. Returns the sizes of consecutive groups.
std::vector<int64_t> fuse_groups(const std::vector<double>& ready_seconds, const std::vector<int64_t>& bytes,
                                 const AlphaBeta& link);

}  // namespace dkfac::assign
