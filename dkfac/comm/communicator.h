#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/torch.h>

namespace c10d {
class Backend;
class ProcessGroup;
class Store;
}  // namespace c10d

/// Collective communication for dkfac over c10d process groups: Gloo for CPU tensors, NCCL (or Gloo) for
/// CUDA tensors, in one group. No dkfac header includes c10d's (this one declares the two types it names);
/// among dkfac's sources communicator.cpp, heartbeat.cpp, parallel/data_parallel.cpp (DDP's Reducer) and
/// python/src/bindings.cpp (torch.distributed's groups) do. The core's users see this interface.
namespace dkfac::comm {

class Heartbeat;  // comm/heartbeat.h: the lost-rank watchdog

/// An in-flight collective. Move-only; `wait()` is the visible synchronisation point and throws
/// c10::Error naming the operation when it fails or times out (e.g. a peer died).
class Handle {
 public:
  Handle();
  ~Handle();
  Handle(Handle&&) noexcept;
  Handle& operator=(Handle&&) noexcept;
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  /// Blocks until the collective is done; then applies any post-processing (e.g. the 1/n of a mean).
  void wait();

 private:
  friend class Communicator;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Waits for every handle, in order.
void wait_all(std::vector<Handle>& handles);

/// What a collective is for. Traffic is counted per purpose; the names (to_string) are what
/// Communicator::traffic(), the training metrics and the Python front end report. (Named Phase before 2026-11-28,
/// which it is not: KfacPhase is the step's phase; a collective of one phase may serve several purposes.)
enum class Purpose {
  kDataParallel,  ///< "data_parallel": gradient averaging (DDP's reducer in parallel::DataParallel)
  kFactors,       ///< "factors": Kronecker factor allreduce
  kSecondOrder,   ///< "second_order": eigendecompositions / inverses broadcast inside columns
  kGradients,     ///< "gradients": preconditioned gradients broadcast along rows
  kCalibration,   ///< "calibration": SPD-KFAC's link and decomposition measurements
  kSetup,         ///< "setup": configuration checks, checkpoint and summary tables
  kFiniteCheck,   ///< "finite-check": the ranks' agreement on a non-finite loss (dkfac train)
  kControl,       ///< "control": the ranks' schedule values each step, the Python front end's all_true, the owners'
                  ///< guard reports (owner placement)
};

/// The phase's name: "data_parallel", "factors", "second_order", "gradients", "calibration", "setup",
/// "finite-check", "control".
const char* to_string(Purpose purpose);
/// The old name of Purpose.
using Phase [[deprecated("comm::Phase is now comm::Purpose")]] = Purpose;

/// Calls and payload bytes of one phase, as seen by this rank (a collective's payload counts once
/// per call on every participating rank).
struct Traffic {
  int64_t calls = 0;
  int64_t bytes = 0;
};

/// What carries collectives of CUDA tensors (CPU tensors always go through Gloo).
enum class CudaBackend {
  kAuto,  ///< NCCL when torch was built with it and a CUDA device is visible, else Gloo
  kNccl,  ///< NCCL; an error when this build or machine has none
  kGloo,  ///< Gloo (copies through the host): for several ranks sharing one GPU, which NCCL refuses
};

/// "auto", "nccl", "gloo".
const char* to_string(CudaBackend backend);

/// How ranks meet: a TCPStore hosted by rank 0 at host:port.
struct RendezvousOptions {
  std::string host = "127.0.0.1";
  int port = 29500;
  int rank = 0;
  int world_size = 1;
  /// Bound on rendezvous and on every collective: a lost peer becomes an error after this long.
  std::chrono::milliseconds timeout{60000};
  /// The store already runs at host:port (torch's elastic agent hosts one): every rank, rank 0 too,
  /// connects to it as a client instead of rank 0 hosting it.
  bool external_store = false;
  /// Prefix of every key dkfac writes into the store; a store that outlives the workers (the agent's)
  /// needs a new one per attempt.
  std::string key_prefix = "dkfac/";
  /// What carries CUDA tensors.
  CudaBackend cuda_backend = CudaBackend::kAuto;
};

/// A key-value store shared by ranks that run as threads of one process (tests, examples).
class InProcessStore {
 public:
  InProcessStore();
  ~InProcessStore();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Makes the Gloo backend of one of dkfac's groups: `size` ranks meeting through `store`, this one `rank`, its
/// collectives failing after `timeout`. The C++ library's own (native_gloo_backends) needs gloo's headers at build
/// time; the Python extension is built without them and passes one that asks torch.distributed for a
/// ProcessGroupGloo (pip's torch compiles Gloo in but ships no headers).
using GlooBackendMaker = std::function<c10::intrusive_ptr<c10d::Backend>(
    c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::chrono::milliseconds timeout)>;

/// Gloo backends made with gloo's headers, over the transport device for `host` ("127.0.0.1": the loopback; "":
/// the machine's default; DKFAC_GLOO_IFNAME or GLOO_SOCKET_IFNAME name an interface instead). Throws, naming
/// the way out, in a build without gloo's headers (`gloo_headers_built_in()` is false).
GlooBackendMaker native_gloo_backends(const std::string& host);
/// Whether this build of dkfac had gloo's headers (the command line and C++ rendezvous need them).
bool gloo_headers_built_in();

/// Group handle: 0 is the world.
using GroupId = int;
constexpr GroupId kWorld = 0;

/// One rank's endpoint: the world group plus subgroups, and per-phase traffic counters.
class Communicator {
 public:
  /// Joins `options.world_size` ranks over TCP (Gloo on the loopback or the host's interface).
  static std::shared_ptr<Communicator> connect(const RendezvousOptions& options);
  /// Joins the job the launcher's environment describes (torch's elastic agent, RANK/WORLD_SIZE,
  /// mpirun, Slurm: see comm/environment.h); a single process when there is none.
  static std::shared_ptr<Communicator> from_environment(std::chrono::milliseconds timeout = std::chrono::seconds(60));
  /// Joins ranks that are threads of this process and share `store`.
  static std::shared_ptr<Communicator> connect_in_process(const std::shared_ptr<InProcessStore>& store, int rank,
                                                          int world_size,
                                                          std::chrono::milliseconds timeout = std::chrono::seconds(60),
                                                          CudaBackend cuda_backend = CudaBackend::kAuto);
  /// Wraps a process group created elsewhere (torch.distributed's default group, or one a LibTorch
  /// program built) with no second rendezvous: its collectives are the world's. dkfac's subgroups (KAISA
  /// columns and rows) are new groups with the same backends (Gloo for CPU tensors; for CUDA tensors NCCL
  /// when `group` uses NCCL for them, else Gloo), meeting through `store` under `prefix`, which must be the
  /// same on every rank of `group` and unique among the communicators built on that store. The heartbeat
  /// watchdog runs on a clone of `store` (a TCPStore, as torch.distributed's default store is), so that a failed
  /// collective names the lost rank; with a store that cannot be cloned, failures surface as the group's own
  /// collective errors and timeouts. `make_gloo` makes the
  /// subgroups' Gloo backends (default: native_gloo_backends(""), which needs gloo's headers in the build).
  static std::shared_ptr<Communicator> from_process_group(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                          c10::intrusive_ptr<c10d::Store> store,
                                                          const std::string& prefix,
                                                          std::chrono::milliseconds timeout,
                                                          GlooBackendMaker make_gloo = nullptr);
  ~Communicator();
  /// Stops the heartbeat watchdog now, as a clean end (every rank marks itself done); idempotent. A front end
  /// whose communicator may outlive its process's orderly shutdown (Python's) calls it at exit.
  void stop_watchdog();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  /// What carries CUDA tensors here (kNccl or kGloo; never kAuto once connected).
  CudaBackend cuda_backend() const;
  /// Where small control tensors (flags, calibration timings, state tables) live: control_device_for(whether the
  /// world group has a CPU backend, the device given to use_device).
  c10::Device control_device() const;
  /// The device this rank's K-FAC tensors live on (the Preconditioner gives its layers'): where control tensors
  /// go when the world group has no CPU backend.
  void use_device(c10::Device device);

