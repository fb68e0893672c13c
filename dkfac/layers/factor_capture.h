#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "dkfac/device.h"
#include "dkfac/math/factors.h"
#include "dkfac/options.h"

namespace dkfac {

/// The layer kinds whose Kronecker factors dkfac builds (docs/MATH.md section 1).
enum class LayerKind {
  kLinear,     ///< y = x W^T + b over any leading dimensions (also transformers' Conv1D: y = x W + b)
  kConv2d,     ///< 2-D convolution, groups = 1, any stride, dilation, padding and padding mode
  kEmbedding,  ///< y = W[x] for integer tokens x: the Linear of one-hot rows, its A factor diagonal
};

/// "Linear", "Conv2d" or "Embedding" (the names skip_layers patterns and messages use).
const char* to_string(LayerKind kind);

/// How one layer turns what its front end captured into factors: its kind, whether it has a bias,
/// for Conv2d the patch geometry its forward uses, and which factors are kept diagonal.
struct LayerGeometry {
  LayerKind kind = LayerKind::kLinear;
  bool has_bias = false;
  math::Conv2dGeometry conv;  ///< Conv2d only
  /// The weight is stored [in, out], the transpose of a Linear's [out, in]: transformers' Conv1D, and every
  /// Embedding ([vocabulary, dim]). KfacLayer reads and writes its gradient transposed.
  bool transposed = false;
  int64_t vocabulary = 0;    ///< Embedding only: num_embeddings, the width of its A factor
  /// Embedding only: where its weight is a slice of a vocabulary split over ranks (tensor parallel), the first
  /// token of the slice, whose `vocabulary` rows it holds; -1 for a whole vocabulary.
  int64_t vocabulary_first = -1;
  /// Factors kept as their diagonal (math/factors.h): an Embedding's A always; any factor wider than
  /// Options::diagonal_factor_dim (the preconditioner decides at construction, set_diagonal).
  bool a_diagonal = false;
  bool g_diagonal = false;
};

/// The geometry of an Embedding of `vocabulary` tokens (no bias; weight [vocabulary, dim]).
LayerGeometry embedding_geometry(int64_t vocabulary);

/// Time spent building factors since the last take: device marks around each capture (resolved when read,
/// so that capturing never waits for the device) and seconds given directly (add_a, add_g).
struct CaptureTiming {
  double seconds = 0.0;
  std::vector<std::pair<device::Mark, device::Mark>> spans;
};

/// What identifies one captured input (Options::shared_input_layers): the layers of a group must have been given
/// one tensor, the same data, view and version, pass for pass.
struct InputPass {
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage;  ///< held weakly (no memory kept)
  const void* data = nullptr;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Device device = c10::kCPU;
  uint32_t version = 0;  ///< written to in place since: another value
  explicit InputPass(const torch::Tensor& input);
  /// The same tensor, seen twice: one live storage, one view of it, unchanged since.
  bool same(const InputPass& other) const;
  /// "[8, 16] float at 0x..., version 0" for messages.
  std::string describe() const;
};

/// Per-layer accumulator of mini-batch Kronecker factors, fed the same way by either front end: the
/// C++ dkfac::nn modules call `capture_input` from their forward and `capture_output_grad` from a hook
/// on their output; the Python package calls them from torch module and tensor hooks. The preconditioner
/// takes their means at each factor update. Shared by the layer, its module and autograd hooks that may
/// outlive both.
class FactorCapture {
 public:
  explicit FactorCapture(LayerGeometry geometry = {});

  const LayerGeometry& geometry() const { return geometry_; }
  /// Keeps the A and/or G factor diagonal from now on (an Embedding's A stays diagonal whatever `a` says).
  /// Only before anything was captured: the preconditioner calls it at construction.
  void set_diagonal(bool a, bool g);
  /// An Embedding whose weight holds the tokens [first, first + rows) of a vocabulary split over ranks: its A
  /// factor is those entries of the whole one (math::embedding_a_factor_slice), from the whole batch's ids.
  /// Only before anything was captured.
  void set_vocabulary_slice(int64_t first, int64_t rows);
  /// K-FAC-reduce (Options::kfac_approx): a Linear's input [B, ..., in] is averaged and its output gradient
  /// summed over the middle dimensions before the factors are built, one row per sample. Conv2d and Embedding
  /// captures ignore it. Before anything is captured.
  void set_reduce(bool reduce);
  bool reduce() const { return reduce_; }
  /// dtype of the layer's weight: factors are built in it where the layer's inputs or output gradients come
  /// in a lower precision (mixed precision), and an Embedding's A factor (its input is integers) takes it,
  /// unless set_factor_dtype says otherwise. KfacLayer sets it.
  void set_weight_dtype(torch::ScalarType dtype) { weight_dtype_ = dtype; }

