// What a `dkfac train` job leaves behind and finds again: the metrics writer (checked writes, lock, the run
// event and epoch numbering, format 3's kfac_time_s) and the checkpoint directory's rules (lock, no silent replacement,
// .prev fallback, another world size, a finished run).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "tests/test_util.h"
#include "tools/plot/plot.h"
#include "tools/train/checkpoint.h"
#include "tools/train/checkpointer.h"
#include "tools/train/metrics.h"
#include "tools/train/trainer.h"

namespace dkfac::train {
namespace {

namespace fs = std::filesystem;
using dkfac::testing::expect_error;

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::vector<nlohmann::json> read_events(const fs::path& path) {
  std::vector<nlohmann::json> events;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) events.push_back(nlohmann::json::parse(line));
  return events;
}

// Runs `fn`, which must throw T (not c10::Error only), and returns the message.
template <typename T>
std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const T& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

class RunStateTest : public ::testing::Test {
 protected:
  TrainConfig config() const {
    TrainConfig c;
    c.model = train::Model::kMlp;
    c.dataset = train::Dataset::kSynthetic;
    c.batch_size = 256;
    c.epochs = 1;
    c.threads = 1;
    c.kfac_options.damping(0.1);
    c.log_every = 4;
    return c;
  }
  dkfac::testing::ScratchDir scratch_{"dkfac-run-state-test"};
  const fs::path& dir_ = scratch_.path();
};

TEST_F(RunStateTest, MetricsWriteErrorsStopTheJob) {
  // /dev/full: open and lock succeed, every write fails with ENOSPC, as on a full disk.
  {
    MetricsWriter full("/dev/full", MetricsWriter::Existing::kRefuse);
    expect_error([&] { full.write({{"event", "x"}}); },
                 {"writing metrics file '/dev/full' failed: No space left on device"});
  }

  // A training job on it ends with that error, and the checkpoint it wrote stays loadable.
  auto c = config();
  c.metrics = "/dev/full";
  c.checkpoint_dir = (dir_ / "ck").string();
  expect_error([&] { Trainer(c).run(); }, {"No space left on device"});
  c.metrics.clear();
  c.checkpoint_dir = (dir_ / "ck2").string();
  c.max_steps = 3;
  Trainer(c).run();
  c.metrics = "/dev/full";
  c.max_steps = 6;
  c.resume = true;
  expect_error([&] { Trainer(c).run(); }, {"No space left on device"});
  EXPECT_NO_THROW(load_verified((dir_ / "ck2" / "checkpoint.pt").string()));
}

TEST_F(RunStateTest, MetricsFileIsLockedAndNeverReplacedSilently) {
  const auto path = (dir_ / "sub" / "m.jsonl").string();
  {
    MetricsWriter first(path, MetricsWriter::Existing::kRefuse);
    first.write({{"event", "a"}});
    expect_error([&] { MetricsWriter second(path, MetricsWriter::Existing::kAppend); },
                 {"metrics file '" + path + "' is in use by another dkfac job"});
  }
  expect_error([&] { MetricsWriter again(path, MetricsWriter::Existing::kRefuse); },
               {"already holds 14 bytes of events; pass --resume", "--overwrite"});
  EXPECT_EQ(read_text(path), "{\"event\":\"a\"}\n") << "the refused open changed the file";

  // A line cut by a killed job: the appended event starts on its own line.
  std::ofstream(path, std::ios::app) << "{\"event\":\"st";
  {
    MetricsWriter resumed(path, MetricsWriter::Existing::kAppend);
    resumed.write({{"event", "b"}});
  }
  EXPECT_EQ(read_text(path), "{\"event\":\"a\"}\n{\"event\":\"st\n{\"event\":\"b\"}\n");
  {
    MetricsWriter replaced(path, MetricsWriter::Existing::kReplace);
    replaced.write({{"event", "c"}});
  }
  EXPECT_EQ(read_text(path), "{\"event\":\"c\"}\n");
}

TEST_F(RunStateTest, RunEventFirstAndOneEpochNumbering) {
  auto c = config();
  c.metrics = (dir_ / "m.jsonl").string();
  c.command_line = "dkfac train --model mlp";
  c.seed = 7;
  Trainer(c).run();
  const auto events = read_events(c.metrics);
  ASSERT_GE(events.size(), 3u);
  const auto& run = events.front();
  EXPECT_EQ(run.at("event"), "run");
  EXPECT_EQ(run.at("format_version"), kMetricsFormatVersion);
  EXPECT_EQ(run.at("command_line"), "dkfac train --model mlp");
  EXPECT_EQ(run.at("world_size"), 1);
  EXPECT_EQ(run.at("seed"), 7);
  EXPECT_EQ(run.at("options").at("batch-size"), 256);
  EXPECT_EQ(run.at("options").at("damping"), 0.1);
  for (const char* key : {"dkfac_version", "threads", "machine", "started_utc"}) EXPECT_TRUE(run.contains(key)) << key;
  EXPECT_FALSE(run.contains("resumed_at_step"));
  // 8192 examples / 256 = 32 steps in epoch 1, logged every 4: epoch 1 everywhere, progress k/8.
  int steps = 0;
  for (const auto& e : events) {
    if (e.at("event") == "step") {
      ++steps;
      EXPECT_EQ(e.at("epoch"), 1);
      EXPECT_DOUBLE_EQ(e.at("epoch_progress").get<double>(), e.at("step").get<double>() / 32.0);
    }
    if (e.at("event") == "epoch") EXPECT_EQ(e.at("epoch"), 1);
  }
  EXPECT_EQ(steps, 8);
}

// Format 3: kfac_time_s is one object in step, epoch and summary events, every K-FAC phase and their total.
void expect_kfac_time_shape(const nlohmann::json& event) {
  ASSERT_TRUE(event.contains("kfac_time_s")) << event.dump();
  const auto& t = event.at("kfac_time_s");
  ASSERT_TRUE(t.is_object()) << event.dump();
  std::vector<std::string> keys;
  for (const auto& [key, value] : t.items()) {
    keys.push_back(key);
    EXPECT_TRUE(value.is_number() && value.get<double>() >= 0.0) << key << " in " << event.dump();
  }
  EXPECT_EQ(keys, (std::vector<std::string>{"apply", "communication", "factors", "precondition", "second_order",
                                            "total"}))
      << event.dump();
  const double sum = t.value("factors", 0.0) + t.value("second_order", 0.0) + t.value("precondition", 0.0) +
                     t.value("apply", 0.0) + t.value("communication", 0.0);
  EXPECT_DOUBLE_EQ(t.value("total", -1.0), sum) << event.dump();
}

TEST_F(RunStateTest, KfacTimeHasOneShapeInStepEpochAndSummaryEvents) {
  auto c = config();
  c.metrics = (dir_ / "kfac.jsonl").string();
  const auto summary = Trainer(c).run();
  std::map<std::string, int> seen;
  double last_total = 0.0;
  for (const auto& e : read_events(c.metrics)) {
    const std::string kind = e.at("event");
    ++seen[kind];
    if (kind == "run") EXPECT_EQ(e.at("format_version"), 3);
    if (kind != "step" && kind != "epoch" && kind != "summary") continue;
    expect_kfac_time_shape(e);
    const double total = e.at("kfac_time_s").value("total", -1.0);
    EXPECT_GE(total, last_total) << kind << ": the times are totals since the run started";
    last_total = total;
    if (kind == "summary") EXPECT_EQ(total, summary.kfac_seconds);
  }
  EXPECT_EQ(seen, (std::map<std::string, int>{{"run", 1}, {"step", 8}, {"epoch", 1}, {"summary", 1}}));
  EXPECT_GT(last_total, 0.0);
  // dkfac plot reads it: 8 steps of epoch 1, one epoch point.
  const auto curve = plot::read_curve(c.metrics);
  EXPECT_EQ(curve.epoch, (std::vector<double>{1}));
  ASSERT_EQ(curve.step.size(), 8u);
  EXPECT_DOUBLE_EQ(curve.step_epoch.back(), 1.0);

  // Without K-FAC, step and epoch events have none and the summary's phases are all 0.
  c.kfac = false;
  c.metrics = (dir_ / "sgd.jsonl").string();
  Trainer(c).run();
  seen.clear();
  for (const auto& e : read_events(c.metrics)) {
    ++seen[e.at("event").get<std::string>()];
    if (e.at("event") == "summary") {
      expect_kfac_time_shape(e);
      for (const auto& [key, value] : e.at("kfac_time_s").items()) EXPECT_EQ(value.get<double>(), 0.0) << key;
    } else {
      EXPECT_FALSE(e.contains("kfac_time_s")) << e.dump();
    }
  }
  EXPECT_EQ(seen, (std::map<std::string, int>{{"run", 1}, {"step", 8}, {"epoch", 1}, {"summary", 1}}));
}

TEST_F(RunStateTest, FreshRunRefusesExistingCheckpointsUnlessOverwrite) {
  auto c = config();
  c.checkpoint_dir = dir_.string();
  c.max_steps = 2;
  Trainer(c).run();
  const auto before = read_text(dir_ / "checkpoint.pt");
  EXPECT_NE(message_of<JobError>([&] { Trainer(c).run(); })
                .find("already holds checkpoints (checkpoint.pt); pass --resume to continue that run, --overwrite"),
            std::string::npos);
  EXPECT_EQ(read_text(dir_ / "checkpoint.pt"), before);

  c.overwrite = true;
  c.max_steps = 1;
  ::testing::internal::CaptureStdout();
  Trainer(c).run();
  const auto log = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(log.find("--overwrite: removed 1 checkpoint file(s) of an earlier run"), std::string::npos) << log;
  EXPECT_FALSE(fs::exists(dir_ / "checkpoint.pt.prev")) << "a .prev of the old run survived --overwrite";
  auto archive = load_verified((dir_ / "checkpoint.pt").string());
  c10::IValue step;
  archive.read("global_step", step);
  EXPECT_EQ(step.toInt(), 1);

  c.overwrite = false;
  c.resume = true;
  c.overwrite = true;
  expect_error([&] { c.validate(); }, {"--resume continues the run in --checkpoint-dir and --overwrite replaces it"});
}

TEST_F(RunStateTest, CheckpointDirectoryIsLocked) {
  Checkpointer holder(dir_.string(), 0, 1, nullptr);
  holder.open(false, false);
  auto c = config();
  c.checkpoint_dir = dir_.string();
  EXPECT_NE(message_of<JobError>([&] { Trainer(c).run(); })
                .find("--checkpoint-dir '" + dir_.string() + "' (rank 0) is in use by another dkfac job (pid "),
            std::string::npos);
}

TEST_F(RunStateTest, DamagedNewestFallsBackToPrevSayingSo) {
  auto c = config();
  c.checkpoint_dir = dir_.string();
  c.checkpoint_every_steps = 2;
  c.max_steps = 4;  // checkpoints at steps 2 (then .prev) and 4
  Trainer(c).run();
  c.max_steps = 6;
  c.checkpoint_every_steps = 0;
  c.resume = true;
  c.checkpoint_dir = (dir_ / "reference").string();
  fs::create_directories(c.checkpoint_dir);
  fs::copy_file(dir_ / "checkpoint.pt.prev", dir_ / "reference" / "checkpoint.pt");
  const auto from_step_2 = Trainer(c).run().step_losses;  // steps 3..6

  auto bytes = read_text(dir_ / "checkpoint.pt");
  bytes[bytes.size() / 2] ^= 0x20;
  std::ofstream(dir_ / "checkpoint.pt", std::ios::binary | std::ios::trunc) << bytes;
  c.checkpoint_dir = dir_.string();
  ::testing::internal::CaptureStderr();
  const auto resumed = Trainer(c).run().step_losses;
  const auto warning = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warning.find("checksum mismatch"), std::string::npos) << warning;
  EXPECT_NE(warning.find("resuming from " + c.checkpoint_dir + "/checkpoint.pt.prev (step 2)"), std::string::npos)
      << warning;
  EXPECT_EQ(resumed, from_step_2);

