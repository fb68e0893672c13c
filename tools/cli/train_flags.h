#pragma once

#include <CLI/CLI.hpp>

#include "tools/train/config.h"

namespace dkfac::cli {

/// The groups of `dkfac train --help`, in the order they appear.
inline constexpr const char* kDataGroup = "Data";
inline constexpr const char* kModelGroup = "Model";
inline constexpr const char* kOptimizerGroup = "Optimizer";
inline constexpr const char* kKfacGroup = "K-FAC";
inline constexpr const char* kDistributedGroup = "Distributed";
inline constexpr const char* kCheckpointGroup = "Checkpoints";
inline constexpr const char* kOutputGroup = "Output";
inline constexpr const char* kAliasGroup = "kfac_pytorch example-script names (examples/torch_cifar10_resnet.py)";

/// A flag whose value is one of a fixed set of names (train::choices<E>()): the name is parsed into `field`
/// when the command line is parsed, and an unknown one is an error naming the flag and listing the choices.
template <typename E>
CLI::Option* add_choice(CLI::App& app, const std::string& flag, E& field, const std::string& help) {
  auto* option = app.add_option_function<std::string>(
      flag,
      [&field, flag](const std::string& name) {
        try {
          field = train::parse_choice<E>(flag, name);
        } catch (const c10::Error& e) {
          throw CLI::ValidationError(e.what_without_backtrace());
        }
      },
      help);
  const std::string default_name = train::to_string(field);
  if (!default_name.empty()) option->default_str(default_name);
  return option;
}

/// Registers `dkfac train`'s training flags on `app`, writing into `config`. Once `app` is parsed, the
/// kfac_pytorch aliases are copied into their dkfac fields (an alias and its dkfac flag given with different
/// values is a CLI::ValidationError naming both) and `config.validate()` runs, its errors becoming
/// CLI::ValidationErrors: a bad value stops the command line before any worker starts.
void add_train_options(CLI::App& app, train::TrainConfig& config);

}  // namespace dkfac::cli
