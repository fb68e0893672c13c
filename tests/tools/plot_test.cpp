// `dkfac plot`: reading metrics files (versions 1, 2 and 3, the committed ones too), labels, the gnuplot script
// and running gnuplot.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "tests/test_util.h"
#include "tools/plot/plot.h"

namespace dkfac::plot {
namespace {

namespace fs = std::filesystem;

/// A fresh directory named after the running test, removed at the end of the scope.
class Scratch {
 public:
  Scratch()
      : path_(fs::temp_directory_path() / ("dkfac-plot-test-" + std::to_string(::getpid()) + "-" +
                                           ::testing::UnitTest::GetInstance()->current_test_info()->name())) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~Scratch() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }
  /// Writes `text` to path()/name (directories created) and returns that path.
  std::string write(const std::string& name, const std::string& text) const {
    const fs::path file = path_ / name;
    fs::create_directories(file.parent_path());
    std::ofstream(file) << text;
    return file.string();
  }

 private:
  fs::path path_;
};

/// Sets TMPDIR for the scope (plot_metrics makes its temporary directory there), restoring it after.
class TmpDirEnv {
 public:
  explicit TmpDirEnv(const fs::path& dir) {
    if (const char* old = std::getenv("TMPDIR")) old_ = old;
    ::setenv("TMPDIR", dir.c_str(), 1);
  }
  ~TmpDirEnv() {
    if (old_) {
      ::setenv("TMPDIR", old_->c_str(), 1);
    } else {
      ::unsetenv("TMPDIR");
    }
  }

 private:
  std::optional<std::string> old_;
};

/// Plot errors are std::runtime_error (not c10::Error).
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& needles,
                  const std::vector<std::string>& absent = {}) {
  dkfac::testing::expect_error<std::runtime_error>(fn, needles, absent);
}

std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

bool is_png(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  char magic[8] = {};
  in.read(magic, 8);
  return in && std::string(magic + 1, 3) == "PNG" && fs::file_size(file) > 1000;
}

const std::string kRun =
    R"({"event":"run","format_version":3,"dkfac_version":"0.1.0","command_line":"dkfac train","options":{},)"
    R"("world_size":2,"seed":0})"
    "\n";

std::string step(int step, int epoch, double progress, double loss, double wall) {
  std::ostringstream s;
  s << R"({"event":"step","step":)" << step << R"(,"epoch":)" << epoch << R"(,"epoch_progress":)" << progress
    << R"(,"loss":)" << loss << R"(,"lr":0.05,"wall_time_s":)" << wall << "}\n";
  return s.str();
}

std::string epoch(int epoch, int step, double accuracy, double test_loss, double wall) {
  std::ostringstream s;
  s << R"({"event":"epoch","epoch":)" << epoch << R"(,"train_loss":0.9,"test_loss":)" << test_loss
    << R"(,"test_accuracy":)" << accuracy << R"(,"wall_time_s":)" << wall << R"(,"step":)" << step << "}\n";
  return s.str();
}

/// A run of 2 epochs of 4 steps, with the events plot ignores.
std::string two_epochs() {
  return kRun + step(2, 1, 0.5, 1.5, 1.0) + step(4, 1, 1.0, 1.0, 2.0) + epoch(1, 4, 0.5, 1.2, 2.5) +
         R"({"event":"skipped_step","step":5,"epoch":2})" "\n" + step(6, 2, 1.5, 0.8, 3.5) +
         R"({"event":"something_new","x":[1,2]})" "\n" + step(8, 2, 2.0, 0.6, 4.5) + epoch(2, 8, 0.75, 0.7, 5.0) +
         R"({"event":"summary","best_test_accuracy":0.75,"wall_time_s":5.1})" "\n";
}

