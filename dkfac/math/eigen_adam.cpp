#include "dkfac/math/eigen_adam.h"

#include <limits>

namespace dkfac::math {
namespace {

/// Q_to^T Q_from, or undefined (the identity) where both are (a diagonal factor's side).
torch::Tensor rotation(const torch::Tensor& from, const torch::Tensor& to) {
  if (!from.defined() && !to.defined()) return {};
  if (!to.defined()) return from;
  if (!from.defined()) return to.t();
  return torch::mm(to.t(), from);
}

}  // namespace

EigenAdamMoments zero_moments(int64_t g, int64_t a, const torch::TensorOptions& options) {
  return {torch::zeros({g, a}, options), torch::zeros({g, a}, options),
          torch::zeros({1}, options.dtype(torch::kFloat64))};
}

torch::Tensor to_eigenbasis(const EigenFactor& a, const EigenFactor& g, const torch::Tensor& matrix) {
  auto rotated = g.eigenvectors.defined() ? torch::mm(g.eigenvectors.t(), matrix) : matrix;
  return a.eigenvectors.defined() ? torch::mm(rotated, a.eigenvectors) : rotated;
}

torch::Tensor from_eigenbasis(const EigenFactor& a, const EigenFactor& g, const torch::Tensor& rotated) {
  auto back = g.eigenvectors.defined() ? torch::mm(g.eigenvectors, rotated) : rotated;
  return a.eigenvectors.defined() ? torch::mm(back, a.eigenvectors.t()) : back;
}

EigenAdamStep eigen_adam_step(const EigenFactor& a, const EigenFactor& g, const EigenAdamMoments& moments,
                              const torch::Tensor& grad, const AdamConstants& constants) {
  TORCH_CHECK(moments.defined() && moments.exp_avg.sizes() == grad.sizes(), "eigen_adam_step: moments of shape ",
              moments.exp_avg.defined() ? moments.exp_avg.sizes() : at::IntArrayRef{}, " for a gradient of shape ",
              grad.sizes());
  const auto dtype = moments.exp_avg.scalar_type();
  const auto p = to_eigenbasis(a, g, grad.scalar_type() == dtype ? grad : grad.to(dtype));
  const auto finite = torch::isfinite(p).all();
  const double b1 = constants.beta1;
  const double b2 = constants.beta2;
  auto m = torch::where(finite, moments.exp_avg * b1 + p * (1.0 - b1), moments.exp_avg);
  auto v = torch::where(finite, moments.exp_avg_sq * b2 + p * p * (1.0 - b2), moments.exp_avg_sq);
  auto t = torch::where(finite, moments.steps + 1.0, moments.steps);
  // Bias corrections 1 - beta^t as float64 [1] tensors (t is 0 only where no update was ever folded in: then m is
  // 0 and the quotient's NaN is masked below with the rest of an unfinished step).
  const auto bc1 = 1.0 - torch::pow(b1, t);
  const auto bc2 = 1.0 - torch::pow(b2, t);
  auto scaled = (m / bc1.to(dtype)) / ((v / bc2.to(dtype)).sqrt_() + constants.eps);
  scaled.masked_fill_(finite.logical_not(), std::numeric_limits<double>::quiet_NaN());
  auto direction = from_eigenbasis(a, g, scaled);
  if (direction.scalar_type() != grad.scalar_type()) direction = direction.to(grad.scalar_type());
  return {direction, {m, v, t}};
}

EigenAdamMoments rotate_moments(const EigenAdamMoments& moments, const EigenFactor& from_a, const EigenFactor& from_g,
                                const EigenFactor& to_a, const EigenFactor& to_g) {
  const auto dtype = moments.exp_avg.scalar_type();
  auto cast = [dtype](const torch::Tensor& t) { return !t.defined() || t.scalar_type() == dtype ? t : t.to(dtype); };
  const auto r_a = cast(rotation(from_a.eigenvectors, to_a.eigenvectors));
  const auto r_g = cast(rotation(from_g.eigenvectors, to_g.eigenvectors));
  auto both = [&](const torch::Tensor& x, const torch::Tensor& left, const torch::Tensor& right) {
    auto y = left.defined() ? torch::mm(left, x) : x;
    return right.defined() ? torch::mm(y, right.t()) : y;
  };
  auto square = [](const torch::Tensor& r) { return r.defined() ? r * r : r; };
  auto m = both(moments.exp_avg, r_g, r_a);
  auto v = both(moments.exp_avg_sq, square(r_g), square(r_a));
  const auto finite = torch::isfinite(m).all().logical_and(torch::isfinite(v).all());
  const auto zero = torch::zeros({}, m.options());
  return {torch::where(finite, m, zero), torch::where(finite, v, zero),
          torch::where(finite, moments.steps, torch::zeros_like(moments.steps))};
}

}  // namespace dkfac::math
