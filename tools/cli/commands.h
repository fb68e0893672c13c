#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>

/// The subcommands of the `dkfac` executable, one file each. Each registers its flags on the parent
/// application and returns what runs it once the command line has been parsed (its exit code).
namespace dkfac::cli {

/// What every command is run with, besides its flags.
struct Invocation {
  std::string allocator;     ///< the allocator setup (dkfac::configure_allocator)
  std::string command_line;  ///< the command as typed, arguments shell-quoted where needed
};

struct Command {
  CLI::App* app;           // the subcommand, parsed when app->parsed()
  std::function<int(const Invocation&)> run;  // runs it once parsed; returns the exit code
};

Command add_train_command(CLI::App& app);  // train.cpp (its --nproc launcher: launch.cpp)
Command add_plan_command(CLI::App& app);   // plan.cpp
Command add_bench_command(CLI::App& app);  // bench.cpp
Command add_plot_command(CLI::App& app);   // plot.cpp

}  // namespace dkfac::cli
