// `dkfac train`'s training flags (the launcher's own flags are in train.cpp).
#include "tools/cli/train_flags.h"

namespace dkfac::cli {

void add_train_options(CLI::App& app, dkfac::train::TrainConfig& c) {
  app.add_option("--model", c.model, "mlp | cnn | resnet20 | autoencoder")->capture_default_str();
  app.add_option("--dataset", c.dataset, "fashion-mnist | mnist | cifar10 | synthetic")->capture_default_str();
  app.add_option("--data-dir", c.data_dir,
                 "dataset directory (default for fashion-mnist: /usr/share/datasets/fashion-mnist)");
  app.add_option("--optimizer", c.optimizer, "sgd | adam")->capture_default_str();
  app.add_option("--lr", c.lr, "base learning rate")->capture_default_str();
  app.add_option("--momentum", c.momentum, "SGD momentum")->capture_default_str();
  app.add_option("--weight-decay", c.weight_decay, "L2 weight decay")->capture_default_str();
  app.add_option("--batch-size", c.batch_size, "examples per rank per step (the global batch is this x ranks)")
      ->capture_default_str();
  app.add_option("--accumulation-steps", c.accumulation_steps,
                 "split each step's batch into this many micro-batches whose gradients accumulate before one "
                 "allreduce and one K-FAC/optimizer step (DDP's no_sync)")
      ->capture_default_str();
  app.add_option("--epochs", c.epochs, "passes over the training set")->capture_default_str();
  app.add_option("--max-steps", c.max_steps, "stop after this many steps in total (-1: no limit)")
      ->capture_default_str();
  app.add_option("--lr-schedule", c.lr_schedule, "constant | step (x0.1 at 50% and 75%) | cosine")
      ->capture_default_str();
  app.add_option("--warmup-epochs", c.warmup_epochs, "linear learning-rate warmup")->capture_default_str();
  app.add_option("--seed", c.seed, "seed of initialisation, shuffling and augmentation")->capture_default_str();
  app.add_option("--threads", c.threads, "intra-op threads (0: LibTorch default)")->capture_default_str();
  app.add_flag("--kfac,!--no-kfac", c.kfac, "K-FAC on (default) or off (plain SGD/Adam)");
  app.add_option("--damping", c.damping, "K-FAC damping")->capture_default_str();
  app.add_option("--factor-decay", c.factor_decay, "K-FAC running-average decay")->capture_default_str();
  app.add_option("--kl-clip", c.kl_clip, "K-FAC KL clip (0: off)")->capture_default_str();
  app.add_flag("--kl-clip-follows-lr,!--kl-clip-fixed", c.kl_clip_follows_lr,
               "scale the KL-clip bound by (lr / base lr)^2 (default) or keep it fixed (kfac_pytorch)");
  app.add_option("--factor-update-steps", c.factor_update_steps, "steps between factor updates")
      ->capture_default_str();
  app.add_option("--inv-update-steps", c.inv_update_steps, "steps between eigendecompositions/inverses")
      ->capture_default_str();
  app.add_option("--compute-method", c.compute_method, "eigen | inverse")->capture_default_str();
  app.add_option("--factor-dtype", c.factor_dtype,
                 "storage dtype of K-FAC factors: float32 | float64 | bfloat16 (default: the model's)");
  app.add_option("--inv-dtype", c.inv_dtype,
                 "storage dtype of eigendecompositions/inverses: float32 | float64 | bfloat16 (default: the factors')");
  app.add_option("--metrics", c.metrics, "write JSON Lines metrics to this file");
  app.add_option("--checkpoint-dir", c.checkpoint_dir, "directory for checkpoint.pt (written atomically)");
  app.add_option("--checkpoint-every-epochs", c.checkpoint_every_epochs, "epochs between checkpoints")
      ->capture_default_str();
  app.add_option("--checkpoint-every-steps", c.checkpoint_every_steps,
                 "also checkpoint every N steps (0: only at epoch ends)")
      ->capture_default_str();
  app.add_option("--on-nan-loss", c.on_nan_loss,
                 "stop: end with an error before a non-finite loss or gradient reaches the weights; skip: drop "
                 "that step and go on")
      ->capture_default_str();
  app.add_flag("--resume", c.resume, "continue from --checkpoint-dir/checkpoint.pt if it exists");
  app.add_flag("--overwrite", c.overwrite,
               "start a fresh run even if --checkpoint-dir holds checkpoints or --metrics holds events, replacing "
               "them (without it, such a run is refused)");
  app.add_option("--eval-examples", c.eval_examples, "evaluate on the first N test examples (0: all)")
      ->capture_default_str();
  app.add_option("--log-every", c.log_every, "steps between progress lines (0: ~10 per epoch)")
      ->capture_default_str();
  app.add_option("--strategy", c.strategy,
                 "kaisa (--grad-worker-fraction) | dkfac (SC20, = kaisa f=1) | dkfac-lw (SC20 layer-wise, = kaisa "
                 "f=1/P) | spd (SPD-KFAC) | dp (DP-KFAC)")
      ->capture_default_str();
  app.add_flag("--balance-memory", c.balance_memory, "place second-order work by dim^2 (memory) instead of dim^3");
  app.add_flag("!--separate-factors,--colocate-factors", c.colocate_factors,
               "decompose A and G of a layer on different ranks (default: colocated)");
  app.add_option("--grad-worker-fraction", c.grad_worker_fraction,
                 "KAISA: 1 = comm-opt, 0.5 = hybrid-opt, 1/P = mem-opt")
      ->capture_default_str();
  app.add_option("--skip-layers", c.skip_layers,
                 "layers K-FAC leaves alone: regular expressions matched against module names (as the strategy "
                 "log prints them) or kinds (Linear, Conv2d)");
  app.add_flag("--symmetric-comm", c.symmetric_comm, "send symmetric factors as upper triangles");
}

}  // namespace dkfac::cli
