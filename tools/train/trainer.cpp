#include "tools/train/trainer.h"

#include "tools/common/threads.h"
#include "tools/common/report_json.h"
#include "tools/train/checkpointer.h"
#include "tools/train/devices.h"
#include "tools/train/metrics.h"
#include "tools/train/training_checkpoint.h"
#include "dkfac/version.h"
#include "dkfac/numbers.h"
#include "dkfac/comm/agreement.h"
#include "dkfac/comm/communicator.h"

#include <fcntl.h>
#include <torch/version.h>
#include <unistd.h>

#include <chrono>
#include <ctime>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <type_traits>
#include <vector>

#include <c10/util/StringUtil.h>

namespace dkfac::train {
namespace {

namespace F = torch::nn::functional;
using Clock = std::chrono::steady_clock;
// What the core's out-of-memory errors say after naming their place (device::rethrow_out_of_memory).
constexpr const char* kRanOutOfMemory = " ran out of device memory: ";

// Runs `phase`; a CUDA out-of-memory error inside it comes out naming `where()` (e.g. "the optimizer (sgd)
// in step 12"), then the allocator's own words: how much was asked for, how much is in use. An error that
// already names its place (the core's, naming a K-FAC layer) passes unchanged.
template <typename Where, typename Phase>
auto naming_out_of_memory(const Where& where, const Phase& phase) -> decltype(phase()) {
  try {
    return phase();
  } catch (const c10::OutOfMemoryError& e) {
    if (std::string(e.what_without_backtrace()).find(kRanOutOfMemory) != std::string::npos) throw;
    device::rethrow_out_of_memory(e, where());
  }
}

// The allocator's statistics of a GPU as metrics fields (tools/train/metrics.h); nothing on the CPU.
void add_gpu_memory(nlohmann::json& event, c10::Device device) {
  const auto stats = device::memory_stats(device);
  if (!stats) return;
  event["gpu_memory_allocated_bytes"] = stats->allocated;
  event["gpu_max_memory_allocated_bytes"] = stats->peak_allocated;
  event["gpu_memory_reserved_bytes"] = stats->reserved;
}

// One rank's entry in the summary event's ranks[].
struct RankReport {
  std::map<std::string, int64_t> comm_bytes;  // every comm::Purpose by name; 0 where nothing moved
  int64_t kfac_memory_bytes = 0;
  PhaseTimes kfac_time;
  double wall_time_s = 0.0;
  int64_t gpu_max_memory_allocated_bytes = 0;  // 0 on the CPU
};

// Calls `visit` on every number of `report`, always in the same order: the one list of the fields that
// travel between ranks (comm_bytes holds the same phases on every rank, so its entries line up too).
template <typename Report, typename Visit>
void for_each_number(Report& report, const Visit& visit) {
  for (auto& phase : report.comm_bytes) visit(phase.second);
  visit(report.kfac_memory_bytes);
  for (auto& seconds : report.kfac_time.values) visit(seconds);
  visit(report.wall_time_s);
  visit(report.gpu_max_memory_allocated_bytes);
}

RankReport rank_report(const comm::Communicator& communicator, const Preconditioner* kfac,
                       const TrainSummary& summary) {
  RankReport report;
  const auto traffic = communicator.traffic();
  for (const auto& phase : comm::Communicator::all_phase_names()) {
    const auto it = traffic.find(phase);
    report.comm_bytes[phase] = it == traffic.end() ? 0 : it->second.bytes;
  }
  if (kfac) {
    report.kfac_memory_bytes = kfac->memory_bytes();
    report.kfac_time = kfac->total_times();
  }
  report.wall_time_s = summary.wall_seconds;
  report.gpu_max_memory_allocated_bytes = summary.gpu_max_memory_allocated_bytes.value_or(0);
  return report;
}

// Every rank's report, in rank order. Each rank writes its own row of a [world, numbers] float64 table
// and one sum hands every row to every rank (byte counts stay exact up to 2^53).
std::vector<RankReport> gather_reports(const RankReport& mine, comm::Communicator& communicator) {
  std::vector<double> row;
  for_each_number(mine, [&](const auto& value) { row.push_back(static_cast<double>(value)); });
  auto table = torch::zeros({communicator.size(), static_cast<int64_t>(row.size())}, torch::kFloat64);
  table[communicator.rank()].copy_(torch::tensor(row, torch::kFloat64));
  communicator.allreduce_sum(table, comm::kWorld, comm::Purpose::kSetup).wait();
  std::vector<RankReport> reports(communicator.size(), mine);  // the same phases; every number is replaced
  for (int r = 0; r < communicator.size(); ++r) {
    const double* values = table[r].data_ptr<double>();
    size_t k = 0;
    for_each_number(reports[r], [&](auto& value) { value = static_cast<std::decay_t<decltype(value)>>(values[k++]); });
  }
  return reports;
}

nlohmann::json report_json(int rank, const RankReport& report, bool with_gpu) {
  nlohmann::json json = {{"rank", rank},
                         {"comm_bytes", report.comm_bytes},
                         {"kfac_memory_bytes", report.kfac_memory_bytes},
                         {"kfac_time_s", report.kfac_time},
                         {"wall_time_s", report.wall_time_s}};
  if (with_gpu) json["gpu_max_memory_allocated_bytes"] = report.gpu_max_memory_allocated_bytes;
  return json;
}

// True when `model` holds a BatchNorm layer (its statistics are those of each rank's own examples).
bool has_batch_norm(torch::nn::Module& model) {
  for (const auto& module : model.modules()) {
    if (module->name().find("BatchNorm") != std::string::npos) return true;
  }
  return false;
}

// CRC-32 of the bytes of every parameter and buffer, in registration order.
uint32_t parameters_crc32(torch::nn::Module& model) {
  uint32_t crc = 0;
  auto add = [&](const torch::Tensor& t) {
    const auto bytes = t.detach().to(torch::kCPU).contiguous();
    crc = crc32_of(bytes.data_ptr(), bytes.nbytes(), crc);
  };
  for (const auto& p : model.parameters()) add(p);
  for (const auto& b : model.buffers()) add(b);
  return crc;
}

}  // namespace

struct Trainer::State {
  data::Dataset dataset;
  models::Task task = models::Task::kClassification;
  torch::nn::Sequential model{nullptr};
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  std::shared_ptr<Preconditioner> kfac;
  std::unique_ptr<optim::KFAC> kfac_optimizer;  // --eigen-adam, --graft: K-FAC and the optimizer step as one
  std::unique_ptr<parallel::DataParallel> data_parallel;  // DDP's reducer: gradient averaging overlapped with backward
  MetricsWriter metrics;                      // rank 0's metrics file (disabled elsewhere)
  std::unique_ptr<Checkpointer> checkpointer;  // null without --checkpoint-dir
  double current_lr = 0.0;
  int64_t global_step = 0;
  int64_t steps_per_epoch = 0;
  double best_accuracy = 0.0;
  double wall_offset = 0.0;  // seconds trained before a resume
  Clock::time_point start;
  bool terminal = false;
  bool remove_other_worlds = false;  // resumed from another world size's files: remove them after the first save
  Clock::time_point last_draw;

