// The region of a step that writes the gradients (precondition, guard_and_clip, write_gradients), run eagerly or,
// with Options::cuda_graphs, as the replay of a CUDA graph captured from it (device::Graph).
//
// Note [a step's CUDA graph]
// A capture runs the region's host code once and records its kernels with the address of every tensor they touch;
// a replay runs the same kernels again, so its results are the eager step's, bit for bit, as long as every tensor
// the region reads from outside is where it was at the capture, and every value it reads from the host is the
// capture's. So:
//  - the region reads its per-step scalars (lr^2 and kl_clip, which schedules change) from step_scalars_, a device
//    tensor at one address written before each step, never from the host;
//  - what it reads from outside (each gradient, each second-order tensor and stack) and what it decides on the host
//    (the executor, the fates, KL clipping on or off, TF32) form its GraphKey; a graph is replayed only under the
//    key it was captured with, and a step whose key differs runs eagerly;
//  - a graph is captured at the second eligible step in a row with one key, so gradients that move at every step
//    (set to None and allocated again elsewhere) cost no captures, only eager steps;
//  - steps that update factors or second-order state, or that need another rank or the host inside the region
//    (graph_ineligible), run eagerly and leave the graph for the next step that can use it;
//  - eigen_adam's moments are state it steps in place: their addresses are in the key, a rotation into a new basis
//    writes them in place, and a step that makes or rotates them (a host decision, KfacLayer::adam_moments_current)
//    runs eagerly; a replayed step's Adam step count is a device tensor, which the fused kernel reads there;
//  - the region's own tensors (its report's rows and scale among them) live in the graph's memory pool at fixed
//    addresses: the report kept with the graph is the one each replay rewrites, and its host copies are taken
//    after each replay (defer_guard_read), so no step's report is read from a later replay's tensors.
#include <cstdint>
#include <cstring>
#include <sstream>

#include <ATen/Context.h>

#include "dkfac/preconditioner.h"

namespace dkfac {
namespace {

/// Pushes what a kernel sees of `t`: its address, dtype and layout (-1 for an undefined tensor).
void push_tensor(std::vector<int64_t>& key, const torch::Tensor& t) {
  if (!t.defined()) {
    key.push_back(-1);
    return;
  }
  key.push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr())));
  key.push_back(static_cast<int64_t>(t.scalar_type()));
  key.push_back(t.dim());
  for (const auto size : t.sizes()) key.push_back(size);
  for (const auto stride : t.strides()) key.push_back(stride);
}

constexpr int64_t kReplaysBeforeReport = 8;  // eligible steps in a row without a replay before the report says why

}  // namespace

std::string Preconditioner::GraphKey::changed_from(const GraphKey& before) const {
  std::vector<std::string> parts;
  if (setup != before.setup || executor.lock() != before.executor.lock()) {
    parts.emplace_back("the step's setup (strategy, layers preconditioned, KL clipping, TF32, stream)");
  }
  if (gradients != before.gradients) {
    parts.emplace_back("the gradients' memory (a gradient set to None, by zero_grad(set_to_none=True), the default, "
                       "is allocated again by the next backward pass, perhaps elsewhere; "
                       "zero_grad(set_to_none=False) keeps it)");
  }
  if (state != before.state) parts.emplace_back("the second-order state's memory");
  std::ostringstream out;
  for (size_t k = 0; k < parts.size(); ++k) out << (k == 0 ? "" : ", and ") << parts[k];
  return out.str();
}

