#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "dkfac/device.h"
#include "dkfac/layers/kfac_layer.h"
#include "dkfac/layers/layer_group.h"
#include "dkfac/options.h"
#include "dkfac/phase.h"
#include "dkfac/phase_clock.h"
#include "dkfac/strategy/auto.h"
#include "dkfac/strategy/rates.h"
#include "dkfac/strategy/step_executor.h"
#include "dkfac/strategy/time_model.h"

namespace dkfac {

namespace nn {
class KfacModule;
}  // namespace nn

/// Counters of what happened to layers, for logs and tests.
struct LayerEvents {
  int64_t fallbacks = 0;           ///< layer-steps that kept their plain gradient because of NaN/Inf or failure
  int64_t skipped_unused = 0;      ///< layer-steps skipped because the layer did not run
  int64_t second_order_failures = 0;  ///< decompositions/inverses that failed (previous state kept)
};

/// What Options::cuda_graphs did so far (Preconditioner::cuda_graph_report).
struct CudaGraphReport {
  int64_t captures = 0;     ///< graphs captured (each replayed at once, by the step that captured it)
  int64_t replays = 0;      ///< steps whose preconditioning, guard and writes were one graph's replay
  int64_t eager_steps = 0;  ///< preconditioning steps without one, the option on
  std::string off;          ///< why no graph is captured for good ("" while they may be): no CUDA, a failed capture
  std::string last_eager;   ///< why the last step without one had none
};

/// What Preconditioner::load() restored, for a training loop's resume line.
struct StateRestore {
  int64_t format_version = 0;     ///< the archive's (2: every layer's whole state, world-size independent)
  int world_size = 0;             ///< the world size that wrote it
  bool same_plan = false;         ///< written under this job's step plan: every rank gets back exactly what it held
  int64_t placed_layers = 0;      ///< layers whose second-order state this rank took from the archive
  int64_t recomputed_layers = 0;  ///< layers whose second-order state was recomputed from the factors
  /// In words: "K-FAC state of a 2-rank job re-placed for 1 rank (factors and second-order state of 4 layers)".
  std::string describe(int world_size_now) const;
};

/// A saved K-FAC state as a front end read it, whatever its layout (the C++ archive, Python's state dict, a
/// torch.distributed.checkpoint load): Preconditioner::restore decides what becomes of it, by one set of rules
/// for every front end.
struct SavedState {
  int64_t steps = 0;
  /// Per layer, in registration order: the entries found, by layer_state_entries()' keys. A rank may be handed
  /// every layer's whole state (a gathered state, the C++ archive) or only what one rank held.
  std::vector<std::map<std::string, torch::Tensor>> layers;
  /// The compute method its second-order entries were computed with; nullopt: not known (kfac_pytorch's layout),
  /// and then they are not restored.
  std::optional<ComputeMethod> method;
  /// For a state that may hold only one rank's share (Python's own per-rank state_dict): what it is and how to
  /// resume instead, said when it lacks a factor this rank keeps after the first step ("it is rank 1's own
  /// state of a 2-rank job, ...; save state_dict(gathered=True)"). Empty: not checked (a state of every layer,
  /// where a missing factor is a layer that had none).
  std::string per_rank_writer;
  /// Recompute the second-order state from the factors where it is not restored exactly (collective).
  bool recompute = true;
  /// Per layer (or empty): keys its writer wrote as blanks, not held (Python's state_dict keeps every key of a
  /// layer that never built its factors, a frozen or unused one). Neither loaded nor missing.
  std::vector<std::set<std::string>> unheld;
};

/// How the core's messages (warnings and errors about a layer or an option) name layers and options. The
/// defaults are the C++ API's; a front end whose users know other names passes its own (the Python package:
/// each module's torch.nn class and KFACPreconditioner's keyword arguments).
struct MessageNames {
  /// The class shown after each layer's name, one per layer in registration order (e.g. torch.nn's
  /// "NonDynamicallyQuantizableLinear"); empty: the layer kinds, "Linear" or "Conv2d".
  std::vector<std::string> layer_classes;
  /// An option set to a value reads `option_prefix + name + option_separator + value`:
  /// "Options::large_factor_dim 4096" by default, "large_factor_dim=4096" for keyword arguments.
  std::string option_prefix = "Options::";
  std::string option_separator = " ";
  /// How a bool option's values read: "true" and "false" in C++, "True" and "False" in Python.
  std::array<std::string, 2> bool_values = {"false", "true"};