  double wall() const { return wall_offset + std::chrono::duration<double>(Clock::now() - start).count(); }
};

Trainer::Trainer(TrainConfig config, std::shared_ptr<comm::Communicator> communicator,
                 std::optional<c10::Device> device)
    : config_(std::move(config)), communicator_(std::move(communicator)), state_(std::make_unique<State>()) {
  config_.validate();
  device_ = device ? *device : rank_device(config_, 0);
  TORCH_CHECK(device_.is_cpu() || config_.device != DeviceChoice::kCpu, "Trainer was handed device ", device_.str(),
              ", but its config says --device cpu");
  make_current(device_);
  if (communicator_) {
    rank_ = communicator_->rank();
    world_ = communicator_->size();
    agree_on(*communicator_, to_json(config_));
  }
  threads_ = tools::configure_threads(config_.threads);
  auto& s = *state_;
  s.task = models::model_task(to_string(config_.model));
  s.dataset = data::load_dataset(to_string(config_.dataset), config_.data_dir, s.task == models::Task::kReconstruction);
  config_.batch_size = config_.batch_per_rank(world_);
  s.steps_per_epoch = s.dataset.train.size() / (config_.batch_size * world_);
  TORCH_CHECK(s.steps_per_epoch > 0, "--batch-size ", config_.batch_size, " x ", world_, " ranks is larger than the training set (",
              s.dataset.train.size(), " examples)");
  torch::manual_seed(static_cast<uint64_t>(config_.seed));
  const auto& d = s.dataset;
  s.model = models::make_model(to_string(config_.model), d.channels, d.height, d.width, d.classes);
  // Initialised on the CPU (same weights on every device), then moved; the optimizer and K-FAC see it there.
  naming_out_of_memory([this] { return "moving the model to " + device_.str(); }, [&] { s.model->to(device_); });
  if (config_.optimizer == Optimizer::kSgd) {
    s.optimizer = std::make_unique<torch::optim::SGD>(
        s.model->parameters(),
        torch::optim::SGDOptions(config_.lr).momentum(config_.momentum).weight_decay(config_.weight_decay));
  } else if (config_.optimizer == Optimizer::kAdam) {
    s.optimizer = std::make_unique<torch::optim::Adam>(
        s.model->parameters(), torch::optim::AdamOptions(config_.lr).weight_decay(config_.weight_decay));
  } else {
    s.optimizer = std::make_unique<torch::optim::AdamW>(
        s.model->parameters(), torch::optim::AdamWOptions(config_.lr).weight_decay(config_.weight_decay));
  }
  if (config_.kfac) {
    State* state = state_.get();
    // The flags' options (config_.kfac_options); the learning rate and accumulation follow the optimizer's.
    Options options = config_.kfac_options;
    const double kl_clip = options.kl_clip_at(0);
    options.lr([state](int64_t) { return state->current_lr; })
        .kl_clip([state, kl_clip, this](int64_t) {
          // While clipping is active the update length is sqrt(kl_clip / vg), whatever the lr; scaling the
          // bound with (lr / base lr)^2 lets the lr schedule act.
          if (!config_.kl_clip_follows_lr) return kl_clip;
          const double ratio = state->current_lr / config_.lr;
          return kl_clip * ratio * ratio;
        })
        .accumulation_steps(config_.accumulation_steps);
    // A skipped step leaves the factors as they were: nothing folded in the hooks before the loss is checked.
    if (config_.on_nan_loss == NanPolicy::kSkip) options.fold_in_hooks(false);
    s.kfac = std::make_shared<Preconditioner>(s.model.ptr(), options, communicator_);
    if (!config_.kfac_rates.empty()) s.kfac->use_rates(read_rates(config_.kfac_rates, "--kfac-rates"));
    // Its own lr (the schedule above) and Adam's constants (AdamW's defaults, as the Options'), and the same
    // objects the checkpoints save.
    if (options.eigen_adam() || config_.graft) {
      s.kfac_optimizer = std::make_unique<optim::KFAC>(s.kfac, s.optimizer, optim::KFACOptions().graft(config_.graft));
    }
  }
  s.terminal = ::isatty(::fileno(stdout)) != 0;
  if (s.kfac && rank_ == 0) {
    // One line (log() prefixes every call with the rank in a distributed job).
    std::ostringstream layers;
    layers << "K-FAC layers (name kind A x G):";
    for (const auto& layer : s.kfac->layers()) {
      layers << (&layer == &s.kfac->layers().front() ? " " : ", ") << layer.name() << " "
             << dkfac::to_string(layer.kind()) << " " << layer.a_dim() << "x" << layer.g_dim();
    }
    log() << layers.str() << "\n";
    if (!s.kfac->options().strategy()) {
      log() << "step plan: strategy auto chooses it at the first step, from "
            << (config_.kfac_rates.empty() ? "this machine's rates measured then" : "the rates in " + config_.kfac_rates)
            << std::endl;
    } else if (config_.print_plan || s.kfac->plan().world_size() > 1) {
      log() << s.kfac->executor()->describe(/*per_layer=*/config_.print_plan) << std::flush;
    }
  } else if (config_.print_plan && rank_ == 0) {
    log() << "step plan: none (--no-kfac: plain " << to_string(config_.optimizer) << ", no K-FAC work)\n" << std::flush;
  }
}

Trainer::~Trainer() = default;

double Trainer::learning_rate(int64_t epoch, int64_t step_in_epoch) const {
  const double t = static_cast<double>(epoch) + static_cast<double>(step_in_epoch) / state_->steps_per_epoch;
  double lr = config_.lr;
  if (config_.warmup_epochs > 0 && t < config_.warmup_epochs) return lr * (t + 1e-3) / config_.warmup_epochs;
  const double total = static_cast<double>(config_.epochs);
  if (config_.lr_schedule == LrSchedule::kCosine) {
    lr *= 0.5 * (1.0 + std::cos(M_PI * std::min(t, total) / total));
  } else if (config_.lr_schedule == LrSchedule::kStep) {
    if (t >= 0.5 * total) lr *= 0.1;
    if (t >= 0.75 * total) lr *= 0.1;
  }
  return lr;
}

void Trainer::set_learning_rate(double lr) {
  state_->current_lr = lr;
  for (auto& group : state_->optimizer->param_groups()) {
    group.options().set_lr(lr);
  }
}

torch::Tensor Trainer::loss_of(const torch::Tensor& output, const torch::Tensor& x, const torch::Tensor& y) const {
  if (state_->task == models::Task::kReconstruction) {
    return F::binary_cross_entropy_with_logits(output, x.flatten(1));
  }
  return F::cross_entropy(output, y);
}

Evaluation Trainer::evaluate() {
  auto& s = *state_;
  if (s.data_parallel) s.data_parallel->broadcast_buffers();  // every rank evaluates rank 0's model
  torch::NoGradGuard no_grad;
  s.model->eval();
  const auto& test = s.dataset.test;
  const int64_t size = config_.eval_examples > 0 ? std::min(config_.eval_examples, test.size()) : test.size();
  // Summed on the device and read once: no host synchronisation per batch. In float64, as the host's
  // double sum was: the CPU's result is bit for bit what it was.
  auto loss_sum = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat64).device(device_));
  auto correct = torch::zeros({}, torch::TensorOptions().dtype(torch::kInt64).device(device_));
  for (int64_t begin = 0; begin < size; begin += 1000) {
    const int64_t end = std::min(begin + 1000, size);
    auto x = to_device(s.dataset.test_batch(begin, end), device_);
    auto y = to_device(test.labels.slice(0, begin, end), device_);
    naming_out_of_memory(
        [&] {
          return "evaluation of test examples " + std::to_string(begin) + "-" + std::to_string(end) + " on " +
                 device_.str();
        },
        [&] {
          auto out = s.model->forward(x);
          loss_sum += loss_of(out, x, y).to(torch::kFloat64) * static_cast<double>(end - begin);
          if (s.task == models::Task::kClassification) correct += out.argmax(1).eq(y).sum();
        });
  }
  s.model->train();
  return {loss_sum.item<double>() / size, static_cast<double>(correct.item<int64_t>()) / size};
}

