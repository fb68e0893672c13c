#include "tools/train/metrics.h"

#include "tools/common/files.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include <c10/util/Exception.h>

namespace dkfac::train {

MetricsWriter::MetricsWriter(const std::string& path, Existing existing) : path_(path) {
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) {
    std::error_code error;
    std::filesystem::create_directories(parent, error);
    TORCH_CHECK(!error, "cannot create the directory of metrics file '", path, "': ", error.message());
  }
  // Opened without O_TRUNC: a file in use by another job must be refused before anything changes it.
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, "cannot open metrics file '", path, "': ", std::strerror(errno));
  struct stat info {};
  TORCH_CHECK(::fstat(fd_, &info) == 0, "cannot stat metrics file '", path, "': ", std::strerror(errno));
  // A device or a pipe (/dev/stdout, /dev/null): nothing to lock, keep or replace.
  const bool regular = S_ISREG(info.st_mode);
  if (regular && ::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    TORCH_CHECK(err != EWOULDBLOCK, "metrics file '", path, "' is in use by another dkfac job; wait for it to end "
                "or pass another --metrics");
    TORCH_CHECK(false, "cannot lock metrics file '", path, "': ", std::strerror(err));
  }
  if (regular && info.st_size > 0) {
    if (existing == Existing::kRefuse) {
      ::close(fd_);
      fd_ = -1;
      TORCH_CHECK(false, "metrics file '", path, "' already holds ", info.st_size, " bytes of events; pass --resume "
                  "to continue that run, --overwrite to replace the file, or another --metrics");
    }
    if (existing == Existing::kReplace) {
      TORCH_CHECK(::ftruncate(fd_, 0) == 0, "cannot empty metrics file '", path, "': ", std::strerror(errno));
    } else {
      // A job killed mid-write leaves a cut last line: the next event starts on a line of its own.
      char last = '\n';
      const int reader = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (reader >= 0) {
        if (::pread(reader, &last, 1, info.st_size - 1) != 1) last = '\n';
        ::close(reader);
      }
      if (last != '\n') write(nullptr);
    }
  }
}

MetricsWriter::~MetricsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

MetricsWriter::MetricsWriter(MetricsWriter&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)) {}

MetricsWriter& MetricsWriter::operator=(MetricsWriter&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

void MetricsWriter::write(const nlohmann::json& event) {
  if (fd_ < 0) return;
  const std::string line = event.is_null() ? "\n" : event.dump() + "\n";
  try {
    tools::write_all(fd_, line, "metrics file '" + path_ + "'");
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, e.what_without_backtrace(), "; stopping (checkpoints are not affected)");
  }
}

}  // namespace dkfac::train
