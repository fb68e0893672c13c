#pragma once

#include <c10/core/Device.h>
#include <torch/torch.h>

#include "tools/train/config.h"

/// Which device each rank of `dkfac train` trains on, and what moves there. The device choice is made here
/// once per rank; the trainer puts its model, optimizer state, batches, loss and evaluation on it.
namespace dkfac::train {

/// The device of the rank with `local_rank` on its node (`gpus`: the CUDA devices this process sees):
/// --device cpu -> the CPU; cuda -> cuda:local_rank, or with --backend gloo cuda:(local_rank % gpus), so
/// that more ranks than GPUs share them round-robin (NCCL refuses two ranks on one device); auto -> as
/// cuda when `gpus` > 0, else the CPU. Throws c10::Error naming the problem: cuda without a CUDA device, a
/// local rank beyond the GPUs without --backend gloo, or --backend nccl on a rank that trains on the CPU.
c10::Device rank_device(const TrainConfig& config, int local_rank, int gpus);
/// The same with the CUDA devices LibTorch sees in this process (initialises CUDA when --device is not cpu).
c10::Device rank_device(const TrainConfig& config, int local_rank);

/// Makes `device` the current CUDA device of this process (where CUDA events, streams and NCCL's
/// communicators go when nothing else says); nothing for the CPU.
void make_current(c10::Device device);

/// Refuses `nproc` local ranks of `config` on a node with `gpus` visible CUDA devices, with a message
/// naming both, when they would need more GPUs than there are: --device cuda (or auto with a GPU visible)
/// needs one GPU per rank unless --backend gloo, which shares them; --device cuda needs at least one.
/// Throws c10::Error; nothing for --device cpu or auto without a GPU.
void check_ranks_fit_gpus(const TrainConfig& config, int nproc, int gpus);

/// `host` (a batch or its labels, made on the CPU) on `device`: itself on the CPU; on a GPU, copied into
/// page-locked (pinned) host memory and from there asynchronously (non_blocking), so that the copy
/// overlaps the host's work on the next batch. The pinned buffer is kept by LibTorch's host allocator
/// until the copy is done.
torch::Tensor to_device(const torch::Tensor& host, c10::Device device);

}  // namespace dkfac::train