// One decision for every rank: a step is dropped (or training stops) when any rank's loss or its averaged
// gradient is not finite, so that the ranks' collectives stay in step.
bool Trainer::step_is_finite(const torch::Tensor& loss) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> largest{loss.detach().abs().reshape({1})};
  for (const auto& p : state_->model->parameters()) {
    if (p.grad().defined()) largest.push_back(p.grad().abs().max().reshape({1}));
  }
  bool finite = torch::isfinite(torch::cat(largest).max()).item<bool>();
  if (communicator_ && world_ > 1) {
    auto bad = torch::full({1}, finite ? 0.0f : 1.0f);
    communicator_->allreduce_sum(bad, comm::kWorld, comm::Purpose::kFiniteCheck).wait();
    finite = bad.item<float>() == 0.0f;
  }
  return finite;
}

std::string Trainer::layout() const {
  // What decides which K-FAC state a rank holds: a checkpoint of another layout cannot be resumed.
  std::ostringstream out;
  const auto& o = config_.kfac_options;
  const double fraction = o.grad_worker_fraction() == 0.0 ? 1.0 / world_ : o.grad_worker_fraction();  // 0: 1/P
  out << "world " << world_ << ", rank " << rank_ << ", strategy " << dkfac::to_string(o.strategy())
      << ", grad-worker-fraction " << fraction << ", " << (o.colocate_factors() ? "colocated" : "separate")
      << " factors, " << dkfac::to_string(o.balance()) << " balance";
  return out.str();
}

std::ostream& Trainer::log() const {
  // Rank 0 speaks for the job; the other ranks' lines would repeat it (each prints its own errors).
  static std::ostream discard(nullptr);
  return rank_ == 0 ? std::cout : discard;
}

void Trainer::warn(const std::string& message) const {
  std::cout << std::flush;
  std::cerr << (world_ > 1 ? "[rank " + std::to_string(rank_) + "] " : std::string()) << "dkfac: warning: " << message
            << std::endl;
}

CheckpointIdentity Trainer::identity() const {
  return {to_string(config_.model), to_string(config_.dataset), to_string(config_.optimizer),
          shape_signature(*state_->model), config_.kfac, layout(), job_layout()};
}

