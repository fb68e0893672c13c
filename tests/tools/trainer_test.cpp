// The training loop of `dkfac train`: determinism, exact resume, checkpoint safety, option errors.
#include <gtest/gtest.h>

#include <functional>
#include <limits>

#include <signal.h>
#include <sys/resource.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dkfac/device.h"
#include "tests/test_util.h"
#include "tools/data/datasets.h"
#include "tools/models/models.h"
#include "tools/plot/plot.h"
#include "tools/train/trainer.h"

namespace dkfac::train {
namespace {

namespace fs = std::filesystem;
using dkfac::testing::expect_error;

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class TrainerTest : public ::testing::Test {
 protected:

  TrainConfig config() const {
    TrainConfig c;
    c.model = Model::kMlp;
    c.dataset = Dataset::kSynthetic;
    c.batch_size = 64;
    c.epochs = 1;
    c.threads = 1;
    c.lr = 0.05;
    c.kfac_options.damping(0.1).factor_update_steps(3).inv_update_steps(7);
    c.log_every = 1000;
    return c;
  }
  dkfac::testing::ScratchDir scratch_{"dkfac-trainer-test"};
  const fs::path& dir_ = scratch_.path();
};

TEST_F(TrainerTest, SameSeedSameLosses) {
  auto c = config();
  c.max_steps = 12;
  auto a = Trainer(c).run();
  auto b = Trainer(c).run();
  ASSERT_EQ(a.step_losses.size(), 12u);
  EXPECT_EQ(a.step_losses, b.step_losses);
  c.seed = 1;
  auto other = Trainer(c).run();
  EXPECT_NE(other.step_losses, a.step_losses);
}

TEST_F(TrainerTest, SkipLayersLeavesMatchingLayersOutOfKfac) {
  auto c = config();
  c.max_steps = 6;
  const auto full = Trainer(c).run().step_losses;
  c.kfac_options.skip_layers({"^1$"});  // the mlp's first Linear (Sequential index 1)
  const auto skipped = Trainer(c).run().step_losses;
  c.kfac = false;
  const auto sgd = Trainer(c).run().step_losses;
  ASSERT_EQ(skipped.size(), 6u);
  EXPECT_EQ(skipped.front(), full.front()) << "same model before the first update";
  EXPECT_NE(skipped.back(), full.back()) << "layer 1 was still preconditioned";
  EXPECT_NE(skipped.back(), sgd.back()) << "layers 3 and 5 were not preconditioned";
  c.kfac = true;
  c.kfac_options.skip_layers({"Linear"});
  expect_error([&] { Trainer(c).run(); }, {"found no Linear, Conv2d or Embedding layer to precondition", "after skip_layers"});
  c.kfac_options.skip_layers({"^1$", "("});
  expect_error([&] { Trainer(c).run(); }, {"skip_layers pattern '(' is not a valid regular expression"});
}

TEST_F(TrainerTest, ResumeContinuesTheSameTrajectory) {
  for (bool kfac : {true, false}) {
    auto c = config();
    c.kfac = kfac;
    c.optimizer = kfac ? Optimizer::kSgd : Optimizer::kAdam;
    c.max_steps = 20;
    const auto straight = Trainer(c).run().step_losses;

    c.checkpoint_dir = (dir_ / (kfac ? "kfac" : "adam")).string();
    c.max_steps = 10;
    const auto first = Trainer(c).run().step_losses;
    ASSERT_TRUE(fs::exists(c.checkpoint_dir + "/checkpoint.pt"));
    c.max_steps = 20;
    c.resume = true;
    const auto second = Trainer(c).run().step_losses;
    ASSERT_EQ(first.size(), 10u);
    ASSERT_EQ(second.size(), 10u);
    for (size_t i = 0; i < 10; ++i) {
      EXPECT_EQ(first[i], straight[i]) << "step " << i;
      EXPECT_EQ(second[i], straight[10 + i]) << "step " << 10 + i << (kfac ? " (K-FAC)" : " (Adam)");
    }
  }
}

// --eigen-adam (AdamW in the K-FAC eigenbasis) and --graft step through dkfac::optim::KFAC: each run differs from
// plain AdamW (K-FAC acted) and lowers the loss, and resumes on the same trajectory (Adam's moments in the eigenbasis
// are K-FAC state, saved with it).
TEST_F(TrainerTest, EigenAdamAndGraftingTrainAndResumeOnTheSameTrajectory) {
  auto base = config();
  base.optimizer = Optimizer::kAdamW;
  base.lr = 3e-3;
  base.weight_decay = 0.01;
  base.max_steps = 16;
  auto plain = base;
  plain.kfac = false;
  const auto adamw = Trainer(plain).run().step_losses;
  for (const bool eigen_adam : {true, false}) {
    auto c = base;
    if (eigen_adam) {
      c.kfac_options.eigen_adam(true).kl_clip(0).compute_method(ComputeMethod::kEigen);
    } else {
      c.graft = true;
    }
    const std::string what = eigen_adam ? "eigen_adam" : "graft";
    const auto straight = Trainer(c).run().step_losses;
    ASSERT_EQ(straight.size(), 16u);
    EXPECT_EQ(straight.front(), adamw.front()) << what << ": same model before the first step";
    EXPECT_NE(straight.back(), adamw.back()) << what << ": K-FAC did not act";
    EXPECT_LT(straight.back(), straight.front()) << what;

    c.checkpoint_dir = (dir_ / what).string();
    c.max_steps = 8;
    const auto first = Trainer(c).run().step_losses;
    c.max_steps = 16;
    c.resume = true;
    const auto second = Trainer(c).run().step_losses;
    ASSERT_EQ(second.size(), 8u);
    for (size_t i = 0; i < 8; ++i) {
      EXPECT_EQ(first[i], straight[i]) << what << ": step " << i;
      EXPECT_EQ(second[i], straight[8 + i]) << what << ": step " << 8 + i;
    }
  }
}

// A resume names the options that changed since the checkpoint; a changed --seed (each epoch's order of
// examples) is refused before anything is loaded, unless --allow-seed-change.
TEST_F(TrainerTest, ResumeNamesChangedOptionsAndRefusesANewSeed) {
  auto c = config();
  c.checkpoint_dir = dir_.string();
  c.max_steps = 4;
  Trainer(c).run();
  const auto saved = read_bytes(dir_ / "checkpoint.pt");
  c.resume = true;
  c.max_steps = 6;
  c.seed = 3;
  expect_error([&] { Trainer(c).run(); },
               {"was written with --seed 0, this run has --seed 3", "pass --seed 0, or --allow-seed-change"});
  EXPECT_EQ(read_bytes(dir_ / "checkpoint.pt"), saved) << "a refused resume must leave the checkpoint as it was";
  c.seed = 0;
  c.lr = 0.02;
  ::testing::internal::CaptureStdout();
  Trainer(c).run();
  const auto out = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("\noptions changed since the checkpoint: --lr 0.05 -> 0.02, --max-steps 4 -> 6"),
            std::string::npos) << out;
  c.seed = 3;
  c.allow_seed_change = true;
  c.max_steps = 8;
  ::testing::internal::CaptureStdout();
  Trainer(c).run();
  EXPECT_NE(::testing::internal::GetCapturedStdout().find("--seed 0 -> 3"), std::string::npos);
}

TEST_F(TrainerTest, CheckpointOfAnotherModelIsRefusedAndKept) {
  auto c = config();
  c.checkpoint_dir = dir_.string();
  c.max_steps = 2;
  Trainer(c).run();
  const auto path = dir_ / "checkpoint.pt";
  const auto size = fs::file_size(path);
  c.model = Model::kCnn;
  c.resume = true;
  expect_error([&] { Trainer(c).run(); }, {"written with model_name 'mlp', this run uses 'cnn'"});
  EXPECT_EQ(fs::file_size(path), size);

  // Another layout (strategy, world, placement) is refused the same way.
  c.model = Model::kMlp;
  c.kfac_options.strategy(Strategy::kSpd);
  expect_error([&] { Trainer(c).run(); }, {"was written with layout 'world 1, rank 0, strategy kaisa"});
  EXPECT_EQ(fs::file_size(path), size);

  // A foreign file is reported as such.
  std::ofstream(path, std::ios::binary | std::ios::trunc) << "not a checkpoint";
  c.kfac_options.strategy(Strategy::kKaisa);
  expect_error([&] { Trainer(c).run(); }, {"is not a dkfac checkpoint (no DKFACCKP header)"});
}


// Every defect of the envelope is named before the archive reader sees a byte of it.
TEST_F(TrainerTest, DamagedCheckpointsAreRefusedWithTheDefect) {
  const auto path = (dir_ / "state.pt").string();
  save_atomically(path, [](torch::serialize::OutputArchive& a) { a.write("x", torch::arange(64)); });
  const auto good = read_bytes(path);
  torch::Tensor x;
  parse_checkpoint(good, "good").read("x", x);
  EXPECT_TRUE(torch::equal(x, torch::arange(64)));

  auto expect = [](const std::string& bytes, const std::string& needle) {
    expect_error([&] { parse_checkpoint(bytes, "f.pt"); }, {needle});
  };
  auto flipped = good;
  flipped[good.size() / 2] ^= 0x10;
  expect(flipped, "checkpoint 'f.pt' is damaged: checksum mismatch");
  expect(good.substr(0, good.size() - 7), "checkpoint 'f.pt' is truncated: ");
  expect(good + "xyz", "checkpoint 'f.pt' has 3 bytes after its payload");
  expect(good.substr(0, 10), "'f.pt' is not a dkfac checkpoint (no DKFACCKP header)");
  expect("", "'f.pt' is not a dkfac checkpoint (no DKFACCKP header)");
  auto version = good;
  version[8] = 9;
  expect(version, "checkpoint 'f.pt' has envelope version 9, this build reads 1");
  // Found by fuzzing: an intact envelope around an archive that LibTorch's reader rejects with a
  // torch::jit::ErrorReport (not a c10::Error) must still end in a message, not std::terminate.
  expect_error([] { load_verified(DKFAC_TEST_DATA_DIR "/archive_type_error.ckpt"); },
               {"passed its checksum but its archive does not load"});
  expect_error([&] { load_verified((dir_ / "missing.pt").string()); }, {"cannot open checkpoint '"});
}

// A disk that fills up while the checkpoint is written (simulated with RLIMIT_FSIZE) leaves the previous
// checkpoint as it was and no temporary file.
TEST_F(TrainerTest, FullDiskKeepsThePreviousCheckpoint) {
  const auto path = (dir_ / "state.pt").string();
  save_atomically(path, [](torch::serialize::OutputArchive& a) { a.write("x", torch::ones({3})); });
  const auto before = read_bytes(path);
  struct rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  auto* previous_handler = ::signal(SIGXFSZ, SIG_IGN);  // write() then fails with EFBIG instead of killing us
  struct rlimit small = old;
  small.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string message;
  try {
    save_atomically(path, [](torch::serialize::OutputArchive& a) { a.write("x", torch::zeros({100000})); });
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, previous_handler);
  EXPECT_NE(message.find("could not write checkpoint '" + path + "' (the previous one, if any, is intact): writing"),
            std::string::npos)
      << message;
  EXPECT_EQ(read_bytes(path), before);
  for (const auto& entry : fs::directory_iterator(dir_)) {
    EXPECT_EQ(entry.path().filename(), "state.pt") << "temporary file left behind";
  }
}

// A diverging run stops before a non-finite loss reaches the weights, or skips such steps when asked.
TEST_F(TrainerTest, NonFiniteLossStopsOrIsSkipped) {
  auto c = config();
  c.kfac = false;
  c.lr = 1e12;
  c.lr_schedule = LrSchedule::kConstant;
  c.max_steps = 8;
  expect_error([&] { Trainer(c).run(); },
               {"training loss or gradient became non-finite", "the weights were not updated", "--on-nan-loss skip"});
  for (bool kfac : {false, true}) {
    c.kfac = kfac;
    c.on_nan_loss = NanPolicy::kSkip;
    const auto summary = Trainer(c).run();
    EXPECT_EQ(summary.steps, 8);
    EXPECT_GT(summary.skipped_steps, 0);
    EXPECT_EQ(summary.step_losses.size() + summary.skipped_steps, 8u);
    for (double loss : summary.step_losses) EXPECT_TRUE(std::isfinite(loss));
  }
  // A loss that never recovers: --max-skipped-steps dropped steps in a row end the run as failed (it used to
  // exit 0 with nearly every step dropped).
  c.kfac = false;
  c.max_steps = 40;
  c.max_skipped_steps = 3;
  try {
    Trainer(c).run();
    ADD_FAILURE() << "a run that never recovers must fail";
  } catch (const JobError& e) {  // every rank reaches it: rank 0 says it for the job
    const std::string message = e.what();
    for (const char* part : {"the loss or gradient was non-finite at 3 steps in a row", "--max-skipped-steps 3",
                             "the run is not recovering"}) {
      EXPECT_NE(message.find(part), std::string::npos) << message;
    }
  }
}

// Checkpoints every N steps resume mid-epoch onto the same trajectory.
TEST_F(TrainerTest, StepCheckpointsResumeMidEpoch) {
  auto c = config();
  c.max_steps = 14;
  const auto straight = Trainer(c).run().step_losses;
  c.checkpoint_dir = dir_.string();
  c.checkpoint_every_steps = 5;
  c.max_steps = 12;  // stops (and checkpoints) at 12; periodic checkpoints were written at 5 and 10
  ::testing::internal::CaptureStdout();
  Trainer(c).run();
  const auto log = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(log.find("(every 5 steps, in epoch 1, step 5)"), std::string::npos) << log;
  EXPECT_NE(log.find("(every 5 steps, in epoch 1, step 10)"), std::string::npos) << log;
  c.max_steps = 14;
  c.resume = true;
  const auto resumed = Trainer(c).run().step_losses;
  ASSERT_EQ(resumed.size(), 2u);
  EXPECT_EQ(resumed[0], straight[12]);
  EXPECT_EQ(resumed[1], straight[13]);
}

TEST_F(TrainerTest, AtomicSaveLeavesThePreviousFileOnFailure) {
  const auto path = (dir_ / "state.pt").string();
  save_atomically(path, [](torch::serialize::OutputArchive& a) { a.write("x", torch::ones({3})); });
  const auto before = fs::file_size(path);
  EXPECT_THROW(save_atomically(path,
                               [](torch::serialize::OutputArchive& a) {
                                 a.write("x", torch::zeros({100}));
                                 throw std::runtime_error("disk full");
                               }),
               c10::Error);
  EXPECT_EQ(fs::file_size(path), before);
  auto in = load_verified(path);
  torch::Tensor x;
  in.read("x", x);
  EXPECT_TRUE(torch::equal(x, torch::ones({3})));
  for (const auto& entry : fs::directory_iterator(dir_)) {
    EXPECT_EQ(entry.path().filename(), "state.pt") << "temporary file left behind";
  }
}

TEST_F(TrainerTest, MetricsAreJsonLinesWithStepEpochAndSummary) {
  auto c = config();
  c.metrics = (dir_ / "m.jsonl").string();
  c.log_every = 16;
  c.dataset = Dataset::kSynthetic;
  auto summary = Trainer(c).run();
  std::ifstream in(c.metrics);
  std::string line;
  std::map<std::string, int> counts;
  nlohmann::json last;
  while (std::getline(in, line)) {
    last = nlohmann::json::parse(line);
    counts[last.at("event").get<std::string>()]++;
    if (last["event"] == "step") {
      for (const char* key : {"step", "loss", "lr", "wall_time_s"}) EXPECT_TRUE(last.contains(key)) << key;
    }
    if (last["event"] == "epoch") {
      for (const char* key : {"epoch", "train_loss", "test_loss", "test_accuracy", "wall_time_s"}) {
        EXPECT_TRUE(last.contains(key)) << key;
      }
    }
  }
  EXPECT_EQ(counts["step"], 128 / 16);
  EXPECT_EQ(counts["epoch"], 1);
  EXPECT_EQ(last["event"], "summary");
  EXPECT_DOUBLE_EQ(last["best_test_accuracy"].get<double>(), summary.best_accuracy);
  EXPECT_GT(summary.best_accuracy, 0.2) << "synthetic labels are learnable";

  auto curve = plot::read_curve(c.metrics);
  EXPECT_EQ(curve.epoch.size(), 1u);
  EXPECT_EQ(curve.label, "m");
  ASSERT_EQ(curve.step.size(), 8u) << "the step events: the training-loss curve";
  EXPECT_DOUBLE_EQ(curve.step_epoch.back(), 1.0) << "the last step of epoch 1";
}

// --device auto on a machine without a GPU is the CPU run, bit for bit: losses, test loss, parameters.
TEST_F(TrainerTest, AutoWithoutAGpuTrainsExactlyAsTheCpu) {
  if (device::cuda_available()) GTEST_SKIP() << "a CUDA device is visible: auto means cuda here (tests/integration/gpu_*)";
  auto c = config();
  c.max_steps = 12;
  const auto cpu = Trainer(c).run();
  c.device = DeviceChoice::kAuto;
  Trainer automatic(c);
  EXPECT_EQ(automatic.device(), c10::Device(c10::kCPU));
  const auto chosen = automatic.run();
  ASSERT_EQ(cpu.step_losses.size(), 12u);
  EXPECT_EQ(chosen.step_losses, cpu.step_losses);
  EXPECT_EQ(chosen.final_test_loss, cpu.final_test_loss);
  EXPECT_EQ(chosen.parameters_crc32, cpu.parameters_crc32);
  EXPECT_FALSE(chosen.gpu_max_memory_allocated_bytes.has_value()) << "no GPU memory on the CPU";
}

// A checkpoint written by a --device cpu run resumes under --device auto on the same trajectory.
TEST_F(TrainerTest, CpuCheckpointResumesUnderAuto) {
  if (device::cuda_available()) GTEST_SKIP() << "a CUDA device is visible: tests/integration/gpu_backends_test.sh";
  auto c = config();
  c.max_steps = 16;
  const auto straight = Trainer(c).run();
  c.checkpoint_dir = (dir_ / "cpu").string();
  c.max_steps = 8;
  Trainer(c).run();
  c.device = DeviceChoice::kAuto;
  c.resume = true;
  c.max_steps = 16;
  const auto resumed = Trainer(c).run();
  ASSERT_EQ(resumed.step_losses.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(resumed.step_losses[i], straight.step_losses[8 + i]) << "step " << 9 + i;
  EXPECT_EQ(resumed.parameters_crc32, straight.parameters_crc32);
}

// A one-rank group (what `--device cuda --backend nccl|gloo` builds for a single process, here on the CPU over
// Gloo) trains as the single process does, bit for bit, with DDP's reducer averaging over one rank.
TEST_F(TrainerTest, OneRankGroupTrainsAsASingleProcess) {
  auto c = config();
  c.max_steps = 8;
  c.log_every = 4;
  const auto single = Trainer(c).run();
  c.metrics = (dir_ / "group.jsonl").string();
  auto group = comm::Communicator::connect_in_process(std::make_shared<comm::InProcessStore>(), 0, 1);
  const auto grouped = Trainer(c, group).run();
  EXPECT_EQ(grouped.step_losses, single.step_losses);
  EXPECT_EQ(grouped.parameters_crc32, single.parameters_crc32);
  std::ifstream in(c.metrics);
  std::string line, last;
  while (std::getline(in, line)) last = line;
  const auto summary = nlohmann::json::parse(last);
  ASSERT_EQ(summary.at("ranks").size(), 1u);
  EXPECT_GT(summary["ranks"][0]["comm_bytes"]["data_parallel"].get<int64_t>(), 0) << "the reducer ran";
}

// The run event names the device; GPU memory fields are absent on the CPU (tools/train/metrics.h).
TEST_F(TrainerTest, CpuMetricsNameTheDeviceAndCarryNoGpuMemory) {
  auto c = config();
  c.max_steps = 4;
  c.log_every = 2;
  c.metrics = (dir_ / "m.jsonl").string();
  Trainer(c).run();
  std::ifstream in(c.metrics);
  std::string line;
  int events = 0;
  while (std::getline(in, line)) {
    const auto event = nlohmann::json::parse(line);
    ++events;
    if (event["event"] == "run") {
      EXPECT_EQ(event.at("device"), "cpu");
      EXPECT_EQ(event.at("options").at("device"), "cpu");
      EXPECT_EQ(event.at("options").at("backend"), "auto");
      EXPECT_FALSE(event.contains("cuda_backend"));
    }
    for (const auto& [key, value] : event.items()) EXPECT_EQ(key.rfind("gpu_", 0), std::string::npos) << key;
  }
  EXPECT_EQ(events, 4) << "run, two steps, summary";
}

// The flags with a fixed set of choices are enums parsed at the command line: an unknown name is an error
// naming the flag and listing the choices, and to_string gives back the names the output has always carried.
TEST(TrainConfigTest, ChoicesParseTheirNamesAndNameFlagAndChoicesOtherwise) {
  auto expect = [](const std::function<void()>& parse, const std::string& needle) { expect_error(parse, {needle}); };
  expect([] { parse_choice<Model>("--model", "vgg"); },
         "--model must be one of mlp, cnn, resnet20, autoencoder, got 'vgg'");
  expect([] { parse_choice<Dataset>("--dataset", "imagenet"); },
         "--dataset must be one of fashion-mnist, mnist, cifar10, synthetic, got 'imagenet'");
  expect([] { parse_choice<Optimizer>("--optimizer", "lamb"); },
         "--optimizer must be one of sgd, adam, adamw, got 'lamb'");
  expect([] { parse_choice<LrSchedule>("--lr-schedule", "linear"); },
         "--lr-schedule must be one of constant, step, cosine, got 'linear'");
  expect([] { parse_choice<NanPolicy>("--on-nan-loss", "ignore"); },
         "--on-nan-loss must be one of stop, skip, got 'ignore'");
  expect([] { parse_choice<ComputeMethod>("--compute-method", "svd"); },
         "--compute-method must be one of eigen, inverse, got 'svd'");
  expect([] { parse_choice<Model>("--model", "CNN"); }, "got 'CNN'");  // names are case-sensitive, as before

  // Every name parses to a value that prints as that name.
  auto round_trips = [](auto tag) {
    using E = decltype(tag);
    for (const auto& [name, value] : choices<E>()) {
      EXPECT_EQ(parse_choice<E>("--flag", name), value) << name;
      EXPECT_EQ(to_string(value), name);
    }
  };
  round_trips(Model{});
  round_trips(Dataset{});
  round_trips(Optimizer{});
  round_trips(LrSchedule{});
  round_trips(NanPolicy{});
  round_trips(ComputeMethod{});

  // The model and dataset choices are the ones the models and datasets modules build.
  std::vector<std::string> models, datasets;
  for (const auto& choice : choices<Model>()) models.push_back(choice.first);
  for (const auto& choice : choices<Dataset>()) datasets.push_back(choice.first);
  EXPECT_EQ(models, models::model_names());
  EXPECT_EQ(datasets, data::dataset_names());

  // The options the ranks compare and the run event records carry the names.
  const auto json = to_json(TrainConfig());
  EXPECT_EQ(json["model"], "cnn");
  EXPECT_EQ(json["dataset"], "fashion-mnist");
  EXPECT_EQ(json["optimizer"], "sgd");
  EXPECT_EQ(json["lr-schedule"], "cosine");
  EXPECT_EQ(json["compute-method"], "inverse");
  EXPECT_EQ(json["factor-dtype"], "none");
  EXPECT_EQ(json["inv-dtype"], "none");
  EXPECT_EQ(json["on-nan-loss"], "stop");
  EXPECT_EQ(json["strategy"], "kaisa");
}

TEST(TrainConfigTest, GlobalBatchSplitsOverTheRanksOrNamesWhyNot) {
  TrainConfig c;
  c.batch_size = 32;
  EXPECT_EQ(c.batch_per_rank(4), 32) << "--batch-size is per rank without --global-batch-size";
  c.global_batch_size = 64;
  EXPECT_EQ(c.batch_per_rank(4), 16);
  EXPECT_EQ(c.batch_per_rank(1), 64);
  const auto message = [&](int world) {
    try {
      c.batch_per_rank(world);
    } catch (const JobError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message(3), "--global-batch-size 64 cannot be split over 3 ranks (64 is not a multiple of 3); pass a "
                        "multiple of the number of ranks");
  c.accumulation_steps = 3;
  EXPECT_EQ(message(2), "--global-batch-size 64 gives 32 examples per rank on 2 ranks, not a multiple of "
                        "--accumulation-steps 3");
}

TEST(TrainConfigTest, BadOptionsNameFlagAndValue) {
  auto expect = [](TrainConfig c, const std::string& needle) {
    expect_error([&] { c.validate(); }, {needle});
  };
  TrainConfig c;
  c.batch_size = 0;
  expect(c, "--batch-size must be >= 1, got 0");
  c = TrainConfig();
  c.max_steps = -5;
  expect(c, "--max-steps must be >= 0 (or -1: no limit), got -5");
  c = TrainConfig();
  c.batch_size = 64;
  c.accumulation_steps = 3;
  expect(c, "--batch-size 64 must be a multiple of --accumulation-steps 3");
  c = TrainConfig();
  c.resume = true;
  expect(c, "--resume needs --checkpoint-dir");
  // A metrics file where the checkpoints go (their atomic rename replaced it, their rotation moved it to .prev).
  for (const char* name : {"ck/checkpoint.pt", "ck/./checkpoint-rank1.pt.prev"}) {
    c = TrainConfig();
    c.checkpoint_dir = "ck";
    c.metrics = name;
    expect(c, "is in --checkpoint-dir under a checkpoint's name: the checkpoints would replace it");
  }
  c = TrainConfig();
  c.checkpoint_dir = "ck";
  c.metrics = "ck/metrics.jsonl";  // beside them: fine
  EXPECT_NO_THROW(c.validate());
  c = TrainConfig();
  c.kfac_options.strategy(Strategy::kDp).grad_worker_fraction(0.5);
  expect(c, "grad_worker_fraction applies to strategy kaisa only (dp places its own work), got 0.5");
  c = TrainConfig();
  c.eval_examples = -1;
  expect(c, "--eval-examples must be >= 0, got -1");
  c = TrainConfig();
  c.checkpoint_every_steps = -2;
  expect(c, "--checkpoint-every-steps must be >= 0, got -2");

  // Every numeric flag is range-checked under its own name, before the library's checks (which name
  // Options fields such as factor_decay) could see the value.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<std::pair<std::function<void(TrainConfig&)>, std::string>> numeric = {
      {[](TrainConfig& t) { t.lr = 0; }, "--lr must be > 0, got 0"},
      {[nan](TrainConfig& t) { t.lr = nan; }, "--lr must be > 0, got nan"},
      {[](TrainConfig& t) { t.momentum = 1; }, "--momentum must be in [0, 1), got 1"},
      {[](TrainConfig& t) { t.momentum = -0.5; }, "--momentum must be in [0, 1), got -0.5"},
      {[](TrainConfig& t) { t.weight_decay = -1e-4; }, "--weight-decay must be >= 0, got -0.0001"},
      {[inf](TrainConfig& t) { t.weight_decay = inf; }, "--weight-decay must be >= 0, got inf"},
      {[](TrainConfig& t) { t.accumulation_steps = 0; }, "--accumulation-steps must be >= 1, got 0"},
      {[](TrainConfig& t) { t.epochs = 0; }, "--epochs must be >= 1, got 0"},
      {[](TrainConfig& t) { t.warmup_epochs = -1; }, "--warmup-epochs must be >= 0, got -1"},
      {[](TrainConfig& t) { t.seed = -3; }, "--seed must be >= 0, got -3"},
      {[](TrainConfig& t) { t.threads = -1; }, "--threads must be in [0, 4096] (0: LibTorch's default), got -1"},
      {[](TrainConfig& t) { t.threads = 5000; }, "--threads must be in [0, 4096] (0: LibTorch's default), got 5000"},
      {[](TrainConfig& t) { t.checkpoint_every_epochs = 0; }, "--checkpoint-every-epochs must be >= 1, got 0"},
      {[](TrainConfig& t) { t.log_every = -1; }, "--log-every must be >= 0, got -1"},
  };
  for (const auto& [change, message] : numeric) {
    TrainConfig bad;
    change(bad);
    expect(bad, message);
  }
  // The edges that are allowed.
  c = TrainConfig();
  c.kfac_options.factor_decay(0).kl_clip(0).grad_worker_fraction(0);  // 0: 1/P
  c.momentum = 0;
  c.threads = 4096;
  EXPECT_NO_THROW(c.validate());
}

}  // namespace
}  // namespace dkfac::train