  /// Layer `index` as messages name it: "'fc1' (Linear)".
  std::string layer(const KfacLayer& layer, size_t index) const;
  /// Option `name` with `value`: "Options::large_factor_dim 4096".
  std::string option(const std::string& name, const std::string& value) const;
  /// Bool option `name` with `value`, spelled by bool_values: "Options::fold_in_hooks false", "fold_in_hooks=False".
  std::string option_flag(const std::string& name, bool value) const {
    return option(name, bool_values[value ? 1 : 0]);
  }
};

/// A front end's collectives around the core's step, for layers whose gradients it holds in parts: Python's
/// FSDP2 and HSDP layers, where the core binds full-shaped stand-ins and one distributor per parallelism
/// (python/dkfac/base_preconditioner.py, `_distributor`) fills them before the step and returns their rows
/// after it. Preconditioner::step runs `gather` first, before it reads any gradient, and `scatter` last, after it
/// wrote them, also when the step failed after the gather (every rank keeps its collectives in order); a scatter
/// that fails ends the step (counted) before its error goes on. Their time is communication in the phase clock
/// (not in strategy auto's profile: the time model prices K-FAC's own collectives), and the calls and bytes they
/// return count under
/// comm::Purpose::kGradients in the Communicator's traffic, as strategy::predict counts a sharded layer's rows.
///
/// `sum_over_model`: where this rank holds one part of a replica's layers (a pipeline stage, a tensor-parallel
/// slice; the front end's `model_parallel_group`), sums a 0-dim float64 tensor over the ranks holding the other
/// parts, in place. The KL clip's sum(V * grad) is the whole model's then, as in one process: every part scales by
/// the same nu. `counted_elsewhere` (empty: none) marks the layers of which another rank of that sum adds the term:
/// a layer tensor parallelism leaves whole is held by every tensor-parallel rank, and one of them counts it.
struct Distributor {
  struct Moved {
    int64_t calls = 0;  ///< collectives run
    int64_t bytes = 0;  ///< gradient bytes this rank sent or received (a chunk's padding not counted)
  };
  std::function<Moved()> gather;
  std::function<Moved()> scatter;
  std::function<void(torch::Tensor&)> sum_over_model;
  std::vector<bool> counted_elsewhere;
};

/// K-FAC preconditioner for a LibTorch model (single process).
///
/// Finds every dkfac::nn::Linear / dkfac::nn::Conv2d in `model` whose parameters all require grad
/// (minus those matching Options::skip_layers) and, at each `step()`, replaces their gradients by
/// the preconditioned, KL-clipped gradients of docs/MATH.md sections 1-4. Call it after
/// `loss.backward()` (after all accumulation micro-batches) and before the optimizer's `step()`.
/// Other parameters keep their plain gradients.
///
/// Activations and output gradients are captured only on factor-update steps, only in training
/// mode with grad mode on; evaluation under torch::NoGradGuard captures nothing.
class Preconditioner {
 public:
  /// Registers the model's K-FAC layers and validates `options` (throws c10::Error naming the bad value).
  /// With a `communicator` (every rank constructs its preconditioner with the same model and options),
  /// work is placed and factors move as Options::strategy says (KAISA with grad_worker_fraction,
  /// SPD-KFAC or DP-KFAC); gradients must already be averaged over ranks when step() is called. The ranks
  /// check that at construction, before any other collective: where their layers or options differ, every
  /// rank throws, naming the first difference (comm/agreement.h).
  explicit Preconditioner(std::shared_ptr<torch::nn::Module> model, Options options = Options(),
                          std::shared_ptr<comm::Communicator> communicator = nullptr);
  /// Preconditions `layers` as registered by a front end (the Python package binds torch.nn modules
  /// this way), in this order; Options::skip_layers is not applied (the front end chose the layers).
  /// Their captures must be fed by the front end's hooks. Warnings and errors name layers and options
  /// as `names` says (its layer_classes: empty or one per layer).
  Preconditioner(std::vector<LayerBinding> layers, Options options,
                 std::shared_ptr<comm::Communicator> communicator = nullptr, MessageNames names = MessageNames());
  ~Preconditioner();
  Preconditioner(const Preconditioner&) = delete;
  Preconditioner& operator=(const Preconditioner&) = delete;

  /// One K-FAC step: update factors (factor steps) -> second order (inverse steps) -> precondition
  /// -> KL clip -> write gradients. Then arms capture for the next step. With several ranks it first checks
  /// that every rank's schedules give the same values at this step (check_schedules_agree). A step() that
  /// finds every gradient it wrote last time unchanged (no backward pass, accumulation or gradient allreduce
  /// since) is refused: it would precondition the same gradients twice. `distributor`: a front end's
  /// collectives around the step (Distributor).
  void step(const Distributor& distributor = {});

  /// Drops the current step without touching gradients or the step counter, for a training loop that skips a
  /// step (e.g. a non-finite loss). What forward/backward captured and has not been folded is discarded; with
  /// Options::fold_in_hooks (on by default) the layers' hooks may have folded the batch into the factors already,
  /// and that stays (a finite batch: a non-finite one is kept out by the fold's guard). A loop that discards finite
  /// batches (loss spikes) and wants the factors untouched turns fold_in_hooks off (`dkfac train --on-nan-loss
  /// skip` does). On a factor step of a distributed preconditioner the factor collectives still run, so every rank
  /// must call it for the same step. Capture stays armed for the step that replaces it.
  void discard_step();

  /// Recomputes the second-order state from the current factors now, outside step() (collective: every
  /// rank calls it), e.g. after factors were loaded from a checkpoint that holds factors only.
  void update_second_order();

  /// Drops whatever the hooks captured since the last factor update (with Options::fold_in_hooks, what they folded
  /// into the factors stays there).
  void reset_batch();
  /// Layers whose backward hooks folded a batch into their factors since the last step() (Options::fold_in_hooks):
  /// a state saved now holds that batch, though the step count does not include it.
  int64_t layers_folded_since_step() const;

  /// Reads the factor schedule again for the coming step and arms the captures by it, where nothing was captured
  /// since the end of the last step() armed them (else changes nothing, and returns false). The end of each step()
  /// arms them by Options::factor_update_steps at the next step, and that decision stands for the step (factor_step
  /// _as_armed); a schedule changed after it (kfac_pytorch's LambdaParamScheduler.step() after step(), an
  /// assignment of preconditioner._factor_update_steps) takes effect through this call, which the Python front end
  /// makes for both.
  bool rearm_capture();

  /// Options::eigen_adam's constants from the next step on, checked as at construction (adam_beta1, adam_beta2 in
  /// [0, 1), adam_eps > 0): the Python optimizer follows its base AdamW's betas and eps with it (a scheduler that
  /// cycles the momentum, OneCycleLR's cycle_momentum). The moments stay; their next updates use these.
  void set_adam_constants(double beta1, double beta2, double eps);

  /// Restores the step count and each layer's KfacLayer::state() (a missing second-order state is
  /// left undefined), keeping of each the part this rank's plan gives it: factors where it builds them,
  /// second-order state where it preconditions or decomposes the layer. `states` may be this rank's own
  /// (layer_states()) or every layer's whole state (gathered_layer_states() of a job of any world size).
  /// Checks every layer first and changes nothing on error.
  void load_layer_states(int64_t steps, const std::vector<std::map<std::string, torch::Tensor>>& states);

