#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include "dkfac/assign/assignment.h"

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

/// How a Linear applied over shared dimensions ([B, ..., in]: a sequence) turns them into factor rows: K-FAC
/// expand and reduce (Eschenhagen et al., NeurIPS 2023; docs/MATH.md 7.6). Conv2d and Embedding always expand.
enum class KfacApprox {
  kExpand,  ///< every position is a row: n = B * T (kfac_pytorch's)
  kReduce,  ///< one row per sample: inputs averaged, output gradients summed over the shared dimensions: n = B
};

/// The arithmetic of the preconditioning products (Q_G^T grad Q_A and back, or G^-1 grad A^-1) on a GPU: a fast
/// mode, opt-in, its error measured in docs/PERFORMANCE.md. bfloat16 products: inv_dtype bfloat16.
enum class PreconditionDtype {
  kFloat32,  ///< the state's own dtype, IEEE float32 products (exact; default)
  kTf32,     ///< float32 state, cuBLAS products in TF32 (10-bit mantissa inputs, float32 sums); no effect on a CPU
};

/// Which published distributed K-FAC system places and moves the work (docs/MATH.md section 5).
/// Ignored in a single process.
enum class Strategy {
  kKaisa,  ///< KAISA (SC21); grad_worker_fraction 1 is SC20's D-KFAC, 1/P its layer-wise variant
  kSpd,    ///< SPD-KFAC (ICDCS'21): pipelined, fused factor allreduce; small factors decomposed everywhere
  kDp,     ///< DP-KFAC: one owner per layer builds its factors from its own batch; V broadcast every step
};

/// The `strategy` option: one Strategy, or none for strategy auto, which the Preconditioner chooses at its first
/// step: the fastest of strategy::candidates on measured rates that fits memory_budget (strategy::choose_strategy;
/// docs/STRATEGIES.md, "Choosing automatically"). Everything that runs a strategy takes a Strategy.
using StrategyOption = std::optional<Strategy>;
/// `Options().strategy(kStrategyAuto)`: strategy auto.
inline constexpr std::nullopt_t kStrategyAuto = std::nullopt;

/// Where the K-FAC work of a layer whose gradient the front end shards by output rows (FSDP2's `fully_shard`,
/// HSDP: assign::LayerShape::sharded) runs (docs/STRATEGIES.md, "Sharded models"). Layers that are not sharded
/// are preconditioned as the strategy says either way.
enum class ShardedPlacement {
  kReplicated,  ///< every rank gathers the whole gradient; the strategy runs as under DDP; each rank keeps its rows
  kOwner,       ///< each layer's grad worker in a row of ranks (its owner) alone holds its factors and second-order
                ///< state; it gathers the row's gradient shards, preconditions and scatters the rows back
};

/// The loss scale of a mixed-precision gradient scaler as a one-element tensor, e.g. torch.amp.GradScaler's
/// scale on its device: reading it does not wait for the device. G is built from grad_output / scale.
using GradScale = std::function<at::Tensor()>;

/// An option's value as the front ends hand it over (Options::set): nothing (Python's None), a bool, an
/// integer, a number, a name, names, integers, or a function of the step (schedules).
using OptionValue = std::variant<std::monostate, bool, int64_t, double, std::string, std::vector<std::string>,
                                 std::vector<int64_t>, std::function<double(int64_t)>>;

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

/// A bound on a numeric option: `value` must be >= (or > when `open`) min and <= (or <) max; some
/// numbers have names (grad_worker_fraction "mem-opt" is 0, i.e. 1/P).
struct OptionRange {
  double min = -1e308;
  double max = 1e308;
  bool min_open = false;
  bool max_open = false;
  std::vector<std::pair<std::string, double>> named = {};
  /// What a reader is told: "> 0", ">= 1", "in [0, 1]".
  std::string describe() const;
  bool contains(double value) const;
};
inline OptionRange at_least(double min) { return {min}; }
inline OptionRange greater_than(double min) { return {min, 1e308, true}; }
inline OptionRange between(double min, double max) { return {min, max}; }
inline OptionRange any_value() { return {}; }

