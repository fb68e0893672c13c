#pragma once

// What dkfac needs to know about the device its tensors live on, in one place: timing that is honest on
// asynchronous devices, memory statistics, and out-of-memory errors that say where. Device-generic through
// c10 (c10::Event, c10::DeviceAllocator): no CUDA header is included, so this compiles with any LibTorch.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Storage.h>
#include <c10/core/Stream.h>
#include <c10/util/Exception.h>

namespace dkfac::device {

/// A point in a device's work. On the CPU: the host clock. On a CUDA device: a timing event recorded on
/// the current stream, so the time between two marks is the device's time for the work enqueued between
/// them, not the host's time to enqueue it.
class Mark {
 public:
  /// Marks now on `device`'s current stream (host clock for the CPU).
  static Mark now(c10::Device device);

  /// Seconds from `start` to `end` (same device). For a device, waits until `end` has been reached.
  static double seconds_between(const Mark& start, const Mark& end);
  /// True when the work before this mark has finished (always for the CPU): seconds_between will not wait.
  bool reached() const;
  /// Waits until the work before this mark has finished (returns at once for the CPU).
  void wait() const;

 private:
  std::chrono::steady_clock::time_point host_;
  std::shared_ptr<c10::Event> event_;  // null on the CPU
};

/// Timing events created so far in this process (Marks reuse them: after the first steps, the count stays).
int64_t events_created();

/// Work that another host thread does beside this one's (Options::second_order_lag). On a CUDA device the other
/// thread enqueues its kernels on a low-priority stream of the pool, after everything enqueued on this thread's
/// current stream so far, and this thread's stream waits for them when it takes the results (join); on the CPU the
/// work is done when the other thread returns, and nothing more is needed.
class SideWork {
 public:
  /// On the thread that hands the work over, before the other thread starts: the point the side work follows.
  /// `lane` picks the stream: the same one for the same device and lane every time (the caching allocator keeps
  /// freed memory per stream, so a new stream each time would strand it).
  explicit SideWork(c10::Device device, size_t lane = 0);
  /// On the other thread: runs `work` on `device` and the side stream, after the point above, as second-order work
  /// beside the steps runs: on the process's intra-op threads (a new thread's OpenMP team is otherwise the
  /// default's), without autograd, and in exact float32 (no TF32: precondition_dtype tf32 switches the process-wide
  /// flag around the step's products, which must not reach it).
  void run(const std::function<void()>& work);
  /// On the first thread, once the other has returned: its current stream waits for the side work, and the
  /// storages the side work made (`made`), which this thread's stream will read and free, are marked as in use
  /// by it (the caching allocator must not give them to the side stream again before that stream's reads are done).
  void join(const std::vector<c10::Storage>& made);

 private:
  c10::Device device_;
  std::optional<c10::Stream> side_;  // nullopt on the CPU
  std::optional<c10::Event> started_, done_;
};

/// The kernels of one region of host code, captured once as a CUDA graph and replayed (Options::cuda_graphs). A
/// capture runs the host code once and launches nothing: its kernels are recorded, with the addresses of every
/// tensor they read and write, and each replay runs them again on the device's current stream at those addresses.
/// The tensors the region makes come from the graph's own memory pool and keep their addresses from replay to
/// replay; the caller keeps the ones it reads afterwards. What a replay reads from outside the region must be at
/// the addresses it had at the capture (the caller's to check), and the region must not wait for the device.
class Graph {
 public:
  /// Captures `region` on `device` (a CUDA device) on a side stream of its own, with cudaStreamCaptureModeThreadLocal
  /// (other host threads' work, a second-order update beside the steps, goes on meanwhile). Throws where this
  /// LibTorch has no CUDA graphs or the region does what a capture cannot (a host synchronisation); the capture is
  /// then abandoned, nothing was launched, and the region's host effects are the caller's to undo.
  Graph(c10::Device device, const std::function<void()>& region);
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  /// Runs the captured kernels on the device's current stream.
  void replay();

 private:
  struct Captured;
  std::unique_ptr<Captured> captured_;
};

/// The current stream of `device` (of its current index where it names none); the CPU's default stream.
c10::Stream current_stream(c10::Device device);

/// Whether this build of dkfac can capture CUDA graphs on `device` (a CUDA device, LibTorch built with CUDA);
/// when not, why not ("" when it can).
std::string graphs_unavailable(c10::Device device);

/// Allocator statistics of a device, in bytes.
struct MemoryStats {
  int64_t allocated = 0;       ///< held by tensors now
  int64_t peak_allocated = 0;  ///< most held by tensors since the last reset_peak_memory (max_memory_allocated)
  int64_t reserved = 0;        ///< held by the caching allocator now, used or not
};

/// The caching allocator's statistics of `device`; nullopt on the CPU (no such allocator).
std::optional<MemoryStats> memory_stats(c10::Device device);
/// Starts a new peak for memory_stats(device).peak_allocated; nothing on the CPU.
void reset_peak_memory(c10::Device device);

/// Bytes of memory `device` has in all: the machine's physical memory for the CPU; nullopt for other devices
/// (their allocator reports an out-of-memory error itself, which rethrow_out_of_memory words).
std::optional<int64_t> total_memory(c10::Device device);

/// True when LibTorch sees a CUDA device; `cuda_device_count()` how many.
bool cuda_available();
int cuda_device_count();

/// "cpu", "cuda" or "auto" (cuda:local_rank when a CUDA device is visible, else the CPU) as the device
/// of a rank with `local_rank` on its node. Throws c10::Error naming the problem: cuda without a CUDA device,
/// or a local rank beyond the visible devices.
c10::Device resolve(const std::string& choice, int local_rank);

/// Throws a c10::OutOfMemoryError whose message starts with `where` (e.g. "K-FAC second-order update of
/// layer 'fc1'"), then the allocator's own words (what was asked for, what is in use), then what to try.
[[noreturn]] void rethrow_out_of_memory(const c10::OutOfMemoryError& error, const std::string& where);

}  // namespace dkfac::device
