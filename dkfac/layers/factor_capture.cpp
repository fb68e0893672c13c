#include "dkfac/layers/factor_capture.h"

#include <ATen/SavedTensorHooks.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/graph_task.h>

#include <sstream>
#include <utility>

namespace dkfac {

const char* to_string(LayerKind kind) {
  switch (kind) {
    case LayerKind::kLinear: return "Linear";
    case LayerKind::kConv2d: return "Conv2d";
    case LayerKind::kEmbedding: return "Embedding";
  }
  return "?";
}

LayerGeometry embedding_geometry(int64_t vocabulary) {
  TORCH_CHECK(vocabulary > 0, "an Embedding needs at least one token, got num_embeddings ", vocabulary);
  LayerGeometry geometry;
  geometry.kind = LayerKind::kEmbedding;
  geometry.transposed = true;
  geometry.vocabulary = vocabulary;
  geometry.a_diagonal = true;
  return geometry;
}

InputPass::InputPass(const torch::Tensor& input)
    : data(input.has_storage() ? input.data_ptr() : nullptr),
      sizes(input.sizes().vec()),
      strides(input.strides().vec()),
      dtype(input.scalar_type()),
      device(input.device()),
      version(input._version()) {
  if (input.has_storage()) storage = input.storage().getWeakStorageImpl();
}

bool InputPass::same(const InputPass& other) const {
  if (!storage || !other.storage) return false;
  const auto live = storage->lock();
  return live && live == other.storage->lock() && data == other.data && sizes == other.sizes &&
         strides == other.strides && dtype == other.dtype && device == other.device && version == other.version;
}

std::string InputPass::describe() const {
  std::ostringstream out;
  out << c10::IntArrayRef(sizes) << " " << dtype << " on " << device << " at " << data << ", version " << version;
  if (!storage || !storage->lock()) out << " (freed since)";
  return out.str();
}

FactorCapture::FactorCapture(LayerGeometry geometry) : geometry_(geometry) {
  if (geometry_.kind == LayerKind::kEmbedding) {
    TORCH_CHECK(geometry_.vocabulary > 0 && !geometry_.has_bias, "an Embedding capture needs its vocabulary and no bias");
    geometry_.transposed = geometry_.a_diagonal = true;
  }
}

void FactorCapture::set_diagonal(bool a, bool g) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(a_count_ == 0 && g_count_ == 0 && waiting_inputs_.empty(), "set_diagonal after factors were captured");
  geometry_.a_diagonal = a || geometry_.kind == LayerKind::kEmbedding;
  geometry_.g_diagonal = g;
}

void FactorCapture::set_vocabulary_slice(int64_t first, int64_t rows) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(geometry_.kind == LayerKind::kEmbedding, "a vocabulary slice is for an Embedding, this capture is a ",
              to_string(geometry_.kind));
  TORCH_CHECK(a_count_ == 0 && g_count_ == 0 && waiting_inputs_.empty(),
              "set_vocabulary_slice after factors were captured");
  TORCH_CHECK(first >= 0 && rows > 0, "an Embedding slice needs rows [first, first + rows), got first ", first,
              ", rows ", rows);
  geometry_.vocabulary = rows;
  geometry_.vocabulary_first = first;
}

torch::Tensor FactorCapture::in_factor_dtype(const torch::Tensor& t, bool autocast) const {
  auto dtype = t.scalar_type();
  if (factor_dtype_) {
    dtype = *factor_dtype_;
  } else {
    // A layer that computes in a lower precision than its weight is kept in (FSDP2's MixedPrecisionPolicy
    // runs it in param_dtype; autocast's region in half) builds its factors in the weight's dtype, and
    // under autocast in float32 at least: the half dtype is for the layer, not its factors.
    dtype = c10::promoteTypes(dtype, weight_dtype_.load());
    if (autocast) dtype = c10::promoteTypes(dtype, torch::kFloat);
  }
  return dtype != t.scalar_type() ? t.to(dtype) : t;
}

void FactorCapture::set_reduce(bool reduce) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(a_count_ == 0 && g_count_ == 0 && waiting_inputs_.empty(), "set_reduce after factors were captured");
  reduce_ = reduce && geometry_.kind == LayerKind::kLinear;
}