  /// The one restore of a saved K-FAC state (every front end's load calls it; docs/RELIABILITY.md):
  ///  - first, in a distributed job, each part a rank keeps but was not handed is sent by the lowest rank that was
  ///    (the ranks' own states of one save, loaded under another plan); ranks handed states of different step
  ///    counts are refused;
  ///  - refused, naming the layer, where `saved.per_rank_writer` is set, `saved.steps` > 0 and a factor this
  ///    rank keeps is missing still (no rank was handed it: another rank's DP-KFAC share alone); refused too where
  ///    any layer's entries do not fit it (shape, NaN, another model: load_layer_states' checks);
  ///  - exact where every rank finds, of the compute method this job runs, the whole second-order state of
  ///    each layer it holds that has factors (state_template(); a layer that never built factors has none to
  ///    restore): then factors, second-order state and Adam's moments are taken as saved;
  ///  - otherwise the factors and Adam's moments are taken, and with `saved.recompute` the second-order state is
  ///    recomputed from the factors (update_second_order).
  /// Every rank takes the same branch: each rank checks what it would load, then one tiny allreduce agrees on
  /// the exactness and one on the acceptance (collective in a distributed job), and nothing changes unless
  /// every rank accepts. Each rank keeps what its plan gives it (load_layer_states).
  StateRestore restore(SavedState saved);

  /// K-FAC steps taken so far (0 before the first step()).
  int64_t steps() const { return steps_; }
  /// True if step() number `step` updates factors / second-order state.
  bool is_factor_step(int64_t step) const;
  bool is_inverse_step(int64_t step) const;
  /// An inverse step that decomposes in full rather than refresh the eigenbases (Options::eigh_interval k): the
  /// first, and those at multiples of k inverse intervals. A function of the step, so a resumed run is the same.
  bool is_full_decomposition_step(int64_t step) const;

  /// The options in force. With kStrategyAuto: auto until the first step() chose, then the choice's
  /// (StrategyChoice::apply); in one process kaisa from the start (every strategy is the same plan there).
  const Options& options() const { return options_; }
  /// The job's step plan: who builds, reduces, decomposes and preconditions what (one process: everything here).
  /// With kStrategyAuto, until the first step() chose: a provisional KAISA plan (every rank builds every
  /// factor, all collectives in step()), under which save() and load() work as for any plan. A copy: strategy
  /// auto replaces the plan at its first step (and may at its re-check), so no reference into it is handed out.
  strategy::StepPlan plan() const { return executor_->plan(); }
  /// A change of the plan made while training, in words, once: strategy auto's choice (its table of
  /// candidates and reason), SPD-KFAC's fusion grouping chosen after its profiled steps; "" when there is
  /// none to report. For a training loop's log.
  std::string take_plan_change();
  /// Strategy auto's choice in words (StrategyChoice::describe), "" before it is made or without auto; after
  /// the re-check (Options::auto_recheck_steps), followed by what it measured and decided.
  const std::string& strategy_choice() const { return auto_ ? auto_->description() : strategy_choice_; }
  /// Strategy auto: the rates to choose from instead of measuring them at the first step (strategy::Rates,
  /// e.g. read from `dkfac plan --measure-rates`'s JSON, or fixed by a test). Every rank must pass the same.
  void use_rates(strategy::Rates rates);
  /// Strategy auto where this rank's group holds one part of a model split over other ranks too (tensor-parallel
  /// slices, pipeline stages: the ranks step()'s Distributor::sum_over_model sums over), whose parts must run one
  /// strategy: every choice is the part whose rank is the `leader` (one rank of those) chose, agreed through that
  /// sum. The choice is then made at a step(), never at discard_step() (which has no such sum: it runs under the
  /// provisional plan), and a step() without the sum is refused until it is made.
  void agree_strategy_over_model(bool leader);
  /// What executes the plan (its collectives are no-ops in one process). Shared: one held across strategy auto's
  /// replacement of the executor stays valid, describing the plan it executed.
  std::shared_ptr<const strategy::StepExecutor> executor() const { return executor_; }
  /// The ranks it was built over (nullptr in one process).
  const std::shared_ptr<comm::Communicator>& communicator() const { return communicator_; }
  /// The preconditioned layers, in model order.
  const std::vector<KfacLayer>& layers() const { return layers_; }
  /// Layer `index` now preconditions `weight` and `bias` (KfacLayer::rebind): a front end calls it when the
  /// module's parameters were replaced since registration. The Python package checks at every step(); a
  /// Preconditioner built from a model does so itself (follow_parameters).
  void rebind_layer(size_t index, torch::Tensor weight, torch::Tensor bias);
  std::vector<KfacLayer>& layers() { return layers_; }

  /// Phase times of the last step and summed over all steps. On a CUDA device, reading them waits until
  /// the device has finished the step's work (step() itself does not).
  PhaseTimes last_step_times() const;
  PhaseTimes total_times() const;
  /// The device the K-FAC state lives on (the first layer's weight's).
  c10::Device device() const { return device_; }
  /// Whether step() reads its NaN guard and KL-clip sums on the host before it writes the gradients (true: a
  /// fallback's warning comes from that step(); the default on a CPU, where reading is free), or writes them on
  /// the device without waiting, each layer's where(usable, V * nu, grad), and reads them when first needed: at
  /// the next step(), events() or last_kl_scale() (false: the default on a GPU, where reading would wait for the
  /// device to finish the step; a later step() reads what the device has finished, without waiting). The
  /// gradients are the same either way.
  void read_guard_at_once(bool at_once) { read_guard_at_once_ = at_once; }
  /// Fallbacks, skipped layers and failed decompositions so far (on a GPU, reading them waits for the last step's
  /// guard).
  const LayerEvents& events() {
    settle_pending_guards(/*wait=*/true);
    return events_;
  }
  /// KL-clip scale nu applied at the last step (1 when clipping is off; on a GPU, reading it waits for that step).
  double last_kl_scale() {
    settle_pending_guards(/*wait=*/true);
    return last_kl_scale_;
  }
  /// Options::cuda_graphs: captures, replays and the steps without one, with why.
  const CudaGraphReport& cuda_graph_report() const { return graph_report_; }
  /// Bytes of K-FAC state (factors and second-order state) held now, second_order_in_flight_bytes and
  /// stack_padding_bytes included.
  int64_t memory_bytes() const;
  /// Options::pad_widths: bytes of the stacks of layers of one shape that are their pads, no layer's state
  /// (strategy::predict's RankCost::stack_padding_bytes). 0 unpadded.
  int64_t stack_padding_bytes() const { return groups_.padding_bytes(); }
  /// Options::second_order_lag: bytes the update in flight holds beside the state in use: of each layer it computes,
  /// a second copy of the sides this rank computes, and of the denominator where it computes both (as large as the
  /// ones they replace; counted from its start, while its thread computes them),
  /// the factors it is computed from where a factor update has replaced them since, and the old stacks its copies
  /// keep alive where the groups were planned again meanwhile (Options::stack_layers). 0 with none in flight.
  /// strategy::predict's RankCost::in_flight_bytes is its most in the steady state (without old stacks).
  int64_t second_order_in_flight_bytes() const;