void Trainer::save_checkpoint(const Position& at, const std::string& reason) {
  auto& s = *state_;
  CheckpointProgress progress;
  progress.world_size = world_;
  progress.global_batch = global_batch();
  progress.epoch = at.epoch;
  progress.step_in_epoch = at.step_in_epoch;
  progress.epoch_examples = at.step_in_epoch * global_batch();
  progress.global_step = s.global_step;
  progress.best_accuracy = s.best_accuracy;
  progress.wall_seconds = s.wall();
  s.checkpointer->save([&](torch::serialize::OutputArchive& archive) {
    write_checkpoint(archive, config_, identity(), progress, {*s.model, *s.optimizer, s.kfac.get()});
  });
  if (s.remove_other_worlds) {
    // Resumed from another world size's files: once every rank has written its own, they go.
    if (communicator_ && world_ > 1) {
      auto done = torch::ones({1}, torch::kInt64);
      communicator_->allreduce_sum(done, comm::kWorld, comm::Purpose::kSetup).wait();
    }
    if (rank_ == 0) {
      const int removed = s.checkpointer->remove_other_worlds();
      if (removed > 0) log() << "checkpoint: removed " << removed << " file(s) of the earlier job of another number of ranks" << std::endl;
    }
    s.remove_other_worlds = false;
  }
  log() << "checkpoint: " << s.checkpointer->path() << (world_ > 1 ? " and the other ranks'" : "") << " (" << reason
        << (at.step_in_epoch > 0 ? ", in epoch " + std::to_string(at.epoch + 1) : std::string()) << ", step "
        << s.global_step << ")" << std::endl;
}

std::optional<Trainer::Position> Trainer::load_checkpoint() {
  auto& s = *state_;
  auto chosen = s.checkpointer->find(device_);  // tensors onto this run's device, whichever device saved them
  if (!chosen) {
    log() << "resume: no checkpoint in " << config_.checkpoint_dir << " yet, starting from scratch" << std::endl;
    return std::nullopt;
  }
  if (!chosen->note.empty()) warn(chosen->note);
  const auto path = chosen->path;
  const auto resumed = read_checkpoint(chosen->archive, path, config_, identity(), {*s.model, *s.optimizer, s.kfac.get()});
  const auto& written = resumed.progress;
  Position at{written.epoch, written.step_in_epoch};
  // The position in examples, as steps of this run's global batch (rounded down: a partial step is redone).
  at.step_in_epoch = std::min(written.epoch_examples / global_batch(), s.steps_per_epoch);
  const int64_t repeated = written.epoch_examples - at.step_in_epoch * global_batch();  // seen again by this run
  s.global_step = written.global_step;
  s.best_accuracy = written.best_accuracy;
  s.wall_offset = written.wall_seconds;
  s.remove_other_worlds = chosen->other_world;
  log() << "resume: " << path << " (step " << s.global_step
        << (at.step_in_epoch == 0 && at.epoch > 0 ? ", end of epoch " + std::to_string(at.epoch)
                                                  : ", in epoch " + std::to_string(at.epoch + 1))
        << ")" << resume_differences(written.world_size, written.global_batch, repeated, resumed.restore) << std::endl;
  if (!resumed.changed_options.empty()) {
    log() << "options changed since the checkpoint: " << resumed.changed_options << std::endl;
  }
  return at;
}

int64_t Trainer::global_batch() const { return config_.batch_size * world_; }

std::string Trainer::job_layout() const {
  // What a resume may not change: the strategy and placement as configured (world-size independent).
  std::ostringstream out;
  const auto& o = config_.kfac_options;
  out << "strategy " << dkfac::to_string(o.strategy()) << ", grad-worker-fraction " << o.grad_worker_fraction() << ", "
      << (o.colocate_factors() ? "colocated" : "separate") << " factors, " << dkfac::to_string(o.balance())
      << " balance";
  return out.str();
}

// The end of the resume line: what a resume on another number of ranks or global batch re-placed or
// recomputed, and whether the run goes on as the one that wrote the checkpoint would have.
std::string Trainer::resume_differences(int64_t written_world, int64_t written_batch, int64_t repeated,
                                        const std::optional<StateRestore>& restore) const {
  const bool same_world = written_world == world_;
  std::ostringstream out;
  if (!same_world) {
    out << "; written by a " << written_world << "-rank job, continued on " << world_ << " rank"
        << (world_ == 1 ? "" : "s");
  }
  if (restore && (!restore->same_plan || restore->recomputed_layers > 0)) {
    out << "; " << restore->describe(world_);
  }
  if (same_world && written_batch == global_batch() && repeated == 0) return out.str();
  std::vector<std::string> differs;
  if (written_batch != global_batch()) {
    differs.push_back("the global batch is " + std::to_string(global_batch()) + " examples, it was " +
                      std::to_string(written_batch) + " (--global-batch-size " + std::to_string(written_batch) +
                      " keeps it on any number of ranks that divides it)");
  }
  if (repeated > 0) {
    differs.push_back(std::to_string(repeated) + " examples of the epoch seen before the checkpoint are seen again "
                      "(the position falls inside a step of this run's global batch)");
  }
  if (!same_world && config_.kfac && config_.kfac_options.strategy() == Strategy::kDp) {
    differs.push_back("DP-KFAC builds each layer's factors from its owner's own batch, now " +
                      std::to_string(config_.batch_size) + " examples instead of " +
                      std::to_string(written_batch / written_world));
  }
  if (!same_world && has_batch_norm(*state_->model)) {
    differs.push_back("BatchNorm statistics are per rank, now over " + std::to_string(config_.batch_size) +
                      " examples instead of " + std::to_string(written_batch / written_world));
  }
  if (differs.empty()) {
    out << "; the same batches: the run continues the " << written_world << "-rank run's trajectory up to "
        << "floating-point reduction order";
  } else {
    out << "; the trajectory differs from the " << written_world << "-rank run's: " << c10::Join("; ", differs);
  }
  return out.str();
}

