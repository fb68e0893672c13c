#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dkfac/assign/assignment.h"
#include "dkfac/options.h"

/// The distributed K-FAC step of one job as data (docs/MATH.md section 5): computed once from the layer
/// shapes, the world size and the options; executed by strategy::StepExecutor, summed into predicted
/// bytes, memory and FLOPs by strategy::predict, printed by `dkfac plan` and `dkfac train --print-plan`.
/// Pure: no tensors, no processes.
namespace dkfac::strategy {

/// How factors reach the ranks that decompose them.
enum class FactorReduction {
  kNone,         ///< each rank that builds a layer's factors keeps them (one process, DP-KFAC)
  kAllreduce,    ///< averaged over the world inside step(), one collective per factor
  kHookBuckets,  ///< averaged over the world from the capture hooks, in buckets of at most a size (KAISA)
  kSpdPipeline,  ///< averaged over the world from the capture hooks, fused by a measured alpha-beta model (SPD-KFAC)
};

/// "none", "allreduce", "hook-buckets", "spd-pipeline".
const char* to_string(FactorReduction reduction);

/// How one layer's factors and second-order parts move, beside its placement (assign::LayerAssignment).
struct LayerFlow {
  int factor_builder = assign::kEveryRank;  ///< the rank that captures and builds the factors, or every rank
  bool broadcast_a = false;  ///< A's second-order part is broadcast from its a_worker inside the column
  bool broadcast_g = false;  ///< G's likewise from its g_worker
  /// Owner placement of a sharded layer (ShardedPlacement::kOwner): the front end gathers the gradient's row
  /// shards of each row of ranks to the layer's grad worker there (its owner) and scatters V's rows back; V is
  /// not broadcast, and only its owners keep the factors (StepPlan::keeps_factors).
  bool owner_rows = false;
};

/// One job's step. Every rank computes the same plan from the same inputs.
struct StepPlan {
  Strategy strategy = Strategy::kKaisa;
  ComputeMethod method = ComputeMethod::kEigen;
  KfacApprox approx = KfacApprox::kExpand;  ///< Options::kfac_approx (the shapes' rows_per_sample follow it)
  bool eigen_adam = false;  ///< Options::eigen_adam: each grad worker also keeps Adam's two [g, a] moments
  /// Options::eigh_interval: one second-order update in this many decomposes in full, the others refresh the
  /// eigenbases (the time model prices the average, Rates::second_order_seconds)
  int64_t eigh_interval = 1;
  /// Options::second_order_lag: each update after the first is computed beside the steps and installed this many
  /// steps later (0: at once), holding a second copy of the sides it computes meanwhile (strategy::predict)
  int64_t second_order_lag = 0;
  /// stacks_layers(options): the layers of one shape a rank preconditions are preconditioned together, a batch of at
  /// most kStackedBatchBytes of gradients at a time (LayerGroups; the time model prices a batch's fixed cost once)
  bool stack_layers = false;
  /// Options::pad_widths where stack_layers applies (else 1): a group's stacks hold its widths padded up to a multiple
  /// of this (padded_width), the pad's bytes held (strategy::predict) and its FLOPs computed (the time model)
  int64_t pad_widths = 1;
  /// The layers, in model order. In a job's plan, rows_per_sample is what each layer knew when the plan was
  /// made (1 for a conv layer that has not run yet); only strategy::predict's factor FLOPs read it.
  std::vector<assign::LayerShape> shapes;
  assign::Assignment placement;  ///< the W x (P/W) grid; per layer who decomposes A and G, who preconditions
  std::vector<LayerFlow> flows;  ///< per layer, in model order
  FactorReduction reduction = FactorReduction::kNone;
  bool factor_triangles = false;     ///< factors travel as upper triangles (else full matrices)
  bool inverse_triangles = false;    ///< inverses are broadcast as upper triangles (eigenvectors never are)
  bool broadcast_gradients = false;  ///< V is broadcast along rows from each layer's grad worker (W < P)
  double bucket_cap_mb = 0;          ///< kHookBuckets: largest bucket
  int64_t redundant_dim = -1;        ///< SPD-KFAC: factors of dimension <= this are decomposed on every rank
  std::vector<int64_t> fusion;       ///< SPD-KFAC: fusion groups as given (SpdOptions::fusion); empty: profiled
  int64_t profile_steps = 0;         ///< SPD-KFAC with no given fusion: factor steps profiled before fusing

  /// The plan of one process: it builds, decomposes and preconditions every layer; nothing moves.
  /// `strategy` is recorded only (it places nothing in one process).
  static StepPlan single_process(const std::vector<assign::LayerShape>& shapes, ComputeMethod method,
                                 Strategy strategy = Strategy::kKaisa);

