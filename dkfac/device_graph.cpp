// device::Graph on a CUDA build of LibTorch, over ATen's CUDAGraph (Options::cuda_graphs). The library's only
// file that includes CUDA headers: CMakeLists.txt builds device_graph_missing.cpp in its place where torch has
// no CUDA.
#include <ATen/ATen.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "dkfac/device.h"

namespace dkfac::device {
namespace {

/// ATen's CUDAGraph, with a way out of a capture that failed part-way (capture_begin, the region or capture_end):
/// everything capture_begin set up is undone, so that the process goes on as before it (a capture that failed
/// launched nothing). Each step is tried on its own, as far as capture_begin got.
class AbandonableGraph : public at::cuda::CUDAGraph {
 public:
  void abandon() noexcept {
    if (capture_ended_) {  // capture_end closed the pools and failed after (instantiation): reset releases them
      reset();
      return;
    }
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(capture_stream_.stream(), &status) == cudaSuccess &&
        status != cudaStreamCaptureStatusNone) {
      cudaGraph_t partial = nullptr;
      if (cudaStreamEndCapture(capture_stream_.stream(), &partial) == cudaSuccess && partial != nullptr) {
        cudaGraphDestroy(partial);
      }
    }
    (void)cudaGetLastError();  // the capture's own error, expected: cleared
    // The generators capture_begin put in capture mode (the default CUDA generator among them): out of it, or every
    // later random number on this device would fail ("Offset increment outside graph capture"). What
    // CUDAGeneratorState::capture_epilogue does, which LibTorch does not export: the flag off.
    for (auto& entry : captured_generator_states_) entry.first->capturing_ = false;
    if (capture_dev_ != UNDEFINED_DEVICE) {  // capture_begin reached the allocators
      try {  // released only where it was opened
        c10::cuda::CUDACachingAllocator::endAllocateToPool(capture_dev_, mempool_id_);
        c10::cuda::CUDACachingAllocator::releasePool(capture_dev_, mempool_id_);
      } catch (...) {
      }
      try {  // the pinned-memory allocator's pool, where this torch opens one
        auto* host = at::getHostAllocator(at::kCUDA);
        host->end_allocate_to_pool(mempool_id_);
        host->release_pool(mempool_id_);
      } catch (...) {
      }
    }
    reset();
  }
};

/// The stream captures run on, one per device, made the first time and never destroyed (a capture needs a stream
/// that is not the default one, and one of its own: torch's pool hands its streams out round-robin, and a capture
/// would take in whatever another thread enqueued on its stream meanwhile).
c10::cuda::CUDAStream capture_stream(c10::DeviceIndex index) {
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = streams.find(index);
  if (found != streams.end()) return found->second;
  cudaStream_t raw = nullptr;
  C10_CUDA_CHECK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
  return streams.emplace(index, c10::cuda::getStreamFromExternal(raw, index)).first->second;
}

/// One capture at a time on each device: two threads (ranks as threads, two preconditioners) would capture on its
/// one stream together.
std::mutex& capture_lock(c10::DeviceIndex index) {
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, std::unique_ptr<std::mutex>> locks;
  std::lock_guard<std::mutex> lock(mutex);
  auto& entry = locks[index];
  if (!entry) entry = std::make_unique<std::mutex>();
  return *entry;
}

/// cuBLAS makes a handle for each thread and a workspace for each handle and stream at their first product: made
/// before this thread's first capture on `stream`, outside it, so that they do not come from a graph's pool, which
/// goes with the graph.
void warm_up(const c10::cuda::CUDAStream& stream) {
  thread_local std::set<cudaStream_t> warmed;
  if (!warmed.insert(stream.stream()).second) return;
  const c10::cuda::CUDAStreamGuard on_stream(stream);
  const auto x = at::ones({8, 8}, at::TensorOptions().device(stream.device()));
  (void)at::mm(x, x);
  (void)at::bmm(x.unsqueeze(0), x.unsqueeze(0));
  (void)at::addmm(x, x, x);
  stream.synchronize();
}

}  // namespace

struct Graph::Captured {
  AbandonableGraph graph;
};

std::string graphs_unavailable(c10::Device device) {
  if (!device.is_cuda()) return c10::str("CUDA graphs need a CUDA device, and this preconditioner's is ", device);
  return "";
}

Graph::Graph(c10::Device device, const std::function<void()>& region) {
  const auto why_not = graphs_unavailable(device);
  TORCH_CHECK(why_not.empty(), why_not);
  const auto index = device.has_index() ? device.index() : c10::cuda::current_device();
  const c10::cuda::CUDAGuard on_device(index);  // the stream below is made on it
  const auto stream = capture_stream(index);
  const std::lock_guard<std::mutex> one_at_a_time(capture_lock(index));
  warm_up(stream);
  captured_ = std::make_unique<Captured>();
  const c10::cuda::CUDAStreamGuard on_stream(stream);
  try {
    // Thread-local: another thread's calls (a second-order update beside the steps, with its host
    // synchronisations) do not break this capture.
    captured_->graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    region();
    captured_->graph.capture_end();
  } catch (...) {
    captured_->graph.abandon();
    throw;
  }
}

Graph::~Graph() = default;

void Graph::replay() { captured_->graph.replay(); }

}  // namespace dkfac::device
