#pragma once

#include <string>

/// Process setup of the dkfac programs: threads and the memory allocator.
namespace dkfac::tools {

/// Gives LibTorch's intra-op pool `threads` threads (0: every core). PyPI's torch threads its BLAS (MKL on
/// x86-64) with the same setting, so products and element-wise kernels share one pool and never
/// oversubscribe the cores. Returns a one-line description.
std::string configure_threads(int threads);

/// Keeps freed memory in the process instead of returning it to the system after every step: with
/// glibc's defaults every activation above the (adaptive) mmap threshold is mapped and unmapped each
/// step, and the page faults made the cnn's SGD step 3.4x slower (docs/PERFORMANCE.md). Call once at
/// start-up, before the first tensor. Returns a one-line description.
std::string configure_allocator();

}  // namespace dkfac::tools
