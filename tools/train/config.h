#pragma once

#include <cstdint>
#include <stdexcept>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "dkfac/comm/communicator.h"
#include "dkfac/options.h"

namespace dkfac::train {

// The flags whose value is one of a fixed set of names are enums, parsed once at the command line
// (parse_choice) and printed back by to_string as the same names: the metrics run event, the options
// that ranks compare and the checkpoint metadata carry the names.

/// --model (models::model_names(), in that order).
enum class Model { kMlp, kCnn, kResnet20, kAutoencoder };
/// --dataset (data::dataset_names(), in that order).
enum class Dataset { kFashionMnist, kMnist, kCifar10, kSynthetic };
/// --optimizer.
enum class Optimizer { kSgd, kAdam, kAdamW };
/// --lr-schedule: constant, step (x0.1 at 50% and 75% of the epochs), cosine.
enum class LrSchedule { kConstant, kStep, kCosine };
/// --on-nan-loss: stop with an error, or skip the step.
enum class NanPolicy { kStop, kSkip };
/// --device: the CPU, cuda:LOCAL_RANK, or auto (cuda:LOCAL_RANK when a CUDA device is visible, else the CPU).
enum class DeviceChoice { kCpu, kCuda, kAuto };
// --backend is the communicator's comm::CudaBackend (comm::to_string names it). The K-FAC flags are the
// library's options (dkfac/options.h, option_table()): their flags, checks and help come from that declaration.

/// A flag's names and the values they stand for, in the order --help and errors list them.
template <typename E>
const std::vector<std::pair<std::string, E>>& choices();

/// The name of `value` as typed on the command line and written to the metrics and checkpoints.
const char* to_string(Model value);
const char* to_string(Dataset value);
const char* to_string(Optimizer value);
const char* to_string(LrSchedule value);
const char* to_string(NanPolicy value);
const char* to_string(DeviceChoice value);
using dkfac::to_string;                     // ComputeMethod (dkfac plan's --compute-method)
using dkfac::comm::to_string;               // CudaBackend

/// The choices' names, comma-separated ("mlp, cnn, resnet20, autoencoder").
template <typename E>
std::string choice_names();

/// The value `name` stands for; otherwise throws c10::Error "<flag> must be one of <choices>, got '<name>'".
template <typename E>
E parse_choice(const std::string& flag, const std::string& name);

/// Everything `dkfac train` can be told. Defaults are the recipe docs/CLI.md documents.
struct TrainConfig {
  Model model = Model::kCnn;
  Dataset dataset = Dataset::kFashionMnist;
  std::string data_dir;  // empty: the dataset's default location
  Optimizer optimizer = Optimizer::kSgd;
  double lr = 0.05;
  double momentum = 0.9;
  double weight_decay = 5e-4;
  int64_t batch_size = 128;          // examples per rank per step
  // --global-batch-size: examples per step over all ranks, split evenly (each rank B / world, which must
  // divide); replaces batch_size, so that a job resumed on another world size sees the same batches. 0: off.
  int64_t global_batch_size = 0;
  int64_t accumulation_steps = 1;    // micro-batches of batch_size / accumulation_steps per step
  int64_t epochs = 3;
  int64_t max_steps = -1;  // < 0: no limit
  LrSchedule lr_schedule = LrSchedule::kCosine;
  double warmup_epochs = 0.0;
  int64_t seed = 0;
  int threads = 0;  // 0: LibTorch's default
  // Where each rank trains: model, optimizer state, batches, loss and evaluation (tools/train/devices.h).
  DeviceChoice device = DeviceChoice::kCpu;
  // What carries the collectives of CUDA tensors (CPU tensors always go through Gloo). kGloo also lets
  // more ranks than GPUs share them round-robin (devices.h); with kNccl or kGloo a single CUDA process
  // joins a one-rank group over that backend.
  comm::CudaBackend backend = comm::CudaBackend::kAuto;
  bool kfac = true;
  bool kl_clip_follows_lr = true;  // scale the KL bound by (lr / base lr)^2 so schedules shrink K-FAC steps
  // --graft: each K-FAC layer moves along K-FAC's direction by the length of the optimizer's own step on its plain
  // gradient (dkfac::optim::KFACOptions::graft). Adam in the K-FAC eigenbasis is kfac_options.eigen_adam
  // (--eigen-adam, with --optimizer adamw). Both step through dkfac::optim::KFAC.
  bool graft = false;
  /// The K-FAC options, every one a flag of its own (option_table()); `lr` and `accumulation_steps` follow the
  /// optimizer's. The recipe docs/PERFORMANCE.md measures: damping 0.3, factors every 10 steps, inverses every 100 (inverse:
  /// the same accuracy as eigen on the cnn, in half the preconditioning time).
  Options kfac_options = Options().damping(0.3).factor_update_steps(10).inv_update_steps(100).compute_method(
      ComputeMethod::kInverse);
  std::string metrics;  // JSON Lines file; empty: none
  std::string checkpoint_dir;
  int64_t checkpoint_every_epochs = 1;
  int64_t checkpoint_every_steps = 0;  // 0: only at epoch ends (and --max-steps)
  NanPolicy on_nan_loss = NanPolicy::kStop;  // what a non-finite loss or gradient does
  int64_t max_skipped_steps = 10;  // --on-nan-loss skip: consecutive dropped steps that end the run as failed
  bool resume = false;
  bool allow_seed_change = false;  // --resume with another --seed than the checkpoint's (refused otherwise)
  bool overwrite = false;  // a fresh run may replace the checkpoints and metrics file it finds
  std::string command_line;  // as typed, for the metrics file's run event (not an option)
  int64_t log_every = 0;  // steps between progress lines; 0: about 10 per epoch
  bool print_plan = false;  // print the K-FAC step plan at start, one line per layer
  std::string kfac_rates;   // --strategy auto: rates JSON to choose from (empty: measured at the first step)
  int64_t eval_examples = 0;  // test examples evaluated (the first ones); 0: the whole test set
  /// The flag that set a field when it was not the dkfac flag itself: "--damping" -> "--kfac-damping" when
  /// kfac_pytorch's alias was typed. validate() names the flag as typed. Not an option: not in to_json().
  std::map<std::string, std::string> typed_as;

  /// `flag` ("--damping") or the alias that stood for it on the command line.
  std::string flag(const std::string& name) const;

  /// Throws c10::Error naming the first bad field's flag (as typed: see typed_as) and its value. Every
  /// numeric flag is range-checked here, before the library sees it.
  void validate() const;
  /// The examples each of `world` ranks takes per step: --global-batch-size split over the ranks, or
  /// --batch-size. Throws JobError when the global batch does not split into equal micro-batches.
  int64_t batch_per_rank(int world) const;
};

/// An error every rank of a job reaches identically (a bad option, a directory another run owns): rank 0
/// alone reports it, so that a job's output says it once.
struct JobError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// The options that must agree between the ranks of a job, keyed by flag name without "--" (threads
/// may differ).
nlohmann::json to_json(const TrainConfig& config);

/// Every rank's `options` (to_json) against rank 0's: when any rank's differ, every rank throws c10::Error with
/// the same message, naming the first differing flag with its value on that rank and on rank 0. Collective.
void agree_on(comm::Communicator& communicator, const nlohmann::json& options);

}  // namespace dkfac::train