bool Trainer::finished(const Position& at) const {
  return at.epoch >= config_.epochs || max_steps_reached();
}

nlohmann::json Trainer::run_event(std::optional<int64_t> resumed_at_step) const {
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  auto options = to_json(config_);
  options["metrics"] = config_.metrics;
  options["threads"] = config_.threads;
  options["log-every"] = config_.log_every;
  options["eval-examples"] = config_.eval_examples;
  const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::ostringstream utc;
  utc << std::put_time(std::gmtime(&now), "%Y-%m-%dT%H:%M:%SZ");
  nlohmann::json event = {{"event", "run"},
                          {"format_version", kMetricsFormatVersion},
                          {"dkfac_version", DKFAC_VERSION_STRING},
                          {"command_line", config_.command_line},
                          {"options", options},
                          {"world_size", world_},
                          {"seed", config_.seed},
                          {"threads", threads_},
                          {"machine", {{"hostname", host},
                                       {"cores", std::thread::hardware_concurrency()},
                                       {"libtorch", TORCH_VERSION}}},
                          {"device", device_.str()},
                          {"started_utc", utc.str()}};
  if (device_.is_cuda()) {
    event["machine"]["cuda_devices"] = device::cuda_device_count();
    if (communicator_) event["cuda_backend"] = comm::to_string(communicator_->cuda_backend());
  }
  if (resumed_at_step) event["resumed_at_step"] = *resumed_at_step;
  return event;
}

// One training step on this rank's slice of the global batch: K micro-batches (gradients accumulate and
// are averaged over the ranks with the last), the finite check, K-FAC and the optimizer. Returns the
// step's loss, or nullopt when the step was dropped (--on-nan-loss skip).
std::optional<double> Trainer::train_step(const Position& at, const torch::Tensor& x, const torch::Tensor& y) {
  auto& s = *state_;
  s.optimizer->zero_grad();
  const int64_t k_steps = config_.accumulation_steps;
  const int64_t micro = config_.batch_size / k_steps;
  const std::string step = "step " + std::to_string(s.global_step + 1) + " (epoch " + std::to_string(at.epoch + 1) + ")";
  torch::Tensor loss;  // the step's loss: the sum of the micro-batches' losses / K
  for (int64_t k = 0; k < k_steps; ++k) {
    if (s.data_parallel && k == 0) s.data_parallel->broadcast_buffers();
    auto xk = x.slice(0, k * micro, (k + 1) * micro);
    auto yk = y.slice(0, k * micro, (k + 1) * micro);
    const auto where = [&] {
      return "the forward and backward pass of " + step + ", micro-batch " + std::to_string(k + 1) + " of " +
             std::to_string(k_steps) + " (" + std::to_string(micro) + " examples on " + device_.str() + ")";
    };
    naming_out_of_memory(where, [&] {
      auto micro_loss = loss_of(s.model->forward(xk), xk, yk) / static_cast<double>(k_steps);
      if (s.data_parallel) {
        s.data_parallel->backward(micro_loss, /*average=*/k + 1 == k_steps);
      } else {
        micro_loss.backward();
      }
      loss = k == 0 ? micro_loss.detach() : loss + micro_loss.detach();
    });
  }
  const bool finite = naming_out_of_memory([&] { return "the finite check of " + step; },
                                           [&] { return step_is_finite(loss); });
  if (!finite) {
    TORCH_CHECK(config_.on_nan_loss == NanPolicy::kSkip, "training loss or gradient became non-finite (loss ",
                loss.item<double>(), ") at step ", s.global_step, " (epoch ", at.epoch + 1,
                "); the weights were not updated. Lower --lr or raise --damping, resume from the last "
                "checkpoint, or pass --on-nan-loss skip to drop such steps");
    if (s.kfac) s.kfac->discard_step();
    s.optimizer->zero_grad();
    return std::nullopt;
  }
  if (s.kfac_optimizer) {
    naming_out_of_memory(
        [&] {
          return std::string("K-FAC's step() and the optimizer (") + to_string(config_.optimizer) + ") in " + step;
        },
        [&] { s.kfac_optimizer->step(); });
  } else {
    if (s.kfac) naming_out_of_memory([&] { return "K-FAC's step() in " + step; }, [&] { s.kfac->step(); });
    naming_out_of_memory([&] { return std::string("the optimizer (") + to_string(config_.optimizer) + ") in " + step; },
                         [&] { s.optimizer->step(); });
  }
  if (s.kfac) {
    if (const auto change = s.kfac->take_plan_change(); !change.empty()) log() << change << std::endl;
  }
  if (config_.global_batch_size > 0 && communicator_ && world_ > 1) {
    // The loss over the global batch, the same whatever the number of ranks that share it.
    return global_mean(loss.item<double>(), 1);
  }
  return loss.item<double>();
}

// The progress line of rank 0: redrawn in place on a terminal, one line per --log-every steps otherwise.
// Its rate is images over the device's time since `epoch_start`.
void Trainer::draw_progress(const Position& at, double loss, const device::Mark& epoch_start, int64_t epoch_steps,
                            bool logged) {
  const int64_t step_in_epoch = at.step_in_epoch;
  auto& s = *state_;
  const auto now = Clock::now();
  if (rank_ != 0 || !(logged || (s.terminal && now - s.last_draw > std::chrono::milliseconds(200)))) return;
  s.last_draw = now;
  // The device's time since the epoch began (CUDA events on a GPU; the host clock on the CPU).
  const double epoch_seconds = device::Mark::seconds_between(epoch_start, device::Mark::now(device_));
  const double rate = epoch_steps * config_.batch_size * world_ / std::max(epoch_seconds, 1e-9);
  const double eta = (s.steps_per_epoch - step_in_epoch - 1) * config_.batch_size * world_ / std::max(rate, 1e-9);
  std::ostringstream line;
  line << "epoch " << at.epoch + 1 << "/" << config_.epochs << " ";
  if (s.terminal) {
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(kWidth * (step_in_epoch + 1) / s.steps_per_epoch);
    line << "[" << std::string(filled, '#') << std::string(kWidth - filled, '.') << "] ";
  }
  line << "step " << step_in_epoch + 1 << "/" << s.steps_per_epoch << " loss " << std::fixed << std::setprecision(4)
       << loss << " lr " << std::setprecision(5) << s.current_lr << " " << std::setprecision(0) << rate << " img/s eta "
       << std::setprecision(0) << eta << "s";
  if (s.terminal) {
    std::cout << "\r" << line.str() << "   " << std::flush;
  } else {
    std::cout << line.str() << std::endl;
  }
}