namespace {

/// K-FAC-reduce of a Linear's input or output gradient [B, ..., d] -> [B, d]: the mean (inputs) or the sum
/// (output gradients) over the middle dimensions. [B, d] and unbatched [d] have none and are returned as they are.
torch::Tensor reduced(const torch::Tensor& t, bool mean) {
  if (t.dim() <= 2) return t;
  const auto rows = t.reshape({t.size(0), -1, t.size(-1)});
  return mean ? rows.mean(1) : rows.sum(1);
}

/// `build(x)` for a factor kept in `x`'s dtype. A float16 factor's products and sums run in float32 from the
/// float16 values and are rounded once: float16's sums over a batch pass 65504 where their mean fits, and
/// the factor would be inf (the layer then falls back to its plain gradient).
template <typename Build>
torch::Tensor built_in_range(const torch::Tensor& x, Build build) {
  if (x.scalar_type() != torch::kHalf) return build(x);
  return build(x.to(torch::kFloat)).to(torch::kHalf);
}

/// True when `t`'s device type has autocast on in this thread (the capture runs inside the user's region).
bool autocast_on(const torch::Tensor& t) {
  const auto type = t.device().type();
  return at::autocast::is_autocast_available(type) && at::autocast::is_autocast_enabled(type);
}

}  // namespace

void FactorCapture::set_shared_input(bool member, bool follower,
                                     const std::vector<std::shared_ptr<FactorCapture>>& group) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(a_count_ == 0 && g_count_ == 0 && waiting_inputs_.empty(),
              "set_shared_input after factors were captured");
  member_ = member || follower;
  follower_ = follower;
  group_.assign(group.begin(), group.end());
}

size_t FactorCapture::input_passes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return passes_.size();
}

std::optional<InputPass> FactorCapture::pass_at(size_t k) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (k >= passes_.size()) return std::nullopt;
  return passes_[k];
}

void FactorCapture::forget_passes() {
  passes_.clear();
  mismatch_.clear();
  mismatch_with_ = nullptr;
}

std::string FactorCapture::input_mismatch(const FactorCapture** other) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (other != nullptr) *other = mismatch_with_;
  return mismatch_;
}

void FactorCapture::capture_input(const torch::Tensor& input, bool at_once) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (input.numel() == 0) {  // no rows: nothing to capture (empty_passes)
      ++empty_passes_;
      return;
    }
    const auto forwards = follower_ ? static_cast<int64_t>(passes_.size())
                                    : a_count_ + static_cast<int64_t>(waiting_inputs_.size());
    // Activation checkpointing without reentrance runs the forward with saved-tensor hooks (captured), then again in
    // the backward pass: that recomputation is the same input, not captured twice. Each forward captured under
    // such hooks outside a backward pass allows one such skip (recomputable_). The reentrant kind runs its first
    // forward without gradients (not captured): its recomputation is the pass, and is captured.
    const bool in_backward = torch::autograd::get_current_graph_task_id() != -1;
    if (in_backward && recomputable_ > 0) {
      --recomputable_;
      return;
    }
    if (!in_backward && !at::SavedTensorDefaultHooks::get_tls_state().stack.empty()) ++recomputable_;
    if (forwards > g_count_) interleaved_ = true;  // before the last forward's backward
  }
  const bool autocast = autocast_on(input);
  forward_autocast_ = autocast;  // a follower's G is built in the dtype its forward's autocast says too
  if (member_) {
    const InputPass pass(input);
    size_t k = 0;
    std::vector<std::weak_ptr<FactorCapture>> group;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      passes_.push_back(pass);
      k = passes_.size() - 1;
      group = group_;
    }
    // Compared now, while both inputs are alive; one lock at a time (members may capture on other threads).
    for (const auto& weak : group) {
      const auto other = weak.lock();
      const auto theirs = other ? other->pass_at(k) : std::nullopt;
      if (!theirs || theirs->same(pass)) continue;
      std::lock_guard<std::mutex> lock(mutex_);
      if (!mismatch_.empty()) continue;
      mismatch_ = c10::str("was given another input at pass ", k + 1, ": ", pass.describe(), " where it was given ",
                           theirs->describe());
      mismatch_with_ = other.get();
    }
    if (follower_) return;  // the group's first member builds the A factor they share
  }
  const bool hooked = !at::SavedTensorDefaultHooks::get_tls_state().stack.empty();
  if (geometry_.kind != LayerKind::kEmbedding && !autocast && !hooked && !at_once) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!listener_ && waiting_inputs_.size() < kMaxWaitingInputs) {
      waiting_inputs_.push_back(input.detach());
      return;
    }
  }
  build_waiting_inputs();  // the sum adds in the order things came
  build_a(input, autocast);
}

