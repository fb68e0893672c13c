#include "tools/train/config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include <c10/util/Exception.h>

#include "dkfac/comm/agreement.h"

namespace dkfac::train {
namespace {

template <typename E>
const char* name_of(E value) {
  for (const auto& [name, v] : choices<E>()) {
    if (v == value) return name.c_str();
  }
  return "unknown";
}

}  // namespace

template <>
const std::vector<std::pair<std::string, Model>>& choices<Model>() {
  static const std::vector<std::pair<std::string, Model>> all = {
      {"mlp", Model::kMlp}, {"cnn", Model::kCnn}, {"resnet20", Model::kResnet20}, {"autoencoder", Model::kAutoencoder}};
  return all;
}
template <>
const std::vector<std::pair<std::string, Dataset>>& choices<Dataset>() {
  static const std::vector<std::pair<std::string, Dataset>> all = {{"fashion-mnist", Dataset::kFashionMnist},
                                                                   {"mnist", Dataset::kMnist},
                                                                   {"cifar10", Dataset::kCifar10},
                                                                   {"synthetic", Dataset::kSynthetic}};
  return all;
}
template <>
const std::vector<std::pair<std::string, Optimizer>>& choices<Optimizer>() {
  static const std::vector<std::pair<std::string, Optimizer>> all = {{"sgd", Optimizer::kSgd},
                                                                     {"adam", Optimizer::kAdam},
                                                                     {"adamw", Optimizer::kAdamW}};
  return all;
}
template <>
const std::vector<std::pair<std::string, LrSchedule>>& choices<LrSchedule>() {
  static const std::vector<std::pair<std::string, LrSchedule>> all = {
      {"constant", LrSchedule::kConstant}, {"step", LrSchedule::kStep}, {"cosine", LrSchedule::kCosine}};
  return all;
}
template <>
const std::vector<std::pair<std::string, NanPolicy>>& choices<NanPolicy>() {
  static const std::vector<std::pair<std::string, NanPolicy>> all = {{"stop", NanPolicy::kStop},
                                                                     {"skip", NanPolicy::kSkip}};
  return all;
}
template <>
const std::vector<std::pair<std::string, DeviceChoice>>& choices<DeviceChoice>() {
  static const std::vector<std::pair<std::string, DeviceChoice>> all = {
      {"cpu", DeviceChoice::kCpu}, {"cuda", DeviceChoice::kCuda}, {"auto", DeviceChoice::kAuto}};
  return all;
}
template <>
const std::vector<std::pair<std::string, comm::CudaBackend>>& choices<comm::CudaBackend>() {
  static const std::vector<std::pair<std::string, comm::CudaBackend>> all = {
      {comm::to_string(comm::CudaBackend::kAuto), comm::CudaBackend::kAuto},
      {comm::to_string(comm::CudaBackend::kNccl), comm::CudaBackend::kNccl},
      {comm::to_string(comm::CudaBackend::kGloo), comm::CudaBackend::kGloo}};
  return all;
}

template <>
const std::vector<std::pair<std::string, ComputeMethod>>& choices<ComputeMethod>() {
  static const std::vector<std::pair<std::string, ComputeMethod>> all = {
      {to_string(ComputeMethod::kEigen), ComputeMethod::kEigen},
      {to_string(ComputeMethod::kInverse), ComputeMethod::kInverse}};
  return all;
}

const char* to_string(Model value) { return name_of(value); }
const char* to_string(Dataset value) { return name_of(value); }
const char* to_string(Optimizer value) { return name_of(value); }
const char* to_string(LrSchedule value) { return name_of(value); }
const char* to_string(NanPolicy value) { return name_of(value); }
const char* to_string(DeviceChoice value) { return name_of(value); }

template <typename E>
std::string choice_names() {
  std::string out;
  for (const auto& [name, value] : choices<E>()) {
    if (!name.empty()) out += (out.empty() ? "" : ", ") + name;
  }
  return out;
}

template <typename E>
E parse_choice(const std::string& flag, const std::string& name) {
  const auto& all = choices<E>();
  const auto it = std::find_if(all.begin(), all.end(), [&name](const auto& choice) { return choice.first == name; });
  TORCH_CHECK(it != all.end(), flag, " must be one of ", choice_names<E>(), ", got '", name, "'");
  return it->second;
}

#define DKFAC_CHOICE(E)                        \
  template std::string choice_names<E>(); \
  template E parse_choice<E>(const std::string&, const std::string&);
DKFAC_CHOICE(Model)
DKFAC_CHOICE(Dataset)
DKFAC_CHOICE(Optimizer)
DKFAC_CHOICE(LrSchedule)
DKFAC_CHOICE(NanPolicy)
DKFAC_CHOICE(ComputeMethod)
DKFAC_CHOICE(DeviceChoice)
DKFAC_CHOICE(comm::CudaBackend)
#undef DKFAC_CHOICE

std::string TrainConfig::flag(const std::string& name) const {
  const auto it = typed_as.find(name);
  return it == typed_as.end() ? name : it->second;
}

void TrainConfig::validate() const {
  // Every numeric flag is range-checked here with the flag's name (as typed), so that no value reaches the
  // library's own checks, which name its option fields instead. The flags with a fixed set of choices were
  // checked when they were parsed (parse_choice).
  TORCH_CHECK(lr > 0 && std::isfinite(lr), "--lr must be > 0, got ", lr);
  TORCH_CHECK(momentum >= 0 && momentum < 1, "--momentum must be in [0, 1), got ", momentum);
  TORCH_CHECK(weight_decay >= 0 && std::isfinite(weight_decay), "--weight-decay must be >= 0, got ", weight_decay);
  TORCH_CHECK(batch_size >= 1, "--batch-size must be >= 1, got ", batch_size);
  TORCH_CHECK(global_batch_size >= 0, "--global-batch-size must be >= 1 (or 0: off, --batch-size per rank), got ",
              global_batch_size);
  TORCH_CHECK(accumulation_steps >= 1, "--accumulation-steps must be >= 1, got ", accumulation_steps);
  TORCH_CHECK(batch_size % accumulation_steps == 0, "--batch-size ", batch_size,
              " must be a multiple of --accumulation-steps ", accumulation_steps,
              " (each step is that many micro-batches of equal size)");
  TORCH_CHECK(epochs >= 1, "--epochs must be >= 1, got ", epochs);
  TORCH_CHECK(max_steps >= -1, "--max-steps must be >= 0 (or -1: no limit), got ", max_steps);
  TORCH_CHECK(warmup_epochs >= 0 && std::isfinite(warmup_epochs), "--warmup-epochs must be >= 0, got ",
              warmup_epochs);
  TORCH_CHECK(seed >= 0, "--seed must be >= 0, got ", seed);
  TORCH_CHECK(threads >= 0 && threads <= 4096, "--threads must be in [0, 4096] (0: LibTorch's default), got ",
              threads);
  kfac_options.validate();  // each flag was checked against its declaration when it was parsed
  if (kfac_options.eigen_adam()) {
    TORCH_CHECK(optimizer == Optimizer::kAdamW, "--eigen-adam is AdamW's update in the K-FAC eigenbasis: it needs "
                "--optimizer adamw, got --optimizer ", to_string(optimizer));
    TORCH_CHECK(kfac, "--eigen-adam is K-FAC's (Adam in its eigenbasis); --no-kfac turns K-FAC off: give one");
  }
  TORCH_CHECK(!graft || kfac, "--graft moves K-FAC's layers along K-FAC's direction; --no-kfac turns K-FAC off: "
              "give one");
  TORCH_CHECK(!(graft && kfac_options.eigen_adam()), "--graft takes the length of the optimizer's own step and "
              "--eigen-adam's step is Adam's own, with its own length: give one");
  TORCH_CHECK(kfac_rates.empty() || !kfac_options.strategy(), "--kfac-rates are for --strategy "
              "auto, but --strategy is ", to_string(kfac_options.strategy()));
  TORCH_CHECK(checkpoint_every_epochs >= 1, "--checkpoint-every-epochs must be >= 1, got ", checkpoint_every_epochs);
  TORCH_CHECK(!resume || !checkpoint_dir.empty(), "--resume needs --checkpoint-dir");
  if (!metrics.empty() && !checkpoint_dir.empty()) {
    // The checkpoint's atomic rename would replace such a file, and its rotation move it to .prev.
    namespace fs = std::filesystem;
    std::error_code error;
    const auto file = fs::weakly_canonical(fs::absolute(metrics), error);
    const auto dir = fs::weakly_canonical(fs::absolute(checkpoint_dir), error);
    TORCH_CHECK(file.parent_path() != dir || file.filename().string().rfind("checkpoint", 0) != 0, "--metrics '",
                metrics, "' is in --checkpoint-dir under a checkpoint's name: the checkpoints would replace it; "
                "write the metrics to another file");
  }
  TORCH_CHECK(!(resume && overwrite), "--resume continues the run in --checkpoint-dir and --overwrite replaces it: "
              "pass one of them");
  TORCH_CHECK(checkpoint_every_steps >= 0, "--checkpoint-every-steps must be >= 0, got ", checkpoint_every_steps);
  TORCH_CHECK(max_skipped_steps >= 1, "--max-skipped-steps must be >= 1, got ", max_skipped_steps);
  TORCH_CHECK(log_every >= 0, "--log-every must be >= 0, got ", log_every);
  TORCH_CHECK(eval_examples >= 0, "--eval-examples must be >= 0, got ", eval_examples);
  TORCH_CHECK(!(device == DeviceChoice::kCpu && backend == comm::CudaBackend::kNccl),
              "--backend nccl carries CUDA tensors, but --device cpu trains on the CPU (its collectives always go "
              "through Gloo); pass --device cuda or auto, or leave --backend out");
}

int64_t TrainConfig::batch_per_rank(int world) const {
  if (global_batch_size == 0) return batch_size;
  // Each global batch is split the same way on any number of ranks: rank r takes examples [r B/P, (r + 1) B/P)
  // of it, so the ranks' examples together are always the same batch.
  const std::string global = "--global-batch-size " + std::to_string(global_batch_size);
  if (global_batch_size % world != 0) {
    throw JobError(global + " cannot be split over " + std::to_string(world) + " ranks (" +
                   std::to_string(global_batch_size) + " is not a multiple of " + std::to_string(world) +
                   "); pass a multiple of the number of ranks");
  }
  const int64_t per_rank = global_batch_size / world;
  if (per_rank % accumulation_steps != 0) {
    throw JobError(global + " gives " + std::to_string(per_rank) + " examples per rank on " + std::to_string(world) +
                   " ranks, not a multiple of --accumulation-steps " + std::to_string(accumulation_steps));
  }
  return per_rank;
}

void agree_on(comm::Communicator& communicator, const nlohmann::json& options) {
  std::vector<std::string> lines;  // "--lr 0.05", in key order
  for (const auto& [key, value] : options.items()) lines.push_back("--" + key + " " + value.dump());
  const auto difference = comm::first_difference(communicator, comm::kWorld, lines);
  TORCH_CHECK(difference.empty(), "ranks were started with different options: ", difference);
}

nlohmann::json to_json(const TrainConfig& c) {
  // Everything that must agree between ranks (threads may differ); the K-FAC options by flag, as declared.
  nlohmann::json out = {{"model", to_string(c.model)}, {"dataset", to_string(c.dataset)}, {"data-dir", c.data_dir},
          {"optimizer", to_string(c.optimizer)},
          {"lr", c.lr}, {"momentum", c.momentum}, {"weight-decay", c.weight_decay}, {"batch-size", c.batch_size},
          {"global-batch-size", c.global_batch_size},
          {"accumulation-steps", c.accumulation_steps},
          {"epochs", c.epochs}, {"max-steps", c.max_steps}, {"lr-schedule", to_string(c.lr_schedule)},
          {"warmup-epochs", c.warmup_epochs}, {"seed", c.seed}, {"kfac", c.kfac}, {"kl-clip-follows-lr", c.kl_clip_follows_lr},
          {"eigen-adam", c.kfac_options.eigen_adam()}, {"graft", c.graft},
          {"checkpoint-dir", c.checkpoint_dir},
          {"checkpoint-every-epochs", c.checkpoint_every_epochs}, {"checkpoint-every-steps", c.checkpoint_every_steps},
          {"on-nan-loss", to_string(c.on_nan_loss)}, {"max-skipped-steps", c.max_skipped_steps},
          {"resume", c.resume}, {"allow-seed-change", c.allow_seed_change}, {"overwrite", c.overwrite},
          {"print-plan", c.print_plan}, {"kfac-rates", c.kfac_rates},
          {"device", to_string(c.device)}, {"backend", to_string(c.backend)}};
  for (const auto& info : option_table()) {
    if (info.flag.empty()) continue;
    // Numbers, switches and lists as JSON's own; names, "none" and schedules as text.
    out[info.flag.substr(2)] = std::visit(
        [&info](const auto& v) -> nlohmann::json {
          using V = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<V, bool> || std::is_same_v<V, int64_t> || std::is_same_v<V, double> ||
                        std::is_same_v<V, std::vector<std::string>> || std::is_same_v<V, std::vector<int64_t>>) {
            return v;
          } else {
            return option_text(info, v);
          }
        },
        c.kfac_options.get(info.name));
  }
  return out;
}

}  // namespace dkfac::train
