// `dkfac train`: its flags, one rank's run, and the choice between this process's job and --nproc workers.
#include <iostream>
#include <optional>
#include <string>
#include <thread>

#include "tools/cli/commands.h"
#include "tools/cli/launch.h"
#include "tools/cli/train_flags.h"
#include "tools/common/memory.h"
#include "tools/train/devices.h"

namespace dkfac::cli {
namespace {

// Where the rendezvous is when a launcher's environment leaves it open (flags beat the environment).
struct RendezvousFlags {
  std::string master_addr;
  int master_port = 0;
};

// A single CUDA process with --backend nccl or gloo joins a one-rank group over that backend (the way to
// try a backend on one GPU); otherwise a single process has no group.
bool joins_one_rank_group(const dkfac::train::TrainConfig& config, c10::Device device) {
  return device.is_cuda() && config.backend != dkfac::comm::CudaBackend::kAuto;
}

// A build without gloo's headers (the wheel's command as `pip install` builds it: pip's torch ships none) makes
// no process group, so it trains in one process only: say so before any worker starts and fails at its rendezvous.
void check_process_groups_built_in(const std::string& what) {
  TORCH_CHECK(dkfac::comm::gloo_headers_built_in(), what, " needs process groups, and this dkfac command was built "
              "without gloo's headers (pip's torch ships none), so it trains in one process only. For more, install "
              "gloo's headers (Debian/Ubuntu libgloo-dev) and pip install dkfac again, or build it with CMake (docs/INSTALL.md)");
}

int run_rank(dkfac::train::TrainConfig config, const dkfac::comm::JobEnvironment& job, int timeout_s) {
  std::shared_ptr<dkfac::comm::Communicator> communicator;
  // Before the rendezvous: NCCL's communicators and CUDA's events go to the current device.
  const c10::Device device = dkfac::train::rank_device(config, job.local_rank);
  dkfac::train::make_current(device);
  if (job.restart_count > 0) {
    // torch's elastic agent restarted the workers after a failure: continue from the last checkpoint.
    TORCH_CHECK(!config.checkpoint_dir.empty(), "the elastic agent restarted this job (restart ", job.restart_count,
                ") but it has no --checkpoint-dir to resume from; a restart would silently start over. Pass "
                "--checkpoint-dir so that restarts resume, or launch with max_restarts=0");
    config.resume = true;
    config.overwrite = false;
  }
  // A launcher's one-rank job says so too: an elastic agent's restart on fewer nodes may leave one rank.
  if (job.rank == 0 && job.launcher != dkfac::comm::Launcher::kNone) {
    std::cout << "launch: " << job.describe() << (job.restart_count > 0 ? ": resuming" : "") << std::endl;
  }
  if (job.world_size > 1) {
    check_process_groups_built_in("a job of " + std::to_string(job.world_size) + " ranks");
    auto rendezvous = job.rendezvous(std::chrono::seconds(timeout_s));
    rendezvous.cuda_backend = config.backend;
    communicator = dkfac::comm::Communicator::connect(rendezvous);
    // The main thread may be blocked in a collective that no longer completes: end the process here.
    communicator->on_lost_rank([rank = job.rank](const std::string& message) {
      std::cout << std::flush;
      if (!report_to_launcher(LauncherReport::kLostPeer, message)) {
        std::cerr << "[rank " << rank << "] dkfac: error: " << message << "; stopping (the last checkpoint is intact)"
                  << std::endl;
      }
      std::_Exit(1);
    });
    if (config.threads == 0) {
      config.threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / job.local_world_size);
    }
  }
  if (job.world_size == 1 && joins_one_rank_group(config, device)) {
    check_process_groups_built_in(std::string("--backend ") + dkfac::comm::to_string(config.backend));
    communicator = dkfac::comm::Communicator::connect_in_process(std::make_shared<dkfac::comm::InProcessStore>(), 0, 1,
                                                                 std::chrono::seconds(timeout_s), config.backend);
  }
  dkfac::train::Trainer trainer(config, communicator, device);
  const auto summary = trainer.run();
  if (!config.metrics.empty() && job.rank == 0 && !summary.already_complete) {
    std::cout << "metrics: " << config.metrics << std::endl;
  }
  return 0;
}

}  // namespace

int run_launched_rank(const dkfac::train::TrainConfig& config, const dkfac::comm::JobEnvironment& job, int timeout_s) {
  std::string error;
  try {
    return run_rank(config, job, timeout_s);
  } catch (const dkfac::train::JobError& e) {
    if (job.rank != 0) {  // rank 0 says it for the job
      report_to_launcher(LauncherReport::kJobError, e.what());
      return 1;
    }
    error = e.what();
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::cout << std::flush;
  if (!report_to_launcher(LauncherReport::kError, error)) {
    std::cerr << "[rank " << job.rank << "] dkfac: error: " << error << std::endl;
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
      ->check(CLI::Range(1, 256))
      ->group(kDistributedGroup);
  train->add_option("--master-addr", flags->rendezvous.master_addr,
                    "host of rank 0's rendezvous store under a launcher (default: MASTER_ADDR; Slurm: the first "
                    "node of the job; else 127.0.0.1)")
      ->group(kDistributedGroup);
  train->add_option("--master-port", flags->rendezvous.master_port,
                    "port of the rendezvous store (default: MASTER_PORT; Slurm: 20000 + SLURM_JOB_ID mod 10000; "
                    "else 29500)")
      ->check(CLI::Range(1, 65535))
      ->group(kDistributedGroup);
  train->add_option("--timeout", flags->timeout_s, "seconds before a silent peer is an error")->capture_default_str()
      ->check(CLI::Range(1, 3600))
      ->group(kDistributedGroup);

  return {train, [flags](const Invocation& invocation) {
    flags->config.command_line = invocation.command_line;
    const bool launched = adopt_launcher_report(flags->config);  // a worker of `--nproc` (launch.cpp)
    if (flags->nproc > 1) check_process_groups_built_in("--nproc " + std::to_string(flags->nproc));
    if (flags->nproc > 1) dkfac::tools::check_memory_for_workers(flags->config, flags->nproc);
    if (flags->nproc > 1) return launch_local(flags->config, flags->nproc, flags->timeout_s);
    auto job = job_of_this_process(flags->rendezvous);
    if (launched) job.launcher = dkfac::comm::Launcher::kNone;  // the launcher's own workers: no "launch:" line
    if (job.world_size == 1) {
      try {
        return run_rank(flags->config, job, flags->timeout_s);
      } catch (const dkfac::train::JobError& e) {
        std::cerr << "dkfac: error: " << e.what() << std::endl;
        return 1;
      }
    }
    return run_launched_rank(flags->config, job, flags->timeout_s);
  }};
}

}  // namespace dkfac::cli
