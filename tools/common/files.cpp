#include "tools/common/files.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <c10/util/Exception.h>

namespace dkfac::tools {

void write_all(int fd, const std::string& bytes, const std::string& what) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, "writing ", what, " failed: ", std::strerror(n < 0 ? errno : ENOSPC));
    done += static_cast<size_t>(n);
  }
}

}  // namespace dkfac::tools
