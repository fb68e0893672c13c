#pragma once

#include <string>

#include "dkfac/comm/environment.h"
#include "tools/train/trainer.h"

/// `dkfac train --nproc N`: N workers on this machine, each this program started afresh (fork and exec, with
/// the job in torchrun's environment variables), supervised until they end.
namespace dkfac::cli {

/// Runs one rank of a job started by a launcher (this one or another) and returns its exit code. Its
/// errors carry its rank, since a launcher interleaves every rank's output. Defined in train.cpp.
int run_launched_rank(const train::TrainConfig& config, const comm::JobEnvironment& job, int timeout_s);

/// Why a worker is failing, as it tells its launcher (the launcher names the root cause from these).
enum class LauncherReport {
  kError,     ///< this rank's own error
  kLostPeer,  ///< this rank lost another (the message names it)
  kJobError,  ///< an error every rank reaches (train::JobError): rank 0 reports it for the job
};

/// In a worker of launch_local(): sends `message` to the launcher, which prints the root cause once for
/// the job. Returns false in any other process (then the caller prints it). Safe from any thread.
bool report_to_launcher(LauncherReport kind, const std::string& message);

/// In a worker that launch_local() started: takes the report pipe and the user's command line (for
/// `config`) from the environment the launcher gave it, and returns true; false in any other process.
bool adopt_launcher_report(train::TrainConfig& config);

/// Starts `nproc` workers (this program, its command line less --nproc, --master-addr and --master-port; RANK,
/// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set) with a TCPStore rendezvous on
/// a free loopback port and waits for them. The
/// first worker to fail is named with its reason, and the others get SIGTERM and, after a grace period,
/// SIGKILL (a stopped or hung worker too). SIGINT/SIGTERM to the launcher go to every worker, with the
/// same escalation. Workers die with the launcher (PR_SET_PDEATHSIG), so none is left behind even if the
/// launcher itself is killed. The failure it names is the root cause: a rank's own error or death before
/// a rank that only lost a peer. Returns the exit code: 0, 1 (a worker failed) or 128 + signal.
int launch_local(const train::TrainConfig& config, int nproc, int timeout_s);

}  // namespace dkfac::cli
