#include "dkfac/math/eigen_adam.h"

#include <ATen/ops/_fused_adam.h>

namespace dkfac::math {
namespace {

/// Q_to^T Q_from, or undefined (the identity) where both are (a diagonal factor's side).
torch::Tensor rotation(const torch::Tensor& from, const torch::Tensor& to) {
  if (!from.defined() && !to.defined()) return {};
  if (!to.defined()) return from;
  if (!from.defined()) return to.t();
  return torch::mm(to.t(), from);
}

// Moments Adam can step for a [g, a] gradient of `shape`.
void check_moments(const EigenAdamMoments& moments, at::IntArrayRef shape) {
  TORCH_CHECK(moments.defined() && moments.exp_avg.sizes() == shape, "eigen_adam_step: moments of shape ",
              moments.exp_avg.defined() ? moments.exp_avg.sizes() : at::IntArrayRef{}, " for a gradient of shape ",
              shape);
  TORCH_CHECK(moments.steps.scalar_type() == torch::kFloat32,
              "eigen_adam_step: the step count must be float32 (torch's fused Adam reads it so), got ",
              moments.steps.scalar_type());
}

// Adam's element-wise step on `p` (a layer's gradient in its eigenbasis, [g, a], contiguous, the moments' dtype),
// the moments updated in place, and the update m-hat / (sqrt(v-hat) + eps) written into `update` (contiguous, as p):
// torch's fused Adam kernel, one pass over P, m and v. Where P is not finite the moments are left as they were and the
// update is NaN, decided on the device.
void adam_in_eigenbasis(EigenAdamMoments& moments, const torch::Tensor& p, const AdamConstants& constants,
                        torch::Tensor update) {
  const auto finite = finite_by_sum(p);
  // The kernel steps a "parameter" by -lr times Adam's update: a parameter of zeros and lr -1 leave the update in it.
  // P * 0 is 0 where P is finite and NaN elsewhere: the direction of a step the kernel skips (found_inf) is NaN.
  torch::mul_out(update, p, 0.0);
  moments.steps.add_(finite);  // before the kernel, which reads t; a skipped step does not count
  const auto found_inf = finite.logical_not().to(torch::kFloat32);
  at::_fused_adam_({update}, {p}, {moments.exp_avg}, {moments.exp_avg_sq}, {}, {moments.steps}, /*lr=*/-1.0,
                   constants.beta1, constants.beta2, /*weight_decay=*/0.0, constants.eps, /*amsgrad=*/false,
                   /*maximize=*/false, /*grad_scale=*/std::nullopt, found_inf);
}

}  // namespace

EigenAdamMoments zero_moments(int64_t g, int64_t a, const torch::TensorOptions& options) {
  return {torch::zeros({g, a}, options), torch::zeros({g, a}, options),
          torch::zeros({1}, options.dtype(torch::kFloat32))};
}

torch::Tensor eigen_adam_step(const EigenFactor& a, const EigenFactor& g, EigenAdamMoments& moments,
                              const torch::Tensor& grad, const AdamConstants& constants) {
  check_moments(moments, grad.sizes());
  const auto dtype = moments.exp_avg.scalar_type();
  // Contiguous, as the moments are: CUDA's fused kernel wants one layout across P, m, v and the result (a layer
  // whose two factors are diagonal would pass its gradient's own, transposed, layout through).
  const auto p = to_eigenbasis(a, g, grad.scalar_type() == dtype ? grad : grad.to(dtype)).contiguous();
  auto update = torch::empty_like(p);
  adam_in_eigenbasis(moments, p, constants, update);
  auto direction = from_eigenbasis(a, g, update);
  return direction.scalar_type() == grad.scalar_type() ? direction : direction.to(grad.scalar_type());
}

torch::Tensor eigen_adam_step_stacked(const torch::Tensor& qa, const torch::Tensor& qg,
                                      const std::vector<EigenAdamMoments*>& moments, const torch::Tensor& grads,
                                      int64_t g, int64_t a, const AdamConstants& constants) {
  TORCH_CHECK(g >= 1 && a >= 1 && g <= grads.size(1) && a <= grads.size(2), "eigen_adam_step_stacked: layers of [", g,
              ", ", a, "] in gradients of ", grads.sizes());
  TORCH_CHECK(static_cast<int64_t>(moments.size()) == grads.size(0), "eigen_adam_step_stacked: ", moments.size(),
              " layers' moments for ", grads.size(0), " gradients");
  const auto each = per_layer_side(qa, grads.size(0));  // repeated once, for both products
  const auto dtype = qg.scalar_type();
  const auto p = to_eigenbasis_stacked(each, qg, grads.scalar_type() == dtype ? grads : grads.to(dtype));
  auto update = torch::zeros_like(p);  // a padded layer's update is zero outside its [g, a]
  for (size_t k = 0; k < moments.size(); ++k) {
    TORCH_CHECK(moments[k] != nullptr && moments[k]->defined(), "eigen_adam_step_stacked: layer ", k,
                " has no moments");
    check_moments(*moments[k], {g, a});
    TORCH_CHECK(moments[k]->exp_avg.scalar_type() == dtype, "eigen_adam_step_stacked: layer ", k, "'s moments are ",
                moments[k]->exp_avg.scalar_type(), ", its eigenbasis ", dtype);
    const auto index = static_cast<int64_t>(k);
    if (g == p.size(1) && a == p.size(2)) {  // a slice of the contiguous stack: contiguous, as the kernel wants it
      adam_in_eigenbasis(*moments[k], p[index], constants, update[index]);
    } else {  // padded: the layer's block, copied out and back
      auto block = torch::empty({g, a}, p.options());
      adam_in_eigenbasis(*moments[k], p[index].narrow(0, 0, g).narrow(1, 0, a).contiguous(), constants, block);
      update[index].narrow(0, 0, g).narrow(1, 0, a).copy_(block);
    }
  }
  auto direction = from_eigenbasis_stacked(each, qg, update);
  return direction.scalar_type() == grads.scalar_type() ? direction : direction.to(grads.scalar_type());
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

void apply_decoupled_step(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& directions,
                          double lr, double weight_decay) {
  TORCH_CHECK(params.size() == directions.size(), "apply_decoupled_step: ", params.size(), " parameters but ",
              directions.size(), " directions");
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].defined() && directions[i].defined() && params[i].sizes() == directions[i].sizes(),
                "apply_decoupled_step: parameter ", i, " and its direction differ in shape or are undefined");
  }
  if (params.empty()) return;
  torch::NoGradGuard no_grad;
  if (weight_decay != 0.0) at::_foreach_mul_(params, 1.0 - lr * weight_decay);
  at::_foreach_add_(params, directions, -lr);
}

}  // namespace dkfac::math