  /// Every layer's whole state (KfacLayer::state(): factors and second-order state), the same on every rank
  /// and independent of the world size: factors from the ranks that build them (DP-KFAC's owners; KAISA and
  /// SPD-KFAC hold the same averaged factors everywhere), second-order state from a rank that holds it.
  /// Collective in a distributed job: every rank calls it. For load_layer_states on any world size.
  std::vector<std::map<std::string, torch::Tensor>> gathered_layer_states() const;

  /// The entries of each layer's state that this rank's plan keeps whole, as uninitialised tensors of the
  /// shape, dtype and device the layer keeps them in: the factors where it builds them, and the whole
  /// second-order state of the compute method where it preconditions the layer. A rank that decomposes a
  /// factor without preconditioning the layer recomputes it at the next inverse step, so none is listed there.
  /// What a reader that fills tensors in place (torch.distributed.checkpoint) asks a checkpoint for.
  /// Rank-local: no collective.
  std::vector<std::map<std::string, torch::Tensor>> state_template() const;

  /// Serialises the step count and every layer's factors and second-order state in a form that does not
  /// depend on the world size (format 2: gathered_layer_states(), with the writer's world size and plan).
  /// Collective in a distributed job: every rank calls it, and every rank's archive holds the whole state.
  /// Options are the caller's to rebuild.
  void save(torch::serialize::OutputArchive& archive) const;
  /// Restores what save() wrote into a preconditioner built on the same model with the same options, on
  /// any world size and strategy, by restore()'s rules: this rank keeps what its plan gives it, the
  /// second-order state saved is exact whatever the plan, and where the archive's compute method is not this
  /// one's it is recomputed from the factors. Collective in a distributed job: every rank loads the same archive.
  /// An archive of another format version (dkfac writes and reads format 2 only), a corrupt or a mismatched
  /// archive is refused naming the problem (nothing changes then).
  StateRestore load(torch::serialize::InputArchive& archive);

 private:
  /// What a layer's gradient becomes this step: preconditioned, or left plain (it did not run, its factors or
  /// gradient were not finite, it has no second-order state yet).
  enum class LayerFate { kPreconditioned, kPlainGradient };


