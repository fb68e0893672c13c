#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "dkfac/assign/assignment.h"
#include "dkfac/comm/communicator.h"
#include "dkfac/options.h"

/// How dkfac measures a machine, written once: one timer, one link measurement and fit, one decomposition probe
/// and one SPD-KFAC redundancy rule. strategy::measure_rates (strategy auto's and `dkfac plan`'s rates) and
/// SPD-KFAC's executor (which measures before it plans) both use these, so that `strategy spd` and strategy
/// auto's SPD-KFAC candidate derive their threshold from the same kind of measurement through the same rule.
namespace dkfac::strategy {

/// Seconds of `repeats` runs of `work` after one warm-up run, timed with device marks (CUDA events on a GPU).
std::vector<double> time_runs(c10::Device device, int repeats, const std::function<void()>& work);
/// The median of time_runs.
double time_median(c10::Device device, int repeats, const std::function<void()>& work);

/// The float32 element counts every link measurement times: 4 B, 64 KiB, 1 MiB, 4 MiB. Start-up timings are
/// noisy where ranks share cores, so the slope rests on messages whose transfer dominates their start-up.
const std::vector<int64_t>& link_sizes();
/// Their sizes in bytes.
std::vector<double> link_bytes();
/// Timed collectives per link size: the median of this many (after a warm-up each).
constexpr int kLinkRepeats = 9;

enum class Collective { kAllreduce, kBroadcast };

/// This rank's seconds per link_sizes() entry of `collective` (broadcast: from global rank 0) on `group`:
/// the median of `repeats` runs, or their mean where `mean` (a link measured while the ranks compute, whose
/// waits come and go and which a job pays on average). Not averaged over the ranks. Collective.
std::vector<double> time_link(comm::Communicator& communicator, comm::GroupId group, c10::Device device,
                              Collective collective, int repeats = kLinkRepeats, bool mean = false);

/// {start-up, per unit}: seconds = start-up + per_unit units fitted to one time per `units` value, least
/// squares on relative error with both >= 0 (fit_nonnegative), so that small and large measurements count alike.
std::pair<double, double> fit_affine(const std::vector<double>& units, const std::vector<double>& seconds);

/// fit_affine of one time per link_sizes() entry against its bytes: the link's alpha and beta.
assign::AlphaBeta fit_link(const std::vector<double>& seconds);

/// The allreduce link on `group`: time_link, averaged over the group so that every rank gets the same model,
/// and fit_link. Collective.
assign::AlphaBeta measure_link(comm::Communicator& communicator, comm::GroupId group, c10::Device device);

/// The dimension SPD-KFAC's redundancy rule probes a decomposition at (and reads a Rates table at).
constexpr int64_t kSpdProbeDim = 256;

/// Median seconds of one eigendecomposition (or damped inverse, by `method`) of a d x d SPD matrix of `dtype`
/// on `device`: 3 runs (2 from d = 640) after a warm-up (cuSOLVER's handle). In this process only.
double time_decomposition(int64_t d, ComputeMethod method, c10::ScalarType dtype, c10::Device device);
/// Seconds of one refresh of a d x d factor's eigenbasis (math::refresh_eigenbasis, Options::eigh_interval), timed
/// as time_decomposition.
double time_refresh(int64_t d, c10::ScalarType dtype, c10::Device device);

/// What second-order work beside the steps (Options::second_order_lag) costs them, from one timing of each:
/// `main`, a loop of preconditioning products on this thread; `side`, one decomposition; `together`, both started
/// at once, the decomposition on another host thread through device::SideWork (on CUDA a low-priority side stream),
/// until both have ended. Each the median of 3 runs after a warm-up.
struct SideWorkTimes {
  double main = 0;
  double side = 0;
  double together = 0;
};

/// Times SideWorkTimes on `device` for `method` in `dtype`: the decomposition of a kSideWorkDim x kSideWorkDim
/// factor, and as many products of a [kSideWorkDim, kSideWorkDim] gradient as take about three times as long, so
/// that the decomposition ends within the loop wherever it runs at more than a third of its speed. `meet`, where
/// given, runs before each of the three timings (measure_rates: a collective, so that every rank times the same one
/// at once). The other thread runs on this process's intra-op threads (at::init_num_threads), as an update beside
/// the steps does.
SideWorkTimes time_side_work(ComputeMethod method, c10::ScalarType dtype, c10::Device device,
                             const std::function<void()>& meet = {});
constexpr int64_t kSideWorkDim = 384;

/// The share of the side work's seconds that the main work loses beside it, (together - main) / side, within
/// [0, 1]: 0 where the side work hides entirely behind the main work (another engine's time), 1 where the two
/// take turns on one engine (as on a CPU whose cores the main work already fills). Rates::side_work_cost; the time
/// model prices a lagged update of D seconds as max(cost D, D - the steps it runs beside) (time_model.h). Pure.
double side_work_cost_from(const SideWorkTimes& times);

/// SPD-KFAC's redundancy threshold (assign::redundant_dim_threshold): the largest d for which decomposing a
/// d x d factor on every rank (seconds_per_cubed_dim d^3, from the probe's time / kSpdProbeDim^3) costs no
/// more than broadcasting its result over `link`. A broadcast carries per d^2 the eigenvectors (eigen: one
/// element; the d eigenvalues are negligible) or an inverse's upper triangle (half an element).
int64_t spd_redundant_dim(double probe_seconds, const assign::AlphaBeta& link, c10::ScalarType dtype,
                          ComputeMethod method);

/// What SPD-KFAC's executor measured before planning: the world's allreduce link and the decomposition
/// probe (both averaged over the world), and the threshold they give.
struct SpdMeasurement {
  bool measured = false;  ///< false: nothing was measured (the fields keep their defaults)
  assign::AlphaBeta link;
  double probe_seconds = 0;  ///< time_decomposition(kSpdProbeDim), averaged over the world; 0: not measured
  int64_t redundant_dim = -1;  ///< spd_redundant_dim of the above; -1: not measured
};

/// Measures the link and, where `threshold` is true, the decomposition probe. Collective (the world).
/// describe() gives it in words for the plan's description.
SpdMeasurement measure_spd(comm::Communicator& communicator, c10::Device device, c10::ScalarType dtype,
                           ComputeMethod method, bool threshold);
/// "measured: link alpha 12 us, beta 0.3 ns/B; decomposition 1.2 ns/d^3, so factors of dim <= 190 are
/// decomposed on every rank" ("" when nothing was measured).
std::string describe(const SpdMeasurement& m);

/// Least-squares fit of seconds ~ sum_j c_j features[i][j] with every c_j >= 0, minimising relative error
/// (each row weighted by 1 / seconds[i]) so that small and large measurements count alike. Tries every
/// subset of the features and keeps the best feasible fit. Pure.
std::vector<double> fit_nonnegative(const std::vector<std::vector<double>>& features,
                                    const std::vector<double>& seconds);

}  // namespace dkfac::strategy
