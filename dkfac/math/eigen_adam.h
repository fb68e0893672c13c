#pragma once

#include <vector>

#include <torch/torch.h>

#include "dkfac/math/second_order.h"

/// Adam in the K-FAC eigenbasis (docs/MATH.md section 8): Adam's first and second moments of each layer's gradient
/// projected into the eigenbasis of its Kronecker factors, P = Q_G^T grad Q_A, and Adam's step rotated back. K-FAC's
/// eigenvalues are not used: Adam's second moment of P takes their place (EKFAC's eigenvalue correction, normalised
/// as Adam normalises; SOAP does the same in Shampoo's eigenbasis). Pure functions: tensors in, tensors out.
namespace dkfac::math {

/// Adam's state of one layer in an eigenbasis: the basis it was accumulated in is the caller's to keep.
struct EigenAdamMoments {
  torch::Tensor exp_avg;     ///< m, [g, a]: running mean of P
  torch::Tensor exp_avg_sq;  ///< v, [g, a]: running mean of P * P
  torch::Tensor steps;       ///< t, [1] float32 (as torch's fused Adam keeps it): the updates folded into m and v

  bool defined() const { return exp_avg.defined(); }
};

/// Adam's constants: m = beta1 m + (1 - beta1) P, v = beta2 v + (1 - beta2) P^2, and eps added to sqrt(v-hat).
struct AdamConstants {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
};

/// Zero moments for a [g, a] gradient, m and v of `options`' dtype and device (t: float32 on that device).
EigenAdamMoments zero_moments(int64_t g, int64_t a, const torch::TensorOptions& options);

/// One Adam step in the eigenbasis (a, g) for `grad` [g, a], with `moments` accumulated in that basis and updated
/// in place (an optimizer's state, the one thing here that is not a value): P = Q_G^T grad Q_A; m = beta1 m +
/// (1 - beta1) P; v = beta2 v + (1 - beta2) P^2; t = t + 1; m-hat = m / (1 - beta1^t), v-hat = v / (1 - beta2^t).
/// Returns the direction Q_G [m-hat / (sqrt(v-hat) + eps)] Q_A^T, [g, a], in grad's dtype. The element-wise part is
/// torch's fused Adam kernel (one pass over P, m and v). Decided on the device, nothing waits: where P is not
/// finite, the moments are left as they were and the direction is NaN (the preconditioner's guard then falls back
/// to the plain gradient, as for the other methods). Computed in the moments' dtype.
torch::Tensor eigen_adam_step(const EigenFactor& a, const EigenFactor& g, EigenAdamMoments& moments,
                              const torch::Tensor& grad, const AdamConstants& constants);

/// eigen_adam_step for several layers at once (Options::stack_layers, docs/MATH.md section 2.9), with the batched
/// products of to_eigenbasis_stacked and from_eigenbasis_stacked: `grads` [m c, g', a'] of m units of c layers, `qa`
/// [m, a', a'] (or each layer's, [m c, a', a']: math::per_layer_side) and `qg` [m c, g', g'] their eigenbases, and
/// `moments[k]` layer k's, [g, a] (the layers' widths, g <= g' and a <= a'), in the bases' dtype. Each layer's P is
/// the leading [g, a] block of its Q_G^T X Q_A: where the widths are padded (bases with the identity in the pad,
/// gradients with zeros, as LayerGroups holds them) the rest is zero, and so is the rest of the layer's [g', a']
/// direction returned. Each layer's moments and step count are updated (or, where its P is not finite, left) as
/// eigen_adam_step updates them, and its direction equals eigen_adam_step's to rounding. Computed in the bases'
/// dtype, returned in grads'.
torch::Tensor eigen_adam_step_stacked(const torch::Tensor& qa, const torch::Tensor& qg,
                                      const std::vector<EigenAdamMoments*>& moments, const torch::Tensor& grads,
                                      int64_t g, int64_t a, const AdamConstants& constants);

/// Moments accumulated in the basis (from_a, from_g) expressed in (to_a, to_g), when the basis is refreshed. With
/// R_A = Q_A,to^T Q_A,from and R_G likewise: m' = R_G m R_A^T, exactly (m is linear in the gradients), and
/// v' = (R_G o R_G) v (R_A o R_A)^T (o: element-wise), the second moment of P' = R_G P R_A^T where P's entries are
/// uncorrelated; it keeps sum(v). t is kept. Where the result is not finite (a basis that held NaN), the moments
/// restart from zero.
EigenAdamMoments rotate_moments(const EigenAdamMoments& moments, const EigenFactor& from_a, const EigenFactor& from_g,
                                const EigenFactor& to_a, const EigenFactor& to_g);

/// AdamW's update with the steps `directions` (eigen_adam's, which the preconditioner writes into the gradients),
/// weight decay decoupled: each parameter p becomes p (1 - lr weight_decay) - lr d, in place, outside autograd, with
/// one foreach kernel per operation (the same values as p.mul_ and p.add_ one by one). Both front ends' optimizers
/// apply it to each param group's preconditioned parameters (docs/MATH.md section 8). `params` and `directions` pair
/// up, each pair of one shape, dtype and device.
void apply_decoupled_step(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& directions,
                          double lr, double weight_decay);

}  // namespace dkfac::math
