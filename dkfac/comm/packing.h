#pragma once

#include <cstdint>
#include <vector>

#include <torch/torch.h>

/// How K-FAC tensors are laid out for the wire and grouped into collectives: symmetric matrices as
/// upper triangles or flat, several tensors fused into one buffer, tensors bucketed by size. Pure
/// functions (no communicator, no processes): the strategies call them around their collectives, and
/// every rank computes the same layout from the same shapes.
namespace dkfac::comm {

/// Packs the upper triangle (diagonal included) of a square matrix [n, n] -> [n (n + 1) / 2], row by row.
torch::Tensor pack_upper(const torch::Tensor& matrix);
/// Inverse of pack_upper: the symmetric [n, n] matrix.
torch::Tensor unpack_upper(const torch::Tensor& packed, int64_t n);

/// Elements sent for an n x n symmetric matrix: n (n + 1) / 2 as an upper triangle, else n^2; n for a
/// diagonal one (held as its diagonal [n], math/factors.h).
inline int64_t packed_length(int64_t n, bool triangle, bool diagonal = false) {
  return diagonal ? n : triangle ? n * (n + 1) / 2 : n * n;
}
/// A symmetric matrix as sent: its upper triangle (pack_upper), or the whole matrix flattened; a diagonal
/// one ([n]) as it is.
torch::Tensor pack_symmetric(const torch::Tensor& matrix, bool triangle);
/// Inverse of pack_symmetric for a matrix of dimension `n` (a diagonal one: [n]).
torch::Tensor unpack_symmetric(const torch::Tensor& packed, int64_t n, bool triangle, bool diagonal = false);

/// One buffer for a fused collective: the 1-D `tensors` concatenated in order (a single tensor is sent
/// as itself, made contiguous). Empty `tensors` is the caller's to avoid.
torch::Tensor fuse(const std::vector<torch::Tensor>& tensors);

/// kfac_pytorch's bucketing: tensors of `bytes`, in ready order, packed into consecutive buckets of at
/// most `cap_bytes` (a tensor larger than the cap goes alone; cap 0 sends every tensor alone). Returns
/// the sizes of consecutive groups.
std::vector<int64_t> bucket_groups(const std::vector<int64_t>& bytes, int64_t cap_bytes);

}  // namespace dkfac::comm