std::string Preconditioner::graph_ineligible(bool updated, const std::vector<LayerFate>& fates,
                                             const Distributor& model) const {
  if (updated) return "this step updated factors or second-order state";
  if (options_.eigen_adam()) {
    for (size_t i = 0; i < layers_.size(); ++i) {
      const auto& layer = layers_[i];
      if (fates[i] == LayerFate::kPreconditioned && executor_->preconditions(i) && layer.second_order().defined() &&
          !layer.adam_moments_current()) {
        return "eigen_adam makes a layer's moments, or rotates them into its new eigenbasis, this step";
      }
    }
  }
  if (options_.compute_method() == ComputeMethod::kEigen && !options_.compute_eigenvalue_outer_product() &&
      !options_.eigen_adam()) {  // eigen_adam holds no denominator
    return "compute_eigenvalue_outer_product off builds the denominators from each step's damping";
  }
  if (read_guard_at_once_.value_or(device_.is_cpu())) {
    return "the guard is read on the host before the gradients are written (read_guard_at_once)";
  }
  if (executor_->plan().broadcast_gradients) {
    return "preconditioned gradients are broadcast between ranks (a grad_worker_fraction below 1, or DP-KFAC)";
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (executor_->owner_rows(i)) return "layers are owner-placed (sharded_placement owner)";
    if (factor_ok_[i].defined()) return "factors were folded this step";
  }
  if (model.sum_over_model) return "KL clipping sums over the model's parts (pipeline or tensor parallel)";
  return "";
}

Preconditioner::GraphKey Preconditioner::graph_key(const std::vector<LayerFate>& fates, double kl_clip,
                                                   const Distributor& model) const {
  GraphKey key;
  key.executor = executor_;
  // The stream it runs on: a replay on another would overwrite the report tensors that the last step's host
  // copies, queued on the stream before, have not read yet.
  const auto stream = device::current_stream(device_);
  key.setup.push_back(static_cast<int64_t>(stream.device_index()));
  key.setup.push_back(stream.id());
  key.setup.push_back(kl_clip > 0.0);
  // How cuBLAS runs float32 and reduced-precision products, read where a capture fixes it (the new getters: the
  // old allowTF32CuBLAS raises where the precision was set through the new API).
  const auto& context = at::globalContext();
  key.setup.push_back(static_cast<int64_t>(context.float32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL)));
  key.setup.push_back(static_cast<int64_t>(context.float32MatmulPrecision()));
  key.setup.push_back(static_cast<int64_t>(context.allowFP16ReductionCuBLAS()));
  key.setup.push_back(static_cast<int64_t>(context.allowBF16ReductionCuBLAS()));
  key.setup.push_back(static_cast<int64_t>(options_.precondition_dtype()));
  push_tensor(key.setup, step_scalars_);
  if (options_.eigen_adam()) {  // the fused Adam kernel takes them as numbers: set_adam_constants changes them
    for (const double c : {options_.adam_beta1(), options_.adam_beta2(), options_.adam_eps()}) {
      int64_t bits = 0;
      std::memcpy(&bits, &c, sizeof bits);
      key.setup.push_back(bits);
    }
  }
  for (const auto fate : fates) key.setup.push_back(fate == LayerFate::kPreconditioned);
  for (const bool counted : model.counted_elsewhere) key.setup.push_back(counted);
  for (const auto& layer : layers_) {
    push_tensor(key.gradients, layer.weight().grad());
    if (layer.bias().defined()) push_tensor(key.gradients, layer.bias().grad());
    for (const auto* part : layer.second_order().parts()) push_tensor(key.state, *part);
    const auto& adam = layer.adam_moments();  // Options::eigen_adam: stepped in place, rotated in place
    for (const auto* moment : {&adam.exp_avg, &adam.exp_avg_sq, &adam.steps}) push_tensor(key.state, *moment);
  }
  for (const auto& group : groups_.groups()) {
    key.state.push_back(static_cast<int64_t>(group.members.size()));
    for (const size_t i : group.members) key.state.push_back(static_cast<int64_t>(i));
    push_tensor(key.state, group.a);
    push_tensor(key.state, group.g);
    push_tensor(key.state, group.denominator);
  }
  return key;
}

