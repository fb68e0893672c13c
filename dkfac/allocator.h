#pragma once

#include <string>

namespace dkfac {

/// Keeps freed memory in the process instead of handing it back to the system after every step. With
/// glibc's defaults every block above the (adaptive, at most 32 MiB) mmap threshold is mapped and unmapped
/// each time it is allocated, and the page faults of refilling it dominate a small model's step (cnn SGD
/// steps, docs/PERFORMANCE.md, "The allocator"). This turns mmap off for the heap (M_MMAP_MAX 0) and returns
/// the heap's top only beyond 1 GiB of free space (M_TRIM_THRESHOLD). It is process-wide: call it once at
/// start-up, before the first tensor; the dkfac command line does. Python: dkfac.configure_allocator().
/// Returns a one-line description ("glibc malloc: no mmap, trim threshold 1 GiB"; another C library:
/// "allocator unchanged").
std::string configure_allocator();

}  // namespace dkfac
