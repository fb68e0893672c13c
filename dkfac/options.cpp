#include "dkfac/options.h"

#include <algorithm>
#include <cmath>
#include <regex>

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

namespace dkfac {

namespace {

// Checks `value` of option `name` against its declared range (option_table()); `at` names the step of a schedule.
template <typename T>
T checked(const char* name, T value, const std::string& at = "") {
  const auto& range = option_info(name).range;
  const bool number = std::is_floating_point_v<T>;
  TORCH_CHECK((!number || std::isfinite(static_cast<double>(value))) && range.contains(static_cast<double>(value)),
              name, " must be ", number ? "finite and " : "", range.describe(), ", got ", value, at);
  return value;
}

std::string at_step(int64_t step) { return " at step " + std::to_string(step); }

// checked() for the options that are numbers; the others have no range.
template <typename T>
void check_number(const char* name, const T& value) {
  if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, double>) checked(name, value);
}

}  // namespace

void SpdOptions::validate() const {
  checked("spd_redundant_dim", redundant_dim_);
  checked("spd_profile_steps", profile_steps_);
  for (int64_t size : fusion_) checked("spd_fusion", size, " (a fusion group size)");
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
  auto check_dtype = [this](const char* what, const std::optional<c10::ScalarType>& dtype) {
    if (!dtype) return;
    const auto& names = option_info(what).choices;
    TORCH_CHECK(std::find(names.begin(), names.end(), std::get<std::string>(get(what))) != names.end(), what, " ",
                c10::toString(*dtype), " is not supported: use float32, float64, bfloat16 or float16");
  };
  check_dtype("factor_dtype", factor_dtype_);
  check_dtype("inv_dtype", inv_dtype_);
  // Every number against its declared range (pad_widths, second_order_concurrency and auto_recheck_steps were once
  // left out: pad_widths 0 divided by zero at the first step).
#define DKFAC_RANGE_Value(name) check_number(#name, name##_);
#define DKFAC_RANGE_Schedule(name)
#define DKFAC_RANGE(kind, T, name, ...) DKFAC_RANGE_##kind(name)
  DKFAC_OPTIONS(DKFAC_RANGE)
#undef DKFAC_RANGE
#undef DKFAC_RANGE_Schedule
#undef DKFAC_RANGE_Value
  TORCH_CHECK(!eigen_adam_ || compute_method_ == ComputeMethod::kEigen,
              "eigen_adam runs Adam in the eigenbasis of the factors: it needs compute_method eigen, got ",
              to_string(compute_method_));
  TORCH_CHECK(eigh_interval_ == 1 || compute_method_ == ComputeMethod::kEigen,
              "eigh_interval refreshes eigenbases between full eigendecompositions: it needs compute_method eigen, "
              "got ", to_string(compute_method_), " with eigh_interval ", eigh_interval_);
  TORCH_CHECK(!pi_damping_ || compute_method_ == ComputeMethod::kInverse,
              "pi_damping applies to the inverse compute_method only, got compute_method=", to_string(compute_method_));
  TORCH_CHECK(strategy_ == Strategy::kKaisa || grad_worker_fraction_ == 1.0, "grad_worker_fraction applies to ",
              "strategy kaisa only (", to_string(strategy_), " places its own work), got ", grad_worker_fraction_);
  TORCH_CHECK(memory_budget_ == 0 || !strategy_, "memory_budget applies to strategy auto only (",
              to_string(strategy_), " places its own work), got ", memory_budget_);
  TORCH_CHECK(sharded_placement_ != ShardedPlacement::kOwner || strategy_ == Strategy::kKaisa ||
                  strategy_ == Strategy::kDp,
              "sharded_placement owner needs strategy kaisa or dp (one owner per layer), got strategy ",
              to_string(strategy_));
  spd_.validate();
  for (const auto& pattern : skip_layers_) {
    try {
      std::regex check(pattern);
      (void)check;
    } catch (const std::regex_error& e) {
      TORCH_CHECK(false, "skip_layers pattern '", pattern, "' is not a valid regular expression: ", e.what());
    }
  }
  for (const auto& pattern : shared_input_layers_) {
    size_t groups = 0;
    try {
      groups = std::regex(pattern).mark_count();
    } catch (const std::regex_error& e) {
      TORCH_CHECK(false, "shared_input_layers pattern '", pattern, "' is not a valid regular expression: ", e.what());
    }
    TORCH_CHECK(groups >= 1, "shared_input_layers pattern '", pattern, "' has no capture group: its group (...) "
                "marks the part of the names in which the layers that share an input differ, e.g. "
                "'(query|key|value)$'");
  }
  TORCH_CHECK(shared_input_layers_.empty() || !pi_damping_, "shared_input_layers with pi_damping: pi damping "
              "splits each layer's damping by its own G, so layers that share an A factor would need different A "
              "inverses; use one of them");
  // Constant schedules are checked now so that a bad value fails at construction, not mid-run.
  if (lr_.is_constant()) lr_at(0);
  if (damping_.is_constant()) damping_at(0);
  if (kl_clip_.is_constant()) kl_clip_at(0);
  if (factor_decay_.is_constant()) factor_decay_at(0);
  if (factor_update_steps_.is_constant()) factor_update_steps_at(0);
  if (inv_update_steps_.is_constant()) inv_update_steps_at(0);
}

double Options::lr_at(int64_t step) const { return checked("lr", lr_(step), at_step(step)); }
double Options::damping_at(int64_t step) const { return checked("damping", damping_(step), at_step(step)); }
double Options::kl_clip_at(int64_t step) const {
  const double kl_clip = checked("kl_clip", kl_clip_(step), at_step(step));
  TORCH_CHECK(!eigen_adam_ || kl_clip == 0.0, "eigen_adam's step is Adam's, which KL clipping (a bound on a "
              "natural-gradient step) does not apply to: set kl_clip to 0 (Python: kl_clip=None), got ", kl_clip,
              kl_clip_.is_constant() ? "" : at_step(step));
  return kl_clip;
}
double Options::factor_decay_at(int64_t step) const {
  return checked("factor_decay", factor_decay_(step), at_step(step));
}
int64_t Options::factor_update_steps_at(int64_t step) const {
  return checked("factor_update_steps", factor_update_steps_(step), at_step(step));
}
int64_t Options::inv_update_steps_at(int64_t step) const {
  return checked("inv_update_steps", inv_update_steps_(step), at_step(step));
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

const char* to_string(const StrategyOption& strategy) { return strategy ? to_string(*strategy) : "auto"; }

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
