// A build without gloo's headers (the Python extension from `pip install`): dkfac cannot make Gloo backends
// itself; the Python front end passes torch.distributed's (Communicator::from_process_group's make_gloo).
#include "dkfac/comm/communicator.h"

namespace dkfac::comm {

bool gloo_headers_built_in() { return false; }

GlooBackendMaker native_gloo_backends(const std::string& host) {
  TORCH_CHECK(false, "this dkfac was built without gloo's headers, so it cannot make its own Gloo process groups",
              host.empty() ? "" : " (for a rendezvous at " + host + ")",
              ": join a torch.distributed process group instead (Communicator::from_process_group with a "
              "GlooBackendMaker, as the Python package does), or rebuild with gloo's headers (Debian/Ubuntu "
              "libgloo-dev, or -DDKFAC_GLOO_INCLUDE_DIR=...)");
}

}  // namespace dkfac::comm
