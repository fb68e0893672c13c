// The process groups: c10d's ProcessGroup with a Gloo backend for CPU tensors and, when a GPU is
// present and torch was built with NCCL, an NCCL backend for CUDA tensors (torch.distributed's
// "cpu:gloo,cuda:nccl").
#include "dkfac/comm/communicator.h"
#include "dkfac/comm/heartbeat.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef DKFAC_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>

#include <csignal>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <thread>

namespace dkfac::comm {

struct Handle::Impl {
  c10::intrusive_ptr<c10d::Work> work;
  std::function<void()> after;          // runs once the collective completed
  std::string what;                     // for error messages
  std::function<std::string()> diagnose;  // which ranks went silent, for error messages
};

Handle::Handle() = default;
Handle::~Handle() = default;
Handle::Handle(Handle&&) noexcept = default;
Handle& Handle::operator=(Handle&&) noexcept = default;

void Handle::wait() {
  if (!impl_) return;
  auto impl = std::move(impl_);
  try {
    impl->work->wait();
  } catch (const std::exception& e) {
    const std::string silent = impl->diagnose ? impl->diagnose() : std::string();
    TORCH_CHECK(false, "dkfac: ", impl->what, " failed (",
                silent.empty() ? "a peer died, stopped answering or the timeout passed" : "lost " + silent,
                "): ", e.what());
  }
  if (impl->after) impl->after();
}

void wait_all(std::vector<Handle>& handles) {
  for (auto& h : handles) h.wait();
  handles.clear();
}

const char* to_string(Purpose purpose) {
  switch (purpose) {
    case Purpose::kDataParallel: return "data_parallel";
    case Purpose::kFactors: return "factors";
    case Purpose::kSecondOrder: return "second_order";
    case Purpose::kGradients: return "gradients";
    case Purpose::kCalibration: return "calibration";
    case Purpose::kSetup: return "setup";
    case Purpose::kFiniteCheck: return "finite-check";
    case Purpose::kControl: return "control";
  }
  TORCH_CHECK(false, "unknown communication purpose ", static_cast<int>(purpose));
}

const char* to_string(CudaBackend backend) {
  switch (backend) {
    case CudaBackend::kAuto: return "auto";
    case CudaBackend::kNccl: return "nccl";
    case CudaBackend::kGloo: return "gloo";
  }
  return "unknown";
}

namespace {

#ifdef DKFAC_WITH_NCCL
constexpr bool kBuiltWithNccl = true;
#else
constexpr bool kBuiltWithNccl = false;
#endif

// kAuto settled: NCCL where it can run, else Gloo; kNccl checked.
CudaBackend settle(CudaBackend asked) {
  const bool gpu = torch::cuda::is_available();
  if (asked == CudaBackend::kAuto) return kBuiltWithNccl && gpu ? CudaBackend::kNccl : CudaBackend::kGloo;
  if (asked == CudaBackend::kNccl) {
    TORCH_CHECK(kBuiltWithNccl, "the NCCL backend was asked for, but this dkfac was built without NCCL (LibTorch ",
                "without CUDA, or nccl.h not found at build time); use the gloo backend");
    TORCH_CHECK(gpu, "the NCCL backend was asked for, but LibTorch sees no CUDA device; use the gloo backend");
  }
  return asked;
}

}  // namespace

struct InProcessStore::Impl {
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
};

InProcessStore::InProcessStore() : impl_(std::make_unique<Impl>()) {}
InProcessStore::~InProcessStore() = default;

struct Communicator::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Store> watch_store;  // the watchdog's own client of a TCPStore
  std::string address = "this process";          // where the store lives, for messages
  std::string prefix = "dkfac/";                   // of every key this communicator's groups write
  std::chrono::milliseconds timeout;
  GlooBackendMaker make_gloo;  // every group's Gloo backend
  CudaBackend cuda_backend = CudaBackend::kGloo;  // settled: kNccl or kGloo
  bool world_has_cpu = true;                      // false: a group from elsewhere with an NCCL backend alone
  struct Group {
    std::vector<int> members;
    c10::intrusive_ptr<c10d::ProcessGroup> pg;  // null on ranks outside the group
  };
  std::vector<Group> groups;

