#pragma once

#include <vector>

#include <torch/torch.h>

/// Grafting: K-FAC's direction with the base optimizer's step length, as Distributed Shampoo grafts its direction
/// onto another optimizer's step. Both front ends' optimizers call it (Python's `dkfac.optim.KFAC(graft=True)`,
/// C++'s `dkfac::optim::KFACOptions().graft(true)`).
namespace dkfac::math {

/// One block of parameters (a layer's weight and bias, taken together), which the base optimizer has just moved
/// from `start` (p0) to where they are (p1) with its own step on their plain gradients, is put at
/// p0 - (|p1 - p0| / |d|) d, `direction` d the block's K-FAC direction (its preconditioned gradients). The norms are
/// over the whole block, in float64. Where |d| is 0 or not finite (the preconditioner's guard kept a plain
/// gradient that is not), the base's step stands. In place, outside autograd, decided on the device (no host
/// synchronisation). `block`, `start` and `direction` pair up, each pair of one shape.
void graft_block(const std::vector<torch::Tensor>& block, const std::vector<torch::Tensor>& start,
                 const std::vector<torch::Tensor>& direction);

/// graft_block's first half: row i of the result (float64, [block.size(), 2], on the parameters' device) is
/// (|p1 - p0|^2, |d|^2) of parameter i. Where the parameters are shards of whole ones (a model sharded by FSDP2),
/// each row is summed over the ranks holding that parameter's other shards before graft_apply, so that the norms
/// are the whole block's.
torch::Tensor graft_sums(const std::vector<torch::Tensor>& block, const std::vector<torch::Tensor>& start,
                         const std::vector<torch::Tensor>& direction);
/// graft_block's second half: the block put at p0 - (|p1 - p0| / |d|) d, the norms the square roots of the column
/// sums of `sums` (graft_sums' rows).
void graft_apply(const std::vector<torch::Tensor>& block, const std::vector<torch::Tensor>& start,
                 const std::vector<torch::Tensor>& direction, const torch::Tensor& sums);

}  // namespace dkfac::math
