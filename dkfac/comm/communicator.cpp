// The only translation unit of dkfac that includes c10d.
#define USE_C10D_GLOO 1
#include "dkfac/comm/communicator.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <iomanip>
#include <numeric>
#include <sstream>
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
  std::shared_ptr<::gloo::transport::Device> device;
  struct Group {
    std::vector<int> members;
    c10::intrusive_ptr<c10d::ProcessGroup> pg;  // null on ranks outside the group
  };
  std::vector<Group> groups;

  c10::intrusive_ptr<c10d::ProcessGroupGloo> make_group(const std::string& prefix, int rank, int size) {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(device);
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(this->prefix + prefix, store);
    return c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, size, options);
  }
};

namespace {

std::shared_ptr<::gloo::transport::Device> make_device(const std::string& host) {
  if (const char* ifname = std::getenv("DKFAC_GLOO_IFNAME")) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  // torch.distributed's own variable, so that groups next to a torch.distributed job use its interface.
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  if (host == "127.0.0.1" || host == "localhost") return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

std::vector<int> all_ranks(int size) {
  std::vector<int> all(size);
  std::iota(all.begin(), all.end(), 0);
  return all;
}

}  // namespace

Communicator::Communicator(std::unique_ptr<Impl> impl, int rank, int size, bool watchdog)
    : impl_(std::move(impl)), rank_(rank), size_(size) {
  if (impl_->groups.empty()) impl_->groups.push_back({all_ranks(size), impl_->make_group("world/", rank, size)});
  if (watchdog) start_watchdog();
}

// Heartbeats through the store. The thread owns its own store client where the store is a TCPStore, so
// that a blocking store call of the main thread (group creation) never delays a heartbeat; only this
// thread touches that client.
//
// The first rank to diagnose a loss publishes it under kLostKey, and every other rank reports that
// diagnosis instead of its own: when rank 3 dies and rank 0 stops because of it, rank 1 must still say
// "lost rank 3", not "lost rank 0". Rank 0 hosts the store, so after a loss it lingers until the other
// ranks have stopped beating (they have read the diagnosis) or a few intervals have passed.
struct Communicator::Watchdog {
  using Clock = std::chrono::steady_clock;
  static constexpr const char* kLostKey = "dkfac/lost";
  c10::intrusive_ptr<c10d::Store> store;
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds interval{1000};
  std::chrono::milliseconds timeout{60000};
  std::string store_address;  // for messages

  std::mutex mutex;
  std::condition_variable wake;
  bool stopping = false;
  std::vector<std::string> last_value;
  std::vector<Clock::time_point> last_change;
  std::string store_error;
  std::string remote_lost;  // another rank's published diagnosis, "rank 3 (...) (reported by rank 0)"
  std::string to_publish;   // this rank's diagnosis, written to the store by the thread
  bool published = false;
  bool failure_seen = false;
  std::function<void(const std::string&)> on_lost;
  bool reported = false;
  std::thread thread;

  static std::string key(int r) { return "dkfac/heartbeat/" + std::to_string(r); }
  static std::vector<uint8_t> bytes(const std::string& text) { return {text.begin(), text.end()}; }

  void start() {
    last_value.assign(size, "");
    last_change.assign(size, Clock::now());
    thread = std::thread([this] { run(); });
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stopping = true;
    }
    wake.notify_all();
    if (thread.joinable()) thread.join();
  }

