// `dkfac train --nproc N`: the local launcher.
#include "tools/cli/launch.h"

#include <fcntl.h>
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
#include <fstream>
#include <iostream>
#include <iterator>
#include <set>
#include <optional>
#include <regex>
#include <thread>
#include <vector>

#include "dkfac/device.h"
#include "tools/train/devices.h"

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

// A worker's end of its report pipe to the launcher (-1: not a launch_local worker).
int g_report_fd = -1;

// How the launcher tells a worker, which it starts as a fresh program, where its report pipe is.
constexpr const char* kReportFdVariable = "DKFAC_LAUNCH_REPORT_FD";
// The command as the user typed it (with --nproc), for what the workers record of it.
constexpr const char* kCommandLineVariable = "DKFAC_LAUNCH_COMMAND_LINE";

// The arguments this process was started with.
std::vector<std::string> own_arguments() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TORCH_CHECK(!all.empty(), "cannot start the workers: /proc/self/cmdline is unreadable");
  std::vector<std::string> args;
  size_t begin = 0;
  while (begin < all.size()) {
    const size_t end = all.find('\0', begin);
    args.push_back(all.substr(begin, end == std::string::npos ? std::string::npos : end - begin));
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  return args;
}

// A worker's command line: the launcher's, less the flags that its environment replaces.
std::vector<std::string> worker_arguments(const std::vector<std::string>& args) {
  static const std::vector<std::string> replaced = {"--nproc", "--master-addr", "--master-port"};
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    bool drop = false;
    for (const auto& flag : replaced) {
      if (args[i] == flag) {
        ++i;  // and its value
        drop = true;
      } else if (args[i].rfind(flag + "=", 0) == 0) {
        drop = true;
      }
      if (drop) break;
    }
    if (!drop) out.push_back(args[i]);
  }
  return out;
}

// A worker's environment: the launcher's, with the job's variables (as torchrun sets them) in place of any
// inherited ones, and the report pipe.
std::vector<std::string> worker_environment(const comm::JobEnvironment& job, int report_fd,
                                            const std::string& command_line) {
  static const std::set<std::string> replaced = {
      "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
      "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE", kReportFdVariable,
      kCommandLineVariable};
  std::vector<std::string> out;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string variable(*entry);
    if (replaced.count(variable.substr(0, variable.find('='))) == 0) out.push_back(variable);
  }
  out.push_back("RANK=" + std::to_string(job.rank));
  out.push_back("WORLD_SIZE=" + std::to_string(job.world_size));
  out.push_back("LOCAL_RANK=" + std::to_string(job.local_rank));
  out.push_back("LOCAL_WORLD_SIZE=" + std::to_string(job.local_world_size));
  out.push_back("MASTER_ADDR=" + job.host);
  out.push_back("MASTER_PORT=" + std::to_string(job.port));
  out.push_back(std::string(kReportFdVariable) + "=" + std::to_string(report_fd));
  out.push_back(std::string(kCommandLineVariable) + "=" + command_line);
  return out;
}

// NULL-terminated pointers into `strings`, for execve.
std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// What the launcher knows of one worker.
struct Worker {
  pid_t pid = 0;
  int report_fd = -1;  // the launcher's end of the report pipe
  bool running = true;
  std::string status;  // how it ended
  bool stopped_by_launcher = false;  // it was still running when the launcher sent SIGTERM/SIGKILL
  std::string report;  // "E message", "L message" or "J message", as report_to_launcher wrote it
};

void drain_report(Worker& worker) {
  char buffer[4096];
  ssize_t n = 0;
  while ((n = ::read(worker.report_fd, buffer, sizeof(buffer))) > 0) worker.report.append(buffer, n);
  ::close(worker.report_fd);
  worker.report_fd = -1;
  while (!worker.report.empty() && worker.report.back() == '\n') worker.report.pop_back();
}

