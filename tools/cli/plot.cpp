// `dkfac plot`: learning curves of metrics files in one PNG.
#include <iostream>

#include "tools/cli/commands.h"
#include "tools/plot/plot.h"

namespace dkfac::cli {

Command add_plot_command(CLI::App& app) {
  struct Flags {
    std::vector<std::string> inputs;
    std::string output = "curves.png";
    std::vector<std::string> labels;
  };
  auto flags = std::make_shared<Flags>();
  auto* plot = app.add_subcommand(
      "plot", "plot test accuracy, test loss and training loss of metrics files against epochs and wall time");
  plot->add_option("metrics", flags->inputs, "metrics .jsonl files written by dkfac train")->required()->check(
      CLI::ExistingFile);
  plot->add_option("-o,--output", flags->output, "PNG to write (its directory must exist)")->capture_default_str();
  plot->add_option("--label", flags->labels,
                   "legend label of one run, once per metrics file, in order (default: the file name without "
                   "extension, or its directory's name where two files share that)")
      ->allow_extra_args(false);

  return {plot, [flags](const Invocation&) {
    dkfac::plot::PlotOptions options;
    options.labels = flags->labels;
    dkfac::plot::plot_metrics(flags->inputs, flags->output, options);
    std::cout << "plot: " << flags->output << std::endl;
    return 0;
  }};
}

}  // namespace dkfac::cli
