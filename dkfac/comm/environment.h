#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dkfac/comm/communicator.h"

/// Which launcher started this process, and where its ranks meet, read from the launcher's environment
/// variables. The same rules serve the library (`Communicator::from_environment`) and `dkfac train`.
namespace dkfac::comm {

enum class Launcher {
  kNone,          // no launcher variables: a single process
  kTorchElastic,  // torch's elastic agent (torchrun, torch.distributed.launcher.api)
  kEnv,           // RANK and WORLD_SIZE set by hand or by another launcher
  kMpi,           // Open MPI's mpirun
  kSlurm,         // srun
};

std::string to_string(Launcher launcher);

/// One process's place in a job.
struct JobEnvironment {
  Launcher launcher = Launcher::kNone;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = 0;  // GROUP_RANK / SLURM_NODEID; 0 where the launcher does not say
  std::string host = "127.0.0.1";
  int port = 29500;
  /// The elastic agent already hosts the rendezvous store at host:port (its static rendezvous sets
  /// TORCHELASTIC_USE_AGENT_STORE=True): every rank, rank 0 included, connects to it as a client.
  bool agent_store = false;
  /// TORCHELASTIC_RESTART_COUNT: how often the agent restarted the workers. Keys dkfac writes into a
  /// store that outlives the workers carry it, so that a restart never reads the previous attempt's.
  int restart_count = 0;

  /// "4 ranks from torch elastic agent, rendezvous at node1:29500 (the agent's store), restart 1".
  std::string describe() const;
  /// The rendezvous this environment asks for, with `timeout` on every wait.
  RendezvousOptions rendezvous(std::chrono::milliseconds timeout) const;
};

/// Reads a job from environment variables through `lookup` (nullopt: unset). Precedence: RANK and
/// WORLD_SIZE (torch's elastic agent when TORCHELASTIC_* are set, else by hand), then Open MPI's
/// OMPI_COMM_WORLD_*, then Slurm's SLURM_PROCID/SLURM_NTASKS; none of them: a single process.
/// The address is MASTER_ADDR; under Slurm without it, the first host of SLURM_JOB_NODELIST (or
/// SLURM_NODELIST); under mpirun without it, 127.0.0.1 when every rank is on one node, else an error.
/// The port is MASTER_PORT; under Slurm without it, slurm_port(SLURM_JOB_ID); else 29500.
/// A variable that is not a number, or a rank outside the world, is an error naming the variable.
JobEnvironment read_job_environment(const std::function<std::optional<std::string>(const std::string&)>& lookup);
/// The same, from this process's environment.
JobEnvironment read_job_environment();

/// Slurm's compressed host list, e.g. "node[01-03,07],gpu3" -> node01 node02 node03 node07 gpu3
/// (zero padding kept; several bracket groups in one name expand as a product).
std::vector<std::string> expand_slurm_hostlist(const std::string& list);

/// The rendezvous port of a Slurm job without MASTER_PORT: 20000 + SLURM_JOB_ID mod 10000, the same on
/// every node of the job and different for jobs that share a node (unless their ids differ by 10000).
int slurm_port(long long job_id);

}  // namespace dkfac::comm
