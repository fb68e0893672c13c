#include "tools/train/config.h"

#include <algorithm>
#include <cmath>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include "tools/data/datasets.h"
#include "tools/models/models.h"

namespace dkfac::train {
namespace {

bool one_of(const std::string& value, const std::vector<std::string>& valid) {
  return std::find(valid.begin(), valid.end(), value) != valid.end();
}

}  // namespace

std::string TrainConfig::flag(const std::string& name) const {
  const auto it = typed_as.find(name);
  return it == typed_as.end() ? name : it->second;
}

void TrainConfig::validate() const {
  // Every numeric flag is range-checked here with the flag's name (as typed), so that no value reaches the
  // library's own checks, which name its option fields instead.
  TORCH_CHECK(one_of(model, models::model_names()), "--model must be one of ", c10::Join(", ", models::model_names()),
              ", got '", model, "'");
  TORCH_CHECK(one_of(dataset, data::dataset_names()), "--dataset must be one of ", c10::Join(", ", data::dataset_names()),
              ", got '", dataset, "'");
  TORCH_CHECK(optimizer == "sgd" || optimizer == "adam", "--optimizer must be sgd or adam, got '", optimizer, "'");
  TORCH_CHECK(lr > 0 && std::isfinite(lr), "--lr must be > 0, got ", lr);
  TORCH_CHECK(momentum >= 0 && momentum < 1, "--momentum must be in [0, 1), got ", momentum);
  TORCH_CHECK(weight_decay >= 0 && std::isfinite(weight_decay), "--weight-decay must be >= 0, got ", weight_decay);
  TORCH_CHECK(batch_size >= 1, "--batch-size must be >= 1, got ", batch_size);
  TORCH_CHECK(accumulation_steps >= 1, "--accumulation-steps must be >= 1, got ", accumulation_steps);
  TORCH_CHECK(batch_size % accumulation_steps == 0, "--batch-size ", batch_size,
              " must be a multiple of --accumulation-steps ", accumulation_steps,
              " (each step is that many micro-batches of equal size)");
  TORCH_CHECK(epochs >= 1, "--epochs must be >= 1, got ", epochs);
  TORCH_CHECK(max_steps >= -1, "--max-steps must be >= 0 (or -1: no limit), got ", max_steps);
  TORCH_CHECK(one_of(lr_schedule, {"constant", "step", "cosine"}),
              "--lr-schedule must be constant, step or cosine, got '", lr_schedule, "'");
  TORCH_CHECK(warmup_epochs >= 0 && std::isfinite(warmup_epochs), "--warmup-epochs must be >= 0, got ",
              warmup_epochs);
  TORCH_CHECK(seed >= 0, "--seed must be >= 0, got ", seed);
  TORCH_CHECK(threads >= 0 && threads <= 4096, "--threads must be in [0, 4096] (0: LibTorch's default), got ",
              threads);
  // K-FAC (the library's Options::validate checks the same ranges, under its own option names).
  TORCH_CHECK(damping > 0 && std::isfinite(damping), flag("--damping"), " must be > 0, got ", damping);
  TORCH_CHECK(factor_decay >= 0 && factor_decay < 1, flag("--factor-decay"), " must be in [0, 1), got ",
              factor_decay);
  TORCH_CHECK(kl_clip >= 0 && std::isfinite(kl_clip), flag("--kl-clip"), " must be >= 0 (0: off), got ", kl_clip);
  TORCH_CHECK(factor_update_steps >= 1, flag("--factor-update-steps"), " must be >= 1, got ", factor_update_steps);
  TORCH_CHECK(inv_update_steps >= 1, flag("--inv-update-steps"), " must be >= 1",
              flag("--inv-update-steps") == "--inv-update-steps" ? "" : " (0: K-FAC off)", ", got ", inv_update_steps);
  TORCH_CHECK(compute_method == "eigen" || compute_method == "inverse",
              "--compute-method must be eigen or inverse, got '", compute_method, "'");
  for (const auto& [name, value] : {std::pair{"--factor-dtype", factor_dtype}, std::pair{"--inv-dtype", inv_dtype}}) {
    TORCH_CHECK(value.empty() || one_of(value, {"float32", "float64", "bfloat16"}), name,
                " must be float32, float64 or bfloat16, got '", value, "'");
  }
  TORCH_CHECK(checkpoint_every_epochs >= 1, "--checkpoint-every-epochs must be >= 1, got ", checkpoint_every_epochs);
  TORCH_CHECK(!resume || !checkpoint_dir.empty(), "--resume needs --checkpoint-dir");
  TORCH_CHECK(!(resume && overwrite), "--resume continues the run in --checkpoint-dir and --overwrite replaces it: "
              "pass one of them");
  TORCH_CHECK(checkpoint_every_steps >= 0, "--checkpoint-every-steps must be >= 0, got ", checkpoint_every_steps);
  TORCH_CHECK(on_nan_loss == "stop" || on_nan_loss == "skip", "--on-nan-loss must be stop or skip, got '",
              on_nan_loss, "'");
  TORCH_CHECK(log_every >= 0, "--log-every must be >= 0, got ", log_every);
  TORCH_CHECK(eval_examples >= 0, "--eval-examples must be >= 0, got ", eval_examples);
  TORCH_CHECK(one_of(strategy, {"kaisa", "dkfac", "dkfac-lw", "spd", "dp"}),
              "--strategy must be kaisa, dkfac, dkfac-lw, spd or dp, got '", strategy, "'");
  TORCH_CHECK(grad_worker_fraction >= 0 && grad_worker_fraction <= 1, flag("--grad-worker-fraction"),
              " must be in [0, 1] (0: 1/P), got ", grad_worker_fraction);
  TORCH_CHECK(grad_worker_fraction == 1.0 || strategy == "kaisa", flag("--grad-worker-fraction"),
              " applies to --strategy kaisa only, got ", grad_worker_fraction, " with --strategy ", strategy);
}

Strategy TrainConfig::library_strategy() const {
  if (strategy == "spd") return Strategy::kSpd;
  if (strategy == "dp") return Strategy::kDp;
  return Strategy::kKaisa;
}

double TrainConfig::fraction_for(int world) const {
  if (strategy != "kaisa" && strategy != "dkfac-lw") return 1.0;
  if (strategy == "dkfac-lw" || grad_worker_fraction == 0.0) return 1.0 / world;
  return grad_worker_fraction;
}

nlohmann::json to_json(const TrainConfig& c) {
  // Everything that must agree between ranks (threads may differ).
  return {{"model", c.model}, {"dataset", c.dataset}, {"data-dir", c.data_dir}, {"optimizer", c.optimizer},
          {"lr", c.lr}, {"momentum", c.momentum}, {"weight-decay", c.weight_decay}, {"batch-size", c.batch_size},
          {"accumulation-steps", c.accumulation_steps},
          {"epochs", c.epochs}, {"max-steps", c.max_steps}, {"lr-schedule", c.lr_schedule},
          {"warmup-epochs", c.warmup_epochs}, {"seed", c.seed}, {"kfac", c.kfac}, {"damping", c.damping},
          {"factor-decay", c.factor_decay}, {"kl-clip", c.kl_clip}, {"kl-clip-follows-lr", c.kl_clip_follows_lr},
          {"factor-update-steps", c.factor_update_steps}, {"inv-update-steps", c.inv_update_steps},
          {"compute-method", c.compute_method}, {"factor-dtype", c.factor_dtype}, {"inv-dtype", c.inv_dtype},
          {"skip-layers", c.skip_layers}, {"checkpoint-dir", c.checkpoint_dir},
          {"checkpoint-every-epochs", c.checkpoint_every_epochs}, {"checkpoint-every-steps", c.checkpoint_every_steps},
          {"on-nan-loss", c.on_nan_loss}, {"resume", c.resume}, {"overwrite", c.overwrite}, {"strategy", c.strategy},
          {"grad-worker-fraction", c.grad_worker_fraction}, {"symmetric-comm", c.symmetric_comm},
          {"balance-memory", c.balance_memory}, {"colocate-factors", c.colocate_factors}};
}

}  // namespace dkfac::train