  /// Options::shared_input_layers: every capture of a group's member records its inputs (input_passes), and a
  /// `follower` (every member but the group's first) builds no A factor: the first member's is the group's.
  /// Before anything is captured (the preconditioner's construction).
  /// `group`: the other members' captures (held weakly), whose passes each capture compares its own with as it
  /// captures, while both inputs are alive (autograd frees them after the backward pass).
  void set_shared_input(bool member, bool follower, const std::vector<std::shared_ptr<FactorCapture>>& group = {});
  /// Passes captured since the last take_a or clear (a group's members only).
  size_t input_passes() const;
  /// Pass `k` of this capture, if it captured that many.
  std::optional<InputPass> pass_at(size_t k) const;
  /// The first pass since then whose input was not another member's input of that pass ("" where none): pass,
  /// this capture's input and the other's, for the preconditioner's refusal; `other` is set to that member.
  std::string input_mismatch(const FactorCapture** other) const;

  /// The preconditioner that registered this capture, one at a time: Preconditioner's construction claims each of
  /// its layers' captures (false where another holds it) and its destruction releases them.
  bool claim(const void* owner) {
    const void* free = nullptr;
    return owner_.compare_exchange_strong(free, owner) || free == owner;
  }
  void release(const void* owner) {
    const void* mine = owner;
    owner_.compare_exchange_strong(mine, nullptr);
  }

  /// True when the next forward should capture: enabled, module in training mode, grad mode on.
  bool active(bool training) const { return enabled_ && training && torch::GradMode::is_enabled(); }
  /// Turned on by the preconditioner before each factor step, off after it.
  void set_enabled(bool enabled) { enabled_ = enabled; }
  bool enabled() const { return enabled_; }

  /// Captures one micro-batch's input, from which its A factor is built. Linear: input [..., in_features];
  /// Conv2d: [B, C, H, W] or unbatched [C, H, W]; Embedding: integer tokens of any shape. Runs without autograd.
  /// A Linear's or Conv2d's factor is built when the layer's output gradient arrives (capture_output_grad)
  /// or when the factors are read (take_a): the input is kept until then, which costs no memory while autograd
  /// keeps it for the weight's gradient (until the layer's backward), while the factor built at once would be
  /// held through the backward pass, at its peak (BERT-Large: 2 GiB). The same kernels on the same input, in
  /// the same order: the same numbers. The factor is built at once where the input may cost memory or the
  /// factor is wanted in the forward pass: under autocast (autograd keeps the cast copy), while saved-tensor
  /// hooks are active (activation checkpointing, offloading), for an Embedding, when a listener waits for the
  /// factors (the FactorPipeline overlaps their reduction with forward and backward), and once
  /// kMaxWaitingInputs inputs wait (forward passes without a backward pass). An input whose layer gets no
  /// output gradient (an output that needs none, a layer left unused) is held until the factors are read or
  /// cleared at step(). `at_once` builds it now whatever the case: an input a compiled graph hands over (Python's
  /// torch.compile path) lives in a buffer its memory plan may reuse once the capture returns, whatever references
  /// it (inductor did so under activation checkpointing).
  void capture_input(const torch::Tensor& input, bool at_once = false);
  /// The most inputs kept waiting for their backward pass (capture_input): more forward passes than this
  /// without a backward pass build their factors at once.
  static constexpr size_t kMaxWaitingInputs = 8;
  /// Builds the G factor of one micro-batch from the gradient of the layer's output and adds it.
  /// Linear and Embedding: [..., out_features]; Conv2d: [B, C_out, H_out, W_out] or [C_out, H_out, W_out].
  /// The gradient is divided by the grad scale first, when one is set (mixed-precision loss scaling).
  void capture_output_grad(const torch::Tensor& grad_output);

  /// Records the shape of the layer's output ([B, ..., out_features] or [B, C_out, H_out, W_out], or
  /// unbatched): rows_per_sample and samples_per_pass. capture_output_grad records its gradient's (the same
  /// shape), so both front ends' captures know it after a captured backward; the dkfac::nn modules also
  /// record every training forward's.
  void observe_output(const torch::Tensor& output);
  /// Rows each sample adds to the factor's input matrix in the last observed pass: output positions
  /// H_out * W_out for Conv2d, the middle dimensions' size for Linear (1 for [B, in], and under reduce); 1
  /// before any.
  /// Plans use it to predict factor FLOPs.
  int64_t rows_per_sample() const { return rows_per_sample_; }
  /// Samples in the last observed pass (its batch dimension; 1 unbatched); 0 before any.
  int64_t samples_per_pass() const { return samples_per_pass_; }

