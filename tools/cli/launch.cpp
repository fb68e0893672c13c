// `dkfac train --nproc N`: the local launcher.
#include "tools/cli/launch.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstring>
#include <iostream>
#include <optional>
#include <thread>
#include <vector>

namespace dkfac::cli {
namespace {

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

// The launcher's record of a SIGINT/SIGTERM, set by its handler and read by its wait loop.
volatile std::sig_atomic_t g_launcher_signal = 0;
extern "C" void record_launcher_signal(int signal) { g_launcher_signal = signal; }

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")" +
           (sig == SIGKILL ? "; if nothing sent it, the kernel may have run out of memory (see dmesg)" : "");
  }
  return "exit " + std::to_string(WEXITSTATUS(status));
}

}  // namespace

int launch_local(const dkfac::train::TrainConfig& config, int nproc, int timeout_s) {
  using Clock = std::chrono::steady_clock;
  constexpr auto kGrace = std::chrono::seconds(5);
  dkfac::comm::JobEnvironment job;
  job.world_size = nproc;
  job.local_world_size = nproc;
  job.port = free_loopback_port();
  struct sigaction action {};
  action.sa_handler = record_launcher_signal;
  sigemptyset(&action.sa_mask);
  struct sigaction previous_int {}, previous_term {};
  ::sigaction(SIGINT, &action, &previous_int);
  ::sigaction(SIGTERM, &action, &previous_term);
  const pid_t launcher = ::getpid();
  std::vector<pid_t> pids;
  for (int rank = 0; rank < nproc; ++rank) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      // Default actions, even where the launcher's were "ignore" (a shell's background job ignores
      // SIGINT): a signal the launcher forwards must stop the worker.
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher) std::_Exit(1);  // the launcher died before prctl took effect
      job.rank = rank;
      job.local_rank = rank;
      std::_Exit(run_launched_rank(config, job, timeout_s));
    }
    TORCH_CHECK(pid > 0, "cannot start worker ", rank, ": fork failed (", std::strerror(errno), ")");
    pids.push_back(pid);
  }
  std::vector<bool> running(pids.size(), true);
  size_t live = pids.size();
  int failed_rank = -1;
  std::string failure;
  int received = 0;
  std::optional<Clock::time_point> kill_at;  // when the workers still running get SIGKILL
  auto stop_all = [&](int sig) {
    for (size_t r = 0; r < pids.size(); ++r) {
      if (running[r]) ::kill(pids[r], sig);
    }
  };
  while (live > 0) {
    if (g_launcher_signal != 0 && received == 0) {
      received = g_launcher_signal;
      stop_all(received);
      if (!kill_at) kill_at = Clock::now() + kGrace;
    }
    if (kill_at && Clock::now() >= *kill_at) {
      stop_all(SIGKILL);
      kill_at = Clock::time_point::max();
    }
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    const auto it = std::find(pids.begin(), pids.end(), pid);
    if (it == pids.end()) continue;
    const auto rank = static_cast<size_t>(it - pids.begin());
    running[rank] = false;
    --live;
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok && failed_rank < 0 && received == 0) {
      failed_rank = static_cast<int>(rank);
      failure = describe_status(status);
      stop_all(SIGTERM);
      kill_at = Clock::now() + kGrace;
    }
  }
  ::sigaction(SIGINT, &previous_int, nullptr);
  ::sigaction(SIGTERM, &previous_term, nullptr);
  if (received != 0) {
    std::cerr << "dkfac: stopped by signal " << received << " (" << strsignal(received) << "); passed it to the "
              << nproc << " workers" << (config.checkpoint_dir.empty() ? "" : "; the last checkpoint is intact")
              << std::endl;
    return 128 + received;
  }
  if (failed_rank >= 0) {
    std::cerr << "dkfac: rank " << failed_rank << " failed (" << failure << "); stopped the other ranks" << std::endl;
    return 1;
  }
  return 0;
}

}  // namespace dkfac::cli