  /// Creates a subgroup of `ranks` (ascending). Every rank must call it with the same arguments in
  /// the same order; ranks outside the group get an id they must not use for collectives.
  GroupId new_group(const std::vector<int>& ranks);
  /// Global ranks of a group, ascending.
  const std::vector<int>& members(GroupId group) const;

  /// Starts an in-place average of `tensor` over `group`; counted under `phase`.
  Handle allreduce_mean(torch::Tensor tensor, GroupId group, Purpose phase);
  /// Starts an in-place sum.
  Handle allreduce_sum(torch::Tensor tensor, GroupId group, Purpose phase);
  /// Starts a broadcast of `tensor` from global rank `root` to `group`.
  Handle broadcast(torch::Tensor tensor, int root, GroupId group, Purpose phase);
  /// Starts an in-place sum of `tensor` over `group` into global rank `root`'s (a reduce: on a ring of P ranks N bytes
  /// sent per rank, an allreduce's 2 (P - 1) / P N). Only the root's tensor holds the sum afterwards; the others'
  /// values are undefined.
  Handle reduce_sum(torch::Tensor tensor, int root, GroupId group, Purpose phase);

  /// Traffic per phase since construction, keyed by to_string(phase); phases without traffic are absent.
  std::map<std::string, Traffic> traffic() const;
  /// Counts collectives run on `process_group()` by another engine (DDP's reducer) under `phase`.
  void add_traffic(Purpose phase, int64_t calls, int64_t bytes);
  /// Every Purpose, in declaration order, and their names (to_string), e.g. for a per-phase summary.
  static const std::vector<Purpose>& all_purposes();
  static std::vector<std::string> all_phase_names();

