// The dkfac command line: `dkfac train` and `dkfac plot`.
#include <CLI/CLI.hpp>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <optional>
#include <thread>

#include "dkfac/version.h"
#include "tools/plot/plot.h"
#include "tools/train/trainer.h"

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
  app.add_option("--batch-size", c.batch_size, "examples per step")->capture_default_str();
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
  app.add_option("--metrics", c.metrics, "write JSON Lines metrics to this file");
  app.add_option("--checkpoint-dir", c.checkpoint_dir, "directory for checkpoint.pt (written atomically)");
  app.add_option("--checkpoint-every-epochs", c.checkpoint_every_epochs, "epochs between checkpoints")
      ->capture_default_str();
  app.add_flag("--resume", c.resume, "continue from --checkpoint-dir/checkpoint.pt if it exists");
  app.add_option("--log-every", c.log_every, "steps between progress lines (0: ~10 per epoch)")
      ->capture_default_str();
  app.add_option("--strategy", c.strategy,
                 "kaisa (--grad-worker-fraction) | dkfac (SC20, = kaisa f=1) | dkfac-lw (SC20 layer-wise, = kaisa f=1/P)")
      ->capture_default_str();
  app.add_flag("--balance-memory", c.balance_memory, "place second-order work by dim^2 (memory) instead of dim^3");
  app.add_flag("!--separate-factors,--colocate-factors", c.colocate_factors,
               "decompose A and G of a layer on different ranks (default: colocated)");
  app.add_option("--grad-worker-fraction", c.grad_worker_fraction,
                 "KAISA: 1 = comm-opt, 0.5 = hybrid-opt, 1/P = mem-opt")
      ->capture_default_str();
  app.add_flag("--symmetric-comm", c.symmetric_comm, "send symmetric factors as upper triangles");
}

// The job this process belongs to: --nproc (we launch), or a launcher's environment.
struct Job {
  int rank = 0;
  int world = 1;
  std::string host = "127.0.0.1";
  int port = 29500;
};

std::optional<Job> job_from_environment() {
  auto get = [](const char* name) -> std::optional<std::string> {
    const char* v = std::getenv(name);
    return v ? std::optional<std::string>(v) : std::nullopt;
  };
  Job job;
  if (auto r = get("RANK"), w = get("WORLD_SIZE"); r && w) {  // torchrun
    job.rank = std::stoi(*r);
    job.world = std::stoi(*w);
  } else if (auto r = get("OMPI_COMM_WORLD_RANK"), w = get("OMPI_COMM_WORLD_SIZE"); r && w) {  // mpirun
    job.rank = std::stoi(*r);
    job.world = std::stoi(*w);
  } else if (auto r = get("SLURM_PROCID"), w = get("SLURM_NTASKS"); r && w) {  // srun
    job.rank = std::stoi(*r);
    job.world = std::stoi(*w);
  } else {
    return std::nullopt;
  }
  if (auto a = get("MASTER_ADDR")) job.host = *a;
  if (auto p = get("MASTER_PORT")) job.port = std::stoi(*p);
  return job;
}

int free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    throw std::runtime_error("cannot find a free loopback port for the rendezvous");
  }
  const int port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

int run_rank(dkfac::train::TrainConfig config, const Job& job, int timeout_s) {
  std::shared_ptr<dkfac::comm::Communicator> communicator;
  if (job.world > 1) {
    dkfac::comm::RendezvousOptions options;
    options.host = job.host;
    options.port = job.port;
    options.rank = job.rank;
    options.world_size = job.world;
    options.timeout = std::chrono::seconds(timeout_s);
    communicator = dkfac::comm::Communicator::connect(options);
    if (config.threads == 0) {
      config.threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / job.world);
    }
  }
  dkfac::train::Trainer trainer(config, communicator);
  trainer.run();
  if (!config.metrics.empty() && job.rank == 0) std::cout << "metrics: " << config.metrics << std::endl;
  return 0;
}

// Forks `nproc` workers on this machine; if one fails, stops the others and reports which.
int launch_local(const dkfac::train::TrainConfig& config, int nproc, int timeout_s) {
  Job job;
  job.world = nproc;
  job.port = free_loopback_port();
  std::vector<pid_t> pids;
  for (int rank = 0; rank < nproc; ++rank) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      job.rank = rank;
      int rc = 1;
      try {
        rc = run_rank(config, job, timeout_s);
      } catch (const c10::Error& e) {
        std::cerr << "[rank " << rank << "] dkfac: error: " << e.what_without_backtrace() << std::endl;
      } catch (const std::exception& e) {
        std::cerr << "[rank " << rank << "] dkfac: error: " << e.what() << std::endl;
      }
      std::_Exit(rc);
    }
    pids.push_back(pid);
  }
  int failed_rank = -1;
  int failed_status = 0;
  for (size_t done = 0; done < pids.size(); ++done) {
    int status = 0;
    const pid_t pid = ::wait(&status);
    const auto it = std::find(pids.begin(), pids.end(), pid);
    const int rank = static_cast<int>(it - pids.begin());
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok && failed_rank < 0) {
      failed_rank = rank;
      failed_status = status;
      for (pid_t other : pids) ::kill(other, SIGTERM);
    }
  }
  if (failed_rank >= 0) {
    std::cerr << "dkfac: rank " << failed_rank << " failed ("
              << (WIFSIGNALED(failed_status) ? "killed by signal " + std::to_string(WTERMSIG(failed_status))
                                             : "exit " + std::to_string(WEXITSTATUS(failed_status)))
              << "); stopped the other ranks" << std::endl;
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dkfac: distributed K-FAC training for LibTorch"};
  app.set_version_flag("--version", std::string("dkfac ") + DKFAC_VERSION_STRING);
  app.require_subcommand(1);

  dkfac::train::TrainConfig train_config;
  auto* train = app.add_subcommand("train", "train a model with (or without) K-FAC");
  add_train_options(*train, train_config);
  int nproc = 1;
  int timeout_s = 60;
  train->add_option("--nproc", nproc, "local worker processes (TCPStore rendezvous on a free loopback port)")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  train->add_option("--timeout", timeout_s, "seconds before a silent peer is an error")->capture_default_str()
      ->check(CLI::Range(1, 3600));

  std::vector<std::string> plot_inputs;
  std::string plot_output = "curves.png";
  auto* plot = app.add_subcommand("plot", "plot test accuracy and loss of metrics files against epochs and time");
  plot->add_option("metrics", plot_inputs, "metrics .jsonl files written by dkfac train")->required()->check(
      CLI::ExistingFile);
  plot->add_option("-o,--output", plot_output, "PNG to write")->capture_default_str();

  CLI11_PARSE(app, argc, argv);
  try {
    if (*train) {
      if (nproc > 1) return launch_local(train_config, nproc, timeout_s);
      return run_rank(train_config, job_from_environment().value_or(Job{}), timeout_s);
    } else if (*plot) {
      dkfac::plot::plot_metrics(plot_inputs, plot_output);
      std::cout << "plot: " << plot_output << std::endl;
    }
  } catch (const c10::Error& e) {
    std::cerr << "dkfac: error: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "dkfac: error: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