TEST(PlotCurveTest, ReadsStepAndEpochEvents) {
  Scratch dir;
  std::ostringstream warnings;
  const auto curve = read_curve(dir.write("run_1.jsonl", two_epochs()), warnings);
  EXPECT_EQ(curve.label, "run_1");
  EXPECT_EQ(curve.epoch, (std::vector<double>{1, 2}));
  EXPECT_EQ(curve.wall_time_s, (std::vector<double>{2.5, 5.0}));
  EXPECT_EQ(curve.test_accuracy, (std::vector<double>{50, 75}));
  EXPECT_EQ(curve.test_loss, (std::vector<double>{1.2, 0.7}));
  EXPECT_EQ(curve.step, (std::vector<double>{2, 4, 6, 8}));
  EXPECT_EQ(curve.step_epoch, (std::vector<double>{0.5, 1.0, 1.5, 2.0}));
  EXPECT_EQ(curve.step_wall_time_s, (std::vector<double>{1, 2, 3.5, 4.5}));
  EXPECT_EQ(curve.train_loss, (std::vector<double>{1.5, 1.0, 0.8, 0.6}));
  EXPECT_EQ(warnings.str(), "");
}

/// kfac_time_s as format `format` writes it (tools/train/metrics.h): the per-phase object, with "total" in
/// format 3; in format 2 the object in step events and ranks[], the total alone in epoch and summary events.
std::string kfac_time(int format, bool step_or_rank, double total) {
  std::ostringstream s;
  if (format < 3 && !step_or_rank) {
    s << total;
    return s.str();
  }
  s << R"({"factors":)" << total / 2 << R"(,"second_order":)" << total / 4 << R"(,"precondition":)" << total / 8
    << R"(,"apply":)" << total / 16 << R"(,"communication":)" << total / 16;
  if (format >= 3) s << R"(,"total":)" << total;
  return s.str() + "}";
}

/// two_epochs()' run as a K-FAC job of 2 ranks writes it in `format` (2 or 3): kfac_time_s in every
/// step, epoch and summary event and in the summary's ranks[].
std::string two_epochs_with_kfac_time(int format) {
  auto with_time = [&](std::string event, bool step_or_rank, double total) {
    return event.insert(event.rfind('}'), R"(,"kfac_time_s":)" + kfac_time(format, step_or_rank, total));
  };
  std::string run = kRun;
  run.replace(run.find("\"format_version\":3"), 18, "\"format_version\":" + std::to_string(format));
  std::string ranks = R"(,"world_size":2,"ranks":[)";
  for (int r = 0; r < 2; ++r) {
    ranks += (r ? "," : "") + with_time(R"({"rank":)" + std::to_string(r) + R"(,"comm_bytes":{"factors":64},)"
                                        R"("kfac_memory_bytes":1024,"wall_time_s":5.0})", true, 0.75);
  }
  const std::string summary = R"({"event":"summary","best_test_accuracy":0.75,"wall_time_s":5.1)" + ranks + "]}\n";
  return run + with_time(step(2, 1, 0.5, 1.5, 1.0), true, 0.25) + with_time(step(4, 1, 1.0, 1.0, 2.0), true, 0.5) +
         with_time(epoch(1, 4, 0.5, 1.2, 2.5), false, 0.5) + with_time(step(6, 2, 1.5, 0.8, 3.5), true, 0.625) +
         with_time(step(8, 2, 2.0, 0.6, 4.5), true, 0.75) +
         with_time(epoch(2, 8, 0.75, 0.7, 5.0), false, 0.75) + with_time(summary, false, 0.75);
}

// kfac_time_s (K-FAC's phases, in every event of a K-FAC job) changes nothing plot draws.
TEST(PlotCurveTest, KfacTimeDoesNotChangeTheCurves) {
  Scratch dir;
  const auto v3 = two_epochs_with_kfac_time(3);
  ASSERT_NE(v3.find(R"("event":"epoch","epoch":1,"train_loss":0.9,"test_loss":1.2,"test_accuracy":0.5,)"
                    R"("wall_time_s":2.5,"step":4,"kfac_time_s":{"factors":0.25,)"),
            std::string::npos)
      << v3;
  const auto reference = read_curve(dir.write("plain.jsonl", two_epochs()));
  std::ostringstream warnings;
  const auto curve = read_curve(dir.write("v3.jsonl", v3), warnings);
  EXPECT_EQ(curve.epoch, reference.epoch);
  EXPECT_EQ(curve.wall_time_s, reference.wall_time_s);
  EXPECT_EQ(curve.test_accuracy, reference.test_accuracy);
  EXPECT_EQ(curve.test_loss, reference.test_loss);
  EXPECT_EQ(curve.step, reference.step);
  EXPECT_EQ(curve.step_epoch, (std::vector<double>{0.5, 1.0, 1.5, 2.0}));
  EXPECT_EQ(curve.step_wall_time_s, reference.step_wall_time_s);
  EXPECT_EQ(curve.train_loss, reference.train_loss);
  EXPECT_EQ(warnings.str(), "");
}