// The options, each declared once: kind (Schedule: a value or a function of the K-FAC step; Value), C++ type,
// name (the C++ setter, Python's keyword, the metrics key), default, range, `dkfac train`'s flag ("": not a flag:
// the training loop sets it), kfac_pytorch's keyword where it differs (""), kfac_pytorch's default where it
// differs from dkfac's ("", else as the flag would spell it), and the documentation (Python's, --help's and the
// README's). option_table() (below) is made from this list; so are Options' setters and getters. Adding an
// option: a line here, its use, and a test (docs/ARCHITECTURE.md, "Adding an option").
#define DKFAC_OPTIONS(X)                                                                                             \
  X(Schedule, double, lr, 0.1, at_least(0), "", "", "",                                                              \
    "learning rate of the optimizer that applies the gradients; read by KL clipping only")                           \
  X(Schedule, double, damping, 0.001, greater_than(0), "--damping", "", "",                                          \
    "Tikhonov damping lambda added to the factors (0.001: kfac_pytorch's default; not tuned)")                       \
  X(Schedule, double, kl_clip, 0.001, (OptionRange{0, 1e308, false, false, {{"none", 0.0}}}), "--kl-clip", "", "",  \
    "KL-clip bound (0 or none: no clipping)")                                                                      \
  X(Schedule, int64_t, factor_update_steps, 1, at_least(1), "--factor-update-steps", "", "",                         \
    "steps between factor updates; activations are captured only on these steps")                                   \
  X(Schedule, int64_t, inv_update_steps, 1, at_least(1), "--inv-update-steps", "", "",                               \
    "steps between second-order (eigendecomposition or inverse) updates")                                           \
  X(Schedule, double, factor_decay, 0.95, between(0, 1), "--factor-decay", "", "",                                   \
    "running-average decay alpha of the factors")                                                                   \
  X(Value, int64_t, accumulation_steps, 1, at_least(1), "", "", "",                                                  \
    "forward/backward passes (micro-batches) per optimizer step")                                                   \
  X(Value, int64_t, start_preconditioning_step, 0, at_least(0), "--start-preconditioning-step", "", "",              \
    "the first K-FAC step that preconditions: the steps before it only build the factors (on factor steps) and "     \
    "leave every gradient plain (the base optimizer's own step); the first second-order update runs at it, and "     \
    "strategy auto chooses then (Distributed Shampoo's start_preconditioning_step)")                                 \
  X(Value, ComputeMethod, compute_method, ComputeMethod::kEigen, any_value(), "--compute-method", "", "",            \
    "eigen: eigendecompositions of A and G; inverse: explicit damped inverses")                                     \
  X(Value, bool, compute_eigenvalue_outer_product, true, any_value(), "--compute-eigenvalue-outer-product", "", "",  \
    "eigen: 1 / (d_G d_A^T + damping) once per second-order update (on) or at every step (off)")                    \
  X(Value, int64_t, eigh_interval, 1, at_least(1), "--eigh-interval", "", "",                                        \
    "eigen: every how many second-order updates each eigendecomposition is computed in full; the updates between "   \
    "refresh the previous eigenbasis by one subspace-iteration step (Q R = F Q, the Rayleigh quotients as "         \
    "eigenvalues: no eigensolver; SOAP-style, docs/MATH.md section 2.6), a fast mode whose error is in "             \
    "docs/PERFORMANCE.md; 1: always in full (exact)")                                                               \
  X(Value, int64_t, second_order_concurrency, 1, at_least(0), "--second-order-concurrency", "", "",                  \
    "how many layers' second-order updates (eigendecompositions or inverses) run at once: 1 (the default) one at a " \
    "time; 0 as many as the intra-op threads (torch.get_num_threads()); on a CPU each on one thread (results differ " \
    "from one at a time by rounding; docs/PERFORMANCE.md: 1.06-1.08x on a BERT-shaped stack's second-order phase on " \
    "2 cores), on CUDA each from a host thread of its own on a stream of its own (not yet measured in the step)")     \
  X(Value, int64_t, second_order_lag, 0, at_least(0), "--second-order-lag", "", "",                                \
    "steps between starting a second-order update and installing it: 0 (the default, exact) installs it at the "     \
    "step that computes it; k > 0, a fast mode, computes it beside the next k steps (a thread, on CUDA a side "      \
    "stream), which precondition with the state before it, and installs it at the k-th (sooner at the next "        \
    "inverse step); the first update runs at once (docs/MATH.md section 2.8, its error in docs/PERFORMANCE.md)")     \
  X(Value, bool, stack_layers, true, any_value(), "--stack-layers", "", "",                                          \
    "precondition the layers of one shape together: their eigenbases (or inverses) and denominators held as slices "  \
    "of one stacked tensor per shape, four batched products per group of layers in place of four per layer (exact: "  \
    "equal to one at a time to rounding; docs/MATH.md section 2.9); off, or with eigen_adam or "                    \
    "compute_eigenvalue_outer_product off: layer by layer")                                                            \
  X(Value, int64_t, pad_widths, 8, at_least(1), "--pad-widths", "", "",                                                \
    "stack_layers: each group's widths (a and g) held padded up to a multiple of this, the eigenbases (or inverses) "  \
    "with the identity in the pad, the gradients with zeros, so that the batched products run on aligned widths "      \
    "(exact: equal to unpadded to rounding; docs/MATH.md section 2.9; on a 2-core CPU 0.91-0.98x the preconditioning " \
    "phase of a BERT-shaped stack, docs/PERFORMANCE.md), for the pads' bytes (memory_usage()['stack_padding']); "      \
    "1: unpadded")                                                                                                     \
  X(Value, bool, eigen_adam, false, any_value(), "", "", "",                                             \
    "eigen: Adam in the K-FAC eigenbasis: each layer's step is Q_G [m-hat / (sqrt(v-hat) + eps)] Q_A^T, Adam's "     \
    "moments of Q_G^T grad Q_A kept per layer (docs/MATH.md section 8; kl_clip 0; apply it with plain SGD at "       \
    "Adam's lr: dkfac.optim.KFAC does)")                                                                             \
  X(Value, double, adam_beta1, 0.9, (OptionRange{0, 1, false, true}), "", "", "",                        \
    "eigen_adam: decay of the first moment")                                                                        \
  X(Value, double, adam_beta2, 0.999, (OptionRange{0, 1, false, true}), "", "", "",                      \
    "eigen_adam: decay of the second moment")                                                                       \
  X(Value, double, adam_eps, 1e-8, greater_than(0), "", "", "",                                            \
    "eigen_adam: added to sqrt(v-hat)")                                                                             \
  X(Value, std::optional<c10::ScalarType>, factor_dtype, std::nullopt, any_value(), "--factor-dtype", "", "",        \
    "storage dtype of the factors (default: the activations')")                                                     \
  X(Value, std::optional<c10::ScalarType>, inv_dtype, std::nullopt, any_value(), "--inv-dtype", "", "float32",       \
    "storage dtype of eigendecompositions/inverses and of preconditioning (default: the factors'); decompositions "  \
    "run in float64 when the factors or this are float64, else float32")                                            \
  X(Value, PreconditionDtype, precondition_dtype, PreconditionDtype::kFloat32, any_value(), "--precondition-dtype",   \
    "", "", "float32: preconditioning products in IEEE float32 (exact); tf32: in TF32 on CUDA (a fast mode: inputs " \
    "rounded to 10 mantissa bits, its error in docs/PERFORMANCE.md; no effect on a CPU); bfloat16 products: "         \
    "inv_dtype bfloat16")                                                                                          \
  X(Value, bool, cuda_graphs, false, any_value(), "--cuda-graphs", "", "",                                          \
    "on CUDA: a step that updates neither factors nor second-order state and moves nothing between ranks replays "  \
    "one captured CUDA graph of its preconditioning, NaN guard, KL clipping and gradient writes, in place of a few "   \
    "kernel launches per layer: exact (the same kernels), captured at the second such step in a row whose "          \
    "gradients and state are where the first's were, replayed while they stay there; the graph holds the memory of " \
    "what the step makes and frees; off by default until measured on a GPU; a CPU, eigen_adam, "                       \
    "compute_eigenvalue_outer_product off, a gradient broadcast or owner placement run every step eagerly "            \
    "(cuda_graph_report says why)")                                                                                   \
  X(Value, bool, pi_damping, false, any_value(), "--pi-damping", "", "",                                             \
    "inverse method: split damping between A and G with the pi heuristic (DP-KFAC)")                                \
  X(Value, std::vector<std::string>, skip_layers, {}, any_value(), "--skip-layers", "", "",                          \
    "regular expressions (ECMAScript, searched) matched against each layer's name and class; matching layers keep "  \
    "their plain gradient; a pattern that matches no layer is warned about")                                        \
  X(Value, std::vector<std::string>, shared_input_layers, {}, any_value(), "--shared-input-layers", "", "",          \
    "regular expressions (ECMAScript, searched in layer names), each with one capture group: the layers a pattern "  \
    "matches whose names agree outside the captured text read one input (BERT's query, key and value: "              \
    "'(query|key|value)$') and share one A factor and its decomposition, exactly; every factor step checks that "    \
    "they were given the same tensor (docs/MATH.md section 2.7)")                                                    \
  X(Value, int64_t, large_factor_dim, 4096, at_least(0), "--large-factor-dim", "", "",                               \
    "warn at construction about factors wider than this, with their memory and update cost (0: never)")            \
  X(Value, int64_t, diagonal_factor_dim, 8192, at_least(0), "--diagonal-factor-dim", "", "",                           \
    "keep a factor wider than this as its diagonal (d values, not d^2: vocabulary-sized LM heads; an Embedding's A " \
    "is always diagonal); 0: every factor dense")                                                                   \
  X(Value, KfacApprox, kfac_approx, KfacApprox::kExpand, any_value(), "--kfac-approx", "", "",                        \
    "a Linear over a sequence ([B, ..., in]): expand (every position a row of the factors) or reduce (per sample, "  \
    "inputs averaged and output gradients summed over the sequence: T times fewer rows); Conv2d and Embedding "      \
    "always expand")                                                                                                \
  X(Value, UnusedLayerPolicy, unused_layer_policy, UnusedLayerPolicy::kError, any_value(), "--unused-layer-policy",   \
    "", "", "a registered layer that did not run before step(): error, or skip (keep its plain gradient, warn once; "   \
    "on several ranks, a layer that any rank skipped keeps its plain gradient on every rank that step, and factors are " \
    "reduced in step(), not from the hooks; not with strategy spd)")                                                    \
  X(Value, double, grad_worker_fraction, 1.0,                                                                        \
    (OptionRange{0, 1, false, false, {{"comm-opt", 1.0}, {"hybrid-opt", 0.5}, {"mem-opt", 0.0}}}),                  \
    "--grad-worker-fraction", "", "",                                                                               \
    "KAISA: fraction f of ranks that precondition each layer, W = max(1, round(P f)); 1 comm-opt, 0.5 hybrid-opt, "  \
    "0 = 1/P mem-opt")                                                                                              \
  X(Value, bool, symmetric_comm, false, any_value(), "--symmetric-comm", "symmetry_aware", "",                       \
    "send symmetric matrices (factors, inverses) as upper triangles")                                               \
  X(Value, assign::Balance, balance, assign::Balance::kCompute, any_value(), "--balance", "assignment_strategy", "", \
    "place second-order work by compute (d^3) or memory (d^2)")                                                     \
  X(Value, bool, colocate_factors, true, any_value(), "--colocate-factors", "", "",                                  \
    "decompose A and G of a layer on the same rank")                                                                \
  X(Value, bool, update_factors_in_hook, true, any_value(), "--update-factors-in-hook", "", "",                      \
    "KAISA: start each factor's allreduce from the capture hooks, bucketed, overlapped with forward/backward "      \
    "(off: all in step(); same results)")                                                                           \
  X(Value, bool, fold_in_hooks, true, any_value(), "--fold-in-hooks", "", "",                                        \
    "where no factor is reduced across ranks (one process, DP-KFAC): fold each layer's batches into its running "    \
    "factors in its backward hook, once its accumulation_steps passes are in, so that no batch waits for step() "    \
    "(exact: the same sums and fold; docs/MATH.md section 1.8); a shared-input group folds as one, in its last "     \
    "member's hook. At step() instead: a layer's first factor update, a layer whose passes at a factor update "      \
    "did not match accumulation_steps (a group: any member's), a grad scaler, unused_layer_policy skip on "          \
    "several ranks. A step discarded or failed after its backward keeps what the hooks folded (off: nothing); "      \
    "dkfac train --on-nan-loss skip turns it off")                                                                   \
  X(Value, double, allreduce_bucket_cap_mb, 25.0, at_least(0), "--allreduce-bucket-cap-mb", "", "",                  \
    "KAISA in hooks: largest factor bucket in MiB (0: each factor alone)")                                          \
  X(Value, StrategyOption, strategy, Strategy::kKaisa, any_value(), "--strategy", "", "",                                  \
    "the published system that places and moves K-FAC work: kaisa (with grad_worker_fraction), spd (SPD-KFAC), "   \
    "dp (DP-KFAC), or auto (the fastest on this machine's measured rates, chosen at the first step)")                \
  X(Value, int64_t, memory_budget, 0, at_least(0), "--kfac-memory-budget", "", "",                                   \
    "strategy auto: most bytes of K-FAC state per rank a candidate may need (0: no limit)")                         \
  X(Value, ShardedPlacement, sharded_placement, ShardedPlacement::kReplicated, any_value(), "--sharded-placement",   \
    "", "", "layers sharded by FSDP2/HSDP: replicated (every rank gathers each gradient and runs the strategy as "   \
    "under DDP) or owner (one owner per layer and replica holds its K-FAC state, gathers the gradient's shards and " \
    "scatters the preconditioned rows: K-FAC memory about 1/P; strategy kaisa with one grad worker per replica, "  \
    "or dp)")                                                                                                       \
  X(Value, int64_t, auto_recheck_steps, 10, at_least(0), "--auto-recheck-steps", "", "",                            \
    "strategy auto: steps profiled after the choice; where a K-FAC phase measured over them is more than 20% off "  \
    "its prediction, the rates are scaled by the measurement and the strategy chosen again (0: choose once)")