  int world_size() const { return placement.world_size; }
  int grad_workers() const { return placement.grad_workers; }
  bool builds_factors(size_t layer, int rank) const;
  bool computes_a(size_t layer, int rank) const;
  bool computes_g(size_t layer, int rank) const;
  /// True when `rank` keeps `layer`'s running factors: the ranks that build them, except under owner placement
  /// (LayerFlow::owner_rows), where only the layer's grad workers (its owners) and the ranks that decompose A or
  /// G keep them.
  bool keeps_factors(size_t layer, int rank) const;
  /// ShardedPlacement of the job's sharded layers, and how many layers are sharded.
  ShardedPlacement sharded_placement = ShardedPlacement::kReplicated;
  size_t sharded_layers() const;
  /// Ranks a sharded layer's gradient rows are split over (FSDP2's shard group): a row of the grid (P / W) under
  /// owner placement; under replicated placement make_step_plan's `replicated_shard_ranks` (HSDP: the shard
  /// dimension of the mesh), else the world (FSDP on a 1-D mesh). Only strategy::predict reads it.
  int shard_ranks = 0;
  bool preconditions(size_t layer, int rank) const { return placement.is_grad_worker(layer, rank); }
  /// True when some layer's second-order part is broadcast inside its column.
  bool shares_second_order() const;
  /// The grad worker of `layer` in `rank`'s row: it broadcasts V to that row.
  int gradient_source(size_t layer, int rank) const { return placement.grad_source_for(layer, rank); }
  /// Where `layer`'s averaged factors go: the column of its owners under owner placement (LayerFlow::owner_rows)
  /// with rows of at least kFewestRanksToReduce ranks, whose member in each row receives the row's sum (a reduce);
  /// -1 where every rank receives the average (an allreduce over the world).
  int factor_destination(size_t layer) const;

  /// The plan in words: job-wide choices, then (with `per_layer`) one line per layer.
  std::string describe(bool per_layer = true) const;
};

/// Owner placement reduces factors to their owners over rows of at least this many ranks: on a ring a reduce sends
/// N bytes per rank, an allreduce 2 (P - 1) / P N, the same at P = 2.
inline constexpr int kFewestRanksToReduce = 3;

/// Groups of consecutive slots of these sizes, as slot lists (SPD-KFAC's fusion, one factor per collective).
std::vector<std::vector<size_t>> consecutive_groups(const std::vector<int64_t>& sizes);

/// KAISA's factor buckets (FactorReduction::kHookBuckets): slots of at most `cap_bytes` (0: one per slot) in ready
/// order, formed apart for each destination (StepPlan::factor_destination: one collective has one root), each
/// bucket its slots ascending, the buckets ordered by their first slot. One destination: comm::bucket_groups.
std::vector<std::vector<size_t>> factor_buckets(const std::vector<int64_t>& bytes,
                                                const std::vector<int>& destinations, int64_t cap_bytes);

/// Options::stack_layers where it applies: with the eigen method, where the denominator is the eigenvalues' outer
/// product (compute_eigenvalue_outer_product) or not used (eigen_adam: the bases stacked, the moments per layer).
bool stacks_layers(const Options& options);

/// Options::stack_layers: the most gradient bytes one batch of a group's products takes (its intermediates are as
/// large), so that a group of many large layers does not hold several copies of all their gradients at once.
inline constexpr int64_t kStackedBatchBytes = int64_t{64} << 20;

/// One layer as Options::stack_layers groups it (docs/MATH.md section 2.9): LayerGroups describes the layers a rank
/// holds, the time model a plan's shapes, and both group them with stack_groups.
struct StackCandidate {
  bool held = false;     ///< preconditioned on this rank (with state or factors to do it with)
  int64_t g_dim = 0;
  int64_t a_dim = 0;
  bool diagonal = false;  ///< either of its factors is diagonal: never stacked
  int a_leader = -1;      ///< the layer whose A side it shares (Options::shared_input_layers), or -1
  std::string kind;       ///< what else a group's members must have alike (dtypes, device; empty for a plan's shapes)
};

/// One group: the layers of one (g, a, layers per unit, kind), preconditioned a batch at a time.
struct StackGroup {
  int64_t share = 1;            ///< layers per unit (per A side)
  std::vector<size_t> units;    ///< each unit's layer holding its A side
  std::vector<size_t> members;  ///< every layer, unit by unit: the unit's layer, then its followers
};

/// The groups `layers` form, in the order their first units appear. A unit is a layer holding its A side with every
/// layer that shares it; it joins where all of them are held, not diagonal, and of its layer's g and kind. A group of
/// one layer is left out (batched products gain nothing there).
std::vector<StackGroup> stack_groups(const std::vector<StackCandidate>& layers);

/// The groups Options::stack_layers forms of the layers `plan` has `rank` precondition (its shapes as
/// StackCandidates: a plan knows no dtypes or devices).
std::vector<StackGroup> stack_groups(const StepPlan& plan, int rank);

/// Options::pad_widths: `n` rounded up to a multiple of `multiple` (n itself for 1).
inline int64_t padded_width(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

/// The units of a group of [g, a] layers, `share` per unit, that one batch takes: as many as fit kStackedBatchBytes of
/// gradients (with a shared A side repeated for each of a unit's layers), at least one.
int64_t stacked_batch_units(int64_t g_dim, int64_t a_dim, int64_t share, int64_t element_bytes);

/// The plan for `shapes` on `world_size` ranks under `options` (options.validate() first). SPD-KFAC needs
/// its redundancy threshold decided: options.spd().redundant_dim, or `measured_redundant_dim` when that is
/// -1 (strategy::StepExecutor measures it; `dkfac plan` takes it as a flag). World size 1 gives
/// StepPlan::single_process whatever the strategy. `replicated_shard_ranks`: the ranks a sharded layer's
/// gradient rows are split over under replicated placement (HSDP: the mesh's shard dimension; it divides the
/// world size); 0 for the world (FSDP on a 1-D mesh). Owner placement derives its own (StepPlan::shard_ranks).
StepPlan make_step_plan(const std::vector<assign::LayerShape>& shapes, int world_size, const Options& options,
                        int64_t measured_redundant_dim = -1, int replicated_shard_ranks = 0);

}  // namespace dkfac::strategy
