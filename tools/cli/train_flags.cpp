// `dkfac train`'s training flags (the launcher's own flags are in train.cpp), in --help groups, with the
// flag names of kfac_pytorch's example scripts as aliases.
#include "tools/cli/train_flags.h"

#include <functional>
#include <memory>
#include <sstream>

#include <c10/util/Exception.h>

namespace dkfac::cli {
namespace {

std::string show(double value) {
  std::ostringstream out;
  out << value;
  return out.str();
}
std::string show(int64_t value) { return std::to_string(value); }
std::string show(const std::vector<std::string>& values) {
  std::string out;
  for (const auto& v : values) out += (out.empty() ? "" : " ") + v;
  return out;
}

// What the kfac_pytorch aliases need after parsing: each resolver copies its alias into the dkfac field,
// or throws when the alias and its dkfac flag were both given with different values.
using Resolvers = std::vector<std::function<void()>>;

// One switch as two flags, `on` and `off`, so that --help says which one is the default (the value `field`
// holds now); they exclude each other. Returns the `off` flag.
CLI::Option* add_switch(CLI::App& app, const std::string& on, const std::string& off, bool& field,
                        const std::string& on_help, const std::string& off_help, const std::string& group) {
  const bool initially = field;
  auto* on_flag = app.add_flag_callback(on, [&field] { field = true; },
                                        on_help + (initially ? " (default: on)" : " (default: off)"))
                      ->group(group);
  auto* off_flag = app.add_flag_callback(off, [&field] { field = false; },
                                         off_help + (initially ? " (default: off)" : " (default: on)"))
                       ->group(group);
  on_flag->excludes(off_flag);
  return off_flag;
}

// `alias` (kfac_pytorch's examples) stands for `flag` (dkfac's), whose value lives in `field`.
template <typename T>
void add_alias(CLI::App& app, Resolvers& resolvers, train::TrainConfig& c, const std::string& alias,
               const std::string& flag, T& field, const std::string& help) {
  auto value = std::make_shared<T>();
  auto* option = app.add_option(alias, *value, help + " (= " + flag + ")")->group(kAliasGroup);
  resolvers.push_back([&app, &c, &field, option, value, alias, flag] {
    if (option->count() == 0) return;
    if (app.count(flag) > 0 && field != *value) {
      throw CLI::ValidationError(alias + " " + show(*value) + " and " + flag + " " + show(field) +
                                 " disagree (" + alias + " is kfac_pytorch's name for " + flag + "); give one");
    }
    field = *value;
    c.typed_as[flag] = alias;
  });
}

}  // namespace

void add_train_options(CLI::App& app, dkfac::train::TrainConfig& c) {
  // --- Data
  add_choice(app, "--dataset", c.dataset, "fashion-mnist | mnist | cifar10 | synthetic")->group(kDataGroup);
  app.add_option("--data-dir", c.data_dir,
                 "dataset directory (default for fashion-mnist: /usr/share/datasets/fashion-mnist)")
      ->group(kDataGroup);
  app.add_option("--batch-size", c.batch_size, "examples per rank per step (the global batch is this x ranks)")
      ->capture_default_str()
      ->group(kDataGroup);
  app.add_option("--global-batch-size", c.global_batch_size,
                 "examples per step over all ranks, B / ranks each (must divide); replaces --batch-size, so that a "
                 "run resumed on another number of ranks sees the same batches; the logged step loss is then the "
                 "global batch's (0: off)")
      ->capture_default_str()
      ->group(kDataGroup);
  app.add_option("--eval-examples", c.eval_examples, "evaluate on the first N test examples (0: all)")
      ->capture_default_str()
      ->group(kDataGroup);
  app.add_option("--seed", c.seed, "seed of initialisation, shuffling and augmentation (>= 0)")
      ->capture_default_str()
      ->group(kDataGroup);
  // --- Model
  add_choice(app, "--model", c.model, "mlp | cnn | resnet20 | autoencoder")->group(kModelGroup);
  // --- Optimizer
  add_choice(app, "--optimizer", c.optimizer, "sgd | adam")->group(kOptimizerGroup);
  app.add_option("--lr", c.lr, "base learning rate (> 0)")->capture_default_str()->group(kOptimizerGroup);
  app.add_option("--momentum", c.momentum, "SGD momentum, in [0, 1)")->capture_default_str()->group(kOptimizerGroup);
  app.add_option("--weight-decay", c.weight_decay, "L2 weight decay (>= 0)")
      ->capture_default_str()
      ->group(kOptimizerGroup);
  app.add_option("--accumulation-steps", c.accumulation_steps,
                 "split each step's batch into this many micro-batches whose gradients accumulate before one "
                 "allreduce and one K-FAC/optimizer step (DDP's no_sync)")
      ->capture_default_str()
      ->group(kOptimizerGroup);
  app.add_option("--epochs", c.epochs, "passes over the training set")->capture_default_str()->group(kOptimizerGroup);
  app.add_option("--max-steps", c.max_steps, "stop after this many steps in total (-1: no limit)")
      ->capture_default_str()
      ->group(kOptimizerGroup);
  add_choice(app, "--lr-schedule", c.lr_schedule, "constant | step (x0.1 at 50% and 75%) | cosine")
      ->group(kOptimizerGroup);
  app.add_option("--warmup-epochs", c.warmup_epochs, "linear learning-rate warmup")
      ->capture_default_str()
      ->group(kOptimizerGroup);
  add_choice(app, "--on-nan-loss", c.on_nan_loss,
             "stop: end with an error before a non-finite loss or gradient reaches the weights; skip: drop "
             "that step and go on")
      ->group(kOptimizerGroup);
  // --- K-FAC. Paired switches are two flags each, so that --help says which one is the default.
  add_switch(app, "--kfac", "--no-kfac", c.kfac, "precondition with K-FAC", "no K-FAC: plain SGD/Adam", kKfacGroup);
  app.add_option("--damping", c.damping,
                 "K-FAC Tikhonov damping (> 0); 0.3 is the recipe the README's table measures "
                 "(docs/PERFORMANCE.md: 0.1 reached 91% one epoch sooner there)")
      ->capture_default_str()
      ->group(kKfacGroup);
  app.add_option("--factor-decay", c.factor_decay, "running-average decay of the factors, in [0, 1)")
      ->capture_default_str()
      ->group(kKfacGroup);
  app.add_option("--kl-clip", c.kl_clip, "K-FAC KL clip (>= 0; 0: off)")->capture_default_str()->group(kKfacGroup);
  add_switch(app, "--kl-clip-follows-lr", "--kl-clip-fixed", c.kl_clip_follows_lr,
             "scale the KL-clip bound by (lr / base lr)^2", "keep the KL-clip bound fixed, as kfac_pytorch does",
             kKfacGroup);
  app.add_option("--factor-update-steps", c.factor_update_steps, "steps between factor updates (>= 1)")
      ->capture_default_str()
      ->group(kKfacGroup);
  app.add_option("--inv-update-steps", c.inv_update_steps, "steps between eigendecompositions/inverses (>= 1)")
      ->capture_default_str()
      ->group(kKfacGroup);
  add_choice(app, "--compute-method", c.compute_method, "eigen | inverse")->group(kKfacGroup);
  add_choice(app, "--factor-dtype", c.factor_dtype,
             "storage dtype of K-FAC factors: float32 | float64 | bfloat16 (default: the model's)")
      ->group(kKfacGroup);
  add_choice(app, "--inv-dtype", c.inv_dtype,
             "storage dtype of eigendecompositions/inverses: float32 | float64 | bfloat16 (default: the factors')")
      ->group(kKfacGroup);
  app.add_option("--skip-layers", c.skip_layers,
                 "layers K-FAC leaves alone: regular expressions matched against module names (as the strategy "
                 "log prints them) or kinds (Linear, Conv2d); a pattern that matches no layer is warned about")
      ->group(kKfacGroup);
  // --- Distributed (the launcher's flags join this group in train.cpp)
  add_choice(app, "--strategy", c.strategy,
             "kaisa (--grad-worker-fraction) | dkfac (SC20, = kaisa f=1) | dkfac-lw (SC20 layer-wise, = kaisa "
             "f=1/P) | spd (SPD-KFAC) | dp (DP-KFAC)")
      ->group(kDistributedGroup);
  app.add_option("--grad-worker-fraction", c.grad_worker_fraction,
                 "KAISA: 1 = comm-opt, 0.5 = hybrid-opt, 1/P = mem-opt; 0 means 1/P (as in kfac_pytorch)")
      ->capture_default_str()
      ->group(kDistributedGroup);
  app.add_flag("--balance-memory", c.balance_memory,
               "place second-order work by dim^2 (memory) instead of dim^3 (default: off)")
      ->group(kDistributedGroup);
  auto* separate = add_switch(app, "--colocate-factors", "--separate-factors", c.colocate_factors,
                              "decompose A and G of a layer on one rank",
                              "decompose A and G of a layer on different ranks", kDistributedGroup);
  app.add_flag("--symmetric-comm", c.symmetric_comm, "send symmetric factors as upper triangles (default: off)")
      ->group(kDistributedGroup);
  add_choice(app, "--device", c.device,
             "cpu | cuda (rank r of a node on cuda:LOCAL_RANK) | auto (cuda when a CUDA device is visible, else "
             "cpu): where the model, optimizer and K-FAC state, batches and evaluation live")
      ->group(kDistributedGroup);
  add_choice(app, "--backend", c.backend,
             "what carries collectives of CUDA tensors (CPU tensors always go through Gloo): auto (NCCL when "
             "built with it and a GPU is visible, else Gloo) | nccl | gloo (copies through the host; lets more "
             "ranks than GPUs share them round-robin, rank r on cuda:(LOCAL_RANK % GPUs)). nccl or gloo with "
             "--device cuda in a single process: a one-rank group over that backend")
      ->group(kDistributedGroup);
  app.add_option("--threads", c.threads, "intra-op threads (>= 0; 0: LibTorch's default, or cores / local ranks)")
      ->capture_default_str()
      ->group(kDistributedGroup);
  // --- Checkpoints
  app.add_option("--checkpoint-dir", c.checkpoint_dir, "directory for checkpoint.pt (written atomically)")
      ->group(kCheckpointGroup);
  app.add_option("--checkpoint-every-epochs", c.checkpoint_every_epochs, "epochs between checkpoints (>= 1)")
      ->capture_default_str()
      ->group(kCheckpointGroup);
  app.add_option("--checkpoint-every-steps", c.checkpoint_every_steps,
                 "also checkpoint every N steps (0: only at epoch ends)")
      ->capture_default_str()
      ->group(kCheckpointGroup);
  app.add_flag("--resume", c.resume, "continue from --checkpoint-dir/checkpoint.pt if it exists (default: off)")
      ->group(kCheckpointGroup);
  app.add_flag("--overwrite", c.overwrite,
               "start a fresh run even if --checkpoint-dir holds checkpoints or --metrics holds events, replacing "
               "them (default: off: such a run is refused)")
      ->group(kCheckpointGroup);
  // --- Output
  app.add_option("--metrics", c.metrics, "write JSON Lines metrics to this file")->group(kOutputGroup);
  app.add_option("--log-every", c.log_every, "steps between progress lines (0: ~10 per epoch)")
      ->capture_default_str()
      ->group(kOutputGroup);
  app.add_flag("--print-plan", c.print_plan,
               "print the K-FAC step plan this job runs at start: how factors are reduced, which rank decomposes "
               "each layer's A and G, which ranks precondition it, what is broadcast (default: off; a distributed "
               "job prints the plan's job-wide lines anyway)")
      ->group(kOutputGroup);

  // --- kfac_pytorch's example flags (examples/torch_cifar10_resnet.py, v0.4.2), with their meanings there.
  auto resolvers = std::make_shared<Resolvers>();
  auto inv_steps_value = std::make_shared<int64_t>(0);
  auto* inv_steps = app.add_option("--kfac-inv-update-steps", *inv_steps_value,
                                   "steps between eigendecompositions/inverses; 0 turns K-FAC off (= "
                                   "--inv-update-steps, or --no-kfac for 0)")
                        ->group(kAliasGroup);
  resolvers->push_back([&app, &c, inv_steps, inv_steps_value] {
    if (inv_steps->count() == 0) return;
    const int64_t steps = *inv_steps_value;
    if (steps < 0) {
      throw CLI::ValidationError("--kfac-inv-update-steps must be >= 0 (0: K-FAC off), got " + show(steps));
    }
    if (steps == 0) {
      if (app.count("--kfac") > 0) {
        throw CLI::ValidationError("--kfac-inv-update-steps 0 (K-FAC off) and --kfac disagree; give one");
      }
      c.kfac = false;
      return;
    }
    if (app.count("--no-kfac") > 0) {
      throw CLI::ValidationError("--kfac-inv-update-steps " + show(steps) + " (K-FAC on) and --no-kfac disagree; give "
                                 "one");
    }
    if (app.count("--inv-update-steps") > 0 && c.inv_update_steps != steps) {
      throw CLI::ValidationError("--kfac-inv-update-steps " + show(steps) + " and --inv-update-steps " +
                                 show(c.inv_update_steps) + " disagree (--kfac-inv-update-steps is kfac_pytorch's "
                                 "name for --inv-update-steps); give one");
    }
    c.inv_update_steps = steps;
    c.typed_as["--inv-update-steps"] = "--kfac-inv-update-steps";
  });
  add_alias(app, *resolvers, c, "--kfac-factor-update-steps", "--factor-update-steps", c.factor_update_steps,
            "steps between factor updates");
  add_alias(app, *resolvers, c, "--kfac-damping", "--damping", c.damping, "K-FAC damping");
  add_alias(app, *resolvers, c, "--kfac-factor-decay", "--factor-decay", c.factor_decay, "factor running-average decay");
  add_alias(app, *resolvers, c, "--kfac-kl-clip", "--kl-clip", c.kl_clip, "KL clip");
  add_alias(app, *resolvers, c, "--kfac-skip-layers", "--skip-layers", c.skip_layers, "layers K-FAC leaves alone");
  add_alias(app, *resolvers, c, "--kfac-grad-worker-fraction", "--grad-worker-fraction", c.grad_worker_fraction,
            "KAISA grad-worker fraction; with --kfac-strategy hybrid-opt, its fraction");
  // The description as a named const std::string: built against torch 2.15's headers, a string literal here
  // made CLI11's add_flag(name, description) and add_flag(name, result&) ambiguous.
  static const std::string colocate_help = "decompose A and G of a layer on one rank (= --colocate-factors)";
  auto* colocate_alias = app.add_flag("--kfac-colocate-factors", colocate_help)
                             ->group(kAliasGroup);
  resolvers->push_back([&c, colocate_alias, separate] {
    if (colocate_alias->count() == 0) return;
    if (separate->count() > 0) {
      throw CLI::ValidationError("--kfac-colocate-factors and --separate-factors disagree; give one");
    }
    c.colocate_factors = true;
  });
  auto kfac_strategy_value = std::make_shared<std::string>();
  auto* kfac_strategy =
      app.add_option("--kfac-strategy", *kfac_strategy_value,
                     "comm-opt (= --grad-worker-fraction 1) | mem-opt (= 1/P) | hybrid-opt (= 0.5, or "
                     "--kfac-grad-worker-fraction), all with --strategy kaisa")
          ->check(CLI::IsMember({"comm-opt", "mem-opt", "hybrid-opt"}))
          ->group(kAliasGroup);
  // After --kfac-grad-worker-fraction's resolver: an explicit fraction is in c.grad_worker_fraction by then.
  resolvers->push_back([&app, &c, kfac_strategy, kfac_strategy_value] {
    if (kfac_strategy->count() == 0) return;
    const std::string name = *kfac_strategy_value;
    if (app.count("--strategy") > 0 && c.strategy != train::TrainStrategy::kKaisa) {
      throw CLI::ValidationError("--kfac-strategy " + name + " and --strategy " + train::to_string(c.strategy) +
                                 " disagree (kfac_pytorch's strategies are --strategy kaisa); give one");
    }
    const bool explicit_fraction = app.count("--grad-worker-fraction") + app.count("--kfac-grad-worker-fraction") > 0;
    const std::string fraction_flag = c.typed_as.count("--grad-worker-fraction") ? "--kfac-grad-worker-fraction"
                                                                                   : "--grad-worker-fraction";
    double fraction = 0.5;  // kfac_pytorch's DistributedStrategy.HYBRID_OPT
    if (name == "comm-opt") fraction = 1.0;
    if (name == "mem-opt") fraction = 0.0;  // 1/P, resolved by TrainConfig::fraction_for
    if (name == "hybrid-opt" && explicit_fraction) fraction = c.grad_worker_fraction;
    if (explicit_fraction && c.grad_worker_fraction != fraction) {
      throw CLI::ValidationError("--kfac-strategy " + name + " (grad-worker fraction " +
                                 (name == "mem-opt" ? std::string("1/P") : show(fraction)) + ") and " + fraction_flag +
                                 " " + show(c.grad_worker_fraction) + " disagree; give one");
    }
    c.strategy = train::TrainStrategy::kKaisa;
    c.grad_worker_fraction = fraction;
  });
  // Aliases first, then every range check, naming the flag as typed: all before any worker starts.
  app.parse_complete_callback([resolvers, &c] {
    for (const auto& resolve : *resolvers) resolve();
    try {
      c.validate();
    } catch (const c10::Error& e) {
      throw CLI::ValidationError(e.what_without_backtrace());
    }
  });
}

}  // namespace dkfac::cli