void FactorCapture::build_waiting_inputs() {
  std::vector<torch::Tensor> inputs;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    inputs.swap(waiting_inputs_);
  }
  for (const auto& input : inputs) build_a(input, /*autocast=*/false);
}

void FactorCapture::build_a(const torch::Tensor& input, bool autocast) {
  // The factor products run in the factor dtype: outside the user's autocast region, whose float16 sums of
  // batch x height x width rows pass 65504.
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  auto start = device::Mark::now(input.device());
  torch::NoGradGuard no_grad;
  torch::Tensor a_batch;
  if (geometry_.kind == LayerKind::kEmbedding) {
    // Counts divided by n, built in float32 at least (float16 counts stop at 2048) and stored in the factor dtype.
    const auto dtype = factor_dtype_.value_or(weight_dtype_.load());
    const auto type = c10::promoteTypes(dtype, torch::kFloat);
    const auto ids = input.detach();
    a_batch = geometry_.vocabulary_first < 0
                  ? math::embedding_a_factor(ids, geometry_.vocabulary, type)
                  : math::embedding_a_factor_slice(ids, geometry_.vocabulary_first, geometry_.vocabulary, type);
    if (a_batch.scalar_type() != dtype) a_batch = a_batch.to(dtype);
  } else {
    auto x = in_factor_dtype(input.detach(), autocast);
    if (reduce_) x = reduced(x, /*mean=*/true);
    a_batch = built_in_range(x, [this](const torch::Tensor& in) {
      const bool diagonal = geometry_.a_diagonal;
      if (geometry_.kind == LayerKind::kLinear) {
        return diagonal ? math::linear_a_diagonal(in, geometry_.has_bias) : math::linear_a_factor(in, geometry_.has_bias);
      }
      const auto batched = in.dim() == 3 ? in.unsqueeze(0) : in;
      return diagonal ? math::conv2d_a_diagonal(batched, geometry_.conv, geometry_.has_bias)
                      : math::conv2d_a_factor(batched, geometry_.conv, geometry_.has_bias);
    });
  }
  add_and_notify(true, a_batch, 0.0, std::pair{std::move(start), device::Mark::now(input.device())});
}

void FactorCapture::observe_output(const torch::Tensor& output) {
  const bool conv = geometry_.kind == LayerKind::kConv2d;  // Embedding outputs are laid out like Linear's
  const int64_t unbatched_dims = conv ? 3 : 1;
  if (output.dim() < unbatched_dims || output.numel() == 0) return;  // an empty pass says nothing of the shapes
  const bool batched = output.dim() > unbatched_dims;
  samples_per_pass_ = batched ? output.size(0) : 1;
  if (conv) {
    rows_per_sample_ = output.size(-1) * output.size(-2);
  } else if (reduce_) {
    rows_per_sample_ = 1;
  } else {
    const int64_t per_row = output.size(-1) * samples_per_pass_;
    rows_per_sample_ = per_row > 0 ? output.numel() / per_row : 1;
  }
}