  // Both damaged: refused, naming both defects.
  std::ofstream(dir_ / "checkpoint.pt", std::ios::binary | std::ios::trunc) << "junk";
  std::ofstream(dir_ / "checkpoint.pt.prev", std::ios::binary | std::ios::trunc) << "junk";
  expect_error([&] { Trainer(c).run(); },
               {"no checkpoint of rank 0 in '" + c.checkpoint_dir + "' can be resumed", "checkpoint.pt' is not",
                "checkpoint.pt.prev' is not"});
}

TEST_F(RunStateTest, AnotherWorldSizeResumesFromRankZerosFile) {
  // Checkpoints of a 2-rank job: a job of another number of ranks reads rank 0's newest that verifies
  // (every rank's file holds the whole state), naming the defects of those passed over.
  auto write = [&](const std::string& name, int64_t step) {
    save_atomically((dir_ / name).string(),
                    [&](torch::serialize::OutputArchive& archive) { archive.write("global_step", c10::IValue(step)); });
  };
  write("checkpoint-rank0.pt", 8);
  write("checkpoint-rank0.pt.prev", 4);
  write("checkpoint-rank1.pt", 8);
  Checkpointer one_rank(dir_.string(), 0, 1, nullptr);
  one_rank.open(true, false);
  auto found = one_rank.find();
  ASSERT_TRUE(found.has_value());
  EXPECT_TRUE(found->other_world);
  EXPECT_EQ(found->path, (dir_ / "checkpoint-rank0.pt").string());
  EXPECT_EQ(found->note, "");
  std::ofstream(dir_ / "checkpoint-rank0.pt", std::ios::trunc) << "x";
  found = one_rank.find();
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->path, (dir_ / "checkpoint-rank0.pt.prev").string());
  EXPECT_NE(found->note.find("is not a dkfac checkpoint (no DKFACCKP header)"), std::string::npos) << found->note;
  std::ofstream(dir_ / "checkpoint-rank0.pt.prev", std::ios::trunc) << "x";
  expect_error([&] { one_rank.find(); }, {"holds the checkpoints of a 2-rank job, but no rank 0 checkpoint there can "
                                          "be resumed: ", "checkpoint-rank0.pt' is not a dkfac checkpoint",
                                          "checkpoint-rank0.pt.prev' is not a dkfac checkpoint"});
  // Once this job has written its own file, the other job's go, and a 4-rank job reads this one's.
  write("checkpoint.pt", 12);
  EXPECT_EQ(one_rank.remove_other_worlds(), 3);
  EXPECT_TRUE(fs::exists(dir_ / "checkpoint.pt"));
  EXPECT_FALSE(fs::exists(dir_ / "checkpoint-rank1.pt"));
  Checkpointer rank3_of_4(dir_.string(), 3, 4, nullptr);
  rank3_of_4.open(true, false);
  found = rank3_of_4.find();
  ASSERT_TRUE(found.has_value());
  EXPECT_TRUE(found->other_world);
  EXPECT_EQ(found->path, (dir_ / "checkpoint.pt").string());
  EXPECT_EQ(rank3_of_4.remove_other_worlds(), 1);
  // An empty directory is a first run.
  EXPECT_FALSE(rank3_of_4.find().has_value());
}