// The mean loss of every rank's steps this epoch (each rank trains on its own shard).
double Trainer::global_mean(double sum, int64_t count) {
  auto totals = torch::tensor({sum, static_cast<double>(count)}, torch::kFloat64);
  if (communicator_ && world_ > 1) communicator_->allreduce_sum(totals, comm::kWorld, comm::Purpose::kSetup).wait();
  return totals[1].item<double>() > 0 ? totals[0].item<double>() / totals[1].item<double>() : 0.0;
}

TrainSummary Trainer::run() {
  open_checkpoint_directory();
  Position at;
  std::optional<int64_t> resumed_at_step;
  if (const auto loaded = config_.resume ? load_checkpoint() : std::nullopt) {
    at = *loaded;
    resumed_at_step = state_->global_step;
    if (finished(at)) return already_complete(at);
  }
  open_metrics(resumed_at_step);
  start_training();
  log() << run_header() << std::endl;
  if (!state_->dataset.train.source.empty()) {  // which of a plain and a .gz copy, and where
    log() << "data: train " << state_->dataset.train.source << "; test " << state_->dataset.test.source << std::endl;
  }

  TrainSummary summary;
  Evaluation last_eval;
  for (; at.epoch < config_.epochs; ++at.epoch, at.step_in_epoch = 0) {
    const auto epoch = run_epoch(at, summary);
    if (!epoch) {
      last_eval = stop_at_max_steps(at);
      break;
    }
    last_eval = end_epoch(at, *epoch);
    summary.epochs = at.epoch + 1;
  }
  return finish(std::move(summary), last_eval);
}

void Trainer::open_checkpoint_directory() {
  if (config_.checkpoint_dir.empty()) return;
  auto& s = *state_;
  s.checkpointer = std::make_unique<Checkpointer>(config_.checkpoint_dir, rank_, world_, communicator_);
  std::string note;
  try {
    note = s.checkpointer->open(config_.resume, config_.overwrite);
  } catch (const c10::Error& e) {
    throw JobError(e.what_without_backtrace());
  }
  if (!note.empty()) log() << note << std::endl;
}

// A resumed run that had reached --epochs or --max-steps: nothing to do, and the metrics file and the
// checkpoints stay as they are.
TrainSummary Trainer::already_complete(const Position& at) {
  auto& s = *state_;
  const bool epochs_done = at.epoch >= config_.epochs;
  log() << "resume: the run in " << config_.checkpoint_dir << " is already complete ("
        << (epochs_done
                ? "all " + std::to_string(config_.epochs) + " epochs done, step " + std::to_string(s.global_step)
                : "step " + std::to_string(s.global_step) + " of --max-steps " + std::to_string(config_.max_steps) +
                      ", in epoch " + std::to_string(at.epoch + 1))
        << "); nothing to do. Raise --epochs or --max-steps to train further" << std::endl;
  TrainSummary summary;
  summary.steps = s.global_step;
  summary.epochs = at.epoch;
  summary.best_accuracy = s.best_accuracy;
  summary.already_complete = true;
  summary.parameters_crc32 = parameters_crc32(*s.model);
  return summary;
}

// Rank 0's metrics file, starting with the run event: appended to on --resume, emptied on --overwrite,
// refused if it holds events otherwise.
void Trainer::open_metrics(std::optional<int64_t> resumed_at_step) {
  if (config_.metrics.empty() || rank_ != 0) return;
  using Existing = MetricsWriter::Existing;
  auto& s = *state_;
  s.metrics = MetricsWriter(config_.metrics, config_.resume      ? Existing::kAppend
                                             : config_.overwrite ? Existing::kReplace
                                                                 : Existing::kRefuse);
  s.metrics.write(run_event(resumed_at_step));
}

void Trainer::start_training() {
  auto& s = *state_;
  if (communicator_) {
    // After the checkpoint is loaded (Module::load would detach the reducer's hooks). Rank 0's
    // parameters and buffers go to every rank here. A one-rank group (--backend on one GPU) runs DDP's
    // reducer too, so that its backend carries the gradients.
    s.data_parallel = std::make_unique<parallel::DataParallel>(*s.model, communicator_);
  }
  device::reset_peak_memory(device_);  // the metrics' GPU peak is this run's
  s.start = Clock::now();
}

// The line that opens the run's output: model, data, optimizer, batch, epochs, threads, device, ranks.
std::string Trainer::run_header() const {
  const auto& s = *state_;
  std::ostringstream out;
  out << "train: model " << to_string(config_.model) << ", dataset " << s.dataset.name << " ("
      << s.dataset.train.size() << " train, " << s.dataset.test.size() << " test), "
      << (!config_.kfac                         ? ""
          : config_.kfac_options.eigen_adam() ? "K-FAC (Adam in its eigenbasis) + "
          : config_.graft                     ? "K-FAC (grafted) + "
                                              : "K-FAC + ")
      << to_string(config_.optimizer) << ", batch " << config_.batch_size
      << (world_ > 1 ? " per rank" : "") << ", " << config_.epochs << " epochs, " << threads_ << ", device "
      << device_.str()
      << (device_.is_cuda() && communicator_
              ? std::string(" (CUDA collectives: ") + comm::to_string(communicator_->cuda_backend()) + ")"
              : std::string())
      << (world_ > 1 ? ", " + std::to_string(world_) + " ranks (global batch " +
                           std::to_string(config_.batch_size * world_) + ")"
                     : std::string());
  return out.str();
}

