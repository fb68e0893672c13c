#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

namespace dkfac {

/// How the second-order state of a layer is computed and applied (docs/MATH.md section 2).
enum class ComputeMethod {
  kEigen,    ///< eigendecompositions of A and G; damping added to the eigenvalue products
  kInverse,  ///< explicit inverses of (A + damping I) and (G + damping I)
};

/// What `Preconditioner::step()` does with a registered layer that did not run forward/backward.
enum class UnusedLayerPolicy {
  kError,  ///< throw a c10::Error naming the layer (default)
  kSkip,   ///< leave the layer's plain gradient for this step and warn once
};

/// Which published distributed K-FAC system places and moves the work (docs/MATH.md section 5).
/// Ignored in a single process.
enum class Strategy {
  kKaisa,  ///< KAISA (SC21); grad_worker_fraction 1 is SC20's D-KFAC, 1/P its layer-wise variant
  kSpd,    ///< SPD-KFAC (ICDCS'21): pipelined, fused factor allreduce; small factors decomposed everywhere
  kDp,     ///< DP-KFAC: one owner per layer builds its factors from its own batch; V broadcast every step
};

/// The loss scale of a mixed-precision gradient scaler as a one-element tensor, e.g. torch.amp.GradScaler's
/// scale on its device: reading it does not wait for the device. G is built from grad_output / scale.
using GradScale = std::function<at::Tensor()>;

/// A hyper-parameter that is either a constant or a function of the K-FAC step (0-based).
template <typename T>
class Schedule {
 public:
  /// A constant schedule.
  Schedule(T value) : fn_([value](int64_t) { return value; }), constant_(true) {}  // NOLINT
  /// A schedule computed from the step.
  Schedule(std::function<T(int64_t)> fn) : fn_(std::move(fn)) {}  // NOLINT

  /// The value at K-FAC step `step`.
  T operator()(int64_t step) const { return fn_(step); }
  /// True when built from a plain value.
  bool is_constant() const { return constant_; }

