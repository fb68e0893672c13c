#include "tools/common/file_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include <c10/util/Exception.h>

namespace dkfac::tools {

FileLock::FileLock(const std::string& path, const std::string& what) {
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, "cannot open lock file '", path, "' of ", what, ": ", std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    TORCH_CHECK(err != EWOULDBLOCK, what, " is in use by another dkfac job (", [&] {
      std::ifstream in(path);
      std::string holder;
      std::getline(in, holder);
      return holder.empty() ? std::string("lock ") + path : holder + ", lock " + path;
    }(), "); wait for it to end or use another directory or file");
    TORCH_CHECK(false, "cannot lock '", path, "' of ", what, ": ", std::strerror(err));
  }
  // Who holds it, for the message a second job gets (best effort: the lock itself is what counts).
  std::ostringstream holder;
  holder << "pid " << ::getpid();
  std::ifstream cmdline("/proc/self/cmdline");
  std::string arg;
  std::string command;
  for (int i = 0; i < 3 && std::getline(cmdline, arg, '\0'); ++i) command += (i ? " " : "") + arg;
  if (!command.empty()) holder << ": " << command << " ...";
  const std::string text = holder.str() + "\n";
  if (::ftruncate(fd_, 0) == 0) {
    [[maybe_unused]] const ssize_t n = ::pwrite(fd_, text.data(), text.size(), 0);
  }
}

FileLock::~FileLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the lock
}

FileLock::FileLock(FileLock&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}

FileLock& FileLock::operator=(FileLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

}  // namespace dkfac::tools