// Trains epoch `at.epoch` from step `at.step_in_epoch` on, `at` following the steps. Returns this rank's
// loss over the epoch's steps, or nullopt when --max-steps stopped the epoch before its end.
std::optional<Trainer::EpochLoss> Trainer::run_epoch(Position& at, TrainSummary& summary) {
  auto& s = *state_;
  // The epoch's order of examples: the same on every rank, and again after a resume.
  auto generator =
      at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(config_.seed) * 1000003 + at.epoch);
  const auto order = torch::randperm(s.dataset.train.size(), generator);
  EpochLoss epoch{0.0, 0, device::Mark::now(device_)};
  for (; at.step_in_epoch < s.steps_per_epoch; ++at.step_in_epoch) {
    if (max_steps_reached()) break;
    run_step(at, order, epoch, summary);
  }
  if (s.terminal && rank_ == 0) std::cout << std::endl;  // ends the progress line redrawn in place
  if (at.step_in_epoch < s.steps_per_epoch) return std::nullopt;
  return epoch;
}

// One step of the loop: the learning rate, this rank's batch, train_step, then the progress line, the
// step event and a checkpoint when they are due (or, for a dropped step, its warning and event).
void Trainer::run_step(const Position& at, const torch::Tensor& order, EpochLoss& epoch, TrainSummary& summary) {
  auto& s = *state_;
  set_learning_rate(learning_rate(at.epoch, at.step_in_epoch));
  const auto [x, y] = batch(at, order);
  const auto loss = train_step(at, to_device(x, device_), to_device(y, device_));
  if (!loss) {
    skip_step(at, summary);
    return;
  }
  summary.skipped_in_a_row = 0;
  summary.step_losses.push_back(*loss);
  epoch.sum += *loss;
  ++epoch.steps;
  ++s.global_step;
  const bool logged = s.global_step % log_every() == 0;
  draw_progress(at, *loss, epoch.start, epoch.steps, logged);
  if (logged) s.metrics.write(step_event(at, *loss));
  checkpoint_within_epoch(at);
}

// --max-steps reached before the epoch's end: a checkpoint, an evaluation and the stop line.
Evaluation Trainer::stop_at_max_steps(const Position& at) {
  if (state_->checkpointer) save_checkpoint(at, "--max-steps reached");
  const auto eval = evaluate_and_keep_best();
  log() << "stopped at --max-steps " << config_.max_steps << ": test loss " << std::fixed << std::setprecision(4)
        << eval.loss << ", test accuracy " << std::setprecision(2) << 100.0 * eval.accuracy << "%" << std::endl;
  return eval;
}

// An epoch's end: an evaluation, the epoch line and event, and a checkpoint every --checkpoint-every-epochs
// epochs and after the last.
Evaluation Trainer::end_epoch(const Position& at, const EpochLoss& epoch) {
  auto& s = *state_;
  const auto eval = evaluate_and_keep_best();
  const double train_loss = global_mean(epoch.sum, epoch.steps);
  log() << "epoch " << at.epoch + 1 << "/" << config_.epochs << ": train loss " << std::fixed << std::setprecision(4)
        << train_loss << ", test loss " << eval.loss << ", test accuracy " << std::setprecision(2)
        << 100.0 * eval.accuracy << "%, wall " << std::setprecision(1) << s.wall() << " s" << std::endl;
  s.metrics.write(epoch_event(at, train_loss, eval));
  if (s.checkpointer && ((at.epoch + 1) % config_.checkpoint_every_epochs == 0 || at.epoch + 1 == config_.epochs)) {
    save_checkpoint({at.epoch + 1, 0}, "end of epoch " + std::to_string(at.epoch + 1));
  }
  return eval;
}

// The summary line and event. In a distributed job the event carries every rank's report, gathered with
// one collective that every rank joins.
TrainSummary Trainer::finish(TrainSummary summary, const Evaluation& last_eval) {
  auto& s = *state_;
  summary.steps = s.global_step;
  summary.best_accuracy = s.best_accuracy;
  summary.final_accuracy = last_eval.accuracy;
  summary.final_test_loss = last_eval.loss;
  summary.wall_seconds = s.wall();
  summary.kfac_seconds = s.kfac ? s.kfac->total_times().total() : 0.0;
  summary.parameters_crc32 = parameters_crc32(*s.model);
  if (const auto gpu_memory = device::memory_stats(device_)) {
    summary.gpu_max_memory_allocated_bytes = gpu_memory->peak_allocated;
  }
  const auto& gpu_peak = summary.gpu_max_memory_allocated_bytes;
  log() << "summary: best test accuracy " << std::fixed << std::setprecision(2) << 100.0 * summary.best_accuracy
        << "%, final " << 100.0 * summary.final_accuracy << "%, wall " << std::setprecision(1) << summary.wall_seconds
        << " s, K-FAC " << summary.kfac_seconds << " s, " << summary.steps << " steps"
        << (gpu_peak ? ", GPU memory peak " + human_bytes(static_cast<double>(*gpu_peak)) + " on " + device_.str()
                     : std::string())
        << std::endl;
  auto event = summary_event(summary);
  if (communicator_) {
    const auto reports = gather_reports(rank_report(*communicator_, s.kfac.get(), summary), *communicator_);
    event["world_size"] = world_;
    event["ranks"] = nlohmann::json::array();
    for (int r = 0; r < world_; ++r) event["ranks"].push_back(report_json(r, reports[r], gpu_peak.has_value()));
  }
  s.metrics.write(event);
  return summary;
}

bool Trainer::max_steps_reached() const {
  return config_.max_steps >= 0 && state_->global_step >= config_.max_steps;
}