// Formats 1 (no run event) and 2 are refused at their first step or epoch event, naming the file, the line, the
// format and the converter (scripts/convert_metrics.py, tests/python/test_convert_metrics.py).
TEST(PlotCurveTest, OlderFormatsAreRefusedNamingTheConverter) {
  Scratch dir;
  const auto v2 = dir.write("v2.jsonl", two_epochs_with_kfac_time(2));
  expect_error([&] { read_curve(v2); }, {"metrics file '" + v2 + "' line 2", "metrics format 2; dkfac plot reads "
                                         "format 3", "python3 scripts/convert_metrics.py " + v2});
  const auto v1 = dir.write("v1.jsonl", R"({"event":"step","step":2,"epoch":0,"loss":1.5,"lr":0.1,"wall_time_s":1})"
                                        "\n");
  expect_error([&] { read_curve(v1); }, {"line 1", "metrics format 1 (no run event before it)",
                                         "scripts/convert_metrics.py"});
}

// The metrics files under docs/perf were format 1 (docs/perf/tta) and format 2 (docs/perf/torch-2.11/tta),
// converted once by scripts/convert_metrics.py: they read, with every step placed on the epoch axis, and plot
// together with a file dkfac train writes.
TEST(PlotCurveTest, CommittedConvertedFilesReadAndPlot) {
  const fs::path perf = fs::path(DKFAC_TEST_DATA_DIR) / ".." / ".." / ".." / "docs" / "perf";
  const std::vector<std::pair<std::string, int>> committed = {
      {(perf / "tta" / "kfac-inverse-e2.jsonl").string(), 1},
      {(perf / "tta" / "kfac-4p-dp-d0.1-e2.jsonl").string(), 1},
      {(perf / "torch-2.11" / "tta" / "kfac-inverse-e2.jsonl").string(), 2},
      {(perf / "torch-2.11" / "tta" / "kfac-4p-dp-d0.1-e2.jsonl").string(), 2}};
  std::vector<std::string> paths;
  for (const auto& [path, format] : committed) {
    ASSERT_TRUE(fs::exists(path)) << path;
    EXPECT_NE(read_text(path).find(R"("converted_from":)" + std::to_string(format)), std::string::npos) << path;
    std::ostringstream warnings;
    const auto curve = read_curve(path, warnings);
    EXPECT_EQ(curve.epoch, (std::vector<double>{1, 2})) << path;
    ASSERT_GT(curve.step.size(), 10u) << path;
    for (size_t k = 0; k < curve.step.size(); ++k) {
      EXPECT_TRUE(curve.step_epoch[k] > 0 && curve.step_epoch[k] <= 2.0) << path << " step " << curve.step[k];
      if (k > 0) EXPECT_GT(curve.step_epoch[k], curve.step_epoch[k - 1]) << path << " step " << curve.step[k];
    }
    // 468 steps per epoch (the epoch events' steps): format 1's conversion derives what format 2 wrote.
    EXPECT_NEAR(curve.step_epoch.back(), curve.step.back() / 468.0, 1e-12) << path;
    EXPECT_EQ(warnings.str(), "") << path;
    paths.push_back(path);
  }
  Scratch dir;
  paths.push_back(dir.write("v3.jsonl", two_epochs_with_kfac_time(3)));
  const auto out = dir.path() / "all.png";
  plot_metrics(paths, out.string());
  EXPECT_TRUE(is_png(out));
}

