#include "tools/train/devices.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "dkfac/device.h"

namespace dkfac::train {
namespace {

// True when --device asks for a GPU: cuda, or auto with one visible.
bool wants_gpu(const TrainConfig& config, int gpus) {
  return config.device == DeviceChoice::kCuda || (config.device == DeviceChoice::kAuto && gpus > 0);
}

}  // namespace

c10::Device rank_device(const TrainConfig& config, int local_rank, int gpus) {
  if (!wants_gpu(config, gpus)) {
    TORCH_CHECK(config.backend != comm::CudaBackend::kNccl, "--backend nccl carries CUDA tensors, but --device ",
                to_string(config.device), " found no CUDA device, so this rank trains on the CPU; pass --backend gloo "
                "or auto, or run where a GPU is visible");
    return c10::Device(c10::kCPU);
  }
  TORCH_CHECK(gpus > 0, "--device cuda was asked for, but LibTorch sees no CUDA device (no GPU, no driver, or "
              "CUDA_VISIBLE_DEVICES hides them); use --device cpu or auto");
  // Ranks beyond the GPUs share them only through Gloo; otherwise device::resolve names the local rank.
  const bool share = config.backend == comm::CudaBackend::kGloo;
  const int index = share ? local_rank % gpus : local_rank;
  TORCH_CHECK(index >= 0 && index < gpus, "local rank ", local_rank, " would train on cuda:", index, ", but this node ",
              "has ", gpus, " visible CUDA device", gpus == 1 ? "" : "s", ": start at most one rank per GPU, or pass "
              "--backend gloo to let ranks share GPUs");
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
}

c10::Device rank_device(const TrainConfig& config, int local_rank) {
  const int gpus = config.device == DeviceChoice::kCpu ? 0 : device::cuda_device_count();
  return rank_device(config, local_rank, gpus);
}

void make_current(c10::Device device) {
  if (device.is_cpu()) return;
  c10::impl::getDeviceGuardImpl(device.type())->setDevice(device);
}

void check_ranks_fit_gpus(const TrainConfig& config, int nproc, int gpus) {
  if (!wants_gpu(config, gpus)) return;
  TORCH_CHECK(gpus > 0, "--nproc ", nproc, " --device cuda: LibTorch sees no CUDA device on this machine (no GPU, ",
              "no driver, or CUDA_VISIBLE_DEVICES hides them); use --device cpu or auto");
  if (nproc <= gpus || config.backend == comm::CudaBackend::kGloo) return;
  TORCH_CHECK(false, "--nproc ", nproc, " --device ", to_string(config.device), " needs ", nproc,
              " GPUs (one per rank), but this machine has ", gpus, " visible CUDA device", gpus == 1 ? "" : "s",
              "; start at most ", gpus, " rank", gpus == 1 ? "" : "s", ", or pass --backend gloo to let the ranks share ",
              "the GPUs round-robin (rank r on cuda:(r % ", gpus, "); NCCL refuses two ranks on one GPU)");
}

torch::Tensor to_device(const torch::Tensor& host, c10::Device device) {
  if (device.is_cpu()) return host;
  return host.pin_memory().to(device, /*non_blocking=*/true);
}

}  // namespace dkfac::train