void FactorCapture::capture_output_grad(const torch::Tensor& grad_output) {
  if (grad_output.numel() == 0) return;  // an empty pass's (its input was not captured either: empty_passes)
  build_waiting_inputs();
  observe_output(grad_output);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  auto start = device::Mark::now(grad_output.device());
  torch::NoGradGuard no_grad;
  // The backward runs outside the region, but its gradients carry the region's dtype: the forward decides.
  auto g = in_factor_dtype(grad_output.detach(), forward_autocast_ || autocast_on(grad_output));
  if (reduce_) g = reduced(g, /*mean=*/false);
  if (grad_scale_) {
    const auto scale = grad_scale_();
    TORCH_CHECK(scale.defined() && scale.numel() == 1, "grad scaler returned ",
                scale.defined() ? "a tensor of shape " + c10::str(scale.sizes()) : std::string("nothing"),
                "; it must return the loss scale as one number");
    g = g / scale.to(g.device(), /*non_blocking=*/true).reshape({});  // keeps g's dtype
  }
  const auto g_batch = built_in_range(g, [this](const torch::Tensor& in) {
    const bool diagonal = geometry_.g_diagonal;
    if (geometry_.kind != LayerKind::kConv2d) return diagonal ? math::linear_g_diagonal(in) : math::linear_g_factor(in);
    const auto batched = in.dim() == 3 ? in.unsqueeze(0) : in;
    return diagonal ? math::conv2d_g_diagonal(batched) : math::conv2d_g_factor(batched);
  });
  add_and_notify(false, g_batch, 0.0, std::pair{std::move(start), device::Mark::now(grad_output.device())});
  fold_if_complete(grad_output.device());
  std::lock_guard<std::mutex> lock(mutex_);
  const auto weight = watch_.weight ? watch_.weight->lock() : nullptr;
  if (!weight) return;
  watch_.version = weight->version_counter().current_version();
  watch_.marked = false;
  if (watch_.sums_left > 0 && !weight_written_in_forward_) {
    watch_.sum = at::sum(torch::Tensor(weight), at::kDouble);  // no_grad, outside autocast
  }
}

void FactorCapture::watch_weight(const torch::Tensor& weight) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (watch_.weight && watch_.weight->lock().get() == weight.unsafeGetTensorImpl()) return;  // the same tensor
  watch_ = WeightWatch{};
  watch_.weight.emplace(weight.getIntrusivePtr());
}

FactorCapture::WeightCheck FactorCapture::take_weight_check() {
  std::lock_guard<std::mutex> lock(mutex_);
  WeightCheck check;
  const auto version = std::exchange(watch_.version, std::nullopt);
  const bool marked = std::exchange(watch_.marked, false);
  const auto sum = std::exchange(watch_.sum, torch::Tensor());
  const auto weight = watch_.weight ? watch_.weight->lock() : nullptr;
  if (!version || !weight) return check;
  check.written = marked;
  if (weight_written_in_forward_) return check;
  check.written = check.written || static_cast<int64_t>(weight->version_counter().current_version()) != *version;
  if (sum.defined()) {
    torch::NoGradGuard no_grad;
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    check.sum_differs = at::sum(torch::Tensor(weight), at::kDouble).ne(sum);
    --watch_.sums_left;
  }
  return check;
}

void FactorCapture::set_weight_written_in_forward(bool written) {
  std::lock_guard<std::mutex> lock(mutex_);
  weight_written_in_forward_ = written;
}

void FactorCapture::mark_weight_written() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (watch_.version) watch_.marked = true;
}

void FactorCapture::set_fold(Fold fold, int64_t passes) {
  TORCH_CHECK(!fold || passes >= 1, "a fold waits for at least one pass, got ", passes);
  std::lock_guard<std::mutex> lock(mutex_);
  fold_ = std::move(fold);
  fold_passes_ = passes;
}

int64_t FactorCapture::folded_passes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return folded_passes_;
}

bool FactorCapture::interleaved() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return interleaved_;
}

bool FactorCapture::fold_ready_locked() const {
  const auto forwards = follower_ ? static_cast<int64_t>(passes_.size()) : a_count_;
  return fold_ && folded_passes_ == 0 && !interleaved_ && waiting_inputs_.empty() && forwards == fold_passes_ &&
         g_count_ == fold_passes_;
}

bool FactorCapture::fold_ready() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return fold_ready_locked();
}

void FactorCapture::mark_folded() {
  std::lock_guard<std::mutex> lock(mutex_);
  folded_passes_ = fold_passes_;
}

void FactorCapture::fold_if_complete(c10::Device device) {
  Fold fold;
  int64_t passes = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!fold_ready_locked()) return;
    fold = fold_;
    passes = fold_passes_;
  }
  auto start = device::Mark::now(device);
  if (!fold()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  folded_passes_ = passes;
  timing_.spans.emplace_back(std::move(start), device::Mark::now(device));
}

