#pragma once

#include <string>

#include <nlohmann/json.hpp>

/// The metrics file of `dkfac train`: JSON Lines, one event per line, written by rank 0.
///
/// Format version 3 (kMetricsFormatVersion). Every run (a resumed run too) starts with a "run" event
/// recording how it was started; the other events follow as training goes:
///   run          format_version, dkfac_version, command_line, options (device and backend among them),
///                world_size, seed, threads, machine {hostname, cores, libtorch, cuda_devices (on a GPU)},
///                device (rank 0's: "cpu", "cuda:0"), cuda_backend ("nccl" or "gloo": what carried CUDA
///                tensors; only on a GPU with a group), started_utc, resumed_at_step (absent on a fresh run)
///   step         step (steps done), epoch (1-based epoch of the step), epoch_progress (epochs done, e.g.
///                0.25), loss (rank 0's batch), lr, wall_time_s, kfac_time_s (with K-FAC), GPU memory
///   skipped_step step, epoch (1-based), epoch_progress
///   epoch        epoch (1-based: the epoch just finished), train_loss (mean over every rank's steps),
///                test_loss, test_accuracy (0..1), wall_time_s, step, kfac_time_s (with K-FAC), GPU memory
///   summary      steps, best/final test accuracy, final_test_loss, wall_time_s, kfac_time_s (zeros without
///                K-FAC), kfac_memory_bytes (with K-FAC), parameters_crc32, model, dataset, kfac, GPU memory,
///                and in a distributed job world_size and ranks[] (per rank: rank, comm_bytes for every
///                comm::Purpose by name, kfac_memory_bytes, kfac_time_s, wall_time_s,
///                gpu_max_memory_allocated_bytes on a GPU)
/// kfac_time_s has one shape in every event: rank 0's (in ranks[], that rank's) K-FAC seconds since the run
/// started, per phase of Preconditioner::total_times(), and their sum:
///   {"factors", "second_order", "precondition", "apply", "communication", "total"}
/// GPU memory: rank 0's CUDA caching allocator, in bytes (device::memory_stats), on a GPU only (the fields are
/// absent on the CPU): gpu_memory_allocated_bytes (held by tensors now: torch.cuda.memory_allocated),
/// gpu_max_memory_allocated_bytes (the most held by tensors since the run, or the resumed run, started:
/// torch.cuda.max_memory_allocated after reset_peak_memory_stats), gpu_memory_reserved_bytes (held by the
/// allocator, used or not: torch.cuda.memory_reserved).
/// wall_time_s is the host's clock since the run started; each step ends by reading its loss, which waits
/// for the device, so it covers the device's work. Times around device work alone come from device::Mark
/// (CUDA events on a GPU).
/// Earlier versions, which scripts/convert_metrics.py converts to 3 (dkfac plot reads 3 only; the files under
/// docs/perf were converted on 2026-11-28):
///   2  kfac_time_s was the per-phase object without "total" in step events and ranks[], and a number (the
///      total) in epoch and summary events.
///   1  (before dkfac 0.1.0's issue 17) as 2, without the run event and epoch_progress, and with 0-based
///      step-event epochs.
namespace dkfac::train {

constexpr int kMetricsFormatVersion = 3;

/// Writes events to a metrics file and checks every write: an I/O error (a full disk) throws c10::Error
/// naming the file and the reason, so a job never ends "successfully" with its metrics cut short. The
/// file is locked (flock) while the writer lives, so a second job cannot interleave its events.
class MetricsWriter {
 public:
  /// What happens to a file that already holds events.
  enum class Existing {
    kRefuse,   ///< a fresh run: refuse it (nothing the user saved is replaced silently)
    kAppend,   ///< a resumed run: keep it and append
    kReplace,  ///< --overwrite: empty it
  };

  MetricsWriter() = default;  ///< writes nothing
  /// Opens `path` (creating its directory) and locks it.
  MetricsWriter(const std::string& path, Existing existing);
  ~MetricsWriter();
  MetricsWriter(MetricsWriter&& other) noexcept;
  MetricsWriter& operator=(MetricsWriter&& other) noexcept;
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  /// Appends `event` as one line. No-op for a default-constructed writer.
  void write(const nlohmann::json& event);
  bool enabled() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

}  // namespace dkfac::train