TEST(PlotCurveTest, MaxStepsRunWithoutEpochEventsHasItsSteps) {
  Scratch dir;
  const auto curve = read_curve(dir.write("m.jsonl", kRun + step(1, 1, 0.25, 2.0, 0.5) + step(2, 1, 0.5, 1.8, 1.0) +
                                                         R"({"event":"summary","wall_time_s":1.2})" "\n"));
  EXPECT_TRUE(curve.epoch.empty());
  EXPECT_EQ(curve.step_epoch, (std::vector<double>{0.25, 0.5}));
  EXPECT_EQ(curve.train_loss, (std::vector<double>{2.0, 1.8}));
}

TEST(PlotCurveTest, ResumedRunReplacesTheStepsItReplays) {
  Scratch dir;
  // The first run reached step 6 (mid epoch 2) and died; the resumed run continues from the checkpoint at step 4.
  const std::string text = kRun + step(2, 1, 0.5, 1.5, 1.0) + step(4, 1, 1.0, 1.0, 2.0) + epoch(1, 4, 0.5, 1.2, 2.5) +
                           step(6, 2, 1.5, 0.9, 3.5) + kRun + step(6, 2, 1.5, 0.8, 3.4) + step(8, 2, 2.0, 0.6, 4.4) +
                           epoch(2, 8, 0.75, 0.7, 5.0);
  const auto curve = read_curve(dir.write("resumed.jsonl", text));
  EXPECT_EQ(curve.step, (std::vector<double>{2, 4, 6, 8}));
  EXPECT_EQ(curve.train_loss, (std::vector<double>{1.5, 1.0, 0.8, 0.6}));
  EXPECT_EQ(curve.epoch, (std::vector<double>{1, 2}));
}

TEST(PlotCurveTest, TruncatedLastLineIsSkippedWithAWarning) {
  Scratch dir;
  const std::string text = kRun + step(2, 1, 0.5, 1.5, 1.0) + epoch(1, 2, 0.5, 1.2, 1.5) + R"({"event":"step","st)";
  for (const char* tail : {"", "\n", "\n\n  \n"}) {
    const auto path = dir.write("cut.jsonl", text + tail);
    std::ostringstream warnings;
    const auto curve = read_curve(path, warnings);
    EXPECT_EQ(curve.step, (std::vector<double>{2}));
    EXPECT_EQ(curve.epoch, (std::vector<double>{1}));
    EXPECT_NE(warnings.str().find("warning: metrics file '" + path + "' line 4 "), std::string::npos)
        << warnings.str();
  }
}

TEST(PlotCurveTest, BadLineBeforeTheLastIsAnErrorNamingFileAndLine) {
  Scratch dir;
  const auto path = dir.write("bad.jsonl", kRun + "{\"event\":\"step\",\n" + step(2, 1, 0.5, 1.5, 1.0));
  expect_error([&] { read_curve(path); }, {"metrics file '" + path + "' line 2", "not valid JSON"});
  const auto array = dir.write("array.jsonl", kRun + "[1,2]\n" + step(2, 1, 0.5, 1.5, 1.0));
  expect_error([&] { read_curve(array); }, {"metrics file '" + array + "' line 2", "not a JSON object"});
}

TEST(PlotCurveTest, MissingKeyErrorNamesFileLineAndKey) {
  Scratch dir;
  const auto no_test_loss = dir.write(
      "a.jsonl", kRun + step(2, 1, 0.5, 1.5, 1.0) +
                     R"({"event":"epoch","epoch":1,"train_loss":1,"test_accuracy":0.5,"wall_time_s":2,"step":2})" "\n" +
                     step(4, 2, 1.5, 1.0, 3.0));
  expect_error([&] { read_curve(no_test_loss); }, {"metrics file '" + no_test_loss + "' line 3", "'test_loss'"});
  const auto no_loss =
      dir.write("b.jsonl", kRun + R"({"event":"step","step":1,"epoch":1,"epoch_progress":0.5,"wall_time_s":1})" "\n");
  expect_error([&] { read_curve(no_loss); }, {"metrics file '" + no_loss + "' line 2", "step event has no 'loss'"});
  const auto no_progress =
      dir.write("c.jsonl", kRun + R"({"event":"step","step":1,"epoch":1,"loss":1,"wall_time_s":1})" "\n");
  expect_error([&] { read_curve(no_progress); }, {"line 2", "'epoch_progress'"});
  const auto text_value = dir.write(
      "d.jsonl", kRun + R"({"event":"step","step":1,"epoch":1,"epoch_progress":0.5,"loss":"x","wall_time_s":1})" "\n");
  expect_error([&] { read_curve(text_value); }, {"line 2", "'loss' is not a number"});
}

