// The dkfac command line: `dkfac train`, `dkfac plan`, `dkfac bench` and `dkfac plot` (one file each
// under tools/cli/).
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>

#include <c10/util/Exception.h>

#include "dkfac/allocator.h"
#include "dkfac/comm/environment.h"
#include "dkfac/version.h"
#include "tools/cli/commands.h"

namespace {

// `text` as a POSIX shell reads it back: bare when safe, else in single quotes.
std::string shell_quoted(const std::string& text) {
  const bool safe = !text.empty() && text.find_first_not_of(
      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:,+@%") == std::string::npos;
  if (safe) return text;
  std::string quoted = "'";
  for (char c : text) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

// True in a rank above 0 of a job started by a launcher (torchrun, mpirun, srun): every rank got the same
// command line, so rank 0 alone reports what is wrong with it and the others only exit with its code.
bool launched_rank_above_zero() {
  try {
    return dkfac::comm::read_job_environment().rank > 0;
  } catch (const c10::Error&) {
    return false;  // an environment the job will refuse later, with its own message
  }
}

}  // namespace

int main(int argc, char** argv) {
  // GNU OpenMP's worker threads spin for milliseconds after every parallel region, on the cores that the
  // next single-threaded BLAS call of K-FAC needs; a shorter spin made the cnn's K-FAC step 10% faster and
  // cost SGD nothing measurable (docs/PERFORMANCE.md). The runtime reads its settings when it loads, so
  // set the variable and start again. A wait policy or spin count the user chose is kept.
  if (std::getenv("OMP_WAIT_POLICY") == nullptr && std::getenv("GOMP_SPINCOUNT") == nullptr &&
      ::setenv("GOMP_SPINCOUNT", "20000", 1) == 0) {
    ::execv("/proc/self/exe", argv);  // returns only on failure: then run with the runtime's defaults
  }
  CLI::App app{"dkfac: distributed K-FAC training for LibTorch"};
  app.set_version_flag("--version", std::string("dkfac ") + DKFAC_VERSION_STRING);
  app.require_subcommand(1);
  const std::vector<dkfac::cli::Command> commands = {
      dkfac::cli::add_train_command(app),
      dkfac::cli::add_plan_command(app),
      dkfac::cli::add_bench_command(app),
      dkfac::cli::add_plot_command(app),
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() != 0 && launched_rank_above_zero()) return e.get_exit_code();
    return app.exit(e);
  }
  dkfac::cli::Invocation invocation;
  invocation.allocator = dkfac::configure_allocator();  // every command, before its first tensor
  for (int i = 0; i < argc; ++i) invocation.command_line += (i ? " " : "") + shell_quoted(argv[i]);
  try {
    for (const auto& command : commands) {
      if (command.app->parsed()) return command.run(invocation);
    }
  } catch (const c10::Error& e) {
    std::cerr << "dkfac: error: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "dkfac: error: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