TEST_F(RunStateTest, GlobalBatchSizeSplitsOverTheRanksOrIsRefused) {
  // One process: the whole global batch on this rank; a job's resume line says nothing of other ranks.
  auto c = config();
  c.global_batch_size = 128;
  c.max_steps = 2;
  c.checkpoint_dir = (dir_ / "ck").string();
  EXPECT_EQ(Trainer(c).run().steps, 2);
  c.accumulation_steps = 3;
  c.batch_size = 3;  // ignored beside --global-batch-size, but checked against --accumulation-steps
  expect_error<JobError>([&] { Trainer(c).run(); },
               {"--global-batch-size 128 gives 128 examples per rank on 1 ranks, not a multiple of "
                "--accumulation-steps 3"});
}

TEST_F(RunStateTest, FinishedRunSaysAlreadyCompleteAndChangesNothing) {
  auto c = config();
  c.checkpoint_dir = (dir_ / "ck").string();
  c.metrics = (dir_ / "m.jsonl").string();
  c.max_steps = 5;
  const auto first = Trainer(c).run();
  const auto metrics = read_text(c.metrics);
  const auto checkpoint = read_text(dir_ / "ck" / "checkpoint.pt");
  c.resume = true;
  ::testing::internal::CaptureStdout();
  const auto again = Trainer(c).run();
  const auto log = ::testing::internal::GetCapturedStdout();
  EXPECT_TRUE(again.already_complete);
  EXPECT_EQ(again.steps, 5);
  EXPECT_EQ(again.parameters_crc32, first.parameters_crc32);
  EXPECT_NE(log.find("is already complete (step 5 of --max-steps 5, in epoch 1); nothing to do"), std::string::npos)
      << log;
  EXPECT_EQ(read_text(c.metrics), metrics);
  EXPECT_EQ(read_text(dir_ / "ck" / "checkpoint.pt"), checkpoint);

  // Raising --max-steps continues, with a run event that says where it resumed.
  c.max_steps = 7;
  EXPECT_FALSE(Trainer(c).run().already_complete);
  const auto events = read_events(c.metrics);
  int runs = 0;
  for (const auto& e : events) {
    if (e.at("event") == "run") ++runs;
  }
  EXPECT_EQ(runs, 2);
  bool found = false;
  for (const auto& e : events) found = found || (e.at("event") == "run" && e.value("resumed_at_step", -1) == 5);
  EXPECT_TRUE(found);
}

}  // namespace
}  // namespace dkfac::train
