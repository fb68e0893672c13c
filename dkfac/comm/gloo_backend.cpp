// dkfac's own Gloo backends, made with gloo's headers (ProcessGroupGloo.hpp includes them; pip's torch compiles
// Gloo in but does not ship them). Compiled where CMake finds them; gloo_backend_missing.cpp otherwise.
#define USE_C10D_GLOO 1
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <cstdlib>

#include "dkfac/comm/communicator.h"

namespace dkfac::comm {
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

}  // namespace

bool gloo_headers_built_in() { return true; }

GlooBackendMaker native_gloo_backends(const std::string& host) {
  // One transport device for every group of the communicator, made now: an unknown interface fails at connect.
  auto device = make_device(host);
  return [device](c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::chrono::milliseconds timeout) {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(device);
    return c10::intrusive_ptr<c10d::Backend>(
        c10::make_intrusive<c10d::ProcessGroupGloo>(std::move(store), rank, size, options));
  };
}

}  // namespace dkfac::comm
