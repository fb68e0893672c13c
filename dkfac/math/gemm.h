#pragma once

#include <torch/torch.h>

/// The two matrix products K-FAC spends its time in, spread over LibTorch's intra-op threads.
///
/// LibTorch hands a single product to BLAS, and the dkfac programs keep OpenBLAS at one thread (two
/// thread pools spinning on the same cores cost more than they give, docs/PERFORMANCE.md), so a plain
/// torch::mm runs on one core. These split one product into independent row blocks, each a
/// single-threaded BLAS call on its own thread; small products go to torch::mm unchanged.
namespace dkfac::math {

/// X^T X for X [n, d], exactly symmetric. Only the upper block triangle is multiplied (row blocks of
/// equal work, at least two per thread) and mirrored, so large factors cost about half a GEMM.
torch::Tensor gram(const torch::Tensor& x);

/// Copies the strict upper triangle of the square matrix `m` onto its lower triangle, in place (cache-sized
/// tiles over `threads` threads for contiguous CPU float/double).
void mirror_upper(torch::Tensor& m, int threads = 1);

/// a @ b for 2-D a [m, k] and b [k, n], row blocks of `a` on separate threads.
torch::Tensor parallel_mm(const torch::Tensor& a, const torch::Tensor& b);

}  // namespace dkfac::math