  /// Storage dtype of captured factors (Options::factor_dtype). nullopt keeps the activations' dtype, except
  /// under autocast: a forward captured inside a torch.autocast region (and the backward of that forward)
  /// builds its factors in float32 (float64 inputs stay float64), never in the region's float16/bfloat16.
  /// Either way the products run outside autocast, in the factor dtype.
  void set_factor_dtype(std::optional<torch::ScalarType> dtype) { factor_dtype_ = dtype; }
  const std::optional<torch::ScalarType>& factor_dtype() const { return factor_dtype_; }
  /// Current loss scale of a mixed-precision gradient scaler; G is built from grad_output / scale.
  void set_grad_scale(GradScale scale) { grad_scale_ = std::move(scale); }

  /// Adds one micro-batch factor ([a, a] or [g, g]; [a] or [g] where diagonal) and the seconds spent building it.
  void add_a(const torch::Tensor& a_batch, double seconds);
  void add_g(const torch::Tensor& g_batch, double seconds);

  /// Micro-batches captured since the last take (an input whose factor is not built yet counts).
  int64_t a_count() const;
  int64_t g_count() const;
  /// Forward passes on an empty batch (0 rows: a mixture-of-experts expert that received no tokens) since the last
  /// take_a or clear. They are not captured: a batch without rows has no covariance, so it neither adds to the
  /// factors nor counts as a micro-batch (its output gradient, empty too, is skipped alike).
  int64_t empty_passes() const;
  /// Drops the inputs of forward passes after the last output gradient (a forward in training mode whose backward
  /// never ran, e.g. an evaluation without torch.no_grad()), where they still wait to be built (capture_input), and
  /// returns how many: as a hook's fold would never see them. Only once an output gradient came (g_count() > 0).
  int64_t drop_inputs_after_last_backward();

  /// Mean of the captured factors (sum / count), or an undefined tensor if none; resets the sum.
  torch::Tensor take_a();
  torch::Tensor take_g();

  /// Mean of the factors built so far without resetting (undefined if none): the factor pipeline reads it when
  /// the listener reports a new one.
  torch::Tensor mean_a() const;
  torch::Tensor mean_g() const;

  /// Drops anything captured.
  void clear();

  /// The layer's weight, held weakly: each output gradient captured records its version, so that step() can tell a
  /// weight written in place since the backward pass (optimizer.step() called before the preconditioner's step(),
  /// or an optimizer stepping inside the backward pass). KfacLayer sets it at its construction and rebind. For the
  /// first three checks of a weight, the output gradients also record its sum: LibTorch's SGD writes the weight
  /// through `data()`, which moves no version (three: a first step from lr 0 moves nothing).
  void watch_weight(const torch::Tensor& weight);
  /// What take_weight_check finds since the last output gradient captured: `written` where the weight's version
  /// moved or mark_weight_written said so; `sum_differs`, a bool tensor on the weight's device (read by the caller,
  /// once for all layers), where its sum was recorded and differs now. Neither where no output gradient was
  /// captured since the last take or clear(), or the weight is freed.
  struct WeightCheck {
    bool written = false;
    torch::Tensor sum_differs;
  };
  WeightCheck take_weight_check();
  /// Says the weight was written since the last output gradient captured, where one was: the Python front end's
  /// optimizer hook, for fused optimizers, whose kernels write the weight without moving its version.
  void mark_weight_written();
  /// The layer's own forward writes its weight in place (an Embedding with max_norm renormalizes the rows it looks
  /// up), so that a forward after the backward pass (an evaluation, an activation checkpoint's recomputation) moves
  /// its version and sum: they are not compared, and only mark_weight_written says it was written.
  void set_weight_written_in_forward(bool written);

  /// Bytes held for the next factor update: the sums of the factors built, the inputs waiting for theirs.
  std::pair<int64_t, int64_t> pending_bytes() const;

  /// Options::fold_in_hooks: `fold` runs when the `passes`-th output gradient arrives after as many forward passes,
  /// each backward after its own forward (forward, backward, forward, ...: no forward before the last one's
  /// backward): on the thread that captured, outside the lock, timed as factor building. It takes the batches
  /// (take_a, take_g) into the layer's running factors and returns whether it did; those passes then count as
  /// captured (KfacLayer::captured_batches) until clear(). A forward before the last backward (a layer called twice in one
  /// forward, pipelined micro-batches, a recomputed forward) leaves everything to step(). nullptr: never.
  using Fold = std::function<bool()>;
  void set_fold(Fold fold, int64_t passes);
  /// Passes taken by the fold since the last clear() (0: none).
  int64_t folded_passes() const;
  /// Since the last take_a or clear: a forward pass came before the backward of the one before it.
  bool interleaved() const;
  /// The passes set_fold waits for are in, and nothing is folded yet: what the fold is called on. A shared-input
  /// group folds as one, in its last member's hook: it asks the others whether theirs are in too.
  bool fold_ready() const;
  /// Those passes were taken by a fold another capture's hook ran (a shared-input group's): they count as folded.
  void mark_folded();