// One line naming the failure that caused the others: a rank's own error or unexplained death first (in
// the order they ended); else the rank that another reported lost (a hung or stopped rank).
std::string root_cause(const std::vector<Worker>& workers, const std::vector<int>& failure_order) {
  auto describe = [&](int rank) {
    const auto& w = workers[rank];
    std::string line = "rank " + std::to_string(rank) + " failed (" + w.status + ")";
    if (w.report.size() > 2) line += ": " + w.report.substr(2);
    return line;
  };
  for (int rank : failure_order) {
    const auto& w = workers[rank];
    if (w.report.rfind("E ", 0) == 0 || (w.report.empty() && !w.stopped_by_launcher)) return describe(rank);
  }
  static const std::regex kLost("lost rank ([0-9]+)");
  for (int rank : failure_order) {
    const auto& report = workers[rank].report;
    std::smatch m;
    if (report.rfind("L ", 0) != 0) continue;
    if (std::regex_search(report, m, kLost)) {
      const int lost = std::stoi(m[1].str());
      if (lost >= 0 && lost < static_cast<int>(workers.size()) && lost != rank) {
        return "rank " + std::to_string(lost) + " stopped responding (rank " + std::to_string(rank) +
               " reported: " + report.substr(2) + "; rank " + std::to_string(lost) + " then " +
               (workers[lost].status.empty() ? "ran on" : workers[lost].status) + ")";
      }
    }
    return describe(rank);
  }
  return failure_order.empty() ? std::string("a rank failed") : describe(failure_order.front());
}

extern "C" void record_launcher_signal(int signal) { g_launcher_signal = signal; }

// How a worker ended; `signalled` when the launcher had sent it SIGTERM/SIGKILL.
std::string describe_status(int status, bool signalled) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")" +
           (signalled ? " from the launcher"
            : sig == SIGKILL ? "; if nothing sent it, the kernel may have run out of memory (see dmesg)" : "");
  }
  return "exit " + std::to_string(WEXITSTATUS(status));
}

// The CUDA devices LibTorch sees, counted in a child process: CUDA does not survive fork(), so the
// launcher, which forks the workers next, must not initialise it itself.
int cuda_devices_counted_in_child() {
  int probe[2];
  TORCH_CHECK(::pipe(probe) == 0, "cannot count the CUDA devices: pipe failed (", std::strerror(errno), ")");
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(probe[0]);
    const int count = dkfac::device::cuda_device_count();
    const bool sent = ::write(probe[1], &count, sizeof(count)) == static_cast<ssize_t>(sizeof(count));
    std::_Exit(sent ? 0 : 1);
  }
  ::close(probe[1]);
  if (pid < 0) ::close(probe[0]);
  TORCH_CHECK(pid > 0, "cannot count the CUDA devices: fork failed (", std::strerror(errno), ")");
  int count = -1;
  const ssize_t received = ::read(probe[0], &count, sizeof(count));
  ::close(probe[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  TORCH_CHECK(received == static_cast<ssize_t>(sizeof(count)) && WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "cannot count the CUDA devices: the probe process ended with ", describe_status(status, false));
  return count;
}

}  // namespace

bool adopt_launcher_report(train::TrainConfig& config) {
  const char* fd = std::getenv(kReportFdVariable);
  if (fd == nullptr) return false;
  char* end = nullptr;
  const long value = std::strtol(fd, &end, 10);
  TORCH_CHECK(end != fd && *end == '\0' && value >= 0 && ::fcntl(static_cast<int>(value), F_GETFD) != -1,
              kReportFdVariable, "='", fd, "' names no open pipe: it is set by dkfac train --nproc for its "
              "workers; unset it");
  g_report_fd = static_cast<int>(value);
  ::fcntl(g_report_fd, F_SETFD, FD_CLOEXEC);
  if (const char* line = std::getenv(kCommandLineVariable)) config.command_line = line;
  ::unsetenv(kReportFdVariable);
  ::unsetenv(kCommandLineVariable);
  return true;
}

