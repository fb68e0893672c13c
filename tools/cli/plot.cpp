// `dkfac plot`: learning curves of metrics files in one PNG.
#include <iostream>

#include "tools/cli/commands.h"
#include "tools/plot/plot.h"

namespace dkfac::cli {

Command add_plot_command(CLI::App& app) {
  struct Flags {
    std::vector<std::string> inputs;
    std::string output = "curves.png";
  };
  auto flags = std::make_shared<Flags>();
  auto* plot = app.add_subcommand("plot", "plot test accuracy and loss of metrics files against epochs and time");
  plot->add_option("metrics", flags->inputs, "metrics .jsonl files written by dkfac train")->required()->check(
      CLI::ExistingFile);
  plot->add_option("-o,--output", flags->output, "PNG to write")->capture_default_str();

  return {plot, [flags](const Invocation&) {
    dkfac::plot::plot_metrics(flags->inputs, flags->output);
    std::cout << "plot: " << flags->output << std::endl;
    return 0;
  }};
}

}  // namespace dkfac::cli
