#pragma once

#include <string>

/// Process setup of the dkfac programs: threads (the allocator is the library's dkfac::configure_allocator).
namespace dkfac::tools {

/// Gives LibTorch's intra-op pool `threads` threads (0: every core). PyPI's torch threads its BLAS (MKL on
/// x86-64) with the same setting, so products and element-wise kernels share one pool and never
/// oversubscribe the cores. Returns a one-line description.
std::string configure_threads(int threads);

}  // namespace dkfac::tools
