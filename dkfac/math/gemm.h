#pragma once

#include <torch/torch.h>

/// The symmetric product K-FAC builds its factors with.
///
/// PyPI's torch hands products to a BLAS that threads them itself with LibTorch's intra-op threads (MKL
/// on x86-64), so products run whole: splitting one over threads as well would run threads x threads on
/// the cores. Only the copy that completes a symmetric result, which calls no BLAS, is split over threads.
namespace dkfac::math {

/// X^T X for X [n, d], exactly symmetric. Only the upper block triangle is multiplied (four row blocks of
/// equal work) and mirrored, so large factors cost about 5/8 of a GEMM: on the CPU from d 128 (and 4e6
/// multiply-adds), on a GPU from d 2048 (measured to pay at 4096, to cost at 1024).
torch::Tensor gram(const torch::Tensor& x);

/// Copies the strict upper triangle of the square matrix `m` onto its lower triangle, in place (cache-sized
/// tiles over `threads` threads for contiguous CPU float/double).
void mirror_upper(torch::Tensor& m, int threads = 1);

}  // namespace dkfac::math
