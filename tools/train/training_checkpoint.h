#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <torch/torch.h>

#include "dkfac/preconditioner.h"
#include "tools/train/config.h"

/// The schema of a `dkfac train` checkpoint and its resume rules, beside Checkpointer (checkpointer.h), which owns
/// the files: what a job writes into a checkpoint's archive, and what a resume checks and reads back.
namespace dkfac::train {

/// The one format read and written: world-size independent (every rank's file holds the whole K-FAC state; the
/// data position is in examples; the world size and global batch that wrote it are recorded).
constexpr int64_t kCheckpointVersion = 3;

/// Layer shapes of a model, to refuse a checkpoint of another model with a clear message.
std::string shape_signature(torch::nn::Module& model);

/// What identifies the job a checkpoint belongs to. A resume must match every field but `layout`, which its
/// messages show.
struct CheckpointIdentity {
  std::string model_name;
  std::string dataset;
  std::string optimizer_name;
  std::string shapes;  ///< shape_signature of the model
  bool kfac = false;
  std::string layout;      ///< the strategy and placement in words, on this job's ranks
  std::string job_layout;  ///< the same without the world size: what a resume may not change
};

/// Where training stands.
struct CheckpointProgress {
  int64_t world_size = 1;
  int64_t global_batch = 0;
  int64_t epoch = 0;
  int64_t step_in_epoch = 0;
  int64_t epoch_examples = 0;  ///< the position in the epoch's order of examples, which any world size continues
  int64_t global_step = 0;
  double best_accuracy = 0.0;
  double wall_seconds = 0.0;
};

/// What a training job saves besides its progress: the model, the optimizer, and K-FAC (null without it).
struct TrainingParts {
  torch::nn::Module& model;
  torch::optim::Optimizer& optimizer;
  Preconditioner* kfac = nullptr;
};

/// Writes a checkpoint of `parts` at `progress` into `archive`, with this job's options and identity and the CPU
/// generator's state. Collective with K-FAC: every rank's archive holds every layer's state.
void write_checkpoint(torch::serialize::OutputArchive& archive, const TrainConfig& config,
                      const CheckpointIdentity& identity, const CheckpointProgress& progress, TrainingParts parts);

/// A checkpoint read back.
struct Resumed {
  CheckpointProgress progress;
  std::string changed_options;  ///< "--lr 0.1 -> 0.05, ..." since the checkpoint; "" when none changed
  std::optional<StateRestore> restore;  ///< K-FAC's, with K-FAC
};

/// Checks that the checkpoint `path` belongs to this job: its format version, `identity` (model, dataset,
/// optimizer, shapes, strategy and placement, K-FAC or not) and its options (a changed --seed is refused unless
/// --allow-seed-change). Then loads `parts` and the CPU generator's state from it. Throws c10::Error naming the
/// file and what does not match; `parts` are not touched before every check passed.
Resumed read_checkpoint(torch::serialize::InputArchive& archive, const std::string& path, const TrainConfig& config,
                        const CheckpointIdentity& identity, TrainingParts parts);

}  // namespace dkfac::train