  // One ProcessGroup with a backend per device type, as torch.distributed builds "cpu:gloo,cuda:nccl":
  // Gloo for CPU tensors (the default) and, for CUDA tensors, NCCL or Gloo as cuda_backend says.
  c10::intrusive_ptr<c10d::ProcessGroup> make_group(const std::string& prefix, int rank, int size) {
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(this->prefix + prefix, store);
    auto group = c10::make_intrusive<c10d::ProcessGroup>(prefixed, rank, size);
    auto gloo = make_gloo(c10::make_intrusive<c10d::PrefixStore>("gloo/", prefixed), rank, size, timeout);
    group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
    if (cuda_backend == CudaBackend::kGloo) {
      group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::GLOO, gloo);
    }
#ifdef DKFAC_WITH_NCCL
    if (cuda_backend == CudaBackend::kNccl) {
      auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
      nccl_options->timeout = timeout;
      auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          c10::make_intrusive<c10d::PrefixStore>("nccl/", prefixed), rank, size, nccl_options);
      group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
    }
#endif
    return group;
  }
};

namespace {

// torch's collective flight recorder (on by default since 2.x, for Gloo too) records every collective with a
// captured traceback, and its first record for a process group updates a shared map outside its lock:
// process groups of ranks that are threads of one process (connect_in_process) crashed there in
// std::map insertion (torch 2.11, tests/strategy). dkfac's own diagnosis (the heartbeat watchdog, errors
// naming the operation and the silent ranks) covers what it is for, so the groups dkfac creates turn it
// off unless the user asked for it; torch reads the setting once, when the recorder is first used.
void without_flight_recorder_unless_asked() {
  if (std::getenv("TORCH_FR_BUFFER_SIZE") == nullptr && std::getenv("TORCH_NCCL_TRACE_BUFFER_SIZE") == nullptr) {
    ::setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0);
  }
}

// A write to a peer that has died (a Gloo TCP socket whose other end is closed; the store's client sends with
// MSG_NOSIGNAL) raises SIGPIPE, whose default action ends the process before any error can name the lost rank
// (seen: `dkfac train` under torchrun, exit -13, when its peer's node was killed). Python ignores SIGPIPE at
// start-up; a C++ program gets the same here, so that the write fails with EPIPE, which Gloo raises as an error. It
// is process-wide, and inherited by programs the process starts (docs/RELIABILITY.md); a handler the program
// installed is left as it is.
void ignore_broken_pipes() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    ::sigaction(SIGPIPE, &ignore, nullptr);
  }
}

std::vector<int> all_ranks(int size) {
  std::vector<int> all(size);
  std::iota(all.begin(), all.end(), 0);
  return all;
}

}  // namespace

Communicator::Communicator(std::unique_ptr<Impl> impl, int rank, int size, bool watchdog)
    : impl_(std::move(impl)), rank_(rank), size_(size) {
  ignore_broken_pipes();
  if (impl_->groups.empty()) impl_->groups.push_back({all_ranks(size), impl_->make_group("world/", rank, size)});
  if (watchdog) start_heartbeat();
}


Communicator::~Communicator() { stop_watchdog(); }

void Communicator::stop_watchdog() {
  if (heartbeat_) heartbeat_->stop();
}

std::string Communicator::silent_ranks(std::chrono::milliseconds silent_for) const {
  return heartbeat_ ? heartbeat_->silent_ranks(silent_for) : std::string();
}

void Communicator::on_lost_rank(std::function<void(const std::string&)> callback) {
  if (heartbeat_) heartbeat_->on_lost_rank(std::move(callback));
}

std::function<std::string()> Communicator::diagnosis() const {
  if (!heartbeat_) return nullptr;
  return [weak = std::weak_ptr<Heartbeat>(heartbeat_)] {
    auto heartbeat = weak.lock();
    return heartbeat ? heartbeat->diagnose() : std::string();
  };
}

void Communicator::start_heartbeat() {
  if (size_ == 1) return;
  c10::intrusive_ptr<c10d::Store> store = impl_->watch_store ? impl_->watch_store : impl_->store;
  // Heartbeat keys live under this communicator's prefix when it is not the default (a restarted job).
  if (impl_->prefix != "dkfac/") store = c10::make_intrusive<c10d::PrefixStore>(impl_->prefix, store);
  heartbeat_ = std::make_shared<Heartbeat>(std::move(store), rank_, size_, impl_->timeout, impl_->address);
}

