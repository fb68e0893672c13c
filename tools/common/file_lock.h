#pragma once

#include <string>

namespace dkfac::tools {

/// An exclusive advisory lock (flock) on a file, held until destruction: keeps a second dkfac job off a
/// checkpoint directory or a metrics file while this one runs. The kernel releases it when the process
/// ends, however it ends, so a killed job leaves nothing to clean up.
class FileLock {
 public:
  FileLock() = default;
  /// Locks `path` (created if missing) without waiting. If another process holds it, throws c10::Error
  /// naming `what`, the path and, when the holder wrote it, its pid and command.
  FileLock(const std::string& path, const std::string& what);
  ~FileLock();
  FileLock(FileLock&& other) noexcept;
  FileLock& operator=(FileLock&& other) noexcept;
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

  bool held() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

}  // namespace dkfac::tools