void FactorCapture::add(torch::Tensor& sum, int64_t& count, const torch::Tensor& batch) {
  if (count == 0) {
    sum = batch;
  } else {
    TORCH_INTERNAL_ASSERT(sum.sizes() == batch.sizes(), "captured factor changed shape from ", sum.sizes(),
                          " to ", batch.sizes());
    sum = sum + batch;  // not in place: the first batch may be referenced elsewhere
  }
  ++count;
}

torch::Tensor FactorCapture::mean(const torch::Tensor& sum, int64_t count) {
  if (count == 0) return {};
  return count == 1 ? sum : sum / static_cast<double>(count);
}

torch::Tensor FactorCapture::take(torch::Tensor& sum, int64_t& count) {
  auto mean = FactorCapture::mean(sum, count);
  sum = torch::Tensor();
  count = 0;
  return mean;
}

void FactorCapture::add_and_notify(bool is_a, const torch::Tensor& batch, double seconds,
                                   std::optional<std::pair<device::Mark, device::Mark>> span) {
  Listener listener;
  int64_t count = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t& n = is_a ? a_count_ : g_count_;
    add(is_a ? a_sum_ : g_sum_, n, batch);
    timing_.seconds += seconds;
    if (span) timing_.spans.push_back(std::move(*span));
    listener = listener_;
    count = n;
  }
  if (listener) listener(is_a, count);
}

void FactorCapture::add_a(const torch::Tensor& a_batch, double seconds) {
  build_waiting_inputs();  // the sum adds in the order things came
  add_and_notify(true, a_batch, seconds);
}

void FactorCapture::add_g(const torch::Tensor& g_batch, double seconds) { add_and_notify(false, g_batch, seconds); }

torch::Tensor FactorCapture::mean_a() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return mean(a_sum_, a_count_);
}

torch::Tensor FactorCapture::mean_g() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return mean(g_sum_, g_count_);
}

void FactorCapture::set_listener(Listener listener) {
  std::lock_guard<std::mutex> lock(mutex_);
  listener_ = std::move(listener);
}

int64_t FactorCapture::a_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (follower_) return static_cast<int64_t>(passes_.size());  // its passes: the leader holds the factor
  return a_count_ + static_cast<int64_t>(waiting_inputs_.size());
}

int64_t FactorCapture::empty_passes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return empty_passes_;
}

int64_t FactorCapture::drop_inputs_after_last_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (g_count_ == 0 || follower_) return 0;  // a follower's inputs are its leader's
  // capture_output_grad builds every waiting input: those still waiting came after the last one.
  const auto dropped = static_cast<int64_t>(waiting_inputs_.size());
  waiting_inputs_.clear();
  return dropped;
}

int64_t FactorCapture::g_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return g_count_;
}

torch::Tensor FactorCapture::take_a() {
  build_waiting_inputs();
  std::lock_guard<std::mutex> lock(mutex_);
  forget_passes();
  empty_passes_ = 0;
  recomputable_ = 0;
  interleaved_ = false;
  return take(a_sum_, a_count_);
}

torch::Tensor FactorCapture::take_g() {
  std::lock_guard<std::mutex> lock(mutex_);
  return take(g_sum_, g_count_);
}

void FactorCapture::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  waiting_inputs_.clear();
  forget_passes();
  a_sum_ = torch::Tensor();
  g_sum_ = torch::Tensor();
  a_count_ = 0;
  g_count_ = 0;
  empty_passes_ = 0;
  recomputable_ = 0;
  folded_passes_ = 0;
  interleaved_ = false;
  watch_.version.reset();
  watch_.marked = false;
  watch_.sum = torch::Tensor();
}

std::pair<int64_t, int64_t> FactorCapture::pending_bytes() const {
  auto bytes = [](const torch::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; };
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t a = bytes(a_sum_);
  for (const auto& input : waiting_inputs_) a += bytes(input);
  return {a, bytes(g_sum_)};
}

CaptureTiming FactorCapture::take_timing() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(timing_, {});
}

void capture_module_pass(const std::shared_ptr<FactorCapture>& capture, const torch::Tensor& input,
                         const torch::Tensor& output, bool training) {
  capture->observe_output(output);
  if (!capture->active(training)) return;
  capture->capture_input(input);
  if (output.requires_grad()) {
    output.register_hook([capture](const torch::Tensor& grad) { capture->capture_output_grad(grad); });
  }
}

}  // namespace dkfac