  // One round with the store, without the lock: publish a pending diagnosis, beat, read the others'
  // heartbeats and any published diagnosis; then record what was seen.
  void poll(int64_t beat) {
    std::string publish_now;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (!to_publish.empty() && !published) publish_now = to_publish;
      published = published || !publish_now.empty();
    }
    std::string error, lost_value;
    std::vector<std::string> seen(size);
    try {
      if (!publish_now.empty() && !store->check({kLostKey})) {
        store->set(kLostKey, bytes(std::to_string(rank) + "|" + publish_now));
      }
      store->set(key(rank), bytes(std::to_string(beat)));
      for (int r = 0; r < size; ++r) {
        if (r == rank || !store->check({key(r)})) continue;
        const auto value = store->get(key(r));
        seen[r] = std::string(value.begin(), value.end());
      }
      if (store->check({kLostKey})) {
        const auto value = store->get(kLostKey);
        lost_value.assign(value.begin(), value.end());
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
    std::lock_guard<std::mutex> lock(mutex);
    const auto now = Clock::now();
    if (!error.empty() && store_error.empty()) store_error = error;
    for (int r = 0; r < size; ++r) {
      if (r == rank || seen[r].empty() || seen[r] == last_value[r]) continue;
      last_value[r] = seen[r];
      last_change[r] = now;
    }
    const auto bar = lost_value.find('|');
    if (bar != std::string::npos && remote_lost.empty() && lost_value.substr(0, bar) != std::to_string(rank)) {
      remote_lost = lost_value.substr(bar + 1) + " (reported by rank " + lost_value.substr(0, bar) + ")";
      failure_seen = true;
    }
    wake.notify_all();
  }

  // How long rank 0 keeps the store up for the others, after a loss or at a clean end.
  Clock::time_point grace_deadline() const {
    return Clock::now() + std::max<Clock::duration>(std::chrono::seconds(2), 5 * interval);
  }

  // Rank 0 after a loss: keeps the store up until every other rank has stopped beating or a few intervals
  // (at least 2 s) have passed, so that the others can read the published diagnosis.
  void linger(int64_t& beat) {
    const auto deadline = grace_deadline();
    while (Clock::now() < deadline) {
      poll(++beat);
      {
        std::lock_guard<std::mutex> lock(mutex);
        const auto now = Clock::now();
        bool all_quiet = true;
        for (int r = 0; r < size; ++r) all_quiet = all_quiet && (r == rank || now - last_change[r] >= 2 * interval);
        if (all_quiet) return;
      }
      std::this_thread::sleep_for(interval / 2);
    }
  }

  void run() {
    int64_t beat = 0;
    std::unique_lock<std::mutex> lock(mutex);
    while (!stopping) {
      lock.unlock();
      poll(++beat);
      lock.lock();
      std::string lost;
      if (!remote_lost.empty()) {
        lost = remote_lost;
      } else if (!store_error.empty() && rank != 0) {
        lost = "rank 0 (the rendezvous store it hosts at " + store_address + " stopped answering: " + store_error + ")";
      } else {
        lost = silent_locked(timeout, Clock::now());
        if (!lost.empty() && to_publish.empty()) to_publish = lost;
      }
      if (!lost.empty() && !reported && on_lost && !stopping) {
        reported = true;
        failure_seen = true;
        auto callback = on_lost;
        // Publish this rank's own diagnosis before the callback ends the process; not through a store that
        // already failed, whose every call waits for the timeout again.
        const bool publish = !to_publish.empty() && !published && store_error.empty();
        lock.unlock();
        if (publish) poll(++beat);
        if (rank == 0) linger(beat);
        callback("rank " + std::to_string(rank) + " lost " + lost);
        lock.lock();
      }
      wake.wait_for(lock, interval, [this] { return stopping; });
    }
    // Stopping after a failed collective: publish the diagnosis and, on rank 0, keep the store up a little.
    const bool after_failure = failure_seen && !reported;
    const bool publish = after_failure && !to_publish.empty() && !published && store_error.empty();
    lock.unlock();
    if (publish) poll(++beat);
    if (after_failure && rank == 0) linger(beat);
    if (!after_failure && !reported) finish();
  }

  // A clean shutdown: every rank marks itself done, and rank 0, which hosts the store, keeps it up until
  // all have (at most max(2 s, 5 intervals)), so that no rank's last heartbeat finds the store gone and
  // takes a finished job for a lost rank 0.
  void finish() {
    try {
      store->set("dkfac/done/" + std::to_string(rank), bytes("1"));
      if (rank != 0) return;
      const auto deadline = grace_deadline();
      for (int r = 1; r < size; ++r) {
        while (!store->check({"dkfac/done/" + std::to_string(r)})) {
          if (Clock::now() >= deadline) return;
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      }
    } catch (const std::exception&) {
      // The store is gone or unreachable: nothing left to coordinate.
    }
  }

  // "rank 2 (no heartbeat for 5.8 s), rank 1 (...)": the longest silent first, which is the rank that was
  // lost first when the others stopped because of it.
  std::string describe(std::vector<int> ranks, Clock::time_point now) const {
    std::stable_sort(ranks.begin(), ranks.end(), [this](int a, int b) { return last_change[a] < last_change[b]; });
    std::ostringstream out;
    for (int r : ranks) {
      out << (out.tellp() > 0 ? ", " : "") << "rank " << r << " (no heartbeat for " << std::fixed
          << std::setprecision(1) << std::chrono::duration<double>(now - last_change[r]).count() << " s)";
    }
    return out.str();
  }

  std::string silent_locked(std::chrono::milliseconds silent_for, Clock::time_point now) const {
    std::vector<int> silent;
    for (int r = 0; r < size; ++r) {
      if (r != rank && now - last_change[r] >= silent_for) silent.push_back(r);
    }
    return describe(silent, now);
  }

  // After a failed collective: waits a few heartbeats and names the ranks that did not beat meanwhile,
  // or the diagnosis another rank published first. The result is published for the other ranks.
  std::string diagnose() {
    const auto since = Clock::now();
    std::unique_lock<std::mutex> lock(mutex);
    failure_seen = true;
    wake.wait_for(lock, 3 * interval, [this] { return stopping || !remote_lost.empty(); });
    if (!remote_lost.empty()) return remote_lost;
    if (!store_error.empty() && rank != 0) return "rank 0 (its rendezvous store stopped answering)";
    std::vector<int> silent;
    for (int r = 0; r < size; ++r) {
      // A live rank beats every interval; allow one interval for this thread to notice.
      if (r != rank && last_change[r] <= since + interval) silent.push_back(r);
    }
    auto found = describe(silent, Clock::now());
    if (!found.empty() && to_publish.empty()) to_publish = found;
    wake.notify_all();
    return found;
  }
};

Communicator::~Communicator() {
  if (watchdog_) watchdog_->stop();
}

std::string Communicator::silent_ranks(std::chrono::milliseconds silent_for) const {
  if (!watchdog_) return "";
  std::lock_guard<std::mutex> lock(watchdog_->mutex);
  return watchdog_->silent_locked(silent_for, Watchdog::Clock::now());
}

void Communicator::on_lost_rank(std::function<void(const std::string&)> callback) {
  if (!watchdog_) return;
  std::lock_guard<std::mutex> lock(watchdog_->mutex);
  watchdog_->on_lost = std::move(callback);
}

std::function<std::string()> Communicator::diagnosis() const {
  if (!watchdog_) return nullptr;
  return [weak = std::weak_ptr<Watchdog>(watchdog_)] {
    auto watchdog = weak.lock();
    return watchdog ? watchdog->diagnose() : std::string();
  };
}

void Communicator::start_watchdog() {
  if (size_ == 1) return;
  watchdog_ = std::make_shared<Watchdog>();
  watchdog_->store = impl_->watch_store ? impl_->watch_store : impl_->store;
  // Heartbeat keys live under this communicator's prefix when it is not the default (a restarted job).
  if (impl_->prefix != "dkfac/") watchdog_->store = c10::make_intrusive<c10d::PrefixStore>(impl_->prefix, watchdog_->store);
  watchdog_->rank = rank_;
  watchdog_->size = size_;
  watchdog_->timeout = impl_->timeout;
  watchdog_->interval = std::max(std::chrono::milliseconds(50), std::min(std::chrono::milliseconds(1000),
                                                                          impl_->timeout / 10));
  watchdog_->store_address = impl_->address;
  watchdog_->start();
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
  auto impl = std::make_unique<Impl>();
  impl->timeout = options.timeout;
  impl->prefix = options.key_prefix;
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(options.port);
  store_options.isServer = options.rank == 0 && !options.external_store;
  // An external store (the elastic agent's) counts no workers: Gloo's own rendezvous waits for all ranks.
  store_options.numWorkers = options.external_store ? c10::nullopt : c10::optional<std::size_t>(options.world_size);
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
    client.numWorkers = c10::nullopt;
    impl->watch_store = bounded_store([host = options.host, client] { return c10::make_intrusive<c10d::TCPStore>(host, client); },
                                      options.timeout,
                                      "rank " + std::to_string(options.rank) +
                                          ": second connection to the rendezvous store at " + where);
  }
  impl->address = where;
  impl->device = make_device(options.host);
  return std::shared_ptr<Communicator>(new Communicator(std::move(impl), options.rank, options.world_size));
}

std::shared_ptr<Communicator> Communicator::connect_in_process(const std::shared_ptr<InProcessStore>& store, int rank,
                                                               int world_size, std::chrono::milliseconds timeout) {
  TORCH_CHECK(store != nullptr, "connect_in_process needs a store");
  auto impl = std::make_unique<Impl>();
  impl->store = store->impl_->store;
  impl->timeout = timeout;
  impl->device = make_device("127.0.0.1");
  return std::shared_ptr<Communicator>(new Communicator(std::move(impl), rank, world_size));
}

std::shared_ptr<Communicator> Communicator::from_process_group(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                               c10::intrusive_ptr<c10d::Store> store,
                                                               const std::string& prefix,
                                                               std::chrono::milliseconds timeout) {
  TORCH_CHECK(group, "from_process_group needs a process group, got None");
  TORCH_CHECK(store, "from_process_group needs the store its subgroups meet through, got None");
  auto impl = std::make_unique<Impl>();
  impl->store = std::move(store);
  impl->timeout = timeout;
  impl->prefix = prefix;
  impl->address = "the process group's store";
  const int rank = group->getRank();
  const int size = group->getSize();
  impl->groups.push_back({all_ranks(size), std::move(group)});
  if (size > 1) impl->device = make_device("");
  return std::shared_ptr<Communicator>(new Communicator(std::move(impl), rank, size, /*watchdog=*/false));
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

bool Communicator::contains(GroupId group, int rank) const {
  const auto& m = members(group);
  return std::binary_search(m.begin(), m.end(), rank);
}

void Communicator::add_traffic(const std::string& phase, int64_t calls, int64_t bytes) {
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

void Communicator::count(const std::string& phase, const torch::Tensor& tensor) {
  std::lock_guard<std::mutex> lock(traffic_mutex_);
  auto& t = traffic_[phase];
  ++t.calls;
  t.bytes += tensor.numel() * static_cast<int64_t>(tensor.element_size());
}

namespace {

// Gloo has no bfloat16 arithmetic: such tensors travel as float32 (exact: every bfloat16 is a float32),
// and the result is rounded back into the caller's tensor when the collective completes.
torch::Tensor on_the_wire(const torch::Tensor& tensor) {
  return tensor.scalar_type() == torch::kBFloat16 ? tensor.to(torch::kFloat32) : tensor;
}

}  // namespace

Handle Communicator::allreduce_sum(torch::Tensor tensor, GroupId group, const std::string& phase) {
  auto& g = impl_->groups.at(group);
  TORCH_CHECK(g.pg, "rank ", rank_, " is not in group ", group, " (", phase, ")");
  TORCH_CHECK(tensor.is_contiguous(), "allreduce needs a contiguous tensor (", phase, ")");
  Handle h;
  if (g.members.size() == 1) return h;
  count(phase, tensor);
  auto wire = on_the_wire(tensor);
  std::vector<torch::Tensor> tensors{wire};
  h.impl_ = std::make_unique<Handle::Impl>();
  h.impl_->work = g.pg->allreduce(tensors);
  h.impl_->diagnose = diagnosis();
  h.impl_->what = "allreduce of " + std::to_string(tensor.numel()) + " elements (" + phase + ") over " +
                  std::to_string(g.members.size()) + " ranks";
  if (!wire.is_same(tensor)) h.impl_->after = [tensor, wire]() mutable { tensor.copy_(wire); };
  return h;
}

Handle Communicator::allreduce_mean(torch::Tensor tensor, GroupId group, const std::string& phase) {
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

Handle Communicator::broadcast(torch::Tensor tensor, int root, GroupId group, const std::string& phase) {
  auto& g = impl_->groups.at(group);
  TORCH_CHECK(g.pg, "rank ", rank_, " is not in group ", group, " (", phase, ")");
  TORCH_CHECK(tensor.is_contiguous(), "broadcast needs a contiguous tensor (", phase, ")");
  const auto it = std::find(g.members.begin(), g.members.end(), root);
  TORCH_CHECK(it != g.members.end(), "broadcast root ", root, " is not in group ", group);
  Handle h;
  if (g.members.size() == 1) return h;
  count(phase, tensor);
  c10d::BroadcastOptions options;
  options.rootRank = static_cast<int64_t>(it - g.members.begin());
  auto wire = on_the_wire(tensor);
  std::vector<torch::Tensor> tensors{wire};
  h.impl_ = std::make_unique<Handle::Impl>();
  h.impl_->work = g.pg->broadcast(tensors, options);
  h.impl_->diagnose = diagnosis();
  h.impl_->what = "broadcast of " + std::to_string(tensor.numel()) + " elements (" + phase + ") from rank " +
                  std::to_string(root);
  if (!wire.is_same(tensor)) h.impl_->after = [tensor, wire]() mutable { tensor.copy_(wire); };
  return h;
}

void Communicator::barrier() {
  auto work = impl_->groups.at(kWorld).pg->barrier();
  try {
    work->wait();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "dkfac: barrier of ", size_, " ranks failed: ", e.what());
  }
}

std::map<std::string, Traffic> Communicator::traffic() const {
  std::lock_guard<std::mutex> lock(traffic_mutex_);
  return traffic_;
}

}  // namespace dkfac::comm
