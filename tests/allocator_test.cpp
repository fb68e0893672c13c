#include "dkfac/allocator.h"

#include <gtest/gtest.h>
#include <malloc.h>
#include <torch/torch.h>

namespace dkfac {
namespace {

// glibc maps a 64 MiB block with mmap by default (its threshold is at most 32 MiB) and unmaps it when freed;
// after configure_allocator() it comes from the heap (mallinfo2's hblkhd counts mapped bytes).
TEST(Allocator, LargeTensorsComeFromTheHeapAfterConfigureAllocator) {
#ifdef __GLIBC__
  const auto mapped = [] { return ::mallinfo2().hblkhd; };
  {
    const auto before = mapped();
    auto t = torch::empty({16 << 20}, torch::kFloat32);
    EXPECT_GE(mapped(), before + (size_t{64} << 20)) << "glibc's default should map a 64 MiB block";
  }
  EXPECT_EQ(configure_allocator(), "glibc malloc: no mmap, trim threshold 1 GiB");
  const auto before = mapped();
  auto t = torch::empty({16 << 20}, torch::kFloat32);
  EXPECT_EQ(mapped(), before);
#else
  GTEST_SKIP() << "not glibc: configure_allocator() changes nothing";
#endif
}

}  // namespace
}  // namespace dkfac
