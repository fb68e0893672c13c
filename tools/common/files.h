#pragma once

#include <string>

namespace dkfac::tools {

/// write(2) of every byte of `bytes` to `fd`, retrying short writes and EINTR. On failure throws
/// c10::Error "writing <what> failed: <errno's text>" (a full disk reads "No space left on device").
void write_all(int fd, const std::string& bytes, const std::string& what);

}  // namespace dkfac::tools
