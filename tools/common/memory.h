#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "tools/train/config.h"

/// Whether `dkfac train --nproc N` fits in this machine's memory, checked before the workers are forked.
namespace dkfac::tools {

/// What one `dkfac train` worker is expected to hold at its peak, in bytes, by part.
///
/// The estimate is a sum of measured and computed parts (measured on this project's Debian 12 machine,
/// torch 2.11, peak RSS from `/usr/bin/time -v ./build/dkfac train --max-steps 20 --epochs 1`; the
/// measurements and how far above them the estimate lies are in memory.cpp, at kRuntimeBytes):
/// - runtime: LibTorch, MKL, gloo and the program, with tiny data and model: kRuntimeBytes (measured);
/// - dataset: the training and test images as stored (uint8 pixels; the synthetic set is float32), the
///   int64 labels, and the file bytes held while an IDX file is parsed;
/// - model: parameters x 4 bytes x 4 (weights, gradients, two optimizer/communication buffers) plus the
///   activations of one batch (the outputs of its top-level modules for one example x batch x 4 bytes x 2,
///   x 4 with K-FAC, whose hooks capture layer inputs and output gradients), and of one evaluation batch of
///   up to 1000 test examples (x 4 bytes);
/// - kfac: every K-FAC factor x 4 bytes x 3 (running factor, its inverse or eigendecomposition, the
///   batch factor being folded in), for a model that uses K-FAC.
struct WorkerMemory {
  int64_t runtime = 0;
  int64_t dataset = 0;
  int64_t model = 0;
  int64_t kfac = 0;

  int64_t total() const { return runtime + dataset + model + kfac; }
  /// "412 MiB (runtime 190 MiB, dataset 107 MiB, model 35 MiB, K-FAC 80 MiB)".
  std::string describe() const;
};

/// Bytes of LibTorch and the program themselves (measured: see kRuntimeBytes in memory.cpp).
extern const int64_t kRuntimeBytes;

/// The estimate for one worker of `config` (builds the model to count its parameters and factors).
WorkerMemory estimate_worker_memory(const train::TrainConfig& config);

/// MemAvailable of a /proc/meminfo text, in bytes; nullopt when the line is missing or unreadable.
std::optional<int64_t> parse_mem_available(const std::string& meminfo);

/// Throws c10::Error, naming --nproc, the estimate per worker and in total, and the available memory, when
/// `nproc` workers of `per_worker` do not fit in `available` bytes.
void check_workers_fit(int nproc, const WorkerMemory& per_worker, int64_t available);

/// Name of the environment variable that skips the check (set to 1).
constexpr const char* kSkipMemoryCheckVariable = "DKFAC_SKIP_MEMORY_CHECK";

/// The check `dkfac train` runs before it starts `nproc` workers: estimates one worker of `config`, reads
/// MemAvailable from /proc/meminfo and calls check_workers_fit(). Does nothing when /proc/meminfo has no
/// MemAvailable or DKFAC_SKIP_MEMORY_CHECK=1.
void check_memory_for_workers(const train::TrainConfig& config, int nproc);

}  // namespace dkfac::tools
