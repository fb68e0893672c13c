#pragma once

#include <string>

/// Process setup of the dkfac programs: threads and the memory allocator.
namespace dkfac::tools {

/// Gives LibTorch's intra-op pool `threads` threads (0: every core) and, when LibTorch's BLAS is
/// OpenBLAS, gives OpenBLAS `blas_threads` threads (0: as many as LibTorch). Returns a one-line description.
std::string configure_threads(int threads, int blas_threads = 1);

/// Keeps freed memory in the process instead of returning it to the system after every step: with
/// glibc's defaults every activation above the (adaptive) mmap threshold is mapped and unmapped each
/// step, and the page faults made the cnn's SGD step 3.4x slower (docs/PERFORMANCE.md). Call once at
/// start-up, before the first tensor. Returns a one-line description.
std::string configure_allocator();

}  // namespace dkfac::tools
