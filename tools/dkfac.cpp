// The dkfac command line: `dkfac train`, `dkfac plan`, `dkfac bench` and `dkfac plot`.
#include <CLI/CLI.hpp>
#include <netinet/in.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <optional>
#include <sstream>
#include <thread>

#include "dkfac/dkfac.h"
#include "tools/bench/bench.h"
#include "tools/common/threads.h"
#include "tools/models/models.h"
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

/// run_rank for one rank of several: its errors carry its rank, since a launcher interleaves every rank's
/// output. Returns the exit code.
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

// Forks `nproc` workers on this machine and waits for them. The first worker to fail is named with its
// reason, and the others get SIGTERM and, after a grace period, SIGKILL (a stopped or hung worker too).
// SIGINT/SIGTERM to the launcher go to every worker, with the same escalation. Workers die with the
// launcher (PR_SET_PDEATHSIG), so none is left behind even if the launcher itself is killed.
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

struct PlanConfig {
  std::string model = "cnn";
  std::string dataset = "fashion-mnist";
  int nproc = 4;
  int64_t batch_size = 128;
  std::string compute_method = "inverse";
  int64_t spd_redundant_dim = 0;
  bool json = false;
};

/// `dkfac plan`: every strategy's placement and its predicted per-rank bytes, memory and FLOPs, from
/// the model's layer shapes alone (one forward of a zero sample records the conv output sizes).
int run_plan(const PlanConfig& c) {
  using dkfac::assign::PlanInputs;
  struct Input {
    int64_t channels, height, width, classes;
  };
  const Input in = c.dataset == "cifar10" ? Input{3, 32, 32, 10} : Input{1, 28, 28, 10};
  TORCH_CHECK(c.dataset == "cifar10" || c.dataset == "fashion-mnist" || c.dataset == "mnist",
              "--dataset must be fashion-mnist, mnist or cifar10, got '", c.dataset, "'");
  auto model = dkfac::models::make_model(c.model, in.channels, in.height, in.width, in.classes);
  {
    torch::NoGradGuard no_grad;
    model->eval();
    model->forward(torch::zeros({1, in.channels, in.height, in.width}));
  }
  int64_t parameters = 0;
  for (const auto& p : model->parameters()) parameters += p.numel();
  dkfac::Preconditioner kfac(model.ptr());  // single process: only to list the K-FAC layers
  std::vector<dkfac::assign::LayerShape> shapes;
  for (const auto& layer : kfac.layers()) {
    shapes.push_back({layer.name(), layer.a_dim(), layer.g_dim(), layer.capture().rows_per_sample()});
  }
  struct Row {
    std::string name;
    dkfac::assign::Assignment assignment;
    PlanInputs::Flow flow;
  };
  const int p = c.nproc;
  std::vector<Row> rows = {{"dkfac (kaisa f=1, comm-opt)", dkfac::assign::assign_kaisa(shapes, p, 1.0), PlanInputs::Flow::kKaisa}};
  if (p > 2 && p % 2 == 0) {
    rows.push_back({"kaisa f=1/2 (hybrid-opt)", dkfac::assign::assign_kaisa(shapes, p, 0.5), PlanInputs::Flow::kKaisa});
  }
  if (p > 1) {
    rows.push_back({"dkfac-lw (kaisa f=1/P, mem-opt)", dkfac::assign::assign_kaisa(shapes, p, 1.0 / p),
                    PlanInputs::Flow::kKaisa});
  }
  rows.push_back({"spd (redundant dim <= " + std::to_string(c.spd_redundant_dim) + ")",
                  dkfac::assign::assign_spd(shapes, p, c.spd_redundant_dim), PlanInputs::Flow::kSpd});
  rows.push_back({"dp", dkfac::assign::assign_dp(shapes, p), PlanInputs::Flow::kDp});

  nlohmann::json out = {{"model", c.model}, {"dataset", c.dataset}, {"nproc", p}, {"batch_size", c.batch_size},
                        {"compute_method", c.compute_method}, {"data_parallel_bytes_per_step", 4 * parameters},
                        {"strategies", nlohmann::json::array()}};
  std::ostringstream text;
  text << "plan: " << c.model << " on " << c.dataset << ", " << p << " ranks x batch " << c.batch_size << ", "
       << c.compute_method << "; float32; data-parallel gradient allreduce " << 4 * parameters
       << " B per step on every strategy\n";
  for (const auto& row : rows) {
    PlanInputs inputs;
    inputs.flow = row.flow;
    inputs.eigen = c.compute_method == "eigen";
    inputs.batch_size = c.batch_size;
    const auto plan = dkfac::assign::predict(row.assignment, shapes, inputs);
    text << "\n== " << row.name << "\n" << row.assignment.to_string(shapes)
         << "  rank  factors B/factor-step  2nd-order B/inv-step  gradients B/step  K-FAC memory B  "
            "factor GFLOP  decomp GFLOP  precond GFLOP\n";
    nlohmann::json ranks = nlohmann::json::array();
    for (int r = 0; r < p; ++r) {
      const auto& x = plan[r];
      text << "  " << std::setw(4) << r << std::setw(22) << x.factor_bytes << std::setw(22) << x.second_order_bytes
           << std::setw(18) << x.gradient_bytes << std::setw(16) << x.memory_bytes << std::fixed
           << std::setprecision(3) << std::setw(14) << x.factor_flops / 1e9 << std::setw(14)
           << x.decomposition_flops / 1e9 << std::setw(15) << x.precondition_flops / 1e9 << "\n";
      text.unsetf(std::ios::fixed);
      ranks.push_back({{"rank", r}, {"factor_bytes", x.factor_bytes}, {"second_order_bytes", x.second_order_bytes},
                       {"gradient_bytes", x.gradient_bytes}, {"memory_bytes", x.memory_bytes},
                       {"factor_flops", x.factor_flops}, {"decomposition_flops", x.decomposition_flops},
                       {"precondition_flops", x.precondition_flops}});
    }
    out["strategies"].push_back({{"strategy", row.name}, {"ranks", ranks}});
  }
  std::cout << (c.json ? out.dump(2) : text.str()) << std::endl;
  return 0;
}

