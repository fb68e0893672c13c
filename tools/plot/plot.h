#pragma once

#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

/// `dkfac plot`: learning curves of several runs in one PNG, drawn by gnuplot.
///
/// Six panels, one line per input file (same colour in every panel): test accuracy, test loss and training
/// loss, each against epochs (left) and against wall time (right). Test accuracy and test loss come from
/// `"event":"epoch"` lines, the training loss from `"event":"step"` lines; a run stopped by `--max-steps`
/// before its first epoch ended has only the training-loss panels. A panel no input has data for says "no data".
///
/// Metrics format 3 (JSON Lines written by `dkfac train`, tools/train/metrics.h): every line is one JSON object;
/// events other than "step" and "epoch" ("run", "summary", "skipped_step", unknown ones) are ignored, and so
/// are the fields not named here. A step's epoch coordinate is its `epoch_progress` (epochs completed, a float;
/// null: unknown, and the step appears in the wall-time panel only). A file of an older format (a step or epoch
/// event before a run event of format 3) is refused, naming the line and `scripts/convert_metrics.py`, which
/// converts it once.
/// Appended runs (a resumed job appends a run segment that replays from its checkpoint): an event whose
/// `step` (for epoch events: whose `epoch`) is not after the previous event of its kind replaces the earlier
/// points from that step (epoch) on, so the curve follows the run that continued.
namespace dkfac::plot {

/// One run's curves.
struct Curve {
  std::string path;   // the metrics file
  std::string label;  // read_curve: the file name without extension; plot_metrics: see default_labels
  // Epoch events: the 1-based epoch just finished, wall time, test accuracy in percent, test loss.
  std::vector<double> epoch, wall_time_s, test_accuracy, test_loss;
  // Step events: the global step, its epoch coordinate (NaN where unknown, see above), wall time and the
  // training loss (NaN where the file has null, a non-finite loss).
  std::vector<double> step, step_epoch, step_wall_time_s, train_loss;

  bool empty() const { return epoch.empty() && step.empty(); }
};

/// Reads the step and epoch events of a metrics file. Throws std::runtime_error naming the file and the
/// line number on a line that is not a JSON object, and the key on a missing or non-numeric value. A last
/// line that does not parse (a write cut short when the job was killed) is skipped with a warning naming
/// the file and line written to `warnings`.
Curve read_curve(const std::string& path, std::ostream& warnings = std::cerr);

/// The labels of runs read from `paths`, in order: the file name without extension; where two inputs
/// would share it, their parent directory's name; where that is still shared, the path as given.
std::vector<std::string> default_labels(const std::vector<std::string>& paths);

/// The gnuplot script drawing `curves` into `png`, reading curve i's epoch events from
/// `data_dir/run<i>-epochs.dat` and its step events from `data_dir/run<i>-steps.dat` (as plot_metrics writes them).
/// Every string in it (paths, labels) is a single-quoted gnuplot string with ' doubled, printed literally
/// (noenhanced). Throws std::runtime_error if a label or path has a control character (a newline would end
/// the gnuplot command).
std::string gnuplot_script(const std::vector<Curve>& curves, const std::filesystem::path& data_dir,
                           const std::filesystem::path& png);

struct PlotOptions {
  std::vector<std::string> labels;       // one per input, in order; empty: default_labels
  std::ostream* warnings = &std::cerr;   // where read_curve's warnings go
  std::string gnuplot = "gnuplot";       // the program run (looked up in PATH)
};

/// Draws the metrics files into `output_png` (see the top of this file). The output's directory must exist.
/// gnuplot (package gnuplot-nox) runs without a shell on a script and data in a private temporary directory
/// (mkdtemp under TMPDIR, removed on success and on every error) and writes the PNG there; it is then moved to
/// `output_png`. Throws std::runtime_error on a label count that differs from the input count, a missing
/// output directory, a bad metrics file, no data at all, gnuplot missing or failing (with its messages).
void plot_metrics(const std::vector<std::string>& paths, const std::string& output_png,
                  const PlotOptions& options = {});

}  // namespace dkfac::plot
