#include "tools/common/report_json.h"

#include <fstream>

#include <c10/util/Exception.h>

#include "dkfac/options.h"

namespace dkfac {

void to_json(nlohmann::json& json, const PhaseTimes& times) {
  json = times.by_name();
  json["total"] = times.total();
}

namespace strategy {
namespace {

c10::ScalarType dtype_from_name(const std::string& name) {
  const auto dtype = storage_dtype_named(name);
  TORCH_CHECK(dtype, "rates: dtype must be float32, float64, bfloat16 or float16, got '", name, "'");
  return *dtype;
}

template <typename T>
T field(const nlohmann::json& json, const char* object, const char* key) {
  const nlohmann::json& o = object ? json.at(object) : json;
  TORCH_CHECK(o.contains(key), "rates: missing field ", object ? std::string(object) + "." : "", key);
  try {
    return o.at(key).get<T>();
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "rates: field ", object ? std::string(object) + "." : "", key, ": ", e.what());
  }
}

nlohmann::json factor_rate_json(const FactorRate& rate) {
  return {{"seconds", rate.seconds}, {"per_entry_s", rate.per_entry}, {"per_flop_s", rate.per_flop}};
}

/// The FactorRate in `j[name]`.
FactorRate factor_rate_from_json(const nlohmann::json& j, const char* name) {
  return {field<double>(j, name, "seconds"), field<double>(j, name, "per_entry_s"), field<double>(j, name, "per_flop_s")};
}

nlohmann::json decomposition_rate_json(const DecompositionRate& rate) {
  return {{"dims", rate.dims}, {"seconds", rate.seconds}, {"latency_s", rate.latency},
          {"per_cubed_dim_s", rate.per_cubed_dim}};
}

/// The DecompositionRate in `j[name]`.
DecompositionRate decomposition_rate_from_json(const nlohmann::json& j, const char* name) {
  DecompositionRate rate;
  rate.dims = field<std::vector<int64_t>>(j, name, "dims");
  rate.seconds = field<std::vector<double>>(j, name, "seconds");
  rate.latency = field<double>(j, name, "latency_s");
  rate.per_cubed_dim = field<double>(j, name, "per_cubed_dim_s");
  return rate;
}

}  // namespace

void to_json(nlohmann::json& json, const Rates& r) {
  json = {{"format", "dkfac rates 1"},
          {"world_size", r.world_size},
          {"ranks_per_node", r.ranks_per_node},
          {"parallel_ranks", r.parallel_ranks},
          {"device", r.device},
          {"dtype", storage_dtype_name(r.dtype)},
          {"compute_method", to_string(r.method)},
          {"threads", r.threads},
          {"conditions", r.conditions},
          {"allreduce", {{"alpha_s", r.allreduce.alpha}, {"beta_s_per_byte", r.allreduce.beta}}},
          {"allreduce_busy", {{"alpha_s", r.allreduce_busy.alpha}, {"beta_s_per_byte", r.allreduce_busy.beta}}},
          {"broadcast", {{"alpha_s", r.broadcast.alpha}, {"beta_s_per_byte", r.broadcast.beta}}},
          {"factor", factor_rate_json(r.factor)},
          {"conv_factor", factor_rate_json(r.conv_factor)},
          {"conv_g_factor", factor_rate_json(r.conv_g_factor)},
          {"conv_patches_factor", factor_rate_json(r.conv_patches_factor)},
          {"conv_unfold_factor", factor_rate_json(r.conv_unfold_factor)},
          {"fold", {{"seconds", r.fold.seconds}, {"per_entry_s", r.fold.per_entry}}},
          {"decomposition", decomposition_rate_json(r.decomposition)},
          {"refresh", decomposition_rate_json(r.refresh)},
          {"precondition", {{"seconds", r.precondition.seconds}, {"per_flop_s", r.precondition.per_flop}}},
          {"side_work_cost", r.side_work_cost}};
}

void from_json(const nlohmann::json& j, Rates& rates) {
  TORCH_CHECK(j.is_object(), "rates: expected a JSON object");
  Rates r;
  r.world_size = field<int>(j, nullptr, "world_size");
  r.ranks_per_node = field<int>(j, nullptr, "ranks_per_node");
  r.parallel_ranks = field<double>(j, nullptr, "parallel_ranks");
  r.device = field<std::string>(j, nullptr, "device");
  r.dtype = dtype_from_name(field<std::string>(j, nullptr, "dtype"));
  const auto method = field<std::string>(j, nullptr, "compute_method");
  TORCH_CHECK(method == "eigen" || method == "inverse", "rates: compute_method must be eigen or inverse, got '",
              method, "'");
  r.method = method == "eigen" ? ComputeMethod::kEigen : ComputeMethod::kInverse;
  r.threads = field<int>(j, nullptr, "threads");
  r.conditions = j.value("conditions", std::string());
  // One format, as to_json writes it: every field is required, a missing one is named.
  for (const char* kind : {"allreduce", "broadcast", "allreduce_busy"}) {
    TORCH_CHECK(j.contains(kind), "rates: missing field ", kind);
  }
  r.allreduce = {field<double>(j, "allreduce", "alpha_s"), field<double>(j, "allreduce", "beta_s_per_byte")};
  r.broadcast = {field<double>(j, "broadcast", "alpha_s"), field<double>(j, "broadcast", "beta_s_per_byte")};
  r.allreduce_busy = {field<double>(j, "allreduce_busy", "alpha_s"), field<double>(j, "allreduce_busy", "beta_s_per_byte")};
  for (const char* part : {"factor", "conv_factor", "conv_g_factor", "conv_patches_factor", "conv_unfold_factor", "fold",
                           "decomposition", "refresh", "precondition"}) {
    TORCH_CHECK(j.contains(part), "rates: missing field ", part);
  }
  r.factor = factor_rate_from_json(j, "factor");
  r.conv_factor = factor_rate_from_json(j, "conv_factor");
  r.conv_g_factor = factor_rate_from_json(j, "conv_g_factor");
  r.conv_patches_factor = factor_rate_from_json(j, "conv_patches_factor");
  r.conv_unfold_factor = factor_rate_from_json(j, "conv_unfold_factor");
  r.fold = {field<double>(j, "fold", "seconds"), field<double>(j, "fold", "per_entry_s")};
  r.decomposition = decomposition_rate_from_json(j, "decomposition");
  r.refresh = decomposition_rate_from_json(j, "refresh");  // empty for the inverse method
  r.precondition = {field<double>(j, "precondition", "seconds"), field<double>(j, "precondition", "per_flop_s")};
  r.side_work_cost = field<double>(j, nullptr, "side_work_cost");
  r.validate();
  rates = std::move(r);
}

void to_json(nlohmann::json& json, const RankCost& c) {
  json = {{"factor_bytes", c.factor_bytes},
          {"second_order_bytes", c.second_order_bytes},
          {"gradient_bytes", c.gradient_bytes},
          {"memory_bytes", c.memory_bytes},
          {"in_flight_bytes", c.in_flight_bytes},
          {"stack_padding_bytes", c.stack_padding_bytes},
          {"factor_flops", c.factor_flops},
          {"decomposition_flops", c.decomposition_flops},
          {"precondition_flops", c.precondition_flops}};
}

void to_json(nlohmann::json& json, const PhaseSeconds& s) {
  json = {{"factor_build", s.factor_build},
          {"factor_comm", s.factor_comm},
          {"decomposition", s.decomposition},
          {"second_order_comm", s.second_order_comm},
          {"precondition", s.precondition},
          {"gradient_comm", s.gradient_comm}};
}

void to_json(nlohmann::json& json, const Candidate& c) {
  json = {{"name", c.name},
          {"strategy", to_string(c.options.strategy())},
          {"grad_worker_fraction", c.options.grad_worker_fraction()},
          {"grad_workers", c.plan.grad_workers()},
          {"symmetric_comm", c.options.symmetric_comm()},
          {"redundant_dim", c.plan.redundant_dim},
          {"step_seconds", c.time.step_seconds},
          {"max_over_ranks_seconds", c.time.slowest_phases()},
          {"memory_bytes", c.memory_bytes},
          {"fits", c.fits}};
}

}  // namespace strategy

strategy::Rates read_rates(const std::string& path, const std::string& flag) {
  std::ifstream in(path);
  TORCH_CHECK(in, flag, ": cannot read ", path);
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, flag, " ", path, ": not JSON (", e.what(), ")");
  }
  try {
    return j.get<strategy::Rates>();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, flag, " ", path, ": ", e.what_without_backtrace());
  }
}

}  // namespace dkfac
