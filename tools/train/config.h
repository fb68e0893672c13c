#pragma once

#include <cstdint>
#include <stdexcept>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dkfac/options.h"

namespace dkfac::train {

/// Everything `dkfac train` can be told. Defaults are the recipe the README documents.
struct TrainConfig {
  std::string model = "cnn";
  std::string dataset = "fashion-mnist";
  std::string data_dir;  // empty: the dataset's default location
  std::string optimizer = "sgd";
  double lr = 0.05;
  double momentum = 0.9;
  double weight_decay = 5e-4;
  int64_t batch_size = 128;          // examples per rank per step
  int64_t accumulation_steps = 1;    // micro-batches of batch_size / accumulation_steps per step
  int64_t epochs = 3;
  int64_t max_steps = -1;  // < 0: no limit
  std::string lr_schedule = "cosine";
  double warmup_epochs = 0.0;
  int64_t seed = 0;
  int threads = 0;  // 0: LibTorch's default
  bool kfac = true;
  double damping = 0.3;
  double factor_decay = 0.95;
  double kl_clip = 0.001;
  bool kl_clip_follows_lr = true;  // scale the KL bound by (lr / base lr)^2 so schedules shrink K-FAC steps
  int64_t factor_update_steps = 10;
  int64_t inv_update_steps = 100;
  std::string compute_method = "inverse";  // same accuracy as eigen on the cnn, half the preconditioning time
  std::string factor_dtype;  // float32 | float64 | bfloat16; empty: the model's dtype
  std::string inv_dtype;     // same choices; empty: the factors' dtype
  std::vector<std::string> skip_layers;  // regular expressions: matching layers keep their plain gradient
  std::string metrics;  // JSON Lines file; empty: none
  std::string checkpoint_dir;
  int64_t checkpoint_every_epochs = 1;
  int64_t checkpoint_every_steps = 0;  // 0: only at epoch ends (and --max-steps)
  std::string on_nan_loss = "stop";    // stop | skip: what a non-finite loss or gradient does
  bool resume = false;
  bool overwrite = false;  // a fresh run may replace the checkpoints and metrics file it finds
  std::string command_line;  // as typed, for the metrics file's run event (not an option)
  int64_t log_every = 0;  // steps between progress lines; 0: about 10 per epoch
  int64_t eval_examples = 0;  // test examples evaluated (the first ones); 0: the whole test set
  // Distributed (data parallel + KAISA). --batch-size is per rank; the global batch is batch_size * world.
  std::string strategy = "kaisa";
  double grad_worker_fraction = 1.0;  // 0: 1/P (MEM-OPT; kfac_pytorch's convention), resolved by fraction_for
  bool symmetric_comm = false;
  bool balance_memory = false;    // KAISA placement by dim^2 instead of dim^3
  bool colocate_factors = true;   // A and G of a layer on one rank
  /// The flag that set a field when it was not the dkfac flag itself: "--damping" -> "--kfac-damping" when
  /// kfac_pytorch's alias was typed. validate() names the flag as typed. Not an option: not in to_json().
  std::map<std::string, std::string> typed_as;

  /// `flag` ("--damping") or the alias that stood for it on the command line.
  std::string flag(const std::string& name) const;

  /// The KAISA grad-worker fraction that `strategy` means for `world` ranks: kaisa -> grad_worker_fraction
  /// (0 -> 1/world),
  /// spd, dp -> 1 (they place their own work),
  /// dkfac (SC20 KFAC-opt) -> 1, dkfac-lw (SC20 layer-wise: the owner preconditions and shares V) -> 1/world.
  double fraction_for(int world) const;
  /// The library strategy `strategy` names: spd -> kSpd, dp -> kDp, the others -> kKaisa.
  Strategy library_strategy() const;

  /// Throws c10::Error naming the first bad field's flag (as typed: see typed_as) and its value. Every
  /// numeric flag is range-checked here, before the library sees it.
  void validate() const;
};

/// An error every rank of a job reaches identically (a bad option, a directory another run owns): rank 0
/// alone reports it, so that a job's output says it once.
struct JobError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// The options that must agree between the ranks of a job, keyed by flag name without "--" (threads
/// may differ).
nlohmann::json to_json(const TrainConfig& config);

}  // namespace dkfac::train
