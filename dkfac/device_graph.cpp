// device::Graph on a CUDA build of LibTorch, over ATen's CUDAGraph (Options::cuda_graphs). The library's only
// file that includes CUDA headers: CMakeLists.txt builds device_graph_missing.cpp in its place where torch has
// no CUDA.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <map>
#include <mutex>

#include "dkfac/device.h"

namespace dkfac::device {
namespace {

/// ATen's CUDAGraph, with a way out of a capture that failed part-way: the stream's capture ended, and the
/// caching allocator's pool for it closed and released (a capture that failed launched nothing).
class AbandonableGraph : public at::cuda::CUDAGraph {
 public:
  void abandon() noexcept {
    cudaGraph_t partial = nullptr;
    if (cudaStreamEndCapture(capture_stream_.stream(), &partial) == cudaSuccess && partial != nullptr) {
      cudaGraphDestroy(partial);
    }
    (void)cudaGetLastError();  // the capture's own error, expected: cleared
    try {
      c10::cuda::CUDACachingAllocator::endAllocateToPool(capture_dev_, mempool_id_);
    } catch (...) {  // capture_end had closed it before it failed
    }
    try {
      c10::cuda::CUDACachingAllocator::releasePool(capture_dev_, mempool_id_);
    } catch (...) {
    }
    reset();
  }
};

/// The stream captures run on, one per device, made the first time and never destroyed (a capture needs a stream
/// that is not the default one, and one of its own: torch's pool hands its streams out round-robin, and a capture
/// would take in whatever another thread enqueued on its stream meanwhile). cuBLAS makes its workspace for a stream
/// at the first product there: made then, outside any capture, so that it is not taken from a graph's pool, which
/// goes with the graph.
c10::cuda::CUDAStream capture_stream(c10::DeviceIndex index) {
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = streams.find(index);
  if (found != streams.end()) return found->second;
  cudaStream_t raw = nullptr;
  C10_CUDA_CHECK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
  const auto stream = c10::cuda::getStreamFromExternal(raw, index);
  {
    const c10::cuda::CUDAStreamGuard on_stream(stream);
    const auto x = at::ones({8, 8}, at::TensorOptions().device(at::Device(at::kCUDA, index)));
    (void)at::mm(x, x);
    (void)at::bmm(x.unsqueeze(0), x.unsqueeze(0));
    (void)at::addmm(x, x, x);
    stream.synchronize();
  }
  return streams.emplace(index, stream).first->second;
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
  captured_ = std::make_unique<Captured>();
  const c10::cuda::CUDAStreamGuard on_stream(stream);
  // Thread-local: another thread's calls (a second-order update beside the steps, with its host synchronisations)
  // do not break this capture.
  captured_->graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
  try {
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
