#include "dkfac/device.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <tuple>
#include <mutex>
#include <utility>
#include <vector>

namespace dkfac::device {
namespace {

/// Timing events, reused: every layer marks its factor work at every factor step (four events a layer, about
/// 580 a step on a BERT-Large stack), and creating and destroying a CUDA event each time costs more than the
/// mark. A Mark's event goes back to the pool of its device when the last copy of the Mark is gone.
class EventPool {
 public:
  std::shared_ptr<c10::Event> take(c10::Device device) {
    std::unique_ptr<c10::Event> event;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& free = free_[{device.type(), device.index()}];
      if (!free.empty()) {
        event = std::move(free.back());
        free.pop_back();
      }
    }
    if (!event) {
      // BACKEND_DEFAULT: a CUDA event with timing (PYTORCH_DEFAULT disables it).
      event = std::make_unique<c10::Event>(device.type(), c10::EventFlag::BACKEND_DEFAULT);
      ++created_;
    }
    return {event.release(), [this, device](c10::Event* e) {
              std::lock_guard<std::mutex> lock(mutex_);
              free_[{device.type(), device.index()}].emplace_back(e);
            }};
  }
  int64_t created() const { return created_; }

 private:
  std::mutex mutex_;
  std::map<std::pair<c10::DeviceType, c10::DeviceIndex>, std::vector<std::unique_ptr<c10::Event>>> free_;
  std::atomic<int64_t> created_{0};
};

// Never destroyed: Marks may outlive static destruction, and destroying CUDA events after the driver's
// shutdown fails.
EventPool& event_pool() {
  static auto* pool = new EventPool();
  return *pool;
}

}  // namespace

Mark Mark::now(c10::Device device) {
  Mark mark;
  if (device.is_cpu()) {
    mark.host_ = std::chrono::steady_clock::now();
    return mark;
  }
  const auto stream = current_stream(device);
  mark.event_ = event_pool().take(stream.device());
  mark.event_->record(stream);
  return mark;
}

int64_t events_created() { return event_pool().created(); }

namespace {

// One low-priority stream of the pool per device and lane, taken the first time it is asked for.
c10::Stream lane_stream(const c10::impl::DeviceGuardImplInterface& guard, c10::Device device, size_t lane) {
  static std::mutex mutex;
  static std::map<std::tuple<c10::DeviceType, c10::DeviceIndex, size_t>, c10::Stream> streams;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(device.type(), device.index(), lane);
  auto found = streams.find(key);
  if (found == streams.end()) {
    found = streams.emplace(key, guard.getStreamFromGlobalPool(device, /*isHighPriority=*/false)).first;
  }
  return found->second;
}

}  // namespace

SideWork::SideWork(c10::Device device, size_t lane) : device_(device) {
  if (device.is_cpu()) return;
  const auto current = current_stream(device);
  device_ = current.device();
  side_ = lane_stream(*c10::impl::getDeviceGuardImpl(device.type()), device_, lane);
  started_.emplace(device.type());
  done_.emplace(device.type());
  started_->record(current);
}

void SideWork::run(const std::function<void()>& work) {
  at::init_num_threads();
  at::NoGradGuard no_grad;
  at::NoTF32Guard no_tf32;
  if (!side_) {
    work();
    return;
  }
  c10::DeviceGuard on_device(device_);
  c10::StreamGuard on_stream(*side_);
  started_->block(*side_);
  try {
    work();
  } catch (...) {
    done_->record(*side_);  // join still waits for what the work enqueued before it failed
    throw;
  }
  done_->record(*side_);
}

void SideWork::join(const std::vector<c10::Storage>& made) {
  if (!side_) return;
  const auto* guard = c10::impl::getDeviceGuardImpl(device_.type());
  const auto current = guard->getStream(device_);
  done_->block(current);
  for (const auto& storage : made) {
    if (storage) guard->recordDataPtrOnStream(storage.data_ptr(), current);
  }
}

double Mark::seconds_between(const Mark& start, const Mark& end) {
  TORCH_INTERNAL_ASSERT((start.event_ == nullptr) == (end.event_ == nullptr), "marks of different devices");
  if (!start.event_) return std::chrono::duration<double>(end.host_ - start.host_).count();
  end.event_->synchronize();
  return start.event_->elapsedTime(*end.event_) / 1000.0;  // milliseconds
}

bool Mark::reached() const { return !event_ || event_->query(); }

c10::Stream current_stream(c10::Device device) {
  if (device.is_cpu()) return c10::Stream(c10::Stream::DEFAULT, device);
  const auto* guard = c10::impl::getDeviceGuardImpl(device.type());
  return guard->getStream(device.has_index() ? device : c10::Device(device.type(), guard->getDevice().index()));
}

void Mark::wait() const {
  if (event_) event_->synchronize();
}

namespace {

/// The device's caching allocator, set up first: before anything touched the device in this process (a fresh
/// process that asks for statistics first) it has no per-device state, and asking it fails.
c10::DeviceAllocator* initialised_allocator(c10::Device device) {
  at::globalContext().lazyInitDevice(device.type());
  return c10::getDeviceAllocator(device.type());
}

/// `device`'s index, the current one of its type for a device named without one ("cuda").
c10::DeviceIndex index_of(c10::Device device) {
  return device.has_index() ? device.index() : c10::impl::getDeviceGuardImpl(device.type())->getDevice().index();
}

}  // namespace

std::optional<MemoryStats> memory_stats(c10::Device device) {
  if (device.is_cpu()) return std::nullopt;
  const auto stats = initialised_allocator(device)->getDeviceStats(index_of(device));
  constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  return MemoryStats{stats.allocated_bytes[all].current, stats.allocated_bytes[all].peak,
                     stats.reserved_bytes[all].current};
}

void reset_peak_memory(c10::Device device) {
  if (device.is_cpu()) return;
  initialised_allocator(device)->resetPeakStats(index_of(device));
}

std::optional<int64_t> total_memory(c10::Device device) {
  if (!device.is_cpu()) return std::nullopt;
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return std::nullopt;
  return static_cast<int64_t>(pages) * page;
}

bool cuda_available() { return torch::cuda::is_available(); }

int cuda_device_count() { return static_cast<int>(torch::cuda::device_count()); }

c10::Device resolve(const std::string& choice, int local_rank) {
  TORCH_CHECK(choice == "cpu" || choice == "cuda" || choice == "auto", "device must be cpu, cuda or auto, got '",
              choice, "'");
  if (choice == "cpu" || (choice == "auto" && !cuda_available())) return c10::Device(c10::kCPU);
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  TORCH_CHECK(cuda_available(), "device cuda was asked for, but LibTorch sees no CUDA device (no GPU, no driver, or ",
              "CUDA_VISIBLE_DEVICES=", visible ? visible : "(unset)", " hides them); use device cpu or auto");
  const int count = cuda_device_count();
  TORCH_CHECK(local_rank >= 0 && local_rank < count, "local rank ", local_rank, " would use cuda:", local_rank,
              ", but this node has ", count, " visible CUDA device", count == 1 ? "" : "s",
              ": start at most one rank per GPU on each node");
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
}

void rethrow_out_of_memory(const c10::OutOfMemoryError& error, const std::string& where) {
  throw c10::OutOfMemoryError(
      {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
      where + " ran out of device memory: " + error.what_without_backtrace() +
          " (try a smaller batch, factor_dtype/inv_dtype bfloat16, a grad_worker_fraction below 1 so that fewer "
          "ranks hold each layer's second-order state, or skip_layers for the widest layers)");
}

}  // namespace dkfac::device
