// dkfac/numbers.h: the one median and the one set of human units the library and its tools print.
#include "dkfac/numbers.h"

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace dkfac {
namespace {

TEST(Numbers, MedianOfOddAndEvenCounts) {
  EXPECT_EQ(median({3.0}), 3.0);
  EXPECT_EQ(median({5.0, 1.0, 3.0}), 3.0);
  EXPECT_EQ(median({4.0, 1.0, 3.0, 2.0}), 2.5) << "the mean of the two middle samples";
  EXPECT_EQ(median({7.0, 7.0, 1.0, 9.0, 7.0, 2.0}), 7.0);
  EXPECT_EQ(median({2.0, 1.0}), 1.5);
  testing::expect_error<c10::Error>([] { median({}); }, {"median of no samples"});
}

TEST(Numbers, HumanUnits) {
  EXPECT_EQ(human_bytes(0), "0 B");
  EXPECT_EQ(human_bytes(512), "512 B");
  EXPECT_EQ(human_bytes(1536), "1.50 KiB");
  EXPECT_EQ(human_bytes(97.5 * 1024 * 1024), "97.50 MiB");
  EXPECT_EQ(human_bytes(3.0 * 1024 * 1024 * 1024), "3.00 GiB");
  EXPECT_EQ(human_flops(12), "12 FLOP");
  EXPECT_EQ(human_flops(3.2e9), "3.20 GFLOP");
  EXPECT_EQ(human_flops(1.1e12), "1.10 TFLOP");
}

}  // namespace
}  // namespace dkfac
