#include "dkfac/math/factors.h"

#include "dkfac/math/gemm.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace F = torch::nn::functional;

namespace dkfac::math {
namespace {

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

torch::Tensor diagonal_covariance(const torch::Tensor& x, bool with_bias, double scale) {
  TORCH_CHECK(x.dim() == 2, "diagonal_covariance expects a 2-D tensor, got shape ", x.sizes());
  const auto n = x.size(0);
  TORCH_CHECK(n > 0, "covariance of an empty batch (0 rows)");
  const double s = scale * scale / static_cast<double>(n);
  auto diagonal = x.square().sum(0).mul_(s);
  if (!with_bias) return diagonal;
  return torch::cat({diagonal, torch::full({1}, s * static_cast<double>(n), diagonal.options())});
}

torch::Tensor linear_a_diagonal(const torch::Tensor& input, bool with_bias) {
  TORCH_CHECK(input.dim() >= 1, "Linear input must have at least 1 dimension");
  return diagonal_covariance(input.reshape({-1, input.size(-1)}), with_bias);
}

torch::Tensor linear_g_diagonal(const torch::Tensor& grad_output) {
  TORCH_CHECK(grad_output.dim() >= 1, "Linear output gradient must have at least 1 dimension");
  return diagonal_covariance(grad_output.reshape({-1, grad_output.size(-1)}));
}

namespace {

// An Embedding's token indices as one row of int64 positions, checked: integers, at least one.
torch::Tensor token_positions(const torch::Tensor& indices) {
  TORCH_CHECK(!c10::isFloatingType(indices.scalar_type()) && !c10::isComplexType(indices.scalar_type()),
              "Embedding input must hold integer token indices, got ", indices.scalar_type());
  TORCH_CHECK(indices.numel() > 0, "Embedding A factor of an empty batch (0 positions)");
  return indices.reshape({-1}).to(torch::kLong);
}

}  // namespace

torch::Tensor embedding_a_factor(const torch::Tensor& indices, int64_t vocabulary, torch::ScalarType dtype) {
  const auto flat = token_positions(indices);
  const int64_t n = flat.numel();
  // One-hot rows x: sum_n x x^T / n is diagonal, entry t = (positions holding t) / n. index_add_, not
  // bincount: no wait for the device (the forward that ran on these indices has checked their range).
  auto counts = torch::zeros({vocabulary}, flat.options().dtype(dtype));
  return counts.index_add_(0, flat, torch::ones({n}, counts.options())).div_(static_cast<double>(n));
}

torch::Tensor embedding_a_factor_slice(const torch::Tensor& indices, int64_t first, int64_t rows,
                                       torch::ScalarType dtype) {
  TORCH_CHECK(first >= 0 && rows > 0, "an Embedding slice needs rows [first, first + rows), got first ", first,
              ", rows ", rows);
  const auto local = token_positions(indices) - first;
  const int64_t n = local.numel();
  const auto mine = local.ge(0).logical_and_(local.lt(rows));
  // Other ranks' tokens add 0 (at a clamped row): every position still counts in n, as over the whole vocabulary.
  auto counts = torch::zeros({rows}, local.options().dtype(dtype));
  return counts.index_add_(0, local.clamp(0, rows - 1), mine.to(dtype)).div_(static_cast<double>(n));
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

// Sum of p p^T over the patches p of a stride-1 (in height) convolution, without the im2col matrix.
// Z_u [B * out_w, kw * C] holds padded row u as the kernel columns see it (row (b, x): padded[b, :, u,
// x * sw + j * dw] for j < kw). Output row y reads padded row y + dh i with kernel row i, so the block of
// kernel rows (i, i') is
//   sum over u in [dh i, dh i + out_h) of Z_u^T Z_{u + s},   s = dh (i' - i):
// it depends on i only through the rows it sums. All blocks of one shift delta = i' - i share the rows
// [dh (kh - 1 - delta), out_h): one product for all of them, plus one small product per remaining row.
// kh products of width kw C replace one product of width kh kw C (for 3 x 3 kernels: 3 x 96^2 instead of
// 288^2 / 2 multiply-adds per patch row with 32 channels, and a third of the copy).
// Returns the [D, D] sum in (kernel row, kernel column, channel) order, D = kh kw C, exactly symmetric, and
// the [D] sum of the patches.
std::pair<torch::Tensor, torch::Tensor> row_shift_patch_sums(const torch::Tensor& padded, const Conv2dGeometry& geometry,
                                                             int64_t out_h, int64_t out_w) {
  const int64_t batch = padded.size(0), channels = padded.size(1), height = padded.size(2), width = padded.size(3);
  const int64_t kh = geometry.kernel_size[0], kw = geometry.kernel_size[1], dh = geometry.dilation[0];
  const int64_t w = kw * channels;
  const int64_t dim = kh * w;
  const auto rows = padded.permute({2, 0, 3, 1}).contiguous();  // [H, B, W, C]
  const auto z = rows.as_strided({height, batch, out_w, kw, channels},
                                 {batch * width * channels, width * channels, geometry.stride[1] * channels,
                                  geometry.dilation[1] * channels, 1})
                     .contiguous()
                     .view({height, batch * out_w, w});
  auto sum = torch::empty({dim, dim}, padded.options());
  for (int64_t delta = 0; delta < kh; ++delta) {
    const int64_t shift = dh * delta;
    const int64_t shared_begin = dh * (kh - 1 - delta);  // every block of this shift sums [shared_begin, out_h)
    const int64_t rows_end = shared_begin + out_h;         // and no block sums a row at or past this
    torch::Tensor shared;
    if (shared_begin < out_h) {
      const auto left = z.slice(0, shared_begin, out_h).reshape({-1, w});
      const auto right = z.slice(0, shared_begin + shift, out_h + shift).reshape({-1, w});
      shared = delta == 0 ? gram(left) : torch::mm(left.t(), right);
    }
    // The other rows, one product each: [first, first + count) -> [count, w, w].
    std::vector<std::pair<int64_t, torch::Tensor>> edges;
    auto add_edge = [&](int64_t first, int64_t last) {
      if (last <= first) return;
      edges.emplace_back(first, torch::bmm(z.slice(0, first, last).transpose(1, 2),
                                           z.slice(0, first + shift, last + shift)));
    };
    if (shared.defined()) {
      add_edge(0, shared_begin);
      add_edge(out_h, rows_end);
    } else {
      add_edge(0, rows_end);  // an input so small that no row is in every block
    }
    for (int64_t i = 0; i + delta < kh; ++i) {
      const int64_t begin = dh * i, end = dh * i + out_h;
      auto block = shared.defined() ? shared.clone() : torch::zeros({w, w}, padded.options());
      for (const auto& [first, products] : edges) {
        const int64_t a = std::max(begin, first), b = std::min(end, first + products.size(0));
        if (a < b) block.add_(products.slice(0, a - first, b - first).sum(0));
      }
      auto target = sum.slice(0, i * w, (i + 1) * w).slice(1, (i + delta) * w, (i + delta + 1) * w);
      if (delta == 0) {
        target.copy_(block.add(block.t()).mul_(0.5));
      } else {
        target.copy_(block);
        sum.slice(0, (i + delta) * w, (i + delta + 1) * w).slice(1, i * w, (i + 1) * w).copy_(block.t());
      }
    }
  }
  const auto row_sums = z.sum(1);  // [H, w]
  auto column = torch::empty({dim}, padded.options());
  for (int64_t i = 0; i < kh; ++i) {
    column.slice(0, i * w, (i + 1) * w).copy_(row_sums.slice(0, dh * i, dh * i + out_h).sum(0));
  }
  return {sum, column};
}

}  // namespace

std::array<int64_t, 4> conv2d_same_padding(std::array<int64_t, 2> kernel_size, std::array<int64_t, 2> dilation) {
  const int64_t total_h = dilation[0] * (kernel_size[0] - 1);
  const int64_t total_w = dilation[1] * (kernel_size[1] - 1);
  return {total_w / 2, total_w - total_w / 2, total_h / 2, total_h - total_h / 2};
}

torch::Tensor conv2d_patches(const torch::Tensor& input, const Conv2dGeometry& geometry) {
  auto columns = unfolded_patches(input, geometry);
  return columns.transpose(1, 2).reshape({-1, columns.size(1)});
}

torch::Tensor conv2d_a_factor(const torch::Tensor& input, const Conv2dGeometry& geometry,
                              bool with_bias) {
  TORCH_CHECK(input.dim() == 4, "Conv2d input must be [B, C, H, W], got shape ", input.sizes());
  const int64_t channels = input.size(1);
  const auto kernel = conv2d_a_kernel(channels, geometry.kernel_size[0], geometry.stride[0]);
  if (kernel == FactorKernel::kConvUnfold) {
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
  torch::Tensor cov;
  if (kernel == FactorKernel::kConvRowShift) {
    auto [sum, column] = row_shift_patch_sums(padded, geometry, out_h, out_w);
    const int64_t n = batch * out_h * out_w;
    const double scale = 1.0 / static_cast<double>(out_h * out_w);
    const double s = scale * scale / static_cast<double>(n);
    cov = with_bias ? with_bias_border(sum.mul_(s), column.mul_(s), s, n) : sum.mul_(s);
  } else {
    const auto nhwc = padded.permute({0, 2, 3, 1}).contiguous();
    const int64_t row = width * channels;
    const auto patches = nhwc.as_strided({batch, out_h, out_w, k[0], k[1], channels},
                                         {height * row, row * st[0], channels * st[1], row * dl[0],
                                          channels * dl[1], 1})
                             .reshape({batch * out_h * out_w, k[0] * k[1] * channels});
    cov = covariance(patches, with_bias, 1.0 / static_cast<double>(out_h * out_w));
  }
  const int64_t columns = k[0] * k[1] * channels;
  auto order = torch::arange(columns, torch::TensorOptions().dtype(torch::kLong).device(input.device()))
                   .view({k[0], k[1], channels})
                   .permute({2, 0, 1})
                   .reshape({-1});
  if (with_bias) order = torch::cat({order, torch::full({1}, columns, order.options())});
  return cov.index_select(0, order).index_select(1, order);
}

namespace {

// A Conv2d output gradient [B, C, H, W] as rows [B * H * W, C], one per output position.
torch::Tensor gradient_rows(const torch::Tensor& grad_output) {
  return grad_output.permute({0, 2, 3, 1}).reshape({-1, grad_output.size(1)});
}

}  // namespace

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
  return covariance(gradient_rows(grad_output), false, 1.0 / static_cast<double>(spatial));
}

torch::Tensor conv2d_a_diagonal(const torch::Tensor& input, const Conv2dGeometry& geometry, bool with_bias) {
  TORCH_CHECK(input.dim() == 4, "Conv2d input must be [B, C, H, W], got shape ", input.sizes());
  const auto patches = conv2d_patches(input, geometry);
  const int64_t spatial = patches.size(0) / input.size(0);
  return diagonal_covariance(patches, with_bias, 1.0 / static_cast<double>(spatial));
}

torch::Tensor conv2d_g_diagonal(const torch::Tensor& grad_output) {
  TORCH_CHECK(grad_output.dim() == 4, "Conv2d output gradient must be [B, C, H, W], got shape ",
              grad_output.sizes());
  const auto spatial = grad_output.size(2) * grad_output.size(3);
  return diagonal_covariance(gradient_rows(grad_output), false, 1.0 / static_cast<double>(spatial));
}

torch::Tensor running_average(const torch::Tensor& running, const torch::Tensor& batch, double alpha) {
  // eye() has no bfloat16 kernel on CPU: build the identity in float32 and convert.
  torch::Tensor base = running;
  if (!base.defined()) {
    base = batch.dim() == 1 ? torch::ones_like(batch)
                            : torch::eye(batch.size(0), batch.options().dtype(torch::kFloat32)).to(batch.scalar_type());
  }
  return base.mul(alpha).add_(batch, 1.0 - alpha);
}

torch::Tensor all_finite(const torch::Tensor& a_batch, const torch::Tensor& g_batch) {
  return torch::isfinite(a_batch).all().logical_and_(torch::isfinite(g_batch).all());
}

FoldedFactors fold_factors(const torch::Tensor& a, const torch::Tensor& g, const torch::Tensor& a_batch,
                           const torch::Tensor& g_batch, double alpha) {
  auto finite = all_finite(a_batch, g_batch);
  return {torch::where(finite, running_average(a, a_batch, alpha), a),
          torch::where(finite, running_average(g, g_batch, alpha), g), finite};
}

}  // namespace dkfac::math
