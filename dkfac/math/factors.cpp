#include "dkfac/math/factors.h"

#include "dkfac/math/gemm.h"

namespace F = torch::nn::functional;

namespace dkfac::math {
namespace {

// Inputs with fewer channels build their patches with unfold: a channels-last copy would move
// runs of fewer than this many floats.
constexpr int64_t kChannelsLastMin = 8;

// [sym, column; column^T, s n]: the factor of [X, 1] from sym = s X^T X and column = s X^T 1.
torch::Tensor with_bias_border(const torch::Tensor& sym, const torch::Tensor& column, double s, int64_t n) {
  const auto k = sym.size(0);
  auto cov = torch::empty({k + 1, k + 1}, sym.options());
  cov.slice(0, 0, k).slice(1, 0, k).copy_(sym);
  cov.slice(0, 0, k).select(1, k).copy_(column);
  cov.select(0, k).slice(0, 0, k).copy_(column);
  cov.select(0, k).select(0, k).fill_(s * static_cast<double>(n));
  return cov;
}

// covariance() of X = the rows of every u_b^T for u [B, k, L] (the layout unfold and a conv output gradient
// have), as sum_b u_b u_b^T: no transposed copy of u. Worth it while the [B, k, k] products are no larger
// than u, i.e. k <= L.
torch::Tensor batched_covariance(const torch::Tensor& u, bool with_bias, double scale) {
  const int64_t n = u.size(0) * u.size(2);
  TORCH_CHECK(n > 0, "covariance of an empty batch (0 rows)");
  const double s = scale * scale / static_cast<double>(n);
  auto c = torch::bmm(u, u.transpose(1, 2)).sum(0);
  auto sym = torch::add(c, c.t()).mul_(0.5 * s);
  if (!with_bias) return sym;
  return with_bias_border(sym, u.sum(torch::IntArrayRef{0, 2}).mul_(s), s, n);
}

}  // namespace

torch::Tensor covariance(const torch::Tensor& x, bool with_bias, double scale) {
  TORCH_CHECK(x.dim() == 2, "covariance expects a 2-D tensor, got shape ", x.sizes());
  const auto n = x.size(0);
  TORCH_CHECK(n > 0, "covariance of an empty batch (0 rows)");
  const double s = scale * scale / static_cast<double>(n);
  // gram() is exactly symmetric, so the reference's (C + C^T) / 2 reduces to the scaling.
  auto sym = gram(x).mul_(s);
  if (!with_bias) return sym;
  return with_bias_border(sym, x.sum(0).mul_(s), s, n);  // X^T 1 * scale^2 / n
}

torch::Tensor linear_a_factor(const torch::Tensor& input, bool with_bias) {
  TORCH_CHECK(input.dim() >= 1, "Linear input must have at least 1 dimension");
  return covariance(input.reshape({-1, input.size(-1)}), with_bias);
}

torch::Tensor linear_g_factor(const torch::Tensor& grad_output) {
  TORCH_CHECK(grad_output.dim() >= 1, "Linear output gradient must have at least 1 dimension");
  return covariance(grad_output.reshape({-1, grad_output.size(-1)}));
}

namespace {

torch::Tensor padded_input(const torch::Tensor& input, const Conv2dGeometry& geometry) {
  TORCH_CHECK(input.dim() == 4, "Conv2d input must be [B, C, H, W], got shape ", input.sizes());
  const auto& p = geometry.padding;
  if (p[0] == 0 && p[1] == 0 && p[2] == 0 && p[3] == 0) return input;
  return F::pad(input, F::PadFuncOptions({p[0], p[1], p[2], p[3]}).mode(geometry.padding_mode));
}

// unfold's patches [B, C*kh*kw, L], rows ordered (channel, kernel row, kernel column).
torch::Tensor unfolded_patches(const torch::Tensor& input, const Conv2dGeometry& geometry) {
  const auto padded = padded_input(input, geometry);
  const auto& k = geometry.kernel_size;
  const auto& st = geometry.stride;
  const auto& d = geometry.dilation;
  return F::unfold(padded, F::UnfoldFuncOptions({k[0], k[1]}).dilation({d[0], d[1]}).padding(0).stride({st[0], st[1]}));
}

}  // namespace

torch::Tensor conv2d_patches(const torch::Tensor& input, const Conv2dGeometry& geometry) {
  auto columns = unfolded_patches(input, geometry);
  return columns.transpose(1, 2).reshape({-1, columns.size(1)});
}

torch::Tensor conv2d_a_factor(const torch::Tensor& input, const Conv2dGeometry& geometry,
                              bool with_bias) {
  TORCH_CHECK(input.dim() == 4, "Conv2d input must be [B, C, H, W], got shape ", input.sizes());
  const int64_t channels = input.size(1);
  if (channels < kChannelsLastMin) {
    const auto columns = unfolded_patches(input, geometry);
    const auto spatial = columns.size(2);
    if (columns.size(1) <= spatial) return batched_covariance(columns, with_bias, 1.0 / static_cast<double>(spatial));
    return covariance(columns.transpose(1, 2).reshape({-1, columns.size(1)}), with_bias,
                      1.0 / static_cast<double>(spatial));
  }
  // One copy from a channels-last view builds the patches with columns in (kernel row, kernel column,
  // channel) order; unfold + transpose would copy twice. The factor is then permuted to the
  // (channel, kernel row, kernel column) order of conv2d_patches, which costs dim^2, not rows * dim.
  const auto padded = padded_input(input, geometry);
  const auto& k = geometry.kernel_size;
  const auto& st = geometry.stride;
  const auto& dl = geometry.dilation;
  const int64_t batch = padded.size(0), height = padded.size(2), width = padded.size(3);
  const int64_t out_h = (height - dl[0] * (k[0] - 1) - 1) / st[0] + 1;
  const int64_t out_w = (width - dl[1] * (k[1] - 1) - 1) / st[1] + 1;
  TORCH_CHECK(out_h > 0 && out_w > 0, "Conv2d input ", input.sizes(), " is smaller than its kernel");
  const auto nhwc = padded.permute({0, 2, 3, 1}).contiguous();
  const int64_t row = width * channels;
  const auto patches = nhwc.as_strided({batch, out_h, out_w, k[0], k[1], channels},
                                       {height * row, row * st[0], channels * st[1], row * dl[0],
                                        channels * dl[1], 1})
                           .reshape({batch * out_h * out_w, k[0] * k[1] * channels});
  auto cov = covariance(patches, with_bias, 1.0 / static_cast<double>(out_h * out_w));
  const int64_t columns = k[0] * k[1] * channels;
  auto order = torch::arange(columns, torch::TensorOptions().dtype(torch::kLong).device(input.device()))
                   .view({k[0], k[1], channels})
                   .permute({2, 0, 1})
                   .reshape({-1});
  if (with_bias) order = torch::cat({order, torch::full({1}, columns, order.options())});
  return cov.index_select(0, order).index_select(1, order);
}

torch::Tensor conv2d_g_factor(const torch::Tensor& grad_output) {
  TORCH_CHECK(grad_output.dim() == 4, "Conv2d output gradient must be [B, C, H, W], got shape ",
              grad_output.sizes());
  const int64_t batch = grad_output.size(0), channels = grad_output.size(1);
  const auto spatial = grad_output.size(2) * grad_output.size(3);
  if (channels <= spatial && grad_output.is_contiguous()) {
    // Sum over the batch of Y_b Y_b^T with Y_b [C, H*W] as stored: no transposed copy of the gradient,
    // and the batched product's output [B, C, C] is no larger than that copy would be.
    return batched_covariance(grad_output.view({batch, channels, spatial}), false, 1.0 / static_cast<double>(spatial));
  }
  auto y = grad_output.permute({0, 2, 3, 1}).reshape({-1, channels});
  return covariance(y, false, 1.0 / static_cast<double>(spatial));
}

torch::Tensor pack_upper(const torch::Tensor& matrix) {
  const int64_t n = matrix.size(0);
  auto idx = torch::triu_indices(n, n, 0, torch::TensorOptions().dtype(torch::kLong).device(matrix.device()));
  return matrix.index({idx[0], idx[1]}).contiguous();
}

torch::Tensor unpack_upper(const torch::Tensor& packed, int64_t n) {
  auto idx = torch::triu_indices(n, n, 0, torch::TensorOptions().dtype(torch::kLong).device(packed.device()));
  auto out = torch::empty({n, n}, packed.options());
  out.index_put_({idx[0], idx[1]}, packed);
  out.index_put_({idx[1], idx[0]}, packed);
  return out;
}

}  // namespace dkfac::math
