// dkfac/device.h where no GPU is needed: host marks, no allocator statistics on the CPU, device choice and
// its errors, and the out-of-memory message.
#include "dkfac/device.h"

#include <gtest/gtest.h>

#include <thread>

#include <torch/torch.h>

#include "tests/test_util.h"

namespace dkfac::device {
namespace {

TEST(Mark, HostClockOnTheCpu) {
  const auto start = Mark::now(c10::kCPU);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const auto end = Mark::now(c10::kCPU);
  EXPECT_TRUE(end.reached());
  const double seconds = Mark::seconds_between(start, end);
  EXPECT_GE(seconds, 0.019);
  EXPECT_LT(seconds, 5.0);
}

TEST(MemoryStats, NoneOnTheCpu) {
  EXPECT_FALSE(memory_stats(c10::kCPU).has_value());
  reset_peak_memory(c10::kCPU);  // nothing to reset, no error
}

TEST(Resolve, CpuAndAuto) {
  EXPECT_EQ(resolve("cpu", 3), c10::Device(c10::kCPU));
  const auto automatic = resolve("auto", 0);
  EXPECT_EQ(automatic.is_cuda(), cuda_available());
  if (cuda_available()) EXPECT_EQ(automatic.index(), 0);
}

TEST(Resolve, RefusesWhatCannotRun) {
  testing::expect_error([] { resolve("gpu", 0); }, {"device must be cpu, cuda or auto, got 'gpu'"});
  if (!cuda_available()) {
    testing::expect_error([] { resolve("cuda", 0); },
                          {"device cuda was asked for, but LibTorch sees no CUDA device", "use device cpu or auto"});
  } else {
    const int count = cuda_device_count();
    testing::expect_error([count] { resolve("cuda", count); },
                          {"local rank " + std::to_string(count), "start at most one rank per GPU on each node"});
  }
}

TEST(OutOfMemory, SaysWhereAndWhatToTry) {
  try {
    rethrow_out_of_memory(c10::OutOfMemoryError({"f", "file", 1}, "CUDA out of memory. Tried to allocate 2.00 GiB"),
                          "K-FAC step 3, second-order update of layer 'fc1' (Linear)");
    FAIL() << "expected an error";
  } catch (const c10::OutOfMemoryError& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("K-FAC step 3, second-order update of layer 'fc1' (Linear) ran out of device memory: "
                           "CUDA out of memory. Tried to allocate 2.00 GiB"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("bfloat16"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace dkfac::device
