#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "dkfac/device.h"
#include "dkfac/dkfac.h"
#include "tools/data/datasets.h"
#include "tools/models/models.h"
#include "tools/train/checkpoint.h"
#include "tools/train/config.h"
#include "tools/train/training_checkpoint.h"

namespace dkfac::train {

/// Test-set result.
struct Evaluation {
  double loss = 0.0;
  double accuracy = 0.0;  // fraction in [0, 1]; 0 for reconstruction
};

/// What a run did.
struct TrainSummary {
  int64_t steps = 0;
  int64_t epochs = 0;
  int64_t skipped_steps = 0;  // steps dropped for a non-finite loss or gradient (--on-nan-loss skip)
  int64_t skipped_in_a_row = 0;  // the current run of dropped steps (--max-skipped-steps bounds it)
  double best_accuracy = 0.0;
  double final_accuracy = 0.0;
  double final_test_loss = 0.0;
  double wall_seconds = 0.0;
  double kfac_seconds = 0.0;
  bool already_complete = false;    // resumed a run that had reached --epochs / --max-steps: nothing done
  std::optional<int64_t> gpu_max_memory_allocated_bytes;  // this rank's peak on its GPU; nullopt on the CPU
  uint32_t parameters_crc32 = 0;    // CRC-32 of every parameter and buffer's bytes: equal iff bit-identical
  std::vector<double> step_losses;  // every training step's loss, in order (this process only)
};

/// The training loop of `dkfac train` as one rank runs it, in a data-parallel job or as a single process:
/// data, model, SGD/Adam, optional K-FAC, schedules, progress, metrics, atomic checkpoints and exact resume,
/// on the CPU or a GPU. Rank 0 alone prints progress and writes the metrics file.
///
/// On a GPU the model (initialised on the CPU, so that both devices start from the same weights), the
/// optimizer and K-FAC state, the batches (made on the CPU, copied through pinned memory), the loss and the
/// evaluation live on the device; shuffling and augmentation keep their CPU generators, so the checkpoint's
/// CPU generator state resumes them exactly on either device. A CUDA out-of-memory error is rethrown as a
/// c10::OutOfMemoryError naming the phase (forward/backward, finite check, K-FAC, optimizer, evaluation) and
/// the step, then the allocator's words (what was asked for, what is in use).
class Trainer {
 public:
  /// Single process without `communicator`; rank `communicator->rank()` of a data-parallel job with it.
  /// `device`: where this rank trains (`dkfac train` resolves it from --device and the local rank:
  /// rank_device() in devices.h); nullopt: rank_device(config, 0).
  explicit Trainer(TrainConfig config, std::shared_ptr<comm::Communicator> communicator = nullptr,
                   std::optional<c10::Device> device = std::nullopt);
  ~Trainer();

  /// Trains until `epochs` or `max_steps`, whichever comes first.
  TrainSummary run();

  /// Mean loss and accuracy on the test set, without K-FAC capture or gradients.
  Evaluation evaluate();

  /// The device this rank trains on.
  c10::Device device() const { return device_; }

 private:
  struct State;
  double learning_rate(int64_t epoch, int64_t step_in_epoch) const;
  void set_learning_rate(double lr);
  torch::Tensor loss_of(const torch::Tensor& output, const torch::Tensor& x, const torch::Tensor& y) const;
  /// Where training stands: the 0-based epoch and the steps done in it.
  struct Position {
    int64_t epoch = 0;
    int64_t step_in_epoch = 0;
  };
  /// This job as its checkpoints identify it (training_checkpoint.h).
  CheckpointIdentity identity() const;
  /// Writes this rank's checkpoint at `at` (write_checkpoint), logging `reason`.
  void save_checkpoint(const Position& at, const std::string& reason);
  /// The position of the checkpoint resumed from, after loading it (read_checkpoint); nullopt: none yet (a
  /// first run).
  std::optional<Position> load_checkpoint();
  bool finished(const Position& at) const;
  std::string layout() const;
  /// What a resume may not change (strategy and placement as configured; not the world size).
  std::string job_layout() const;
  /// Examples per step over all ranks.
  int64_t global_batch() const;
  std::string resume_differences(int64_t written_world, int64_t written_batch, int64_t repeated,
                                 const std::optional<StateRestore>& restore) const;
  bool step_is_finite(const torch::Tensor& loss);
  /// This rank's loss over an epoch's steps (skipped steps are not counted) and when the epoch began.
  struct EpochLoss {
    double sum = 0.0;
    int64_t steps = 0;
    dkfac::device::Mark start;  // the device's time at the epoch's start, for the progress line's rate
  };
  /// This rank's examples of a step: inputs and labels, on the CPU.
  struct Batch {
    torch::Tensor x;
    torch::Tensor y;
  };

  // run(), in the order it calls them.
  void open_checkpoint_directory();
  TrainSummary already_complete(const Position& at);
  void open_metrics(std::optional<int64_t> resumed_at_step);
  void start_training();
  std::string run_header() const;
  std::optional<EpochLoss> run_epoch(Position& at, TrainSummary& summary);
  void run_step(const Position& at, const torch::Tensor& order, EpochLoss& epoch, TrainSummary& summary);
  Evaluation stop_at_max_steps(const Position& at);
  Evaluation end_epoch(const Position& at, const EpochLoss& epoch);
  TrainSummary finish(TrainSummary summary, const Evaluation& last_eval);

  // Steps.
  bool max_steps_reached() const;
  int64_t log_every() const;
  double epoch_progress(const Position& at) const;
  Batch batch(const Position& at, const torch::Tensor& order) const;
  std::optional<double> train_step(const Position& at, const torch::Tensor& x, const torch::Tensor& y);
  void skip_step(const Position& at, TrainSummary& summary);
  void draw_progress(const Position& at, double loss, const dkfac::device::Mark& epoch_start, int64_t epoch_steps,
                     bool logged);
  void checkpoint_within_epoch(const Position& at);
  Evaluation evaluate_and_keep_best();
  double global_mean(double sum, int64_t count);

  // Metrics events (tools/train/metrics.h).
  nlohmann::json run_event(std::optional<int64_t> resumed_at_step) const;
  nlohmann::json step_event(const Position& at, double loss) const;
  nlohmann::json epoch_event(const Position& at, double train_loss, const Evaluation& eval) const;
  nlohmann::json summary_event(const TrainSummary& summary) const;
  /// Rank 0's output stream (the job's progress); a discarding stream on the other ranks.
  std::ostream& log() const;
  /// A warning about this rank's own state, on stderr, prefixed with the rank in a distributed job.
  void warn(const std::string& message) const;

  TrainConfig config_;
  std::shared_ptr<comm::Communicator> communicator_;
  int rank_ = 0;
  int world_ = 1;
  c10::Device device_{c10::kCPU};
  std::string threads_;  // thread setup, for the log
  std::unique_ptr<State> state_;
};


}  // namespace dkfac::train
