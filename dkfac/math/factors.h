#pragma once

#include <array>
#include <cstdint>

#include <torch/torch.h>

#include "dkfac/math/factor_kernel.h"

/// Kronecker factors of one mini-batch (docs/MATH.md section 1, kfac_pytorch v0.4.2 convention).
/// Pure functions: tensors in, tensors out; no state, no communication. All results are
/// symmetric, in the dtype of the input.
namespace dkfac::math {

/// cov(X) = X^T X / n, symmetrised, for X = [x, 1] (bias column appended when `with_bias`)
/// scaled by `scale`. x: [n, k] -> [k (+1), k (+1)]. The ones column is never materialised.
torch::Tensor covariance(const torch::Tensor& x, bool with_bias = false, double scale = 1.0);

/// Linear A factor. input: [..., in_features] -> [a, a], a = in_features (+1 with bias).
torch::Tensor linear_a_factor(const torch::Tensor& input, bool with_bias);

/// Linear G factor. grad_output: [..., out_features] -> [out_features, out_features].
torch::Tensor linear_g_factor(const torch::Tensor& grad_output);

/// A diagonal factor is a 1-D tensor [k] holding the diagonal of the factor it stands for (docs/MATH.md
/// section 7.3): the covariance's off-diagonal entries are dropped, so a k-wide factor costs k values, not k^2.
/// diagonal(covariance(x, with_bias, scale)) without the k x k product: x [n, k] -> [k (+1)].
torch::Tensor diagonal_covariance(const torch::Tensor& x, bool with_bias = false, double scale = 1.0);

/// diagonal(linear_a_factor(input, with_bias)) and diagonal(linear_g_factor(grad_output)), in O(n k).
torch::Tensor linear_a_diagonal(const torch::Tensor& input, bool with_bias);
torch::Tensor linear_g_diagonal(const torch::Tensor& grad_output);

/// Embedding A factor: the Linear A factor of the one-hot rows of `indices` (any shape, integer), which is
/// diagonal: entry t is the fraction of the n = indices.numel() positions that hold token t, [vocabulary],
/// in `dtype`. The indices are those the layer's forward took (which checked that they lie in [0, vocabulary)).
torch::Tensor embedding_a_factor(const torch::Tensor& indices, int64_t vocabulary, torch::ScalarType dtype);
/// The entries [first, first + rows) of embedding_a_factor over the whole vocabulary: an Embedding whose vocabulary
/// is split over ranks (tensor parallel), of which this rank holds those rows. Every position counts in n; a token
/// outside the slice counts in no entry.
torch::Tensor embedding_a_factor_slice(const torch::Tensor& indices, int64_t first, int64_t rows,
                                       torch::ScalarType dtype);

/// How a Conv2d lays its input out into patches.
struct Conv2dGeometry {
  std::array<int64_t, 2> kernel_size{1, 1};
  std::array<int64_t, 2> stride{1, 1};
  std::array<int64_t, 2> dilation{1, 1};
  /// Padding in torch::nn::functional::pad order: {left, right, top, bottom}.
  std::array<int64_t, 4> padding{0, 0, 0, 0};
  /// Padding mode of the layer (zeros, reflect, replicate, circular).
  torch::nn::functional::PadFuncOptions::mode_t padding_mode = torch::kConstant;
};

/// Padding {left, right, top, bottom} of a 'same' convolution, by ATen's rule: the total d (k - 1) per
/// dimension is split with the odd pixel on the right/bottom.
std::array<int64_t, 4> conv2d_same_padding(std::array<int64_t, 2> kernel_size, std::array<int64_t, 2> dilation);

/// im2col patches of `input` [B, C, H, W] -> [B * H_out * W_out, C * kh * kw]; each row laid
/// out like `weight.view(C_out, -1)` (channel, kernel row, kernel column).
torch::Tensor conv2d_patches(const torch::Tensor& input, const Conv2dGeometry& geometry);

/// Conv2d A factor: cov([patches, 1] / S). input: [B, C, H, W] -> [a, a], a = C*kh*kw (+1).
/// The kernel is conv2d_a_kernel's (factor_kernel.h): with stride 1 in height (and C >= 8, kh > 1) it is built
/// from products of kernel-row shifts of the input instead of the patch matrix (kh products of width kw*C
/// instead of one of width kh*kw*C).
torch::Tensor conv2d_a_factor(const torch::Tensor& input, const Conv2dGeometry& geometry, bool with_bias);

/// Conv2d G factor: cov(Y / S) with Y the output gradient as [B*S, C_out].
/// grad_output: [B, C_out, H_out, W_out] -> [C_out, C_out].
torch::Tensor conv2d_g_factor(const torch::Tensor& grad_output);

/// diagonal(conv2d_a_factor(input, geometry, with_bias)) and diagonal(conv2d_g_factor(grad_output)), without
/// the k x k products (the 1/S convention kept).
torch::Tensor conv2d_a_diagonal(const torch::Tensor& input, const Conv2dGeometry& geometry, bool with_bias);
torch::Tensor conv2d_g_diagonal(const torch::Tensor& grad_output);

/// F = alpha F + (1 - alpha) F_batch, with F = I before the first update (`running` undefined; a diagonal
/// factor starts from ones).
torch::Tensor running_average(const torch::Tensor& running, const torch::Tensor& batch, double alpha);

/// True (a 0-dim bool tensor, on the device) when every entry of both batches is finite.
torch::Tensor all_finite(const torch::Tensor& a_batch, const torch::Tensor& g_batch);

/// A layer's factors after one update, and whether it happened.
struct FoldedFactors {
  torch::Tensor a;
  torch::Tensor g;
  torch::Tensor finite;  ///< 0-dim bool: false when a batch held NaN/Inf and `a`, `g` are the old factors
};

/// One update of a layer's existing factors A and G, decided on the device without waiting for it: both
/// running averages where both batches are finite, the old factors otherwise.
FoldedFactors fold_factors(const torch::Tensor& a, const torch::Tensor& g, const torch::Tensor& a_batch,
                           const torch::Tensor& g_batch, double alpha);

}  // namespace dkfac::math