 private:
  std::function<T(int64_t)> fn_;
  bool constant_ = false;
};

#define DKFAC_SCHEDULE_ARG(T, name)                                  \
 public:                                                             \
  Options& name(T value) & {                                         \
    name##_ = Schedule<T>(value);                                    \
    return *this;                                                    \
  }                                                                  \
  Options&& name(T value) && { return std::move(this->name(value)); } \
  Options& name(std::function<T(int64_t)> fn) & {                    \
    name##_ = Schedule<T>(std::move(fn));                            \
    return *this;                                                    \
  }                                                                  \
  Options&& name(std::function<T(int64_t)> fn) && {                  \
    return std::move(this->name(std::move(fn)));                     \
  }                                                                  \
  const Schedule<T>& name() const { return name##_; }                \
                                                                     \
 private:                                                            \
  Schedule<T> name##_

#define DKFAC_VALUE_ARG_OF(Self, T, name, default_value)            \
 public:                                                            \
  Self& name(T value) & {                                           \
    name##_ = std::move(value);                                     \
    return *this;                                                   \
  }                                                                 \
  Self&& name(T value) && { return std::move(this->name(std::move(value))); } \
  const T& name() const { return name##_; }                         \
                                                                    \
 private:                                                           \
  T name##_ = default_value

#define DKFAC_VALUE_ARG(T, name, default_value) DKFAC_VALUE_ARG_OF(Options, T, name, default_value)

/// SPD-KFAC's own choices (Options::spd), as a value with chained setters:
/// `dkfac::SpdOptions().redundant_dim(64).fusion({4, 2})`. Ignored by the other strategies.
class SpdOptions {
  /// Factors of dimension <= this are decomposed on every rank instead of broadcast; -1 (default)
  /// chooses it from the measured decomposition and broadcast times.
  DKFAC_VALUE_ARG_OF(SpdOptions, int64_t, redundant_dim, -1);
  /// Factor steps profiled (each factor sent alone) before the fusion grouping is chosen (>= 1).
  DKFAC_VALUE_ARG_OF(SpdOptions, int64_t, profile_steps, 3);
  /// Forces the fusion grouping, as sizes of consecutive groups in ready order (A factors in layer order,
  /// then G factors in reverse layer order); they must sum to 2 x layers. Empty (default): chosen from
  /// the alpha-beta model after the profiled steps.
  DKFAC_VALUE_ARG_OF(SpdOptions, std::vector<int64_t>, fusion, {});

 public:
  /// Checks every value; throws c10::Error naming the offending one.
  void validate() const;
};

/// Hyper-parameters of the K-FAC preconditioner, as a value with chained setters:
/// `dkfac::Options().lr(0.1).damping(3e-3).factor_update_steps(10).inv_update_steps(100)`.
/// Schedules (`lr`, `damping`, `kl_clip`, the two intervals) accept a value or a
/// `std::function<T(int64_t step)>`. Everything is checked once by `validate()`, which the
/// Preconditioner calls when it is built; schedule values are checked each time they are read.
class Options {
  /// Learning rate of the optimizer that applies the gradients; used only by KL clipping.
  DKFAC_SCHEDULE_ARG(double, lr){0.1};
  /// Tikhonov damping lambda (> 0). Default 0.001: kfac_pytorch's KFACPreconditioner default, so that code
  /// ported from it behaves the same (not tuned here; `dkfac train` uses 0.3, `dkfac bench` 0.003: README).
  DKFAC_SCHEDULE_ARG(double, damping){0.001};
  /// KL-clip bound; 0 turns clipping off.
  DKFAC_SCHEDULE_ARG(double, kl_clip){0.001};
  /// Steps between factor updates (>= 1). Activations are captured only on these steps.
  DKFAC_SCHEDULE_ARG(int64_t, factor_update_steps){1};
  /// Steps between second-order (eigen/inverse) updates (>= 1).
  DKFAC_SCHEDULE_ARG(int64_t, inv_update_steps){1};
  /// Running-average decay alpha of the factors, in [0, 1].
  DKFAC_SCHEDULE_ARG(double, factor_decay){0.95};
  /// Forward/backward passes (micro-batches) per optimizer step (>= 1).
  DKFAC_VALUE_ARG(int64_t, accumulation_steps, 1);
  /// Eigen (default) or inverse second-order method.
  DKFAC_VALUE_ARG(ComputeMethod, compute_method, ComputeMethod::kEigen);
  /// Eigen method: compute 1 / (d_G d_A^T + damping) once per second-order update (default, with that
  /// update's damping) or at every step with the step's damping (false; differs only for damping schedules).
  DKFAC_VALUE_ARG(bool, compute_eigenvalue_outer_product, true);
  /// Storage (and computation) dtype of captured and running factors (float32, float64, bfloat16 or
  /// float16); nullopt keeps the activations' dtype.
  DKFAC_VALUE_ARG(std::optional<c10::ScalarType>, factor_dtype, std::nullopt);
  /// Storage dtype of second-order state (eigendecompositions, inverses) and of preconditioning; nullopt
  /// keeps the factors' dtype. Decompositions run in float64 when the factors or this dtype are float64,
  /// otherwise in float32, and the results are stored in this dtype.
  DKFAC_VALUE_ARG(std::optional<c10::ScalarType>, inv_dtype, std::nullopt);
  /// Current loss scale of a mixed-precision gradient scaler, read at each G capture: G is built from
  /// grad_output / scale. Empty (default): no scaling. A function returning a double is accepted too
  /// (checked to be positive and finite at each read; reading it may wait for the device where a tensor
  /// scale would not).
  DKFAC_VALUE_ARG(GradScale, grad_scaler, nullptr);

 public:
  Options& grad_scaler(std::function<double()> scale) &;
  Options&& grad_scaler(std::function<double()> scale) && { return std::move(this->grad_scaler(std::move(scale))); }
  /// Inverse method only: split damping between A and G with the pi heuristic (DP-KFAC).
  DKFAC_VALUE_ARG(bool, pi_damping, false);
  /// ECMAScript regular expressions; a layer whose module name or kind (Linear, Conv2d) matches any is not
  /// preconditioned. A pattern that matches no layer is warned about (TORCH_WARN), naming the candidates.
  DKFAC_VALUE_ARG(std::vector<std::string>, skip_layers, {});
  /// Factors wider than this (A or G dimension) are reported when the Preconditioner is built: one warning
  /// per layer (TORCH_WARN) with the dimension, the memory of the factor and of its decomposition or inverse,
  /// and the FLOPs of one second-order update (9 d^3 eigen, d^3 inverse). Such a layer's first step() can
  /// take tens of seconds (d = 6273: ~44 s on 2 cores). 0 reports none. Python: the keyword argument
  /// KFACPreconditioner(large_factor_dim=), same default, its warnings through Python's warnings module.
  DKFAC_VALUE_ARG(int64_t, large_factor_dim, 4096);
  /// What to do with a registered layer that did not run before `step()`.
  DKFAC_VALUE_ARG(UnusedLayerPolicy, unused_layer_policy, UnusedLayerPolicy::kError);
  /// Distributed (KAISA): fraction f of ranks that precondition each layer, W = max(1, round(P f)).
  /// 1 = COMM-OPT, 1/P = MEM-OPT, in between HYBRID-OPT. Ignored without a communicator.
  DKFAC_VALUE_ARG(double, grad_worker_fraction, 1.0);
  /// Distributed: send symmetric matrices (factors, inverses) as upper triangles.
  DKFAC_VALUE_ARG(bool, symmetric_comm, false);
  /// Distributed: balance second-order work by compute (dim^3, default) or memory (dim^2).
  DKFAC_VALUE_ARG(bool, balance_memory, false);
  /// Distributed: decompose A and G of a layer on the same rank (default) or on separate ranks.
  DKFAC_VALUE_ARG(bool, colocate_factors, true);
  /// Distributed (KAISA): start each factor's allreduce from the capture hooks as soon as it is final
  /// (A in forward, G in backward), bucketed, overlapped with the rest of forward/backward, and wait in
  /// step(); false reduces every factor inside step(). Same results either way (kfac_pytorch's default).
  DKFAC_VALUE_ARG(bool, update_factors_in_hook, true);
  /// Distributed (KAISA, in hooks): largest factor bucket in MiB (factors are packed into one collective
  /// in ready order up to this size); 0 sends each factor alone. kfac_pytorch's default, 25.
  DKFAC_VALUE_ARG(double, allreduce_bucket_cap_mb, 25.0);
  /// Distributed: the system that places and moves K-FAC work. kSpd and kDp need grad_worker_fraction 1
  /// (they fix their own placement); kSpd always sends symmetric matrices as upper triangles.
  DKFAC_VALUE_ARG(Strategy, strategy, Strategy::kKaisa);
  /// SPD-KFAC's redundancy threshold, profiling and fusion (SpdOptions).
  DKFAC_VALUE_ARG(SpdOptions, spd, SpdOptions());

 public:
  /// Checks every constant option; throws c10::Error with the offending value.
  void validate() const;

  /// Reads and checks each schedule at `step`.
  double lr_at(int64_t step) const;
  double damping_at(int64_t step) const;
  double kl_clip_at(int64_t step) const;
  double factor_decay_at(int64_t step) const;
  int64_t factor_update_steps_at(int64_t step) const;
  int64_t inv_update_steps_at(int64_t step) const;
};

#undef DKFAC_SCHEDULE_ARG
#undef DKFAC_VALUE_ARG
#undef DKFAC_VALUE_ARG_OF

/// Readable name of a compute method ("eigen", "inverse").
const char* to_string(ComputeMethod method);
/// The dtype second-order work is computed in for factors of `factor_dtype` stored as `inv_dtype`.
c10::ScalarType decomposition_dtype(c10::ScalarType factor_dtype, c10::ScalarType inv_dtype);

/// Readable name of a strategy ("kaisa", "spd", "dp").
const char* to_string(Strategy strategy);
/// The published system's name ("KAISA", "SPD-KFAC", "DP-KFAC").
const char* system_name(Strategy strategy);

}  // namespace dkfac