bool report_to_launcher(LauncherReport kind, const std::string& message) {
  if (g_report_fd < 0) return false;
  const std::string line = std::string(kind == LauncherReport::kError ? "E " : kind == LauncherReport::kLostPeer ? "L " : "J ") + message + "\n";
  return ::write(g_report_fd, line.data(), line.size()) == static_cast<ssize_t>(line.size());
}

int launch_local(const dkfac::train::TrainConfig& config, int nproc, int timeout_s) {
  using Clock = std::chrono::steady_clock;
  constexpr auto kGrace = std::chrono::seconds(5);
  if (config.device != dkfac::train::DeviceChoice::kCpu) {
    dkfac::train::check_ranks_fit_gpus(config, nproc, cuda_devices_counted_in_child());
  }
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
  auto arguments = worker_arguments(own_arguments());
  auto argv = c_strings(arguments);
  std::vector<Worker> workers(nproc);
  for (int rank = 0; rank < nproc; ++rank) {
    int report[2];
    // Both ends close on exec; the worker's end is kept open in the worker alone, below.
    TORCH_CHECK(::pipe2(report, O_CLOEXEC) == 0, "cannot start worker ", rank, ": pipe failed (",
                std::strerror(errno), ")");
    job.rank = rank;
    job.local_rank = rank;
    // Everything the worker needs is built before fork(): after it, only async-signal-safe calls.
    auto environment = worker_environment(job, report[1], config.command_line);
    auto envp = c_strings(environment);
    const pid_t pid = ::fork();
    if (pid == 0) {
      // Default actions, even where the launcher's were "ignore" (a shell's background job ignores
      // SIGINT): a signal the launcher forwards must stop the worker.
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // kept across execve
      if (::getppid() != launcher) std::_Exit(1);  // the launcher died before prctl took effect
      ::fcntl(report[1], F_SETFD, 0);
      // A fresh program, not a forked copy of this one: a copy inherits the launcher's libraries in the
      // state fork() leaves them (OpenMP's thread team without its threads), and on a 16-core machine such
      // a copy died of a segmentation fault in gomp_team_start at its first parallel region (docs/GPU.md).
      ::execve("/proc/self/exe", argv.data(), envp.data());
      static const char kFailed[] = "E could not start the worker: execve(/proc/self/exe) failed\n";
      [[maybe_unused]] const auto written = ::write(report[1], kFailed, sizeof(kFailed) - 1);
      std::_Exit(127);
    }
    ::close(report[1]);
    if (pid < 0) ::close(report[0]);
    TORCH_CHECK(pid > 0, "cannot start worker ", rank, ": fork failed (", std::strerror(errno), ")");
    workers[rank].pid = pid;
    workers[rank].report_fd = report[0];
  }
  size_t live = workers.size();
  std::vector<int> failure_order;  // ranks that failed, in the order they ended
  int received = 0;
  std::optional<Clock::time_point> kill_at;  // when the workers still running get SIGKILL
  auto stop_all = [&](int sig) {
    for (auto& w : workers) {
      if (w.running) {
        ::kill(w.pid, sig);
        w.stopped_by_launcher = true;
      }
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
    const auto it = std::find_if(workers.begin(), workers.end(), [pid](const Worker& w) { return w.pid == pid; });
    if (it == workers.end()) continue;
    auto& worker = *it;
    worker.running = false;
    worker.status = describe_status(status, worker.stopped_by_launcher);
    drain_report(worker);
    --live;
    if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
      failure_order.push_back(static_cast<int>(it - workers.begin()));
      if (!kill_at) {
        stop_all(SIGTERM);
        kill_at = Clock::now() + kGrace;
      }
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
  if (!failure_order.empty()) {
    std::cerr << "dkfac: error: " << root_cause(workers, failure_order) << "; stopped the other ranks" << std::endl;
    return 1;
  }
  return 0;
}

}  // namespace dkfac::cli