TEST(PlotLabelTest, DefaultLabelsAreStemsThenDirectoriesThenPaths) {
  EXPECT_EQ(default_labels({"runs/cnn_kfac.jsonl", "runs/cnn-sgd.jsonl"}),
            (std::vector<std::string>{"cnn_kfac", "cnn-sgd"}));
  EXPECT_EQ(default_labels({"runs/a/metrics.jsonl", "runs/b/metrics.jsonl", "runs/c/other.jsonl"}),
            (std::vector<std::string>{"a", "b", "other"}));
  EXPECT_EQ(default_labels({"x/a/metrics.jsonl", "y/a/metrics.jsonl"}),
            (std::vector<std::string>{"x/a/metrics.jsonl", "y/a/metrics.jsonl"}));
}

TEST(PlotLabelTest, LabelCountMismatchNamesBothCounts) {
  Scratch dir;
  const auto a = dir.write("a.jsonl", two_epochs()), b = dir.write("b.jsonl", two_epochs());
  PlotOptions options;
  options.labels = {"only one"};
  expect_error([&] { plot_metrics({a, b}, (dir.path() / "out.png").string(), options); },
               {"--label was given 1 times for 2 metrics files"});
}

TEST(PlotScriptTest, LabelsArePrintedLiterally) {
  Curve c;
  c.label = "it's_a `run` @x";
  c.epoch = {1};
  c.wall_time_s = {1};
  c.test_accuracy = {50};
  c.test_loss = {1};
  const auto script = gnuplot_script({c}, "/tmp/d", "/tmp/o.png");
  EXPECT_NE(script.find("noenhanced"), std::string::npos);
  EXPECT_NE(script.find("title 'it''s_a `run` @x'"), std::string::npos) << script;
  c.label = "two\nlines";
  expect_error([&] { gnuplot_script({c}, "/tmp/d", "/tmp/o.png"); }, {"control character"});
}

TEST(PlotScriptTest, SixPanelsWithIntegerEpochTicks) {
  Curve c;
  c.label = "r";
  c.epoch = {1, 2, 3};
  c.wall_time_s = {1, 2, 3};
  c.test_accuracy = {50, 60, 70};
  c.test_loss = {1, 0.9, 0.8};
  c.step = {1, 2};
  c.step_epoch = {0.5, 1.5};
  c.step_wall_time_s = {0.5, 1.5};
  c.train_loss = {2, 1};
  auto script = gnuplot_script({c}, "/tmp/d", "/tmp/o.png");
  size_t plots = 0;
  for (size_t at = script.find("\nplot "); at != std::string::npos; at = script.find("\nplot ", at + 1)) ++plots;
  EXPECT_EQ(plots, 6u) << script;
  EXPECT_NE(script.find("set multiplot layout 3,2"), std::string::npos);
  EXPECT_NE(script.find("'/tmp/d/run0-steps.dat' using 1:3"), std::string::npos) << script;  // train loss / epoch
  EXPECT_NE(script.find("'/tmp/d/run0-steps.dat' using 2:3"), std::string::npos) << script;  // train loss / time
  EXPECT_NE(script.find("set xtics 1\nset format x '%g'"), std::string::npos) << script;
  c.epoch.push_back(200);
  for (auto* v : {&c.wall_time_s, &c.test_accuracy, &c.test_loss}) v->push_back(1);
  script = gnuplot_script({c}, "/tmp/d", "/tmp/o.png");
  EXPECT_NE(script.find("set xtics 20\n"), std::string::npos) << script;
}

