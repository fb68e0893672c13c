// Which device each rank of `dkfac train` trains on, and when --nproc asks for more GPUs than there are.
#include <gtest/gtest.h>

#include "dkfac/device.h"
#include "tests/test_util.h"
#include "tools/train/devices.h"

namespace dkfac::train {
namespace {

using dkfac::testing::expect_error;

TrainConfig with(DeviceChoice device, comm::CudaBackend backend = comm::CudaBackend::kAuto) {
  TrainConfig config;
  config.device = device;
  config.backend = backend;
  return config;
}

const c10::Device kCpu(c10::kCPU);
c10::Device cuda(int index) { return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index)); }

TEST(RankDevice, CpuAutoAndCudaByLocalRank) {
  EXPECT_EQ(rank_device(with(DeviceChoice::kCpu), 3, 8), kCpu) << "cpu stays on the CPU whatever is visible";
  EXPECT_EQ(rank_device(with(DeviceChoice::kAuto), 0, 0), kCpu) << "auto without a GPU";
  EXPECT_EQ(rank_device(with(DeviceChoice::kAuto), 1, 2), cuda(1)) << "auto with GPUs: cuda:LOCAL_RANK";
  EXPECT_EQ(rank_device(with(DeviceChoice::kCuda), 0, 1), cuda(0));
  EXPECT_EQ(rank_device(with(DeviceChoice::kCuda), 3, 4), cuda(3));
  EXPECT_EQ(rank_device(with(DeviceChoice::kCuda, comm::CudaBackend::kNccl), 1, 2), cuda(1));
}

TEST(RankDevice, GlooSharesTheGpusRoundRobin) {
  const auto gloo = with(DeviceChoice::kCuda, comm::CudaBackend::kGloo);
  EXPECT_EQ(rank_device(gloo, 0, 1), cuda(0));
  EXPECT_EQ(rank_device(gloo, 1, 1), cuda(0)) << "two ranks on one GPU";
  EXPECT_EQ(rank_device(gloo, 5, 2), cuda(1));
  EXPECT_EQ(rank_device(with(DeviceChoice::kAuto, comm::CudaBackend::kGloo), 2, 2), cuda(0));
}

TEST(RankDevice, RefusalsNameTheProblem) {
  expect_error([] { rank_device(with(DeviceChoice::kCuda), 0, 0); },
               {"--device cuda was asked for, but LibTorch sees no CUDA device", "use --device cpu or auto"});
  expect_error([] { rank_device(with(DeviceChoice::kCuda), 2, 2); },
               {"local rank 2 would train on cuda:2, but this node has 2 visible CUDA devices", "--backend gloo"});
  expect_error([] { rank_device(with(DeviceChoice::kAuto, comm::CudaBackend::kNccl), 1, 1); },
               {"local rank 1 would train on cuda:1, but this node has 1 visible CUDA device:"});
  expect_error([] { rank_device(with(DeviceChoice::kAuto, comm::CudaBackend::kNccl), 0, 0); },
               {"--backend nccl carries CUDA tensors, but --device auto found no CUDA device"});
}

TEST(RankDevice, ThisMachine) {
  // What LibTorch sees here: without a GPU, auto is the CPU and cuda an error naming the reason.
  if (device::cuda_available()) {
    EXPECT_EQ(rank_device(with(DeviceChoice::kAuto), 0), cuda(0));
  } else {
    EXPECT_EQ(rank_device(with(DeviceChoice::kAuto), 0), kCpu);
    expect_error([] { rank_device(with(DeviceChoice::kCuda), 0); }, {"LibTorch sees no CUDA device"});
  }
  EXPECT_EQ(rank_device(with(DeviceChoice::kCpu), 0), kCpu);
}

TEST(RanksFitGpus, MoreRanksThanGpusAreRefusedUnlessGlooSharesThem) {
  check_ranks_fit_gpus(with(DeviceChoice::kCuda), 2, 2);
  check_ranks_fit_gpus(with(DeviceChoice::kCuda, comm::CudaBackend::kGloo), 4, 1);
  check_ranks_fit_gpus(with(DeviceChoice::kCpu), 16, 0);
  check_ranks_fit_gpus(with(DeviceChoice::kCpu), 16, 1);
  check_ranks_fit_gpus(with(DeviceChoice::kAuto), 4, 0);  // the CPU
  expect_error([] { check_ranks_fit_gpus(with(DeviceChoice::kCuda), 4, 2); },
               {"--nproc 4 --device cuda needs 4 GPUs (one per rank), but this machine has 2 visible CUDA devices",
                "start at most 2 ranks", "--backend gloo", "cuda:(r % 2)"});
  expect_error([] { check_ranks_fit_gpus(with(DeviceChoice::kAuto), 2, 1); },
               {"--nproc 2 --device auto needs 2 GPUs (one per rank), but this machine has 1 visible CUDA device;"});
  expect_error([] { check_ranks_fit_gpus(with(DeviceChoice::kCuda, comm::CudaBackend::kNccl), 2, 1); },
               {"--nproc 2 --device cuda needs 2 GPUs"});
  expect_error([] { check_ranks_fit_gpus(with(DeviceChoice::kCuda, comm::CudaBackend::kGloo), 2, 0); },
               {"--nproc 2 --device cuda: LibTorch sees no CUDA device on this machine"});
}

TEST(ToDevice, TheCpuKeepsTheBatchItself) {
  auto batch = torch::randn({4, 3});
  EXPECT_TRUE(to_device(batch, kCpu).is_same(batch)) << "no copy, no pinning on the CPU";
}

}  // namespace
}  // namespace dkfac::train
