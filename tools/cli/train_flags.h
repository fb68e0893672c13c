#pragma once

#include <CLI/CLI.hpp>

#include "tools/train/config.h"

namespace dkfac::cli {

/// Registers `dkfac train`'s training flags on `app`, writing into `config`.
void add_train_options(CLI::App& app, train::TrainConfig& config);

}  // namespace dkfac::cli
