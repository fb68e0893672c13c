#include "dkfac/device.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>

#include <cstdlib>

namespace dkfac::device {

Mark Mark::now(c10::Device device) {
  Mark mark;
  if (device.is_cpu()) {
    mark.host_ = std::chrono::steady_clock::now();
    return mark;
  }
  // BACKEND_DEFAULT: a CUDA event with timing (PYTORCH_DEFAULT disables it).
  mark.event_ = std::make_shared<c10::Event>(device.type(), c10::EventFlag::BACKEND_DEFAULT);
  const auto* guard = c10::impl::getDeviceGuardImpl(device.type());
  mark.event_->record(guard->getStream(device.has_index() ? device : c10::Device(device.type(), guard->getDevice().index())));
  return mark;
}

double Mark::seconds_between(const Mark& start, const Mark& end) {
  TORCH_INTERNAL_ASSERT((start.event_ == nullptr) == (end.event_ == nullptr), "marks of different devices");
  if (!start.event_) return std::chrono::duration<double>(end.host_ - start.host_).count();
  end.event_->synchronize();
  return start.event_->elapsedTime(*end.event_) / 1000.0;  // milliseconds
}

bool Mark::reached() const { return !event_ || event_->query(); }

std::optional<MemoryStats> memory_stats(c10::Device device) {
  if (device.is_cpu()) return std::nullopt;
  const auto stats = c10::getDeviceAllocator(device.type())->getDeviceStats(device.index());
  constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  return MemoryStats{stats.allocated_bytes[all].current, stats.allocated_bytes[all].peak,
                     stats.reserved_bytes[all].current};
}

void reset_peak_memory(c10::Device device) {
  if (device.is_cpu()) return;
  c10::getDeviceAllocator(device.type())->resetPeakStats(device.index());
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