namespace {

// Runs `connect` on its own thread and waits at most `timeout` plus a second: a TCPStore client whose
// peer accepts the connection but never answers (a port taken by another service) can block in a read
// that its own timeout does not cover. The thread is left behind on timeout; it holds only its socket.
c10::intrusive_ptr<c10d::Store> bounded_store(std::function<c10::intrusive_ptr<c10d::Store>()> connect,
                                              std::chrono::milliseconds timeout, const std::string& what) {
  struct Shared {
    std::mutex mutex;
    std::condition_variable done;
    bool finished = false;
    c10::intrusive_ptr<c10d::Store> store;
    std::string error;
  };
  auto shared = std::make_shared<Shared>();
  std::thread([shared, connect = std::move(connect)] {
    c10::intrusive_ptr<c10d::Store> store;
    std::string error;
    try {
      store = connect();
    } catch (const std::exception& e) {
      error = e.what();
    }
    std::lock_guard<std::mutex> lock(shared->mutex);
    shared->store = std::move(store);
    shared->error = std::move(error);
    shared->finished = true;
    shared->done.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(shared->mutex);
  const bool finished = shared->done.wait_for(lock, timeout + std::chrono::seconds(1), [&] { return shared->finished; });
  TORCH_CHECK(finished, what, " did not complete within ", timeout.count(),
              " ms: no rendezvous store answered there (is another service listening on that port?)");
  TORCH_CHECK(shared->error.empty(), what, " failed: ", shared->error);
  return shared->store;
}

}  // namespace

std::shared_ptr<Communicator> Communicator::connect(const RendezvousOptions& options) {
  TORCH_CHECK(options.world_size >= 1, "world size must be >= 1, got ", options.world_size);
  TORCH_CHECK(options.rank >= 0 && options.rank < options.world_size, "rank ", options.rank,
              " is outside the world of size ", options.world_size);
  TORCH_CHECK(options.port > 0 && options.port < 65536, "rendezvous port must be in 1..65535, got ", options.port);
  TORCH_CHECK(!options.key_prefix.empty(), "the store key prefix must not be empty");
  without_flight_recorder_unless_asked();
  auto impl = std::make_unique<Impl>();
  impl->timeout = options.timeout;
  impl->prefix = options.key_prefix;
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(options.port);
  store_options.isServer = options.rank == 0 && !options.external_store;
  // An external store (the elastic agent's) counts no workers: Gloo's own rendezvous waits for all ranks.
  store_options.numWorkers = options.external_store ? std::nullopt : std::optional<std::size_t>(options.world_size);
  store_options.waitWorkers = !options.external_store;
  store_options.timeout = options.timeout;
  const std::string where = options.host + ":" + std::to_string(options.port);
  impl->store = bounded_store([host = options.host, store_options] { return c10::make_intrusive<c10d::TCPStore>(host, store_options); },
                              options.timeout,
                              "rank " + std::to_string(options.rank) + ": rendezvous at " + where + " with " +
                                  std::to_string(options.world_size) + " ranks" +
                                  (options.external_store ? " (the launcher's store)" : ""));
  if (options.world_size > 1) {
    // Joined once every rank is in, so it does not count as one of the workers the store waits for.
    c10d::TCPStoreOptions client = store_options;
    client.isServer = false;
    client.waitWorkers = false;
    client.numWorkers = std::nullopt;
    impl->watch_store = bounded_store([host = options.host, client] { return c10::make_intrusive<c10d::TCPStore>(host, client); },
                                      options.timeout,
                                      "rank " + std::to_string(options.rank) +
                                          ": second connection to the rendezvous store at " + where);
  }
  impl->address = where;
  impl->make_gloo = native_gloo_backends(options.host);
  impl->cuda_backend = settle(options.cuda_backend);
  return std::shared_ptr<Communicator>(new Communicator(std::move(impl), options.rank, options.world_size));
}

std::shared_ptr<Communicator> Communicator::connect_in_process(const std::shared_ptr<InProcessStore>& store, int rank,
                                                               int world_size, std::chrono::milliseconds timeout,
                                                               CudaBackend cuda_backend) {
  TORCH_CHECK(store != nullptr, "connect_in_process needs a store");
  without_flight_recorder_unless_asked();
  auto impl = std::make_unique<Impl>();
  impl->store = store->impl_->store;
  impl->timeout = timeout;
  impl->make_gloo = native_gloo_backends("127.0.0.1");
  impl->cuda_backend = settle(cuda_backend);
  return std::shared_ptr<Communicator>(new Communicator(std::move(impl), rank, world_size));
}

std::shared_ptr<Communicator> Communicator::from_process_group(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                               c10::intrusive_ptr<c10d::Store> store,
                                                               const std::string& prefix,
                                                               std::chrono::milliseconds timeout,
                                                               GlooBackendMaker make_gloo) {
  TORCH_CHECK(group, "from_process_group needs a process group, got None");
  TORCH_CHECK(store, "from_process_group needs the store its subgroups meet through, got None");
  auto impl = std::make_unique<Impl>();
  impl->store = std::move(store);
  impl->timeout = timeout;
  impl->prefix = prefix;
  impl->address = "the process group's store";
  const int rank = group->getRank();
  const int size = group->getSize();
  // Subgroups mirror the group's backends: NCCL for CUDA tensors where it uses NCCL for them.
  bool cuda = false;
  impl->world_has_cpu = false;
  for (const auto& device : group->getDeviceTypes()) {
    cuda = cuda || device.is_cuda();
    impl->world_has_cpu = impl->world_has_cpu || device.is_cpu();
  }
  const bool nccl = cuda && group->getBackend(c10::DeviceType::CUDA)->getBackendName() == "nccl";
  impl->cuda_backend = nccl ? settle(CudaBackend::kNccl) : CudaBackend::kGloo;
  impl->groups.push_back({all_ranks(size), std::move(group)});
  if (size > 1) impl->make_gloo = make_gloo ? std::move(make_gloo) : native_gloo_backends("");
  // The heartbeat watchdog needs a store client of its own (a TCPStore's clone: torch.distributed's default
  // store); a store that cannot be cloned (a FileStore, a HashStore) leaves failures to the group's own errors.
  if (size > 1) {
    try {
      impl->watch_store = impl->store->clone();
    } catch (const std::exception&) {
      impl->watch_store.reset();
    }
  }
  const bool watchdog = static_cast<bool>(impl->watch_store);
  return std::shared_ptr<Communicator>(new Communicator(std::move(impl), rank, size, watchdog));
}

GroupId Communicator::new_group(const std::vector<int>& ranks) {
  TORCH_CHECK(!ranks.empty() && std::is_sorted(ranks.begin(), ranks.end()), "group ranks must be non-empty and ascending");
  TORCH_CHECK(ranks.front() >= 0 && ranks.back() < size_, "group ranks must be in [0, ", size_, ")");
  const GroupId id = static_cast<GroupId>(impl_->groups.size());
  Impl::Group group{ranks, {}};
  const auto it = std::find(ranks.begin(), ranks.end(), rank_);
  if (it != ranks.end()) {
    group.pg = impl_->make_group("group" + std::to_string(id) + "/", static_cast<int>(it - ranks.begin()),
                                 static_cast<int>(ranks.size()));
  }
  impl_->groups.push_back(std::move(group));
  return id;
}

const std::vector<int>& Communicator::members(GroupId group) const { return impl_->groups.at(group).members; }

CudaBackend Communicator::cuda_backend() const { return impl_->cuda_backend; }

c10::Device control_device_for(bool world_has_cpu, std::optional<c10::Device> work_device) {
  if (world_has_cpu) return c10::Device(c10::kCPU);
  TORCH_CHECK(work_device.has_value(), "the process group has no CPU backend (an NCCL-only group) and no device "
              "was given for dkfac's control tensors: build the Preconditioner (which gives its layers' device) "
              "before any collective, or create the group with backend 'cpu:gloo,cuda:nccl'");
  TORCH_CHECK(work_device->is_cuda(), "the process group has no CPU backend (an NCCL-only group), but the layers "
              "are on ", work_device->str(), ": an NCCL group carries CUDA tensors only; move the model to its GPU "
              "or create the group with backend 'gloo' or 'cpu:gloo,cuda:nccl'");
  if (work_device->has_index()) return *work_device;
  return c10::Device(c10::kCUDA, c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice().index());
}

c10::Device Communicator::control_device() const {
  std::lock_guard<std::mutex> lock(traffic_mutex_);
  return control_device_for(impl_->world_has_cpu, work_device_);
}

void Communicator::use_device(c10::Device device) {
  std::lock_guard<std::mutex> lock(traffic_mutex_);
  work_device_ = device;
}

void Communicator::add_traffic(Purpose phase, int64_t calls, int64_t bytes) {
  std::lock_guard<std::mutex> lock(traffic_mutex_);
  auto& t = traffic_[phase];
  t.calls += calls;
  t.bytes += bytes;
}

c10::intrusive_ptr<c10d::ProcessGroup> Communicator::process_group(GroupId group) const {
  return impl_->groups.at(group).pg;
}

std::string Communicator::diagnose_failure() const {
  const auto diagnose = diagnosis();
  return diagnose ? diagnose() : std::string();
}

void Communicator::count(Purpose phase, const torch::Tensor& tensor) {
  std::lock_guard<std::mutex> lock(traffic_mutex_);
  auto& t = traffic_[phase];
  ++t.calls;
  t.bytes += tensor.numel() * static_cast<int64_t>(tensor.element_size());
}

namespace {

// Gloo has no bfloat16 or float16 arithmetic: such tensors travel as float32 (exact: every one is a
// float32), and the result is rounded back into the caller's tensor when the collective completes. NCCL
// reduces both natively.
torch::Tensor on_the_wire(const torch::Tensor& tensor, CudaBackend cuda_backend) {
  const bool half = tensor.scalar_type() == torch::kBFloat16 || tensor.scalar_type() == torch::kHalf;
  const bool gloo = !tensor.is_cuda() || cuda_backend != CudaBackend::kNccl;
  return half && gloo ? tensor.to(torch::kFloat32) : tensor;
}

}  // namespace

Handle Communicator::allreduce_sum(torch::Tensor tensor, GroupId group, Purpose phase) {
  auto& g = impl_->groups.at(group);
  TORCH_CHECK(g.pg, "rank ", rank_, " is not in group ", group, " (", to_string(phase), ")");
  TORCH_CHECK(tensor.is_contiguous(), "allreduce needs a contiguous tensor (", to_string(phase), ")");
  Handle h;
  if (g.members.size() == 1) return h;
  count(phase, tensor);
  auto wire = on_the_wire(tensor, impl_->cuda_backend);
  std::vector<torch::Tensor> tensors{wire};
  h.impl_ = std::make_unique<Handle::Impl>();
  h.impl_->work = g.pg->allreduce(tensors);
  h.impl_->diagnose = diagnosis();
  h.impl_->what = "rank " + std::to_string(rank_) + ": allreduce of " + std::to_string(tensor.numel()) + " elements (" + to_string(phase) + ") over " +
                  std::to_string(g.members.size()) + " ranks";
  if (!wire.is_same(tensor)) h.impl_->after = [tensor, wire]() mutable { tensor.copy_(wire); };
  return h;
}

Handle Communicator::allreduce_mean(torch::Tensor tensor, GroupId group, Purpose phase) {
  Handle h = allreduce_sum(tensor, group, phase);
  const auto n = static_cast<double>(impl_->groups.at(group).members.size());
  if (h.impl_) {
    h.impl_->after = [tensor, n, copy_back = std::move(h.impl_->after)]() mutable {
      if (copy_back) copy_back();
      tensor.div_(n);
    };
  }
  return h;
}

Handle Communicator::broadcast(torch::Tensor tensor, int root, GroupId group, Purpose phase) {
  return rooted(std::move(tensor), root, group, phase, /*reduce=*/false);
}

Handle Communicator::reduce_sum(torch::Tensor tensor, int root, GroupId group, Purpose phase) {
  return rooted(std::move(tensor), root, group, phase, /*reduce=*/true);
}

Handle Communicator::rooted(torch::Tensor tensor, int root, GroupId group, Purpose phase, bool reduce) {
  const char* kind = reduce ? "reduce" : "broadcast";
  auto& g = impl_->groups.at(group);
  TORCH_CHECK(g.pg, "rank ", rank_, " is not in group ", group, " (", to_string(phase), ")");
  TORCH_CHECK(tensor.is_contiguous(), kind, " needs a contiguous tensor (", to_string(phase), ")");
  const auto it = std::find(g.members.begin(), g.members.end(), root);
  TORCH_CHECK(it != g.members.end(), kind, " root ", root, " is not in group ", group);
  Handle h;
  if (g.members.size() == 1) return h;
  count(phase, tensor);
  const auto index = static_cast<int64_t>(it - g.members.begin());
  auto wire = on_the_wire(tensor, impl_->cuda_backend);
  std::vector<torch::Tensor> tensors{wire};
  h.impl_ = std::make_unique<Handle::Impl>();
  if (reduce) {
    c10d::ReduceOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    options.rootRank = index;
    h.impl_->work = g.pg->reduce(tensors, options);
  } else {
    c10d::BroadcastOptions options;
    options.rootRank = index;
    h.impl_->work = g.pg->broadcast(tensors, options);
  }
  h.impl_->diagnose = diagnosis();
  h.impl_->what = "rank " + std::to_string(rank_) + ": " + kind + " of " + std::to_string(tensor.numel()) +
                  " elements (" + to_string(phase) + (reduce ? ") to rank " : ") from rank ") + std::to_string(root);
  // A reduce leaves its sum in the root's tensor alone.
  if (!wire.is_same(tensor) && (!reduce || root == rank_)) {
    h.impl_->after = [tensor, wire]() mutable { tensor.copy_(wire); };
  }
  return h;
}

std::map<std::string, Traffic> Communicator::traffic() const {
  std::lock_guard<std::mutex> lock(traffic_mutex_);
  std::map<std::string, Traffic> named;
  for (const auto& [phase, t] : traffic_) named[to_string(phase)] = t;
  return named;
}

const std::vector<Purpose>& Communicator::all_purposes() {
  static const std::vector<Purpose> phases = {Purpose::kDataParallel, Purpose::kFactors,     Purpose::kSecondOrder,
                                            Purpose::kGradients,    Purpose::kCalibration, Purpose::kSetup,
                                            Purpose::kFiniteCheck,  Purpose::kControl};
  return phases;
}

std::vector<std::string> Communicator::all_phase_names() {
  std::vector<std::string> names;
  for (const Purpose phase : all_purposes()) names.emplace_back(to_string(phase));
  return names;
}

void average_over(Communicator& communicator, GroupId group, std::vector<double>& values, Purpose phase) {
  auto t = torch::tensor(values, torch::kFloat64).to(communicator.control_device());
  communicator.allreduce_mean(t, group, phase).wait();
  t = t.to(torch::kCPU);
  for (size_t i = 0; i < values.size(); ++i) values[i] = t[static_cast<int64_t>(i)].item<double>();
}

std::vector<std::vector<double>> gather_over(Communicator& communicator, GroupId group,
                                             const std::vector<double>& values, Purpose phase) {
  const auto& members = communicator.members(group);
  const auto at = std::find(members.begin(), members.end(), communicator.rank());
  TORCH_CHECK(at != members.end(), "gather_over: rank ", communicator.rank(), " is not in the group");
  const auto n = static_cast<int64_t>(values.size());
  auto table = torch::zeros({static_cast<int64_t>(members.size()), n}, torch::kFloat64);
  table[at - members.begin()].copy_(torch::tensor(values, torch::kFloat64));
  auto t = table.to(communicator.control_device());
  communicator.allreduce_sum(t, group, phase).wait();
  t = t.to(torch::kCPU).contiguous();
  std::vector<std::vector<double>> out;
  for (int64_t r = 0; r < t.size(0); ++r) {
    const double* row = t[r].data_ptr<double>();
    out.emplace_back(row, row + n);
  }
  return out;
}

}  // namespace dkfac::comm