void Preconditioner::precondition_and_write(std::vector<LayerFate>& fates, double kl_clip, const Distributor& model,
                                            bool updated) {
  set_step_scalars(kl_clip);
  const auto region = [&](std::vector<LayerFate>& region_fates) {
    std::vector<torch::Tensor> vg;
    auto preconditioned = precondition(region_fates, kl_clip, vg);
    auto report = guard_and_clip(region_fates, preconditioned, vg, kl_clip, model);
    write_gradients(region_fates, preconditioned, report);
    return report;
  };
  GuardReport report;
  if (!replay_graph(fates, kl_clip, model, updated, region, report)) report = region(fates);
  if (report.scale.defined()) defer_guard_read(std::move(report));  // left on the device: read later
}

bool Preconditioner::replay_graph(std::vector<LayerFate>& fates, double kl_clip, const Distributor& model,
                                  bool updated, const std::function<GuardReport(std::vector<LayerFate>&)>& region,
                                  GuardReport& report) {
  if (!options_.cuda_graphs()) return false;
  auto& r = graph_report_;
  if (r.off.empty()) r.off = device::graphs_unavailable(device_);
  const auto eager = [&](std::string why) {
    ++r.eager_steps;
    r.last_eager = std::move(why);
    return false;
  };
  if (!r.off.empty()) return eager(r.off);
  // The groups planned, and every member's state copied into its slots (LayerGroups::ready), now: in a capture the
  // copies would be recorded from tensors that are then freed, and replayed from freed memory. (Before the checks:
  // a copy into a slot can keep eigen_adam's basis apart, which makes its moments' rotation due.)
  auto& groups = layer_groups();
  for (size_t k = 0; k < groups.groups().size(); ++k) groups.ready(layers_, k);
  const auto why_not = graph_ineligible(updated, fates, model);
  if (!why_not.empty()) return eager(why_not);
  auto key = graph_key(fates, kl_clip, model);
  if (!step_graph_ || step_graph_->key != key) {
    if (!eager_key_ || *eager_key_ != key) {  // a new key: eager now, captured where the next step's is the same
      std::string why = "first step of its kind";
      if (step_graph_ || eager_key_) why = key.changed_from(eager_key_ ? *eager_key_ : step_graph_->key) + " moved";
      eager_key_ = std::move(key);
      if (++eager_in_a_row_ == kReplaysBeforeReport) {
        TORCH_WARN("cuda_graphs: ", eager_in_a_row_, " steps in a row that a CUDA graph could replay ran eagerly, "
                   "because ", why, " since the step before; a graph is replayed only while what it reads stays "
                   "where it was (cuda_graph_report())");
      }
      return eager(why);
    }
    auto graph = std::make_unique<StepGraph>();
    graph->key = std::move(key);
    graph->fates = fates;
    try {
      const PhaseClock::Paused paused(clock_);  // nothing runs in a capture: no device marks
      graph->graph = std::make_unique<device::Graph>(device_, [&] { graph->report = region(graph->fates); });
    } catch (const c10::Error& e) {
      // The capture launched nothing; what its host code left is dropped, and this step and the rest run eagerly.
      guard_rows_.clear();
      step_graph_.reset();
      r.off = std::string("the capture of a step's CUDA graph failed: ") + e.what_without_backtrace();
      TORCH_WARN("cuda_graphs: ", r.off, "; every step runs eagerly from now on");
      return eager(r.off);
    }
    step_graph_ = std::move(graph);
    eager_key_.reset();
    ++r.captures;
  }
  {
    mark("replaying the step's CUDA graph");
    const PhaseClock::Span span(clock_, KfacPhase::kPrecondition);
    step_graph_->graph->replay();
  }
  fates = step_graph_->fates;
  report = step_graph_->report;
  report.step = steps_;
  report.kl_clip = kl_clip;
  report.lr = options_.lr_at(steps_);
  eager_in_a_row_ = 0;
  ++r.replays;
  return true;
}

}  // namespace dkfac
