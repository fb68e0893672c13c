#include "dkfac/options.h"

#include <cmath>
#include <regex>

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

namespace dkfac {

void SpdOptions::validate() const {
  TORCH_CHECK(redundant_dim_ >= -1, "SpdOptions::redundant_dim must be -1 (measured) or >= 0, got ", redundant_dim_);
  TORCH_CHECK(profile_steps_ >= 1, "SpdOptions::profile_steps must be >= 1, got ", profile_steps_);
  for (int64_t size : fusion_) {
    TORCH_CHECK(size >= 1, "SpdOptions::fusion group sizes must be >= 1, got ", size);
  }
}

Options& Options::grad_scaler(std::function<double()> scale) & {
  if (!scale) return grad_scaler(GradScale());
  return grad_scaler(GradScale([scale = std::move(scale)] {
    const double value = scale();
    TORCH_CHECK(std::isfinite(value) && value > 0.0, "grad scaler returned ", value,
                "; the loss scale must be a positive finite number");
    return at::scalar_tensor(value, at::kDouble);
  }));
}

void Options::validate() const {
  auto check_dtype = [](const char* what, const std::optional<c10::ScalarType>& dtype) {
    if (!dtype) return;
    TORCH_CHECK(c10::isFloatingType(*dtype) && c10::elementSize(*dtype) >= 2, what, " ", c10::toString(*dtype),
                " is not supported: use float32, float64, bfloat16 or float16");
  };
  check_dtype("factor_dtype", factor_dtype_);
  check_dtype("inv_dtype", inv_dtype_);
  TORCH_CHECK(accumulation_steps_ >= 1, "accumulation_steps must be >= 1, got ", accumulation_steps_);
  TORCH_CHECK(!pi_damping_ || compute_method_ == ComputeMethod::kInverse,
              "pi_damping applies to ComputeMethod::kInverse only, got compute_method=",
              to_string(compute_method_));
  TORCH_CHECK(grad_worker_fraction_ > 0.0 && grad_worker_fraction_ <= 1.0,
              "grad_worker_fraction must be in (0, 1], got ", grad_worker_fraction_);
  TORCH_CHECK(strategy_ == Strategy::kKaisa || grad_worker_fraction_ == 1.0, "grad_worker_fraction applies to ",
              "Strategy::kKaisa only (", to_string(strategy_), " places its own work), got ", grad_worker_fraction_);
  TORCH_CHECK(std::isfinite(allreduce_bucket_cap_mb_) && allreduce_bucket_cap_mb_ >= 0.0,
              "allreduce_bucket_cap_mb must be >= 0, got ", allreduce_bucket_cap_mb_);
  TORCH_CHECK(large_factor_dim_ >= 0, "large_factor_dim must be >= 0 (0: no report), got ", large_factor_dim_);
  spd_.validate();
  for (const auto& pattern : skip_layers_) {
    try {
      std::regex check(pattern);
      (void)check;
    } catch (const std::regex_error& e) {
      TORCH_CHECK(false, "skip_layers pattern '", pattern, "' is not a valid regular expression: ",
                  e.what());
    }
  }
  // Constant schedules are checked now so that a bad value fails at construction, not mid-run.
  if (lr_.is_constant()) lr_at(0);
  if (damping_.is_constant()) damping_at(0);
  if (kl_clip_.is_constant()) kl_clip_at(0);
  if (factor_decay_.is_constant()) factor_decay_at(0);
  if (factor_update_steps_.is_constant()) factor_update_steps_at(0);
  if (inv_update_steps_.is_constant()) inv_update_steps_at(0);
}

double Options::lr_at(int64_t step) const {
  const double v = lr_(step);
  TORCH_CHECK(std::isfinite(v) && v >= 0.0, "lr must be finite and >= 0, got ", v, " at step ", step);
  return v;
}

double Options::damping_at(int64_t step) const {
  const double v = damping_(step);
  TORCH_CHECK(std::isfinite(v) && v > 0.0, "damping must be finite and > 0, got ", v, " at step ", step);
  return v;
}

double Options::kl_clip_at(int64_t step) const {
  const double v = kl_clip_(step);
  TORCH_CHECK(std::isfinite(v) && v >= 0.0, "kl_clip must be finite and >= 0 (0 disables it), got ", v,
              " at step ", step);
  return v;
}

double Options::factor_decay_at(int64_t step) const {
  const double v = factor_decay_(step);
  TORCH_CHECK(std::isfinite(v) && v >= 0.0 && v <= 1.0, "factor_decay must be in [0, 1], got ", v, " at step ", step);
  return v;
}

int64_t Options::factor_update_steps_at(int64_t step) const {
  const int64_t v = factor_update_steps_(step);
  TORCH_CHECK(v >= 1, "factor_update_steps must be >= 1, got ", v, " at step ", step);
  return v;
}

int64_t Options::inv_update_steps_at(int64_t step) const {
  const int64_t v = inv_update_steps_(step);
  TORCH_CHECK(v >= 1, "inv_update_steps must be >= 1, got ", v, " at step ", step);
  return v;
}

const char* to_string(ComputeMethod method) {
  switch (method) {
    case ComputeMethod::kEigen:
      return "eigen";
    case ComputeMethod::kInverse:
      return "inverse";
  }
  return "unknown";
}

c10::ScalarType decomposition_dtype(c10::ScalarType factor_dtype, c10::ScalarType inv_dtype) {
  return factor_dtype == c10::kDouble || inv_dtype == c10::kDouble ? c10::kDouble : c10::kFloat;
}

const char* to_string(Strategy strategy) {
  switch (strategy) {
    case Strategy::kKaisa:
      return "kaisa";
    case Strategy::kSpd:
      return "spd";
    case Strategy::kDp:
      return "dp";
  }
  return "unknown";
}

const char* system_name(Strategy strategy) {
  switch (strategy) {
    case Strategy::kKaisa:
      return "KAISA";
    case Strategy::kSpd:
      return "SPD-KFAC";
    case Strategy::kDp:
      return "DP-KFAC";
  }
  return "unknown";
}

}  // namespace dkfac
