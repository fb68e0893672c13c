#pragma once

#include <string>

/// Thread setup of the dkfac programs.
namespace dkfac::tools {

/// Gives LibTorch's intra-op pool `threads` threads (0: every core) and, when LibTorch's BLAS is
/// OpenBLAS, limits OpenBLAS to one thread: two pools each spinning on the same cores cost
/// 40% of the cnn's step rate on a 2-core machine (docs/PERFORMANCE.md). Returns a one-line description.
std::string configure_threads(int threads);

}  // namespace dkfac::tools