TEST(PlotTest, StepOnlyRunPlotsToAPng) {
  Scratch dir;
  const auto m = dir.write("m.jsonl", kRun + step(1, 1, 0.25, 2.0, 0.5) + step(2, 1, 0.5, 1.8, 1.0));
  const auto out = dir.path() / "out.png";
  plot_metrics({m}, out.string());
  EXPECT_TRUE(is_png(out));
}

TEST(PlotTest, TwoRunsWithLabelsPlot) {
  Scratch dir;
  const auto a = dir.write("a/metrics.jsonl", two_epochs());
  const auto b = dir.write("b/metrics.jsonl", kRun + step(1, 1, 0.25, 2.0, 0.5));
  PlotOptions options;
  options.labels = {"kfac_run", "sgd"};
  plot_metrics({a, b}, (dir.path() / "curves.png").string(), options);
  EXPECT_TRUE(is_png(dir.path() / "curves.png"));
}

TEST(PlotTest, MissingOutputDirectoryIsNamed) {
  Scratch dir;
  const auto m = dir.write("m.jsonl", two_epochs());
  const auto missing = dir.path() / "no-such-dir";
  expect_error([&] { plot_metrics({m}, (missing / "out.png").string()); },
               {"output directory '" + missing.string() + "'", "does not exist"}, {"gnuplot"});
}

TEST(PlotTest, MissingOrFailingGnuplotIsReported) {
  Scratch dir;
  const auto m = dir.write("m.jsonl", two_epochs());
  PlotOptions options;
  options.gnuplot = "dkfac-no-such-gnuplot";
  expect_error([&] { plot_metrics({m}, (dir.path() / "out.png").string(), options); },
               {"'dkfac-no-such-gnuplot' was not found", "gnuplot-nox"});
  options.gnuplot = "false";
  expect_error([&] { plot_metrics({m}, (dir.path() / "out.png").string(), options); }, {"'false' failed (exit 1)"},
               {"installed"});
  EXPECT_FALSE(fs::exists(dir.path() / "out.png"));
}

TEST(PlotTest, QuotesInTheOutputAndTemporaryPathsWriteExactlyThatPng) {
  Scratch dir;
  const auto m = dir.write("in/m.jsonl", two_epochs());
  const auto out_dir = dir.path() / "out";
  const auto tmp = dir.path() / "tmp it's `touch x` \"q\" \\ @m";
  fs::create_directories(out_dir);
  fs::create_directories(tmp);
  TmpDirEnv env(tmp);
  plot_metrics({m}, (out_dir / "it's.png").string());
  EXPECT_EQ(entries(out_dir), (std::vector<std::string>{"it's.png"}));
  EXPECT_TRUE(is_png(out_dir / "it's.png"));
  EXPECT_TRUE(entries(tmp).empty());
}

TEST(PlotTest, NoTemporaryDirectoryIsLeftBehind) {
  Scratch dir;
  const auto good = dir.write("good.jsonl", two_epochs());
  const auto bad = dir.write("bad.jsonl", "{\n" + two_epochs());
  const auto tmp = dir.path() / "tmp";
  fs::create_directories(tmp);
  TmpDirEnv env(tmp);
  const auto out = (dir.path() / "out.png").string();
  PlotOptions missing, failing;
  missing.gnuplot = "dkfac-no-such-gnuplot";
  failing.gnuplot = "false";
  EXPECT_THROW(plot_metrics({good}, out, missing), std::runtime_error);
  EXPECT_EQ(entries(tmp), std::vector<std::string>{});
  EXPECT_THROW(plot_metrics({good}, out, failing), std::runtime_error);
  EXPECT_EQ(entries(tmp), std::vector<std::string>{});
  EXPECT_THROW(plot_metrics({good, bad}, out), std::runtime_error);
  EXPECT_EQ(entries(tmp), std::vector<std::string>{});
  plot_metrics({good}, out);
  EXPECT_EQ(entries(tmp), std::vector<std::string>{});
  EXPECT_TRUE(is_png(out));
}

}  // namespace
}  // namespace dkfac::plot
