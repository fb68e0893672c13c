#pragma once

#include <string>
#include <vector>

/// `dkfac plot`: learning curves of several runs in one PNG, drawn by gnuplot.
namespace dkfac::plot {

/// One run's epoch events.
struct Curve {
  std::string label;
  std::vector<double> epoch, wall_time_s, test_accuracy, test_loss;
};

/// Reads the `"event":"epoch"` lines of a metrics file written by `dkfac train`. The label is the
/// file name without extension. Throws std::runtime_error naming the file and line on bad JSON.
Curve read_curve(const std::string& path);

/// Four panels (accuracy and loss against epoch and against wall time), one line per file.
/// Needs gnuplot (package gnuplot-nox); throws std::runtime_error if it fails.
void plot_metrics(const std::vector<std::string>& paths, const std::string& output_png);

}  // namespace dkfac::plot