// SPD-KFAC's own options (Options::spd), declared as above; their names in option_table() start with "spd_".
#define DKFAC_SPD_OPTIONS(X)                                                                                         \
  X(Value, int64_t, redundant_dim, -1, (OptionRange{-1, 1e308, false, false, {{"none", -1.0}}}),                   \
    "--spd-redundant-dim", "", "",                                                                                  \
    "SPD-KFAC: factors of dimension <= this are decomposed on every rank instead of broadcast (-1: chosen from the "  \
    "measured decomposition and broadcast times)")                                                                  \
  X(Value, int64_t, profile_steps, 3, at_least(1), "--spd-profile-steps", "", "",                                    \
    "SPD-KFAC: factor steps profiled (each factor sent alone) before the fusion grouping is chosen")                \
  X(Value, std::vector<int64_t>, fusion, {}, at_least(1), "--spd-fusion", "", "",                                    \
    "SPD-KFAC: the fusion grouping as sizes of consecutive groups in ready order (A in layer order, then G in "       \
    "reverse), summing to 2 x layers (empty: chosen by the alpha-beta model after the profiled steps)")

#define DKFAC_DECLARE_Schedule(Self, T, name, default_value)          \
 public:                                                             \
  Self& name(T value) & {                                            \
    name##_ = Schedule<T>(value);                                    \
    return *this;                                                    \
  }                                                                  \
  Self&& name(T value) && { return std::move(this->name(value)); }   \
  Self& name(std::function<T(int64_t)> fn) & {                       \
    name##_ = Schedule<T>(std::move(fn));                            \
    return *this;                                                    \
  }                                                                  \
  Self&& name(std::function<T(int64_t)> fn) && {                     \
    return std::move(this->name(std::move(fn)));                     \
  }                                                                  \
  Self& name(Schedule<T> schedule) & {                               \
    name##_ = std::move(schedule);                                   \
    return *this;                                                    \
  }                                                                  \
  const Schedule<T>& name() const { return name##_; }                \
                                                                     \
 private:                                                            \
  Schedule<T> name##_{default_value};

#define DKFAC_DECLARE_Value(Self, T, name, default_value)                        \
 public:                                                                        \
  Self& name(T value) & {                                                       \
    name##_ = std::move(value);                                                 \
    return *this;                                                               \
  }                                                                             \
  Self&& name(T value) && { return std::move(this->name(std::move(value))); }   \
  const T& name() const { return name##_; }                                     \
                                                                                \
 private:                                                                       \
  T name##_ = default_value;

#define DKFAC_DECLARE_OPTIONS(kind, T, name, default_value, ...) DKFAC_DECLARE_##kind(Options, T, name, default_value)
#define DKFAC_DECLARE_SPD_OPTIONS(kind, T, name, default_value, ...) \
  DKFAC_DECLARE_##kind(SpdOptions, T, name, default_value)

/// SPD-KFAC's own choices (Options::spd), as a value with chained setters:
/// `dkfac::SpdOptions().redundant_dim(64).fusion({4, 2})`. Ignored by the other strategies.
class SpdOptions {
  DKFAC_SPD_OPTIONS(DKFAC_DECLARE_SPD_OPTIONS)

 public:
  /// Checks every value; throws c10::Error naming the offending one.
  void validate() const;
};

/// Hyper-parameters of the K-FAC preconditioner, as a value with chained setters:
/// `dkfac::Options().lr(0.1).damping(3e-3).factor_update_steps(10).inv_update_steps(100)`, one per entry of
/// DKFAC_OPTIONS above (which documents each), plus `spd(SpdOptions)` and `grad_scaler`. Schedules (`lr`,
/// `damping`, `kl_clip`, `factor_decay`, the two intervals) accept a value or a
/// `std::function<T(int64_t step)>`. Everything is checked once by `validate()`, which the Preconditioner calls
/// when it is built; schedule values are checked each time they are read. Options can also be set by name
/// (`set`), as the Python front end and `dkfac train` do, and listed (`option_table()`).
class Options {
  DKFAC_OPTIONS(DKFAC_DECLARE_OPTIONS)

 public:
  /// SPD-KFAC's redundancy threshold, profiling and fusion.
  Options& spd(SpdOptions value) & {
    spd_ = std::move(value);
    return *this;
  }
  Options&& spd(SpdOptions value) && { return std::move(this->spd(std::move(value))); }
  const SpdOptions& spd() const { return spd_; }

  /// Current loss scale of a mixed-precision gradient scaler, read at each G capture: G is built from
  /// grad_output / scale. Empty (default): no scaling. A function returning a double is accepted too
  /// (checked to be positive and finite at each read; reading it may wait for the device where a tensor
  /// scale would not).
  Options& grad_scaler(GradScale scale) & {
    grad_scaler_ = std::move(scale);
    return *this;
  }
  Options&& grad_scaler(GradScale scale) && { return std::move(this->grad_scaler(std::move(scale))); }
  Options& grad_scaler(std::function<double()> scale) &;
  Options&& grad_scaler(std::function<double()> scale) && { return std::move(this->grad_scaler(std::move(scale))); }
  const GradScale& grad_scaler() const { return grad_scaler_; }

  /// Sets the option `name` (an option_table() name, or its kfac_pytorch keyword) from `value`, checked against
  /// its declaration (type, range, choices); throws c10::Error naming the option and the accepted values. A
  /// schedule takes a number or a function; a choice takes its name; a dtype its torch name ("float32") or none.
  /// `shown_as` names the option in that error instead (`dkfac train`: the flag as typed).
  Options& set(const std::string& name, const OptionValue& value, const std::string& shown_as = "");
  /// The value of option `name` (a schedule: its value at step 0, or "schedule" text when it is a function).
  OptionValue get(const std::string& name) const;
  /// Every option as "name=value", in declaration order, comma-separated (for logs, repr and metrics).
  std::string describe() const;

  /// Checks every constant option; throws c10::Error with the offending value.
  void validate() const;

  /// Reads and checks each schedule at `step`.
  double lr_at(int64_t step) const;
  double damping_at(int64_t step) const;
  double kl_clip_at(int64_t step) const;
  double factor_decay_at(int64_t step) const;
  int64_t factor_update_steps_at(int64_t step) const;
  int64_t inv_update_steps_at(int64_t step) const;

 private:
  SpdOptions spd_;
  GradScale grad_scaler_;
};

/// What an option holds, as front ends convert to and from it.
enum class OptionType { kBool, kInt, kDouble, kChoice, kDtype, kStrings, kInts };

/// One option's declaration (DKFAC_OPTIONS), as data.
struct OptionInfo {
  std::string name;      ///< "damping"; SPD-KFAC's: "spd_redundant_dim"
  OptionType type;
  bool schedule;         ///< accepts a function of the step
  std::string default_text;   ///< dkfac's default as text ("0.001", "eigen", "" for none)
  std::string kfac_pytorch_default;  ///< kfac_pytorch's default where it differs, else ""
  OptionRange range;     ///< numeric options (and the elements of kInts)
  std::vector<std::string> choices;  ///< kChoice and kDtype: the names accepted
  std::string flag;      ///< `dkfac train`'s flag, or "" (set by the training loop)
  std::string alias;     ///< kfac_pytorch's keyword where it differs, else ""
  std::string doc;
};

/// Every option, in declaration order: DKFAC_OPTIONS, then DKFAC_SPD_OPTIONS.
const std::vector<OptionInfo>& option_table();
/// The option called `name` (or whose kfac_pytorch alias is `name`); throws c10::Error listing the names.
const OptionInfo& option_info(const std::string& name);
/// `value` as option `info` prints it ("0.001", "eigen", "[a, b]", "none", "true").
std::string option_text(const OptionInfo& info, const OptionValue& value);

#undef DKFAC_DECLARE_OPTIONS
#undef DKFAC_DECLARE_SPD_OPTIONS
#undef DKFAC_DECLARE_Schedule
#undef DKFAC_DECLARE_Value

/// Readable name of a compute method ("eigen", "inverse").
const char* to_string(ComputeMethod method);
/// The dtype second-order work is computed in for factors of `factor_dtype` stored as `inv_dtype`.
c10::ScalarType decomposition_dtype(c10::ScalarType factor_dtype, c10::ScalarType inv_dtype);

/// The torch name of a storage dtype factors and second-order state may have ("float32", "float64", "bfloat16",
/// "float16"; another dtype: c10's name), and the dtype of such a name (nullopt for any other name).
std::string storage_dtype_name(c10::ScalarType dtype);
std::optional<c10::ScalarType> storage_dtype_named(const std::string& name);

/// Readable name of a strategy ("kaisa", "spd", "dp"), and of the option ("auto" for kStrategyAuto).
const char* to_string(Strategy strategy);
const char* to_string(const StrategyOption& strategy);
const char* to_string(ShardedPlacement placement);
/// Readable name of a placement balance ("compute", "memory") and of an unused-layer policy ("error", "skip").
const char* to_string(assign::Balance balance);
const char* to_string(UnusedLayerPolicy policy);
/// "expand" or "reduce".
const char* to_string(KfacApprox approx);
/// The published system's name ("KAISA", "SPD-KFAC", "DP-KFAC").
const char* system_name(Strategy strategy);

}  // namespace dkfac
