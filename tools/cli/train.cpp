// `dkfac train`: its flags, one rank's run, and the choice between this process's job and --nproc workers.
#include <iostream>
#include <optional>
#include <thread>

#include "tools/cli/commands.h"
#include "tools/cli/launch.h"

namespace dkfac::cli {
namespace {

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

// Where the rendezvous is when a launcher's environment leaves it open (flags beat the environment).
struct RendezvousFlags {
  std::string master_addr;
  int master_port = 0;
};

int run_rank(dkfac::train::TrainConfig config, const dkfac::comm::JobEnvironment& job, int timeout_s) {
  std::shared_ptr<dkfac::comm::Communicator> communicator;
  if (job.restart_count > 0) {
    // torch's elastic agent restarted the workers after a failure: continue from the last checkpoint.
    TORCH_CHECK(!config.checkpoint_dir.empty(), "the elastic agent restarted this job (restart ", job.restart_count,
                ") but it has no --checkpoint-dir to resume from; a restart would silently start over. Pass "
                "--checkpoint-dir so that restarts resume, or launch with max_restarts=0");
    config.resume = true;
  }
  if (job.world_size > 1) {
    if (job.rank == 0 && job.launcher != dkfac::comm::Launcher::kNone) {
      std::cout << "[rank 0] launch: " << job.describe() << (job.restart_count > 0 ? ": resuming" : "") << std::endl;
    }
    communicator = dkfac::comm::Communicator::connect(job.rendezvous(std::chrono::seconds(timeout_s)));
    // The main thread may be blocked in a collective that no longer completes: end the process here.
    communicator->on_lost_rank([rank = job.rank](const std::string& message) {
      std::cout << std::flush;
      std::cerr << "[rank " << rank << "] dkfac: error: " << message << "; stopping (the last checkpoint is intact)"
                << std::endl;
      std::_Exit(1);
    });
    if (config.threads == 0) {
      config.threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / job.local_world_size);
    }
  }
  dkfac::train::Trainer trainer(config, communicator);
  trainer.run();
  if (!config.metrics.empty() && job.rank == 0) std::cout << "metrics: " << config.metrics << std::endl;
  return 0;
}

}  // namespace

int run_launched_rank(const dkfac::train::TrainConfig& config, const dkfac::comm::JobEnvironment& job, int timeout_s) {
  try {
    return run_rank(config, job, timeout_s);
  } catch (const c10::Error& e) {
    std::cerr << "[rank " << job.rank << "] dkfac: error: " << e.what_without_backtrace() << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "[rank " << job.rank << "] dkfac: error: " << e.what() << std::endl;
  }
  return 1;
}

namespace {

/// This process's job: the launcher's environment, with --master-addr/--master-port applied.
dkfac::comm::JobEnvironment job_of_this_process(const RendezvousFlags& flags) {
  return dkfac::comm::read_job_environment([&flags](const std::string& name) -> std::optional<std::string> {
    // The flags stand in for the variables, so that every launcher reads them alike.
    if (name == "MASTER_ADDR" && !flags.master_addr.empty()) return flags.master_addr;
    if (name == "MASTER_PORT" && flags.master_port > 0) return std::to_string(flags.master_port);
    const char* value = std::getenv(name.c_str());
    return value ? std::optional<std::string>(value) : std::nullopt;
  });
}

}  // namespace

Command add_train_command(CLI::App& app) {
  struct Flags {
    dkfac::train::TrainConfig config;
    int nproc = 1;
    int timeout_s = 60;
    RendezvousFlags rendezvous;
  };
  auto flags = std::make_shared<Flags>();
  auto* train = app.add_subcommand("train", "train a model with (or without) K-FAC");
  add_train_options(*train, flags->config);
  train->add_option("--nproc", flags->nproc, "local worker processes (TCPStore rendezvous on a free loopback port)")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  train->add_option("--master-addr", flags->rendezvous.master_addr,
                    "host of rank 0's rendezvous store under a launcher (default: MASTER_ADDR; Slurm: the first "
                    "node of the job; else 127.0.0.1)");
  train->add_option("--master-port", flags->rendezvous.master_port,
                    "port of the rendezvous store (default: MASTER_PORT; Slurm: 20000 + SLURM_JOB_ID mod 10000; "
                    "else 29500)")
      ->check(CLI::Range(1, 65535));
  train->add_option("--timeout", flags->timeout_s, "seconds before a silent peer is an error")->capture_default_str()
      ->check(CLI::Range(1, 3600));

  return {train, [flags](const std::string&) {
    if (flags->nproc > 1) return launch_local(flags->config, flags->nproc, flags->timeout_s);
    const auto job = job_of_this_process(flags->rendezvous);
    if (job.world_size == 1) return run_rank(flags->config, job, flags->timeout_s);
    return run_launched_rank(flags->config, job, flags->timeout_s);
  }};
}

}  // namespace dkfac::cli