struct BenchCli {
  dkfac::bench::BenchConfig config;
  std::vector<std::string> intervals = {"1,10", "10,100"};
  std::string json;
  bool no_steps = false;
  bool no_kernels = false;
  int blas_threads = 1;
  std::string allocator;
};

/// `dkfac bench`: SGD against K-FAC per phase, and the kernels against the sgemm peak, in one run.
int run_bench(BenchCli cli) {
  auto& c = cli.config;
  c.intervals.clear();
  for (const auto& text : cli.intervals) {
    const auto comma = text.find(',');
    TORCH_CHECK(comma != std::string::npos, "--intervals takes FACTOR,INVERSE pairs such as 10,100, got '", text, "'");
    int64_t f = 0, i = 0;
    try {
      f = std::stoll(text.substr(0, comma));
      i = std::stoll(text.substr(comma + 1));
    } catch (const std::exception&) {
      TORCH_CHECK(false, "--intervals takes FACTOR,INVERSE pairs such as 10,100, got '", text, "'");
    }
    TORCH_CHECK(f > 0 && i > 0, "--intervals must be positive, got '", text, "'");
    c.intervals.emplace_back(f, i);
  }
  for (const auto& m : c.models) {
    TORCH_CHECK(m == "mlp" || m == "cnn" || m == "resnet20", "--models takes mlp, cnn, resnet20, got '", m, "'");
  }
  c.steps = !cli.no_steps;
  c.kernels = !cli.no_kernels;
  const auto threads = dkfac::tools::configure_threads(c.threads, cli.blas_threads);
  auto env = dkfac::bench::environment(c);
  env["threads"] = threads;
  env["allocator"] = cli.allocator;
  std::cout << "bench: " << env.dump() << std::endl;
  nlohmann::json out = {{"environment", env}};
  std::string tables;
  if (c.steps) {
    const auto steps = dkfac::bench::run_steps(c, std::cerr);
    out["steps"] = dkfac::bench::to_json(steps);
    tables += dkfac::bench::format_steps(steps) + "\n";
  }
  if (c.kernels) {
    const auto kernels = dkfac::bench::run_kernels(c, std::cerr);
    out["kernels"] = dkfac::bench::to_json(kernels);
    tables += dkfac::bench::format_kernels(kernels);
  }
  std::cout << tables << std::flush;
  if (!cli.json.empty()) {
    std::ofstream file(cli.json);
    TORCH_CHECK(file, "cannot write --json file '", cli.json, "'");
    file << out.dump(2) << std::endl;
    std::cout << "bench: " << cli.json << std::endl;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // GNU OpenMP's worker threads spin for milliseconds after every parallel region, on the cores that the
  // next single-threaded BLAS call of K-FAC needs; a shorter spin made the cnn's K-FAC step 10% faster and
  // cost SGD nothing measurable (docs/PERFORMANCE.md). The runtime reads its settings when it loads, so
  // set the variable and start again. A wait policy or spin count the user chose is kept.
  if (std::getenv("OMP_WAIT_POLICY") == nullptr && std::getenv("GOMP_SPINCOUNT") == nullptr &&
      ::setenv("GOMP_SPINCOUNT", "20000", 1) == 0) {
    ::execv("/proc/self/exe", argv);  // returns only on failure: then run with the runtime's defaults
  }
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
  RendezvousFlags rendezvous_flags;
  train->add_option("--master-addr", rendezvous_flags.master_addr,
                    "host of rank 0's rendezvous store under a launcher (default: MASTER_ADDR; Slurm: the first "
                    "node of the job; else 127.0.0.1)");
  train->add_option("--master-port", rendezvous_flags.master_port,
                    "port of the rendezvous store (default: MASTER_PORT; Slurm: 20000 + SLURM_JOB_ID mod 10000; "
                    "else 29500)")
      ->check(CLI::Range(1, 65535));
  train->add_option("--timeout", timeout_s, "seconds before a silent peer is an error")->capture_default_str()
      ->check(CLI::Range(1, 3600));

  PlanConfig plan_config;
  auto* plan = app.add_subcommand("plan", "predicted per-rank bytes, memory and FLOPs of every strategy for a model");
  plan->add_option("--model", plan_config.model, "mlp | cnn | resnet20 | autoencoder")->capture_default_str();
  plan->add_option("--dataset", plan_config.dataset, "fashion-mnist | mnist | cifar10 (input shape)")
      ->capture_default_str();
  plan->add_option("--nproc", plan_config.nproc, "ranks")->capture_default_str()->check(CLI::Range(1, 4096));
  plan->add_option("--batch-size", plan_config.batch_size, "examples per rank per step")->capture_default_str()
      ->check(CLI::PositiveNumber);
  plan->add_option("--compute-method", plan_config.compute_method, "eigen | inverse")->capture_default_str()
      ->check(CLI::IsMember({"eigen", "inverse"}));
  plan->add_option("--spd-redundant-dim", plan_config.spd_redundant_dim,
                   "SPD-KFAC: factors up to this dimension are decomposed on every rank (a training job measures it)")
      ->capture_default_str();
  plan->add_flag("--json", plan_config.json, "print JSON instead of tables");

  BenchCli bench_cli;
  auto* bench = app.add_subcommand("bench", "time SGD and K-FAC steps per phase, and the K-FAC kernels against sgemm");
  bench->add_option("--models", bench_cli.config.models, "mlp cnn resnet20")->capture_default_str();
  bench->add_option("--batch-size", bench_cli.config.batch_size, "examples per step")->capture_default_str();
  bench->add_option("--intervals", bench_cli.intervals, "FACTOR,INVERSE update intervals")->capture_default_str();
  bench->add_option("--methods", bench_cli.config.methods, "eigen inverse")->capture_default_str();
  bench->add_option("--cycles", bench_cli.config.cycles, "inverse periods measured per K-FAC configuration")
      ->capture_default_str();
  bench->add_option("--warmup", bench_cli.config.warmup_steps, "unmeasured steps first")->capture_default_str();
  bench->add_option("--damping", bench_cli.config.damping, "K-FAC damping")->capture_default_str();
  bench->add_option("--threads", bench_cli.config.threads, "intra-op threads (0: every core)")->capture_default_str();
  bench->add_option("--kernel-dims", bench_cli.config.kernel_dims, "factor dimensions of the kernel benchmark")
      ->capture_default_str();
  bench->add_option("--kernel-rows", bench_cli.config.kernel_rows, "activation rows a factor is built from")
      ->capture_default_str();
  bench->add_option("--kernel-repeats", bench_cli.config.kernel_repeats, "timed calls per kernel and size")
      ->capture_default_str();
  bench->add_option("--blas-threads", bench_cli.blas_threads, "OpenBLAS threads (0: as many as --threads)")
      ->capture_default_str();
  bench->add_flag("--no-steps", bench_cli.no_steps, "skip the per-step benchmark");
  bench->add_flag("--no-kernels", bench_cli.no_kernels, "skip the kernel benchmark");
  bench->add_option("--json", bench_cli.json, "also write the results as JSON to this file");

  std::vector<std::string> plot_inputs;
  std::string plot_output = "curves.png";
  auto* plot = app.add_subcommand("plot", "plot test accuracy and loss of metrics files against epochs and time");
  plot->add_option("metrics", plot_inputs, "metrics .jsonl files written by dkfac train")->required()->check(
      CLI::ExistingFile);
  plot->add_option("-o,--output", plot_output, "PNG to write")->capture_default_str();

  CLI11_PARSE(app, argc, argv);
  bench_cli.allocator = dkfac::tools::configure_allocator();
  try {
    if (*train) {
      if (nproc > 1) return launch_local(train_config, nproc, timeout_s);
      const auto job = job_of_this_process(rendezvous_flags);
      if (job.world_size == 1) return run_rank(train_config, job, timeout_s);
      return run_launched_rank(train_config, job, timeout_s);
    } else if (*plan) {
      return run_plan(plan_config);
    } else if (*bench) {
      return run_bench(bench_cli);
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
