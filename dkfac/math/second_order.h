#pragma once

#include <torch/torch.h>

/// Second-order kernels of K-FAC (docs/MATH.md section 2). Pure functions: tensors in, tensors out.
/// `grad` is always the layer gradient as a matrix [g, a] (bias gradient as the last column).
namespace dkfac::math {

/// A factor is a symmetric matrix [d, d] or a diagonal one, held as its diagonal [d] (factors.h); every
/// kernel here takes both. For a diagonal factor the eigenvectors are the identity and are not held
/// (undefined), the eigenvalues are its diagonal, and its damped inverse is a vector too.

/// Symmetric eigendecomposition of one factor.
struct EigenFactor {
  torch::Tensor eigenvectors;  // Q, [d, d], columns are eigenvectors; undefined for a diagonal factor (Q = I)
  torch::Tensor eigenvalues;   // d, [d], ascending (a diagonal factor's: in its order), clamped to >= 0
};

/// Eigendecomposition of a symmetric factor [d, d]. Runs in the factor's dtype and retries in
/// float64 if LAPACK fails to converge; throws c10::Error if both fail or the result is not finite.
EigenFactor eigen_decompose(const torch::Tensor& factor);

/// The same, without any check that would wait for the device: LAPACK's or cuSOLVER's own convergence
/// failure still throws (and is retried in float64), but a non-finite result is returned as is; the caller
/// checks it (the preconditioner checks every layer's result with one host synchronisation).
EigenFactor eigen_decompose_unchecked(const torch::Tensor& factor);

/// A cheap refresh of `previous`, an eigendecomposition of an earlier value of `factor` [d, d] (Options::eigh_interval,
/// docs/MATH.md section 2.6): one step of subspace iteration, Q R = factor Q_prev (the columns taken in descending
/// order of their eigenvalues, so that the dominant directions are orthogonalised first), and as eigenvalues the
/// Rayleigh quotients d_i = q_i^T factor q_i, clamped to >= 0; returned in ascending order of them. Exact where
/// `previous` is the factor's own eigenbasis (the same Q up to signs, the same d); else the basis moves toward the
/// factor's, at the cost of two products, a QR and an element-wise reduction (no eigensolver, no host
/// synchronisation). Nothing is checked:
/// a non-finite `previous` gives a non-finite result, which the caller's check turns into a full decomposition.
/// A diagonal factor is returned as eigen_decompose_unchecked returns it.
EigenFactor refresh_eigenbasis(const torch::Tensor& factor, const EigenFactor& previous);

/// Whether `t` holds no NaN or infinity, decided on its device without a host read: a 0-dim bool, or with `dims`
/// one per slice over them. One float64 reduction, where isfinite().all() takes four passes: a NaN or an infinity
/// makes the sum one, finite float32 (or narrower) entries cannot overflow it, and float64 entries only near 1e308,
/// which no gradient or preconditioned gradient of a trainable model reaches.
torch::Tensor finite_by_sum(const torch::Tensor& t, at::OptionalIntArrayRef dims = std::nullopt);

/// 1 / (d_G d_A^T + damping), [g, a]: the element-wise scaling of the eigen method.
torch::Tensor eigen_denominator(const EigenFactor& a, const EigenFactor& g, double damping);

/// Q_G^T matrix Q_A, [g, a]: a [g, a] matrix in the eigenbasis of the factors (a diagonal factor's eigenvectors are
/// the identity: that side's product is skipped, and with both sides diagonal `matrix` itself is returned).
torch::Tensor to_eigenbasis(const EigenFactor& a, const EigenFactor& g, const torch::Tensor& matrix);
/// Q_G rotated Q_A^T, the inverse of to_eigenbasis.
torch::Tensor from_eigenbasis(const EigenFactor& a, const EigenFactor& g, const torch::Tensor& rotated);

/// V = Q_G [(Q_G^T grad Q_A) * denominator] Q_A^T, with `denominator` from eigen_denominator.
torch::Tensor precondition_eigen(const EigenFactor& a, const EigenFactor& g, const torch::Tensor& denominator,
                                 const torch::Tensor& grad);

/// precondition_eigen for several layers at once, with batched products (Options::stack_layers, docs/MATH.md section
/// 2.9): `grads` [m c, g, a] holds m units of c layers each, the layers of a unit sharing one A side (c = 1: every
/// layer its own; a shared-input group: c > 1, Options::shared_input_layers). `qa` [m, a, a] is each unit's Q_A; `qg`
/// [m c, g, g] and `denominator` [m c, g, a] each layer's own. Returns every layer's V [m c, g, a], each layer's
/// products taken as precondition_eigen takes them (a shared Q_A repeated for each of its layers): equal to it to
/// rounding, bit for bit where a batched GEMM computes each matrix as mm does (this CPU's, tests/layers).
torch::Tensor precondition_eigen_stacked(const torch::Tensor& qa, const torch::Tensor& qg,
                                         const torch::Tensor& denominator, const torch::Tensor& grads);

/// Each unit's side of `unit_sides` [m, a, a] for each of `layers` layers, m units of c: a unit's side repeated for
/// each of its c layers (a copy, where c > 1; `unit_sides` itself where c = 1), so that every layer's product is the
/// GEMM it has alone (one [c g, a] product per unit would round differently, and sharing an A factor is exact:
/// docs/MATH.md section 2.7). The stacked kernels take either form of their A side.
torch::Tensor per_layer_side(const torch::Tensor& unit_sides, int64_t layers);

/// to_eigenbasis and from_eigenbasis for several layers at once, the products as precondition_eigen_stacked takes
/// them: `matrices` [m c, g, a] of m units of c layers, `qa` [m, a, a] each unit's Q_A, `qg` [m c, g, g] each layer's
/// Q_G. Q_G^T X Q_A, and Q_G Y Q_A^T, for every layer (Options::eigen_adam under Options::stack_layers).
torch::Tensor to_eigenbasis_stacked(const torch::Tensor& qa, const torch::Tensor& qg, const torch::Tensor& matrices);
torch::Tensor from_eigenbasis_stacked(const torch::Tensor& qa, const torch::Tensor& qg, const torch::Tensor& rotated);

/// Convenience form that builds the denominator for `damping`.
torch::Tensor precondition_eigen(const EigenFactor& a, const EigenFactor& g, const torch::Tensor& grad,
                                 double damping);

/// (factor + damping I)^-1 for a symmetric positive semi-definite factor [d, d]; Cholesky based,
/// with a general inverse as fallback. Throws c10::Error if the result is not finite.
torch::Tensor damped_inverse(const torch::Tensor& factor, double damping);

/// A damped inverse and whether it can be trusted, without waiting for the device.
struct DampedInverse {
  torch::Tensor inverse;
  torch::Tensor cholesky_ok;  ///< 0-dim bool: the Cholesky factorisation succeeded (else `inverse` is garbage)
};

/// (factor + damping I)^-1 through Cholesky alone, `damping` a number or a 0-dim tensor on the factor's
/// device. When `cholesky_ok` is false, the caller falls back to damped_inverse (general inverse).
DampedInverse damped_inverse_unchecked(const torch::Tensor& factor, const torch::Tensor& damping);

/// Trace of a factor, dense or diagonal (a 0-dim tensor).
torch::Tensor factor_trace(const torch::Tensor& factor);

/// Damping of A and G for the pi-damped inverse: pi = sqrt((tr(A)/a) / (tr(G)/g)),
/// returns {sqrt(damping) * pi, sqrt(damping) / pi}. pi = 1 when a trace is not positive.
std::pair<double, double> pi_damping(const torch::Tensor& a_factor, const torch::Tensor& g_factor, double damping);
/// The same as 0-dim float64 tensors on the factors' device, computed there (no host synchronisation).
std::pair<torch::Tensor, torch::Tensor> pi_damping_on_device(const torch::Tensor& a_factor,
                                                             const torch::Tensor& g_factor, double damping);

/// V = G_inv grad A_inv with G_inv [g, g], A_inv [a, a] (either one a vector for a diagonal factor).
torch::Tensor precondition_inverse(const torch::Tensor& a_inverse, const torch::Tensor& g_inverse,
                                   const torch::Tensor& grad);

/// precondition_inverse for several layers at once, as precondition_eigen_stacked: `a_inverse` [m, a, a] each unit's,
/// `g_inverse` [m c, g, g] each layer's, `grads` [m c, g, a].
torch::Tensor precondition_inverse_stacked(const torch::Tensor& a_inverse, const torch::Tensor& g_inverse,
                                           const torch::Tensor& grads);

/// KL-clipping scale nu = min(1, sqrt(kl_clip / |vg_sum|)), where vg_sum = sum over layers of
/// sum(V * grad) * lr^2. Returns 1 when vg_sum is 0 or kl_clip is 0 (clipping off).
double kl_clip_scale(double vg_sum, double kl_clip);

}  // namespace dkfac::math