// Steps between progress lines (off a terminal) and step events: --log-every, or a tenth of an epoch.
int64_t Trainer::log_every() const {
  return config_.log_every > 0 ? config_.log_every : std::max<int64_t>(1, state_->steps_per_epoch / 10);
}

// Epochs done once the step at `at` is: 0.25 after the first quarter of epoch 1.
double Trainer::epoch_progress(const Position& at) const {
  return at.epoch + static_cast<double>(at.step_in_epoch + 1) / state_->steps_per_epoch;
}

// This rank's disjoint slice of the global batch of the step at `at` (augmented where the dataset is).
Trainer::Batch Trainer::batch(const Position& at, const torch::Tensor& order) const {
  const auto& s = *state_;
  const int64_t begin = (at.step_in_epoch * world_ + rank_) * config_.batch_size;
  const auto idx = order.slice(0, begin, begin + config_.batch_size);
  Batch b{s.dataset.train_batch(idx), s.dataset.train.labels.index_select(0, idx)};
  if (s.dataset.augment) {
    auto aug = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(config_.seed) * 7919 + s.global_step);
    if (config_.global_batch_size > 0 && world_ > 1) {
      // The draws of the whole global batch, so that an example is augmented alike on any number of ranks.
      const int64_t first = at.step_in_epoch * global_batch();
      const auto all = data::augment_crop_flip(s.dataset.train_batch(order.slice(0, first, first + global_batch())), aug);
      b.x = all.slice(0, begin - first, begin - first + config_.batch_size);
    } else {
      b.x = data::augment_crop_flip(b.x, aug);
    }
  }
  return b;
}

// A step dropped for a non-finite loss or gradient (--on-nan-loss skip): a warning and an event; the step
// still counts, so the schedules and checkpoints keep their places.
void Trainer::skip_step(const Position& at, TrainSummary& summary) {
  auto& s = *state_;
  ++summary.skipped_steps;
  warn("skipped step " + std::to_string(s.global_step) + " (epoch " + std::to_string(at.epoch + 1) +
       "): non-finite loss or gradient (--on-nan-loss skip); " + std::to_string(summary.skipped_steps) +
       " skipped so far");
  s.metrics.write({{"event", "skipped_step"}, {"step", s.global_step}, {"epoch", at.epoch + 1},
                   {"epoch_progress", epoch_progress(at)}});
  ++s.global_step;
  // Every rank drops the same steps (the ranks agree on a non-finite loss), so every rank stops here alike.
  if (++summary.skipped_in_a_row >= config_.max_skipped_steps) {
    throw JobError("the loss or gradient was non-finite at " + std::to_string(summary.skipped_in_a_row) +
                   " steps in a row (" + std::to_string(summary.skipped_steps) + " dropped in all, --on-nan-loss "
                   "skip, --max-skipped-steps " + std::to_string(config_.max_skipped_steps) + "): the run is not "
                   "recovering; stopped (the last checkpoint is intact). Lower the learning rate, or raise "
                   "--max-skipped-steps");
  }
}

// --checkpoint-every-steps: a checkpoint after the step at `at`, unless the epoch's end or --max-steps is
// about to write one.
void Trainer::checkpoint_within_epoch(const Position& at) {
  auto& s = *state_;
  const int64_t every = config_.checkpoint_every_steps;
  if (!s.checkpointer || every <= 0 || s.global_step % every != 0) return;
  if (at.step_in_epoch + 1 >= s.steps_per_epoch || max_steps_reached()) return;
  save_checkpoint({at.epoch, at.step_in_epoch + 1}, "every " + std::to_string(every) + " steps");
}

Evaluation Trainer::evaluate_and_keep_best() {
  const auto eval = evaluate();
  state_->best_accuracy = std::max(state_->best_accuracy, eval.accuracy);
  return eval;
}

nlohmann::json Trainer::step_event(const Position& at, double loss) const {
  const auto& s = *state_;
  nlohmann::json event = {{"event", "step"},       {"step", s.global_step},
                          {"epoch", at.epoch + 1}, {"epoch_progress", epoch_progress(at)},
                          {"loss", loss},          {"lr", s.current_lr},
                          {"wall_time_s", s.wall()}};
  add_gpu_memory(event, device_);
  if (s.kfac) event["kfac_time_s"] = s.kfac->total_times();
  return event;
}

nlohmann::json Trainer::epoch_event(const Position& at, double train_loss, const Evaluation& eval) const {
  const auto& s = *state_;
  nlohmann::json event = {{"event", "epoch"},         {"epoch", at.epoch + 1},
                          {"train_loss", train_loss}, {"test_loss", eval.loss},
                          {"test_accuracy", eval.accuracy}, {"wall_time_s", s.wall()},
                          {"step", s.global_step}};
  if (s.kfac) event["kfac_time_s"] = s.kfac->total_times();
  add_gpu_memory(event, device_);
  return event;
}

// This rank's summary event; finish() adds every rank's report in a distributed job.
nlohmann::json Trainer::summary_event(const TrainSummary& summary) const {
  const auto& s = *state_;
  nlohmann::json event = {{"event", "summary"},
                          {"steps", summary.steps},
                          {"best_test_accuracy", summary.best_accuracy},
                          {"final_test_accuracy", summary.final_accuracy},
                          {"final_test_loss", summary.final_test_loss},
                          {"wall_time_s", summary.wall_seconds},
                          {"kfac_time_s", s.kfac ? s.kfac->total_times() : PhaseTimes()},
                          {"parameters_crc32", summary.parameters_crc32},
                          {"model", to_string(config_.model)},
                          {"dataset", to_string(config_.dataset)},
                          {"kfac", config_.kfac}};
  if (s.kfac) event["kfac_memory_bytes"] = s.kfac->memory_bytes();
  add_gpu_memory(event, device_);
  return event;
}

}  // namespace dkfac::train