  /// Called after each add (on the thread that added, outside the capture's lock) with whether it was
  /// A and how many micro-batches that factor now holds. The FactorPipeline (SPD-KFAC, KAISA's hook buckets)
  /// starts allreduces from it.
  using Listener = std::function<void(bool is_a, int64_t count)>;
  void set_listener(Listener listener);

  /// Time spent building factors (forward and backward) since the last take.
  CaptureTiming take_timing();

 private:
  static void add(torch::Tensor& sum, int64_t& count, const torch::Tensor& batch);
  static torch::Tensor mean(const torch::Tensor& sum, int64_t count);
  static torch::Tensor take(torch::Tensor& sum, int64_t& count);
  /// Adds under the lock, then calls the listener outside it.
  void add_and_notify(bool is_a, const torch::Tensor& batch, double seconds,
                      std::optional<std::pair<device::Mark, device::Mark>> span = std::nullopt);
  /// `t` in the dtype its factor is built in (see set_factor_dtype); `autocast` says whether the forward that
  /// produced it ran under autocast.
  torch::Tensor in_factor_dtype(const torch::Tensor& t, bool autocast) const;
  /// Builds one input's A factor and adds it.
  void build_a(const torch::Tensor& input, bool autocast);
  /// Builds the A factors of the inputs kept by capture_input, in the order they came.
  void build_waiting_inputs();
  /// set_fold's fold, when the passes it waits for are in (capture_output_grad, after the add).
  void fold_if_complete(c10::Device device);
  /// fold_ready's test. Caller holds mutex_.
  bool fold_ready_locked() const;

  LayerGeometry geometry_;
  std::optional<torch::ScalarType> factor_dtype_;
  bool reduce_ = false;
  std::atomic<torch::ScalarType> weight_dtype_{torch::kFloat32};
  GradScale grad_scale_;
  mutable std::mutex mutex_;  // forward and autograd threads may both touch the sums
  // watch_weight: the weight, held weakly, and what the last output gradient captured since the last take saw of it
  struct WeightWatch {
    std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> weight;
    std::optional<int64_t> version;  // its version then
    torch::Tensor sum;               // its sum then, while `sums_left`
    int sums_left = 3;               // takes that compare a sum yet (a first step may move nothing: lr 0)
    bool marked = false;             // mark_weight_written since then
  } watch_;
  bool weight_written_in_forward_ = false;  // set_weight_written_in_forward
  bool enabled_ = false;
  std::atomic<int64_t> rows_per_sample_{1};
  std::atomic<int64_t> samples_per_pass_{0};
  std::atomic<bool> forward_autocast_{false};  // the last captured forward ran under autocast
  std::vector<torch::Tensor> waiting_inputs_;  // captured inputs whose A factor is not built yet
  bool member_ = false;    // of a shared-input group: passes_ recorded
  bool follower_ = false;  // of a shared-input group, not its first: no A factor built
  std::vector<InputPass> passes_;
  std::vector<std::weak_ptr<FactorCapture>> group_;  // the other members of its shared-input group
  std::string mismatch_;                             // input_mismatch()
  const FactorCapture* mismatch_with_ = nullptr;
  /// Drops the passes and their mismatch (take_a, clear). Caller holds mutex_.
  void forget_passes();

  Fold fold_;                    // set_fold
  int64_t fold_passes_ = 0;
  int64_t folded_passes_ = 0;
  bool interleaved_ = false;

  torch::Tensor a_sum_;  // [a, a], or [a] diagonal
  torch::Tensor g_sum_;  // [g, g], or [g] diagonal
  int64_t a_count_ = 0;
  int64_t empty_passes_ = 0;  // empty_passes()
  int64_t recomputable_ = 0;  // forwards under saved-tensor hooks whose recomputation in backward is not captured
  std::atomic<const void*> owner_{nullptr};  // claim()
  int64_t g_count_ = 0;
  CaptureTiming timing_;
  Listener listener_;
};

/// One training forward of a C++ dkfac::nn module (Linear, Conv2d, Embedding): records the output's shape, and,
/// where `capture` is active, captures `input` and hooks `output` for its gradient. The hook holds the capture,
/// not the module: it stays valid if the module goes first.
void capture_module_pass(const std::shared_ptr<FactorCapture>& capture, const torch::Tensor& input,
                         const torch::Tensor& output, bool training);

}  // namespace dkfac
