#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "dkfac/assign/assignment.h"
#include "dkfac/options.h"

namespace dkfac::comm {
class Communicator;
}  // namespace dkfac::comm

/// Measured speeds of one machine (a device, its transport, a world of ranks), the inputs of the
/// time model (strategy/time_model.h) and of `Strategy` auto's choice (strategy::choose_strategy).
/// Rates are values: measured once by measure_rates (collective), or read from JSON (`dkfac plan --rates`,
/// tools/plan/plan_report.h), or written by hand for a machine one does not have.
namespace dkfac::strategy {

/// Seconds to build one factor from `rows` x `d` input rows (covariance X^T X / n of a [rows, d] matrix):
/// seconds + per_entry rows d + per_flop 2 rows d^2.
struct FactorRate {
  double seconds = 0;    ///< per factor: start-up (latency-bound small factors)
  double per_entry = 0;  ///< per input entry read (rows x d): memory-bound part
  double per_flop = 0;   ///< per multiply-add pair (2 rows d^2)
  double seconds_for(int64_t rows, int64_t d) const;
};

/// Seconds to fold one layer's batch factors into its running averages (math::fold_factors: the finite check
/// and both averages): seconds + per_entry (a^2 + g^2).
struct FoldRate {
  double seconds = 0;    ///< per layer
  double per_entry = 0;  ///< per entry of the two factors
  double seconds_for(int64_t a, int64_t g) const;
};

/// Seconds of one eigendecomposition or damped inverse of a d x d factor, by dimension: small d is
/// latency-bound, so the measured (dim, seconds) table is interpolated log-log between its points, taken as
/// the smallest point's time below it and scaled by d^3 above the largest. With an empty table:
/// seconds + per_cubed_dim d^3 (rates given by hand).
struct DecompositionRate {
  std::vector<int64_t> dims;    ///< ascending
  std::vector<double> seconds;  ///< measured, one per dim
  double latency = 0;           ///< empty table only: seconds per decomposition
  double per_cubed_dim = 0;     ///< empty table only: seconds per d^3
  double seconds_for(int64_t d) const;
  /// True when it holds figures (a table, or a latency or per_cubed_dim).
  bool measured() const { return !dims.empty() || latency > 0 || per_cubed_dim > 0; }
};

/// Seconds to precondition one layer's [g, a] gradient (G^-1 grad A^-1, or the four eigenbasis products):
/// seconds + per_flop x 2 g a (g + a) (x 2 for eigen, whose FLOPs strategy::predict counts twice).
struct PreconditionRate {
  double seconds = 0;   ///< per layer
  double per_flop = 0;  ///< per FLOP of strategy::RankCost::precondition_flops
  double seconds_for(int64_t g, int64_t a, ComputeMethod method) const;
};

/// One machine's rates. Collectives were measured on `world_size` ranks; on a group of k ranks the
/// time model scales them as a ring would (allreduce: alpha by (k-1)/(P-1), beta by ((k-1)/k)/((P-1)/P);
/// broadcast from one root, which sends to each peer: alpha and beta by (k-1)/(P-1)), and a group of one
/// costs nothing. Using rates measured on P ranks for a plan on more ranks extrapolates the same way.
/// As JSON (the file `dkfac plan --measure-rates` writes): tools/common/report_json.h.
struct Rates {
  int world_size = 1;                           ///< ranks the collectives were measured on
  /// Ranks that share one machine's compute (consecutive ranks form a node): measure_rates runs on one
  /// machine, so its world. The time model lets a node's busy ranks share `parallel_ranks` full speeds.
  int ranks_per_node = 1;
  /// How many of a node's ranks compute at full speed at once: P t_alone / t_together for one kernel run by
  /// rank 0 alone and by every rank at once, in [1, ranks_per_node] (one GPU per rank: ranks_per_node; on CPUs
  /// measure_rates caps it at cores / threads per rank). The kernel
  /// rates below are one rank's alone.
  double parallel_ranks = 1;
  std::string device = "cpu";                   ///< where the kernels ran ("cpu", "cuda:0")
  c10::ScalarType dtype = c10::ScalarType::Float;  ///< K-FAC tensors' dtype
  ComputeMethod method = ComputeMethod::kInverse;  ///< what decomposition and precondition measured
  int threads = 1;                              ///< intra-op threads per rank while measuring
  std::string conditions;                       ///< free text: machine, load, date (printed with every figure)
  assign::AlphaBeta allreduce;                  ///< seconds = alpha + beta bytes, on the world
  /// The allreduce while every rank also computes (a kernel loop on a thread of its own): what a collective
  /// started during backward costs, as SPD-KFAC's pipelined factor groups are. Where ranks outnumber the
  /// cores, a collective waits for its peers' transport threads to be scheduled between their compute
  /// (figures: docs/STRATEGIES.md, "Choosing automatically", Rates).
  assign::AlphaBeta allreduce_busy;
  assign::AlphaBeta broadcast;                  ///< likewise, from rank 0 to the world
  /// One rate per math::FactorKernel (for_kernel picks it), each measured on its own kernel:
  FactorRate factor;  ///< kCovariance: a Linear layer's factors (a covariance of a contiguous [rows, d] matrix)
  /// kConvRowShift: 3 x 3 stride-1 convolutions' A factors, which math::conv2d_a_factor builds from
  /// kernel-row shifts (about 2/3 of the covariance's work).
  FactorRate conv_factor;
  /// kConvPatches: strided and 1 x 1 convolutions' A factors (a channels-last patch copy, then a covariance:
  /// measured 2-3x the row-shift rate's time for the same rows and d).
  FactorRate conv_patches_factor;
  /// kConvUnfold: A factors of convolutions with fewer than math::kChannelsLastMin input channels (unfold).
  FactorRate conv_unfold_factor;
  /// kConvGradient: a convolution's G factor from its [B, C, H, W] output gradient (math::conv2d_g_factor;
  /// rows = B H W, d = C), which reads the gradient in its stored layout rather than as the contiguous
  /// [rows, d] matrix `factor` was measured on.
  FactorRate conv_g_factor;
  /// Folding each built layer's batch factors into its running averages, once per factor step.
  FoldRate fold;
  DecompositionRate decomposition;
  /// Eigen method: one refresh of a factor's eigenbasis (math::refresh_eigenbasis, Options::eigh_interval), by
  /// dimension as `decomposition`. Not measured (an empty table, no latency, no per_cubed_dim: rates of the
  /// inverse method, or rates given by hand): a refresh is priced as a full decomposition.
  DecompositionRate refresh;
  PreconditionRate precondition;
  /// Options::second_order_lag: the share of a decomposition's seconds that the steps it runs beside lose, in [0, 1]
  /// (measure.h's side_work_cost_from: one decomposition on another host thread, on CUDA a side stream, beside a
  /// loop of preconditioning products, timed by every rank at once). 1, the default where it was not measured (rates
  /// given by hand), prices a lagged update as if it ran on the step.
  double side_work_cost = 1;