  /// `discarding` (discard_step): a layer that cannot be used keeps its plain gradient quietly, whatever the
  /// policy (the step is dropped: a loss found not finite before its backward pass, say).
  std::vector<LayerFate> check_layers(bool factor_step, bool discarding = false);
  void update_factors(std::vector<LayerFate>& fates);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> take_factor_batches(const std::vector<LayerFate>& fates);
  /// `refresh`: refresh the eigenbases held (Options::eigh_interval) rather than decompose in full. `lag`: with
  /// Options::second_order_lag > 0, after the first update (at start_preconditioning_step), start a job
  /// (start_second_order_job) in place of computing and installing at once.
  void compute_second_order(std::vector<LayerFate>& fates, bool refresh = false, bool lag = true);
  /// The layers with a second-order part to compute on this rank.
  std::vector<size_t> second_order_layers() const;
  /// Options::second_order_lag: an update computed by another thread (on CUDA, a side stream) from copies of the
  /// layers taken when it started, installed `lag` steps later.
  struct SecondOrderJob {
    int64_t started = 0;     ///< the step whose update it is (a load resumes one of a step before the one loaded)
    int64_t install_at = 0;  ///< the step that installs it
    ComputeMethod method = ComputeMethod::kEigen;
    double damping = 0.0;
    std::vector<size_t> layers;      ///< the layers it computes (second_order_layers)
    std::vector<std::pair<bool, bool>> parts;  ///< each one's sides (A, G) this rank computes (second_order_parts)
    std::vector<KfacLayer> sources;  ///< each one's copy at the start: the factors and state it is computed from
    std::vector<std::optional<PendingSecondOrder>> pending;
    std::vector<std::exception_ptr> failed;
    std::optional<device::SideWork> side;
    std::thread worker;
    ~SecondOrderJob();
  };
  /// Installs the job's states (waiting for it where it has not finished) and shares them as the plan says
  /// (collective); `fates`, where given, as compute_second_order leaves them. Inside a second-order Span.
  void install_second_order_job(std::vector<LayerFate>* fates);
  /// Starts the job of step `step`'s update (`refresh`: Options::eigh_interval's), to be installed at step + lag.
  void start_second_order_job(int64_t step, bool refresh);
  /// After a load: the update a saved run had in flight (an inverse step at most lag steps before the loaded step
  /// count), started again from the state loaded, installed at the step the saved run would have installed it.
  void resume_second_order_job();
  /// Which parts (A, G) of `layers` this rank computes; how many layers' decompositions run at once.
  std::vector<std::pair<bool, bool>> second_order_parts(const std::vector<size_t>& layers) const;
  size_t second_order_chunk() const;
  /// States installed by install_computed, not yet checked on the host.
  struct Installed {
    std::vector<size_t> layers;                   // the layers installed
    std::vector<torch::Tensor> checks;            // each one's check (0-dim bool, on the device)
    std::map<size_t, SecondOrderState> fallback;  // layers installed unchecked, with the state they had
  };
  /// Installs layer `index`'s computed state (KfacLayer::install_second_order), or reports its failure
  /// (`failed`: keeping_previous_state).
  void install_computed(size_t index, std::optional<PendingSecondOrder>& pending, const std::exception_ptr& failed,
                        Installed& installed, bool beside_the_steps = false);
  /// Reads every installed layer's check at once; a layer whose check failed gets its previous state back, then
  /// the checked path (a general inverse, a full eigendecomposition) computed from `source(index)`: the layer
  /// itself, or the copy a job started from.
  void check_installed(Installed& installed, const std::function<const KfacLayer&(size_t)>& source,
                       ComputeMethod method, double damping);
  /// On an error part-way: every layer installed unchecked gets its previous state back.
  void undo_installed(Installed& installed, double damping);
  /// Shares the installed states (collective) and leaves layers without one to their plain gradient.
  void share_second_order(std::vector<LayerFate>* fates, double damping);
  /// Runs one layer's second-order `update`; a failure (not out-of-memory) is counted and warned about, and the
  /// layer keeps its previous state.
  /// `beside_the_steps` (an update of Options::second_order_lag, installed): every error is the layer's failure,
  /// out of memory and errors that are not torch's included, so that no rank leaves the share that follows.
  void keeping_previous_state(size_t index, const std::function<void()>& update, bool beside_the_steps = false);
  /// V of each layer preconditioned here (the others' are filled by share_gradients) and, with KL clipping on
  /// (`kl_clip` > 0), sum(V * grad) of each in `vg` (0-dim float64), taken while its gradient is at hand.
  std::vector<torch::Tensor> precondition(const std::vector<LayerFate>& fates, double kl_clip,
                                          std::vector<torch::Tensor>& vg);
  /// Options::stack_layers: the groups of layers_ this rank preconditions together (LayerGroups), planned for the
  /// executor in use over the layers it preconditions here that have factors or state (again where either changed,
  /// every member then absorbed); none where the option is off or does not apply.
  LayerGroups& layer_groups();
  /// precondition() of the groups whose every member is preconditioned this step, with batched products (in chunks
  /// of at most strategy::kStackedBatchBytes of gradients), and each member's guard row (guard_rows_) with its batch; marks
  /// the layers done.
  void precondition_groups(const std::vector<LayerFate>& fates, double kl_clip,
                           std::vector<torch::Tensor>& preconditioned, std::vector<torch::Tensor>& vg,
                           std::vector<bool>& done);
  /// What the NaN guard and KL clipping found, one row per layer they looked at, on the layers' device.
  struct GuardReport {
    /// A row's columns: preconditioned here (or by every owner), V finite, its factors folded (1 when none this
    /// step), sum(V * grad).
    enum Column : int64_t { kReported, kFinite, kFolded, kVg, kColumns };
    int64_t step = 0;
    double kl_clip = 0.0, lr = 0.0;  // this step's
    std::vector<size_t> layers;      // the layer of each row
    torch::Tensor rows;          // [layers, kColumns] float64
    torch::Tensor usable;        // [layers] bool: reported, finite and folded
    torch::Tensor vg_sum;        // 0-dim float64: sum(V * grad) of the usable rows (Distributor::sum_over_model's)
    bool model_summed = false;   // vg_sum summed over the model's parts
    torch::Tensor scale;         // 0-dim float64: the KL-clip scale nu (1 without KL clipping)
    // After a device write_gradients(): rows and scale copied to the host without waiting (pinned memory), and
    // the mark past which the copies are done (defer_guard_read).
    torch::Tensor host_rows, host_scale;
    std::optional<device::Mark> copied;
  };
  /// Adam's constants of Options::eigen_adam.
  math::AdamConstants adam_constants() const {
    return {options_.adam_beta1(), options_.adam_beta2(), options_.adam_eps()};
  }
  /// What the guard does with one layer, from its row.
  enum class GuardVerdict { kPrecondition, kNotPreconditioned, kFactorsNotFinite, kGradientNotFinite };
  static GuardVerdict guard_verdict(const double* row);
  /// The KL-clip scale nu = min(1, sqrt(kl_clip / |lr^2 report.vg_sum|)), on the device, lr^2 and kl_clip read
  /// from step_scalars_ (a CUDA graph's replay reads this step's, not the capture's).
  torch::Tensor kl_scale(const GuardReport& report, double kl_clip) const;
  /// This step's [lr^2, kl_clip] into step_scalars_ (float64, on the device), without waiting: at one address while
  /// step() runs on one stream (a CUDA graph reads it there), a new tensor where the stream changed (the last one's
  /// readers may not have run yet).
  void set_step_scalars(double kl_clip);
  /// The guard's rows for every layer step() may write (fates: kPlainGradient for those it will not), with the
  /// owners' rows agreed (StepExecutor::agree_on_reports), and the scale, its sum(V * grad) summed over the model's
  /// parts by `model.sum_over_model` where given (without the layers `model.counted_elsewhere`); `vg` as
  /// precondition() left it. Nothing waits for the device.
  GuardReport guard_and_clip(std::vector<LayerFate>& fates, const std::vector<torch::Tensor>& preconditioned,
                             const std::vector<torch::Tensor>& vg, double kl_clip, const Distributor& model);
  /// Reads a report on the host: warns, counts fallbacks and keeps the scale (last_kl_scale). Before
  /// write_gradients() (on a CPU, where reading is free), it also settles `fates` and the scale, summed on the host
  /// in row order as math::kl_clip_scale; after a device write_gradients() (on a GPU: at the next step() or when
  /// asked, events(), last_kl_scale()), it keeps the scale the device applied.
  void settle_guard(GuardReport& report, std::vector<LayerFate>* fates);
  /// Settles the device steps' reports in order: every one whose copies are done, or all of them (`wait`: the
  /// getters), or the oldest ones while more than kMaxPendingGuards wait.
  void settle_pending_guards(bool wait);
  static constexpr size_t kMaxPendingGuards = 4;
  /// Writes the gradients: from the settled fates and scale, or, with a report still on the device, each
  /// candidate layer's where(usable, V * nu, grad), without a host synchronisation.
  void write_gradients(const std::vector<LayerFate>& fates, const std::vector<torch::Tensor>& preconditioned,
                       const GuardReport& report);
  /// A report left on the device (write_gradients'): its rows and scale copied to the host without waiting, and
  /// queued for settle_pending_guards.
  void defer_guard_read(GuardReport report);
  /// precondition(), guard_and_clip() and write_gradients(), eagerly or as a CUDA graph's replay
  /// (Options::cuda_graphs; `updated`: this step updated factors or second-order state, and runs eagerly).
  void precondition_and_write(std::vector<LayerFate>& fates, double kl_clip, const Distributor& model, bool updated);
  /// Options::cuda_graphs: what a graph's replay would not redo, in the order it is checked: a factor or
  /// second-order update this step, what needs the host or another rank inside the region; "" where a graph may
  /// serve (eigen_adam: a layer preconditioned this step, per `fates`, whose moments are made or rotated).
  std::string graph_ineligible(bool updated, const std::vector<LayerFate>& fates, const Distributor& model) const;
  /// What a captured region reads and decides on: the setup (executor, fates, KL clipping on, TF32), each
  /// gradient's and each second-order tensor's address and layout. A graph is replayed only where it is the same.
  struct GraphKey {
    std::weak_ptr<const strategy::StepExecutor> executor;  // the same one, not one made at its address since
    std::vector<int64_t> setup, gradients, state;
    bool operator==(const GraphKey& other) const {
      const auto mine = executor.lock();
      return mine && mine == other.executor.lock() && setup == other.setup && gradients == other.gradients &&
             state == other.state;
    }
    bool operator!=(const GraphKey& other) const { return !(*this == other); }
    /// In words, what differs from `before` ("the gradients' memory", ...).
    std::string changed_from(const GraphKey& before) const;
  };
  GraphKey graph_key(const std::vector<LayerFate>& fates, double kl_clip, const Distributor& model) const;
  /// The region replayed as a captured graph (captured now where the last eligible step's key is this one's):
  /// true, with `fates` and `report` as the capture left them; false where this step runs it eagerly.
  bool replay_graph(std::vector<LayerFate>& fates, double kl_clip, const Distributor& model, bool updated,
                    const std::function<GuardReport(std::vector<LayerFate>&)>& region, GuardReport& report);
  /// A captured region: its graph, the key it was captured under, and its host results (the report's tensors are
  /// the graph's outputs, rewritten by each replay).
  struct StepGraph {
    GraphKey key;
    std::unique_ptr<device::Graph> graph;
    std::vector<LayerFate> fates;
    GuardReport report;
  };
  /// Options::cuda_graphs: no graph, and no key a capture would match (a load, a rebinding: what a graph read may
  /// be elsewhere now, or back at an address it had).
  void forget_graphs() {
    step_graph_.reset();
    eager_key_.reset();
  }
  void arm_capture();
  /// Whether the current step updates factors: as the captures were armed for it (arm_capture), which is
  /// is_factor_step(steps_) unless the schedule changed since; factor_step_as_armed also warns once of such a
  /// change, which applies from the next step.
  bool armed_factor_step() const { return armed_step_ == steps_ ? armed_factor_step_ : is_factor_step(steps_); }
  bool factor_step_as_armed();
  /// Layer `i`'s passes captured since the last factor update where this is a factor step on which it builds
  /// factors, else -1 (check_layers reads no count then).
  int64_t captured_for_check(size_t i, bool factor_step) const {
    return factor_step && executor_->builds_factors(i) ? layers_[i].captured_batches() : -1;
  }
  /// Warns of each Embedding whose ids were shared by the batch (check_layers, factor steps).
  void warn_of_broadcast_embeddings();
  /// The first layer check_layers would refuse this step (unused_layer_policy error), or -1; read by
  /// check_schedules_agree, so that every rank stops where one would.
  int64_t first_refused_layer() const;
  /// Why layer `i` cannot be used this step (check_layers' words), from its captured passes (captured_for_check);
  /// and the refusal that says so, with what to do.
  std::string unusable_reason(size_t i, int64_t captured) const;
  std::string refusal_of(size_t i, const std::string& reason) const;
  /// load()'s reading and checking of an archive (its header, every layer's tensors, the checksum), before anything
  /// changes.
  void read_archive(torch::serialize::InputArchive& archive, StateRestore& restore, SavedState& saved);
  int64_t armed_step_ = -1;         // the step arm_capture last armed for,
  bool armed_factor_step_ = false;  // and whether it armed the captures
  bool warned_schedule_change_ = false;
  /// Options::fold_in_hooks: whether layer `index` may fold in its backward hook (step() would fold exactly what
  /// the hook has: one process or DP-KFAC's own batches, no grad scaler, no agreement on unused layers to wait for).
  bool may_fold_in_hooks(size_t index) const;
  /// Arms layer `index`'s capture to fold its accumulation_steps passes in its backward hook (fold_in_hook).
  void arm_hook_fold(size_t index);
  /// Every capture folds at step() again (the executor changes; the destructor).
  void disarm_hook_folds();
  /// One layer's: an armed layer folds at step() again, and its capture calls no fold.
  void disarm_hook_fold(size_t index);
  /// The fold of layer `index` in its backward hook: its batches taken and folded into its factors with this step's
  /// decay, the result kept in hook_folded_ for update_factors. False (nothing taken) where step() decides: a frozen
  /// weight or bias, a layer without factors (may_fold_now). A shared-input group's member: fold_group_in_hook.
  bool fold_in_hook(size_t index);
  /// Layer `index` is armed and its hook may take its batches now (fold_in_hook).
  bool may_fold_now(size_t index) const;
  /// The shared-input group led by `leader` folded as one (its A once, each member's G), in the hook of the member
  /// whose passes come in last: false (nothing taken) until every member's are in, each given the one input.
  bool fold_group_in_hook(size_t leader);
  /// Options::shared_input_layers: folds a group's batches (`members` from its leader, each one's {A, G} batch; the
  /// leader's A the group's) into its factors; each member's 0-dim bool says whether its factors were updated.
  std::vector<torch::Tensor> fold_group(const std::vector<size_t>& members,
                                        const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches,
                                        double decay);
  /// At a factor step's check_layers: "" unless layer `index` captured passes (forward or backward) after the ones its
  /// hook folded; then they are dropped, the layer folds at step() for good, and the warning is returned.
  std::string check_hook_fold(size_t index);
  /// Folds in the hooks that no step took (arm_capture: a schedule that made the step no factor step, a failed
  /// step): kept in the factors, their captures cleared.
  void drop_stale_hook_folds();
  /// What must be the same on every rank, one line per item: the layers (names, kinds, shapes, dtypes) and every
  /// option (a schedule given as a function reads "schedule": its values are not compared).
  std::vector<std::string> description() const;
  /// Fails on every rank, naming the first difference, when the ranks' descriptions differ (comm/agreement.h).
  void check_ranks_agree();
  /// Fails on every rank, naming the hyper-parameter and the values, when the ranks' schedules (lr, damping,
  /// kl_clip, factor_decay and the two intervals) give different values at this step, or their factor intervals
  /// at the next step (which this step's end arms the captures by): one allreduce of a world x 7 table at
  /// the start of every step() (its cost: bench/schedule_check.py). The same table carries whether each rank
  /// refuses the step for `written` (weights_written_since_backward) or an unusable layer: every rank refuses then.
  void check_schedules_agree(const std::string& written) const;
  /// After a step() that threw: drops what its forward and backward captured, so that a caller who goes on
  /// builds the next factors from the next batches alone, and arms capture for the same step again.
  void forget_failed_step();
  /// Refuses a step() whose gradients are all the ones the last step() wrote, untouched since.
  void refuse_repeated_step() const;
  /// The refusal of a step whose layers' weights were written in place since their backward pass (FactorCapture::
  /// take_weight_check: the optimizer already applied the gradients this step would precondition), or "".
  std::string weights_written_since_backward();
  /// Remembers each gradient write_gradients() wrote (weakly: a gradient set to None may go) and its version.
  void remember_written_gradients(const std::vector<LayerFate>& fates);
  /// unused_layer_policy skip on several ranks: the ranks agree at every step which layers all can use.
  bool agrees_on_unused_layers() const;
  /// Makes `fates` the same on every rank: a layer that any rank cannot use keeps its plain gradient everywhere.
  void agree_on_unused_layers(std::vector<LayerFate>& fates);
  /// step() between the distributor's gather and scatter: the checks, then factors, second order,
  /// preconditioning (KL clipping summed over the model's parts, as `model` says) and the written gradients.
  /// Returns whether it was a factor step.
  bool run_step(const Distributor& model);
  /// Runs one of a distributor's moves (none when empty), timed as communication and counted as gradient traffic.
  void move_gradients(const std::function<Distributor::Moved()>& move);
  /// Runs a front end's collective, adding its host seconds to front_end_seconds_.
  void front_end(const std::function<void()>& run);
  /// This step's host seconds in the front end's collectives (taken out of what strategy auto profiles).
  double front_end_seconds_ = 0.0;
  /// Moves the capture hooks' timing and this step's spans to the last step's; folds older ones into the total.
  void close_step_timing();
  /// Marks where the step is (its phase, and the layer), for an out-of-memory error to name.
  void mark(const char* phase, int64_t layer = -1) {
    phase_ = phase;
    phase_layer_ = layer;
  }
  /// Options::shared_input_layers at construction: the groups (layers/discovery.h), checked to be able to share an A
  /// factor (one kind, width, bias, geometry and dtype; not sharded), each follower told its leader.
  void group_shared_inputs();
  /// On a factor step, before anything is taken: each follower's captured inputs are its leader's, pass for pass
  /// (the same tensor, unchanged); refused naming both layers otherwise.
  void check_shared_inputs() const;
  /// Without shared_input_layers, at the first factor step: warns once naming the layers that were given one input
  /// tensor (and have alike A factors), with the shared_input_layers patterns that would share it.
  void suggest_shared_inputs();
  /// A group's layers keep their plain gradient together: one that cannot be used this step takes the others
  /// with it (their captures dropped), so that the shared A is folded only with every member's G.
  void spread_group_fates(std::vector<LayerFate>& fates);
  /// Aliases every follower's A side (running factor and decomposition) to its leader's, in `layers` (the live ones,
  /// or staged ones).
  static void link_shared_inputs(std::vector<KfacLayer>& layers);
  /// After every layer of `layers` took a loaded (or gathered) state: link_shared_inputs, then each layer's Adam
  /// moments (Options::eigen_adam) are in the loaded basis, so that the next basis installed rotates them.
  static void settle_loaded_layers(std::vector<KfacLayer>& layers);
  /// After a second-order update: link_shared_inputs, then each follower's denominator from its G and the leader's
  /// new A.
  void relink_followers(double damping);
  /// The leader of layer `index`'s shared-input group (itself where it leads one), or -1 where it is in none.
  int group_of(size_t index) const {
    return layers_[index].follows_a() ? layers_[index].a_leader() : leads_a_[index] ? static_cast<int>(index) : -1;
  }
  /// The layers of the shared-input group `leader` leads, the leader first.
  std::vector<size_t> group_members(size_t leader) const {
    std::vector<size_t> members;
    for (size_t j = leader; j < layers_.size(); ++j) {
      if (group_of(j) == static_cast<int>(leader)) members.push_back(j);
    }
    return members;
  }
  /// Of `state` (KfacLayer::state() entries), the part the plan gives this rank for layer `index`.
  std::map<std::string, torch::Tensor> placed_here(size_t index, std::map<std::string, torch::Tensor> state) const;
  /// The layers with `states` loaded (what placed_here keeps of each), checked; this preconditioner unchanged.
  std::vector<KfacLayer> staged_layer_states(const std::vector<std::map<std::string, torch::Tensor>>& states) const;
  /// Strategy auto at the first step (strategy::AutoStrategy::choose, collective), then the executor for its
  /// choice, re-placing any K-FAC state.
  void choose_strategy();
  /// Strategy auto's agreement over the model's parts (agree_strategy_over_model) for the step() running now; empty
  /// without one.
  strategy::ModelAgreement model_agreement() const;
  /// Replaces the executor by one for `chosen`, re-placing every layer's K-FAC state as its plan says
  /// (collective; `has_state`: any rank holds some).
  void replace_executor(const Options& chosen, bool has_state);
  /// Strategy auto's re-check after its profiled steps (strategy::AutoStrategy::recheck, collective), and the
  /// switch it may decide.
  void recheck_strategy();

