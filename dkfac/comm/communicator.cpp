// The only translation unit of dkfac that includes c10d.
#define USE_C10D_GLOO 1
#include "dkfac/comm/communicator.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cstdlib>
#include <functional>

namespace dkfac::comm {

struct Handle::Impl {
  c10::intrusive_ptr<c10d::Work> work;
  std::function<void()> after;  // runs once the collective completed
  std::string what;             // for error messages
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
    TORCH_CHECK(false, "dkfac: ", impl->what, " failed (a peer died, stopped answering or the timeout passed): ",
                e.what());
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
  std::chrono::milliseconds timeout;
  std::shared_ptr<::gloo::transport::Device> device;
  struct Group {
    std::vector<int> members;
    c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;  // null on ranks outside the group
  };
  std::vector<Group> groups;

  c10::intrusive_ptr<c10d::ProcessGroupGloo> make_group(const std::string& prefix, int rank, int size) {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(device);
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(prefix, store);
    return c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, size, options);
  }
};

namespace {

std::shared_ptr<::gloo::transport::Device> make_device(const std::string& host) {
  if (const char* ifname = std::getenv("DKFAC_GLOO_IFNAME")) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  if (host == "127.0.0.1" || host == "localhost") return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

}  // namespace

Communicator::Communicator(std::unique_ptr<Impl> impl, int rank, int size)
    : impl_(std::move(impl)), rank_(rank), size_(size) {
  std::vector<int> all(size);
  for (int r = 0; r < size; ++r) all[r] = r;
  impl_->groups.push_back({all, impl_->make_group("dkfac/world/", rank, size)});
}

Communicator::~Communicator() = default;

std::shared_ptr<Communicator> Communicator::connect(const RendezvousOptions& options) {
  TORCH_CHECK(options.world_size >= 1, "world size must be >= 1, got ", options.world_size);
  TORCH_CHECK(options.rank >= 0 && options.rank < options.world_size, "rank ", options.rank,
              " is outside the world of size ", options.world_size);
  TORCH_CHECK(options.port > 0 && options.port < 65536, "rendezvous port must be in 1..65535, got ", options.port);
  auto impl = std::make_unique<Impl>();
  impl->timeout = options.timeout;
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(options.port);
  store_options.isServer = options.rank == 0;
  store_options.numWorkers = options.world_size;
  store_options.waitWorkers = true;
  store_options.timeout = options.timeout;
  try {
    impl->store = c10::make_intrusive<c10d::TCPStore>(options.host, store_options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", options.rank, ": rendezvous at ", options.host, ":", options.port, " with ",
                options.world_size, " ranks failed within ", options.timeout.count(), " ms: ", e.what());
  }
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

GroupId Communicator::new_group(const std::vector<int>& ranks) {
  TORCH_CHECK(!ranks.empty() && std::is_sorted(ranks.begin(), ranks.end()), "group ranks must be non-empty and ascending");
  TORCH_CHECK(ranks.front() >= 0 && ranks.back() < size_, "group ranks must be in [0, ", size_, ")");
  const GroupId id = static_cast<GroupId>(impl_->groups.size());
  Impl::Group group{ranks, {}};
  const auto it = std::find(ranks.begin(), ranks.end(), rank_);
  if (it != ranks.end()) {
    group.pg = impl_->make_group("dkfac/group" + std::to_string(id) + "/", static_cast<int>(it - ranks.begin()),
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

void Communicator::count(const std::string& phase, const torch::Tensor& tensor) {
  std::lock_guard<std::mutex> lock(traffic_mutex_);
  auto& t = traffic_[phase];
  ++t.calls;
  t.bytes += tensor.numel() * static_cast<int64_t>(tensor.element_size());
}

Handle Communicator::allreduce_sum(torch::Tensor tensor, GroupId group, const std::string& phase) {
  auto& g = impl_->groups.at(group);
  TORCH_CHECK(g.pg, "rank ", rank_, " is not in group ", group, " (", phase, ")");
  TORCH_CHECK(tensor.is_contiguous(), "allreduce needs a contiguous tensor (", phase, ")");
  Handle h;
  if (g.members.size() == 1) return h;
  count(phase, tensor);
  std::vector<torch::Tensor> tensors{tensor};
  h.impl_ = std::make_unique<Handle::Impl>();
  h.impl_->work = g.pg->allreduce(tensors);
  h.impl_->what = "allreduce of " + std::to_string(tensor.numel()) + " elements (" + phase + ") over " +
                  std::to_string(g.members.size()) + " ranks";
  return h;
}

Handle Communicator::allreduce_mean(torch::Tensor tensor, GroupId group, const std::string& phase) {
  Handle h = allreduce_sum(tensor, group, phase);
  const auto n = static_cast<double>(impl_->groups.at(group).members.size());
  if (h.impl_) h.impl_->after = [tensor, n]() mutable { tensor.div_(n); };
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
  std::vector<torch::Tensor> tensors{tensor};
  h.impl_ = std::make_unique<Handle::Impl>();
  h.impl_->work = g.pg->broadcast(tensors, options);
  h.impl_->what = "broadcast of " + std::to_string(tensor.numel()) + " elements (" + phase + ") from rank " +
                  std::to_string(root);
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
