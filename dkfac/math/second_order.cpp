#include "dkfac/math/second_order.h"

#include "dkfac/math/gemm.h"

#include <cmath>
#include <mutex>

namespace dkfac::math {
namespace {

bool all_finite(const torch::Tensor& t) { return torch::isfinite(t).all().item<bool>(); }

/// torch loads CUDA's linear algebra (cuSOLVER, MAGMA: the torch_cuda_linalg library) at its first use, and
/// that first use is not thread safe: of two threads that decompose at once, one fails with "lazy wrapper
/// should be called at most once" (measured on an H200 with ranks as threads of one process, docs/GPU.md).
/// So the process's first CUDA decomposition runs alone, and the others wait for it.
void load_cuda_linalg_once(const torch::Tensor& like) {
  if (!like.is_cuda()) return;
  static std::once_flag loaded;
  std::call_once(loaded, [&like] {
    const auto identity = torch::eye(2, like.options().dtype(torch::kFloat32));
    torch::linalg_eigh(identity);
    torch::linalg_cholesky_ex(identity);
  });
}

EigenFactor eigh_clamped(const torch::Tensor& factor) {
  load_cuda_linalg_once(factor);
  auto [values, vectors] = torch::linalg_eigh(factor, "U");
  return {vectors, values.clamp_min_(0.0)};
}

bool is_diagonal(const torch::Tensor& factor) { return factor.dim() == 1; }

void check_factor(const torch::Tensor& factor, const char* what) {
  TORCH_CHECK(is_diagonal(factor) || (factor.dim() == 2 && factor.size(0) == factor.size(1)), what,
              " expects a square matrix or a diagonal (a vector), got shape ", factor.sizes());
}

}  // namespace

torch::Tensor factor_trace(const torch::Tensor& factor) { return is_diagonal(factor) ? factor.sum() : factor.trace(); }

EigenFactor eigen_decompose_unchecked(const torch::Tensor& factor) {
  check_factor(factor, "eigen_decompose");
  if (is_diagonal(factor)) return {torch::Tensor(), factor.clamp_min(0.0)};
  EigenFactor result;
  try {
    result = eigh_clamped(factor);
  } catch (const c10::Error& first) {
    TORCH_CHECK(factor.scalar_type() != torch::kFloat64, "eigendecomposition of a ", factor.size(0),
                "x", factor.size(0), " factor failed: ", first.what_without_backtrace());
    // Ill-conditioned float32 factors can fail to converge; float64 nearly always succeeds.
    auto wide = eigh_clamped(factor.to(torch::kFloat64));
    result = {wide.eigenvectors.to(factor.scalar_type()), wide.eigenvalues.to(factor.scalar_type())};
  }
  return result;
}

EigenFactor eigen_decompose(const torch::Tensor& factor) {
  check_factor(factor, "eigen_decompose");
  TORCH_CHECK(all_finite(factor), "eigen_decompose: factor of shape ", factor.sizes(),
              " contains NaN or Inf");
  auto result = eigen_decompose_unchecked(factor);
  TORCH_CHECK((!result.eigenvectors.defined() || all_finite(result.eigenvectors)) && all_finite(result.eigenvalues),
              "eigendecomposition of a ",
              factor.size(0), "x", factor.size(0), " factor produced NaN or Inf");
  return result;
}

EigenFactor refresh_eigenbasis(const torch::Tensor& factor, const EigenFactor& previous) {
  check_factor(factor, "refresh_eigenbasis");
  if (is_diagonal(factor)) return eigen_decompose_unchecked(factor);
  const int64_t d = factor.size(0);
  TORCH_CHECK(previous.eigenvectors.defined() && previous.eigenvectors.sizes() == factor.sizes() &&
                  previous.eigenvalues.defined() && previous.eigenvalues.numel() == d,
              "refresh_eigenbasis: the previous eigenbasis does not match a ", d, "x", d, " factor");
  load_cuda_linalg_once(factor);  // the QR is CUDA linear algebra too
  const auto dtype = factor.scalar_type();
  const auto order = torch::argsort(previous.eigenvalues, /*stable=*/true, /*dim=*/0, /*descending=*/true);
  const auto start = previous.eigenvectors.to(dtype).index_select(1, order);
  // Factors are exactly symmetric (math::gram mirrors its triangle), so both products read the whole matrix.
  auto basis = std::get<0>(torch::linalg_qr(torch::mm(factor, start), "reduced"));
  auto values = (basis * torch::mm(factor, basis)).sum(0).clamp_min_(0.0);
  auto [ascending, index] = torch::sort(values);
  return {basis.index_select(1, index), ascending};
}

torch::Tensor finite_by_sum(const torch::Tensor& t, at::OptionalIntArrayRef dims) {
  return torch::isfinite(dims ? t.sum(*dims, /*keepdim=*/false, torch::kFloat64) : t.sum(torch::kFloat64));
}

torch::Tensor eigen_denominator(const EigenFactor& a, const EigenFactor& g, double damping) {
  return torch::outer(g.eigenvalues, a.eigenvalues).add_(damping).reciprocal_();
}

torch::Tensor to_eigenbasis(const EigenFactor& a, const EigenFactor& g, const torch::Tensor& matrix) {
  // A diagonal factor's eigenvectors are the identity: its products are skipped.
  auto rotated = g.eigenvectors.defined() ? torch::mm(g.eigenvectors.t(), matrix) : matrix;
  return a.eigenvectors.defined() ? torch::mm(rotated, a.eigenvectors) : rotated;
}

torch::Tensor from_eigenbasis(const EigenFactor& a, const EigenFactor& g, const torch::Tensor& rotated) {
  auto back = g.eigenvectors.defined() ? torch::mm(g.eigenvectors, rotated) : rotated;
  return a.eigenvectors.defined() ? torch::mm(back, a.eigenvectors.t()) : back;
}

torch::Tensor precondition_eigen(const EigenFactor& a, const EigenFactor& g, const torch::Tensor& denominator,
                                 const torch::Tensor& grad) {
  auto rotated = to_eigenbasis(a, g, grad);
  const bool is_grad = !a.eigenvectors.defined() && !g.eigenvectors.defined();
  rotated = is_grad ? rotated.mul(denominator) : rotated.mul_(denominator);  // never grad's own
  return from_eigenbasis(a, g, rotated);
}

torch::Tensor precondition_eigen(const EigenFactor& a, const EigenFactor& g, const torch::Tensor& grad,
                                 double damping) {
  return precondition_eigen(a, g, eigen_denominator(a, g, damping), grad);
}

namespace {

// Checks the stacked operands of `what`: m units of c layers, each [g, a]; returns c.
int64_t stacked_units(const char* what, const torch::Tensor& a_side, const torch::Tensor& g_side,
                      const torch::Tensor& grads) {
  TORCH_CHECK(a_side.dim() == 3 && g_side.dim() == 3 && grads.dim() == 3 && a_side.size(0) > 0 &&
                  grads.size(0) % a_side.size(0) == 0 && g_side.size(0) == grads.size(0) &&
                  a_side.size(1) == grads.size(2) && a_side.size(2) == grads.size(2) &&
                  g_side.size(1) == grads.size(1) && g_side.size(2) == grads.size(1),
              what, ": A side ", a_side.sizes(), ", G side ", g_side.sizes(), " and gradients ", grads.sizes(),
              " are not m [a, a], m c [g, g] and m c [g, a]");
  return grads.size(0) / a_side.size(0);
}

// `layers` [m c, g, a] times each unit's `right` [m, a, a], layer by layer (per_layer_side).
torch::Tensor times_unit_side(const torch::Tensor& layers, const torch::Tensor& right) {
  return torch::bmm(layers, per_layer_side(right, layers.size(0)));
}

}  // namespace

torch::Tensor per_layer_side(const torch::Tensor& unit_sides, int64_t layers) {
  TORCH_CHECK(unit_sides.dim() == 3 && unit_sides.size(0) > 0 && layers % unit_sides.size(0) == 0, "per_layer_side: ",
              layers, " layers in units of ", unit_sides.sizes());
  const int64_t c = layers / unit_sides.size(0);
  return c == 1 ? unit_sides : unit_sides.repeat_interleave(c, 0);
}

torch::Tensor to_eigenbasis_stacked(const torch::Tensor& qa, const torch::Tensor& qg, const torch::Tensor& matrices) {
  stacked_units("to_eigenbasis_stacked", qa, qg, matrices);
  return torch::bmm(torch::bmm(qg.transpose(1, 2), matrices), per_layer_side(qa, matrices.size(0)));
}

torch::Tensor from_eigenbasis_stacked(const torch::Tensor& qa, const torch::Tensor& qg, const torch::Tensor& rotated) {
  stacked_units("from_eigenbasis_stacked", qa, qg, rotated);
  return torch::bmm(torch::bmm(qg, rotated), per_layer_side(qa, rotated.size(0)).transpose(1, 2));
}

torch::Tensor precondition_eigen_stacked(const torch::Tensor& qa, const torch::Tensor& qg,
                                         const torch::Tensor& denominator, const torch::Tensor& grads) {
  stacked_units("precondition_eigen_stacked", qa, qg, grads);
  TORCH_CHECK(denominator.sizes() == grads.sizes(), "precondition_eigen_stacked: denominators ", denominator.sizes(),
              " do not match gradients ", grads.sizes());
  const auto each = per_layer_side(qa, grads.size(0));  // repeated once, for both products
  auto rotated = to_eigenbasis_stacked(each, qg, grads);
  rotated.mul_(denominator);
  return from_eigenbasis_stacked(each, qg, rotated);
}

torch::Tensor precondition_inverse_stacked(const torch::Tensor& a_inverse, const torch::Tensor& g_inverse,
                                           const torch::Tensor& grads) {
  stacked_units("precondition_inverse_stacked", a_inverse, g_inverse, grads);
  return times_unit_side(torch::bmm(g_inverse, grads), a_inverse);
}

torch::Tensor damped_inverse(const torch::Tensor& factor, double damping) {
  check_factor(factor, "damped_inverse");
  if (is_diagonal(factor)) {
    auto inverse = factor.add(damping).reciprocal_();
    TORCH_CHECK(all_finite(inverse), "inverse of a diagonal ", factor.size(0), "-wide damped factor produced NaN or Inf (damping ",
                damping, ")");
    return inverse;
  }
  load_cuda_linalg_once(factor);
  auto damped = factor.clone();
  damped.diagonal().add_(damping);
  auto [l, info] = torch::linalg_cholesky_ex(damped);
  torch::Tensor inverse;
  if (info.item<int64_t>() == 0) {
    inverse = torch::cholesky_inverse(l);
  } else {
    // Not numerically positive definite (tiny damping on a singular factor): general inverse.
    inverse = torch::linalg_inv(damped);
  }
  TORCH_CHECK(all_finite(inverse), "inverse of a ", factor.size(0), "x", factor.size(0),
              " damped factor produced NaN or Inf (damping ", damping, ")");
  return inverse;
}

DampedInverse damped_inverse_unchecked(const torch::Tensor& factor, const torch::Tensor& damping) {
  check_factor(factor, "damped_inverse");
  if (is_diagonal(factor)) {  // positive definite where every damped entry is positive
    auto damped = factor.add(damping.to(factor.scalar_type()));
    return {damped.reciprocal(), damped.gt(0).all()};
  }
  load_cuda_linalg_once(factor);
  auto damped = factor.clone();
  damped.diagonal().add_(damping.to(factor.scalar_type()));
  auto [l, info] = torch::linalg_cholesky_ex(damped);
  return {torch::cholesky_inverse(l), info.eq(0)};
}

std::pair<torch::Tensor, torch::Tensor> pi_damping_on_device(const torch::Tensor& a_factor,
                                                             const torch::Tensor& g_factor, double damping) {
  // The same operations as pi_damping, in the same order, so that both give the same numbers.
  const auto a_mean = factor_trace(a_factor).to(torch::kFloat64) / static_cast<double>(a_factor.size(0));
  const auto g_mean = factor_trace(g_factor).to(torch::kFloat64) / static_cast<double>(g_factor.size(0));
  const auto usable = a_mean.gt(0).logical_and(g_mean.gt(0)).logical_and(a_mean.isfinite()).logical_and(g_mean.isfinite());
  const auto pi = torch::where(usable, (a_mean / g_mean).sqrt(), torch::ones_like(a_mean));
  const double root = std::sqrt(damping);
  return {pi * root, torch::full_like(pi, root).div_(pi)};
}

std::pair<double, double> pi_damping(const torch::Tensor& a_factor, const torch::Tensor& g_factor,
                                     double damping) {
  const double a_mean = factor_trace(a_factor).item<double>() / static_cast<double>(a_factor.size(0));
  const double g_mean = factor_trace(g_factor).item<double>() / static_cast<double>(g_factor.size(0));
  double pi = 1.0;
  if (a_mean > 0.0 && g_mean > 0.0 && std::isfinite(a_mean) && std::isfinite(g_mean)) {
    pi = std::sqrt(a_mean / g_mean);
  }
  const double root = std::sqrt(damping);
  return {root * pi, root / pi};
}

torch::Tensor precondition_inverse(const torch::Tensor& a_inverse, const torch::Tensor& g_inverse,
                                   const torch::Tensor& grad) {
  auto left = is_diagonal(g_inverse) ? grad * g_inverse.unsqueeze(1) : torch::mm(g_inverse, grad);
  return is_diagonal(a_inverse) ? left * a_inverse.unsqueeze(0) : torch::mm(left, a_inverse);
}

double kl_clip_scale(double vg_sum, double kl_clip) {
  if (kl_clip == 0.0 || vg_sum == 0.0) return 1.0;
  return std::min(1.0, std::sqrt(kl_clip / std::abs(vg_sum)));
}

}  // namespace dkfac::math
