// device::Graph where LibTorch has no CUDA (CMakeLists.txt builds device_graph.cpp where it has): no graphs, and
// Options::cuda_graphs then leaves every step eager, saying why (Preconditioner::cuda_graph_report).
#include "dkfac/device.h"

namespace dkfac::device {

struct Graph::Captured {};

std::string graphs_unavailable(c10::Device device) {
  return c10::str("this dkfac was built against a LibTorch without CUDA, which has no CUDA graphs (device ", device,
                  ")");
}

Graph::Graph(c10::Device device, const std::function<void()>&) { TORCH_CHECK(false, graphs_unavailable(device)); }

Graph::~Graph() = default;

void Graph::replay() { TORCH_CHECK(false, "device::Graph::replay without a capture"); }

}  // namespace dkfac::device
