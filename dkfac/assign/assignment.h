#pragma once

#include <cstdint>
#include <string>
#include <vector>

/// Placement of K-FAC work on workers (SPEC.md section 3). Pure data and pure functions: no
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
};

/// Where one layer's K-FAC work runs.
struct LayerAssignment {
  int a_worker = 0;               ///< rank that decomposes/inverts A
  int g_worker = 0;               ///< rank that decomposes/inverts G
  std::vector<int> grad_workers;  ///< ranks that precondition this layer (its KAISA column), ascending
};

/// KAISA's W x (P/W) grid and the per-layer placement.
struct Assignment {
  int world_size = 1;
  int grad_workers = 1;  ///< W: ranks per column (gradient workers per layer)
  std::vector<LayerAssignment> layers;

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
  /// Human-readable table: one line per layer.
  std::string to_string(const std::vector<LayerShape>& shapes) const;
};

/// W = max(1, round(P * fraction)); throws c10::Error unless fraction is in (0, 1] and P % W == 0.
int grad_worker_count(int world_size, double grad_worker_fraction);

/// KAISA placement: layers are placed largest first (greedy longest-processing-time). Each goes to the
/// column with the least load so far; within it, A and G go to its least-loaded rank together
/// (`colocate`) or each factor separately. Ties go to the lowest index.
Assignment assign_kaisa(const std::vector<LayerShape>& layers, int world_size, double grad_worker_fraction,
                        Balance balance = Balance::kCompute, bool colocate = true);

}  // namespace dkfac::assign