  /// Seconds of one refresh of a d x d factor's eigenbasis: `refresh`'s, or a full decomposition's where it is not
  /// measured.
  double refresh_seconds(int64_t d) const;
  /// Seconds of one second-order update of a d x d factor, averaged over `eigh_interval` updates: one full
  /// decomposition and eigh_interval - 1 refreshes (refresh_seconds).
  double second_order_seconds(int64_t d, int64_t eigh_interval) const;
  /// The rate of factors built by `kernel`.
  const FactorRate& for_kernel(math::FactorKernel kernel) const;
  FactorRate& for_kernel(math::FactorKernel kernel);
  /// Bytes of one K-FAC tensor element (of `dtype`).
  int64_t element_bytes() const;
  /// A collective of `bytes` payload on a group of `group_size` ranks (0 for a group of one).
  double allreduce_seconds(int group_size, double bytes) const;
  /// The same, started while the ranks compute (allreduce_busy).
  double busy_allreduce_seconds(int group_size, double bytes) const;
  double broadcast_seconds(int group_size, double bytes) const;
  /// What SPD-KFAC's executor measures before planning (measure.h), from these rates: the decomposition
  /// table at kSpdProbeDim and the allreduce link on `group_size` ranks, through the same rule
  /// (strategy::spd_redundant_dim), so that a predicted SPD-KFAC plan places factors as its job would.
  int64_t spd_redundant_dim(int group_size) const;
  /// Checks every field (finite, non-negative, table ascending and as long as its times); throws c10::Error
  /// naming the field.
  void validate() const;
};

/// Seconds of one second-order update averaged over `eigh_interval` updates: one full decomposition of `full` seconds
/// and eigh_interval - 1 refreshes of `refresh` seconds (`full` where eigh_interval <= 1).
double averaged_update_seconds(double full, double refresh, int64_t eigh_interval);

/// Measures this machine's rates, collectively: every rank of `communicator`'s world calls it at the same
/// time, on one machine. Collectives (measure.h's time_link and fit_link, as SPD-KFAC's link): allreduces and
/// broadcasts of 4 B to 4 MiB on the world (median of kLinkRepeats each), and the allreduces again while every
/// rank runs a covariance loop on a thread of its own (allreduce_busy, mean of 25); kernels on `device` in `dtype`: factor
/// covariances of a few (rows, d), convolutions' A factors by each of their three kernels and their G
/// factors, folds, decompositions (`method`, measure.h's time_decomposition) of d = 16 .. 1536 (eigen: .. 640, both
/// with kSpdProbeDim), and preconditioning products; each median of a few runs after a warm-up, timed with device::Mark, by rank 0
/// alone while the others wait (a phase where one rank works, as a large decomposition, runs at that speed);
/// then one covariance by every rank at once, which gives parallel_ranks, and the side work (time_side_work) by every
/// rank at once, which gives side_work_cost. Collective figures are averaged
/// over the ranks (comm::average_over) and rank 0's kernel figures broadcast, so every rank returns the
/// same Rates (its duration: docs/STRATEGIES.md, "Choosing automatically", Rates). A communicator of one rank
/// measures the kernels and the side work only (collectives cost 0).
Rates measure_rates(comm::Communicator& communicator, c10::Device device, c10::ScalarType dtype,
                    ComputeMethod method);

/// How many of `world` ranks compute at full speed together, from one probe kernel's time on one rank alone and
/// its (ranks' mean) time when every rank runs it at once: world x alone / together, at least 1 and at most
/// `most` (on CPUs, the machine's cores / intra-op threads per rank, capped at world: rank 0's time alone is
/// inflated while the others wait to be scheduled; docs/STRATEGIES.md, "Choosing automatically", Rates).
double parallel_ranks_from(int world, double alone_seconds, double together_seconds, double most);

/// Rank 0's `index` on every rank (one 8-byte broadcast over the world): the caller of choose_strategy
/// (time_model.h) agrees on rank 0's choice with it. Collective; returns `index` itself in one process.
size_t agree_on_choice(comm::Communicator& communicator, size_t index);

/// Kernels only, in this process, without a communicator (collectives left at 0): for tests and one-rank use.
Rates measure_local_rates(c10::Device device, c10::ScalarType dtype, ComputeMethod method);

}  // namespace dkfac::strategy