  /// The c10d process group of `group` (null on ranks outside it), for engines that run their own
  /// collectives on it, such as c10d::Reducer.
  c10::intrusive_ptr<c10d::ProcessGroup> process_group(GroupId group) const;

  /// After a collective failed outside a Handle (e.g. in another engine): waits a few heartbeats and
  /// names the ranks that went silent, as a failed Handle's message does; empty when none did.
  std::string diagnose_failure() const;

  /// Every rank publishes a heartbeat in the rendezvous store (from a thread, every min(1 s, timeout / 10))
  /// and watches the others'. The ranks whose heartbeat has not moved for `silent_for`, as
  /// "rank 2 (no heartbeat for 3.1 s)", comma-separated; empty when every rank is alive. A failed
  /// collective's error carries this diagnosis.
  std::string silent_ranks(std::chrono::milliseconds silent_for) const;

  /// Called once, from the watchdog thread, with a message naming the lost rank when a rank has been
  /// silent for the timeout or the store (hosted by rank 0) stopped answering. A training program ends
  /// the process there; the main thread may be blocked in a collective that no longer completes.
  void on_lost_rank(std::function<void(const std::string&)> callback);

 private:
  struct Impl;
  Communicator(std::unique_ptr<Impl> impl, int rank, int size, bool watchdog = true);
  void count(Purpose phase, const torch::Tensor& tensor);
  /// broadcast from `root` (`reduce` false) or reduce_sum into it (true): one body.
  Handle rooted(torch::Tensor tensor, int root, GroupId group, Purpose phase, bool reduce);

  std::unique_ptr<Impl> impl_;
  int rank_;
  int size_;
  std::shared_ptr<Heartbeat> heartbeat_;  // null without a watchdog (one rank, from_process_group)
  void start_heartbeat();
  std::function<std::string()> diagnosis() const;
  mutable std::mutex traffic_mutex_;  // also guards work_device_
  std::map<Purpose, Traffic> traffic_;
  std::optional<c10::Device> work_device_;
};

/// Where a rank's control tensors live: the CPU when the world group carries CPU tensors, else the device of the
/// rank's layers (`work_device`: a torch.distributed group built with backend "nccl" alone carries CUDA tensors
/// only, and a rank's NCCL communicator is bound to its own GPU, which need not be the thread's current one).
/// Throws, naming the problem, when neither can carry them.
c10::Device control_device_for(bool world_has_cpu, std::optional<c10::Device> work_device);

/// Replaces each of `values` by its mean over the ranks of `group` (one allreduce, counted under `phase`;
/// waits for it), so that every rank decides from the same numbers. Collective.
void average_over(Communicator& communicator, GroupId group, std::vector<double>& values,
                  Purpose phase = Purpose::kCalibration);

/// Every rank's `values` (as many on each rank), indexed by rank within `group` (one allreduce of
/// group size x values, counted under `phase`; waits for it). Collective.
std::vector<std::vector<double>> gather_over(Communicator& communicator, GroupId group,
                                             const std::vector<double>& values, Purpose phase = Purpose::kCalibration);

}  // namespace dkfac::comm