  /// Warns that layer `index`'s captured factors were not finite, and counts the fallback.
  void warn_factor_fallback(size_t index, int64_t step = -1);
  /// Warns about layer `index` once per `kind` of problem (at `step`: by default this one).
  void warn_once(size_t index, const std::string& kind, const std::string& message, int64_t step = -1);
  /// One warning for the layers `counts` names (each with its count of passes) that were not warned of `kind` yet,
  /// "<layers> <message>": a pass every layer saw (a forgotten torch.no_grad()) said once, not once per layer.
  void warn_once_for_layers(const std::string& kind, const std::vector<std::pair<size_t, int64_t>>& counts,
                            const std::string& message);

  /// Re-binds each layer whose module now holds another weight or bias tensor than the one preconditioned
  /// (`fc->weight = w`, which the module's forward then uses): otherwise step() would keep writing the old
  /// tensor's gradient, K-FAC silently off. Only for a Preconditioner built from a model.
  void follow_parameters();

  std::shared_ptr<torch::nn::Module> model_;
  std::vector<const nn::KfacModule*> modules_;  // layers_' modules (module_holders_'); empty without a model
  /// layers_' modules, held: one replaced in the model (replace_module) stays alive, and is named as replaced.
  std::vector<std::shared_ptr<torch::nn::Module>> module_holders_;
  /// Why layer `index` did not run, where its module is no longer the model's module of that name; else "".
  std::string replaced_module(size_t index) const;
  /// The captures this preconditioner registered (FactorCapture::claim), released when it goes, or when its
  /// construction fails after claiming them.
  struct CaptureClaims {
    const void* owner = nullptr;
    std::vector<std::shared_ptr<FactorCapture>> held;
    CaptureClaims() = default;
    CaptureClaims(const CaptureClaims&) = delete;
    CaptureClaims& operator=(const CaptureClaims&) = delete;
    ~CaptureClaims() {
      for (auto& capture : held) capture->release(owner);
    }
  };
  CaptureClaims claims_;
  std::atomic<bool> stepping_{false};  // step() runs (on some thread)
  Options options_;
  MessageNames names_;
  std::vector<KfacLayer> layers_;
  int64_t steps_ = 0;
  c10::Device device_{c10::kCPU};
  PhaseClock clock_;                     // the phases' times, this step's and before
  std::vector<bool> leads_a_;  // the layer holds the A factor its shared-input group's followers alias
  std::unique_ptr<SecondOrderJob> job_;  // Options::second_order_lag: the update in flight, or nullptr
  LayerGroups groups_;                   // Options::stack_layers
  std::weak_ptr<const strategy::StepExecutor> grouped_for_;  // the executor groups_ was planned for
  std::vector<bool> grouped_layers_;     // the layers it was planned over (layer_groups())
  std::vector<std::pair<c10::ScalarType, c10::Device>> grouped_kinds_;  // their weights' dtypes and devices then
  bool suggest_shared_inputs_ = false;  // no shared_input_layers: suggest_shared_inputs at the first factor step
  std::vector<torch::Tensor> factor_ok_;   // this step's fold results (0-dim bool) per layer, or undefined
  /// Options::fold_in_hooks, per layer: folded at step() (its first update, or passes that did not match
  /// accumulation_steps, or not allowed), armed in its backward hook, or at step() for good (check_hook_fold).
  enum class HookFold : uint8_t { kAtStep, kArmed, kNever };
  std::vector<HookFold> hook_fold_;
  bool warned_fold_kept_ = false;  // warn_of_kept_folds' warning, said once
  /// Warns, once, where the hooks folded a batch since the last step() that `call` (reset_batch, discard_step)
  /// cannot drop.
  void warn_of_kept_folds(const char* call);
  /// What the hooks captured since the last factor update dropped (reset_batch without its warning).
  void drop_captures();
  std::vector<torch::Tensor> hook_folded_;  // this factor step's fold results where the hooks folded, or undefined
  std::vector<torch::Tensor> guard_rows_;  // stack_layers: a group member's guard row, made with its batch
  const char* phase_ = "";
  int64_t phase_layer_ = -1;
  LayerEvents events_;
  double last_kl_scale_ = 1.0;
  std::deque<GuardReport> pending_guards_;     // device steps' reports, read on the host when done or needed
  torch::Tensor step_scalars_;                 // [lr^2, kl_clip] of this step (set_step_scalars)
  std::optional<c10::Stream> scalars_stream_;  // the stream step_scalars_ was made on
  std::unique_ptr<StepGraph> step_graph_;      // Options::cuda_graphs: the graph replayed while its key holds
  std::optional<GraphKey> eager_key_;          // the last eligible step's, run eagerly: captured if the next's match
  int64_t eager_in_a_row_ = 0;                 // eligible steps run eagerly since the last replay
  CudaGraphReport graph_report_;
  std::optional<bool> read_guard_at_once_;     // read_guard_at_once(); unset: on a CPU only
  using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  // remember_written_gradients: each layer's gradient and its version, where step() wrote one
  std::vector<std::optional<std::pair<WeakTensor, int64_t>>> written_;
  std::set<std::pair<std::string, std::string>> warned_;
  std::shared_ptr<strategy::StepExecutor> executor_;  // never nullptr
  std::shared_ptr<comm::Communicator> communicator_;  // the executor's (nullptr in one process)
  bool auto_requested_ = false;                       // the options asked for strategy auto
  std::unique_ptr<strategy::AutoStrategy> auto_;     // strategy auto on several ranks
  std::optional<bool> model_leader_;                  // agree_strategy_over_model's: whether this rank leads
  const std::function<void(torch::Tensor&)>* model_sum_ = nullptr;  // the running step()'s sum_over_model
  std::string strategy_choice_;                       // strategy auto in one process: why it is kaisa
  std::string choice_to_report_;                      // for take_plan_change, once
};

/// Writes `preconditioner` to an archive (for torch::save).
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const Preconditioner& preconditioner);
/// Reads `preconditioner` from an archive (for torch::load).
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, Preconditioner& preconditioner);

}  // namespace dkfac
