#pragma once

#include <torch/torch.h>

#include "dkfac/assign/assignment.h"
#include "dkfac/comm/communicator.h"
#include "dkfac/options.h"

/// SPD-KFAC (Shi, Zhang, Li, ICDCS'21): the measurements its placement and fusion decisions are made
/// from (the pipelined, fused factor allreduce itself is factor_pipeline.h).
namespace dkfac::strategy {

/// Measures the transport on `group` with timed allreduces of a few sizes (median of several
/// repetitions each) of float32 tensors on `device` (timed with device marks: CUDA events there), averaged
/// over the group so that every rank gets the same model. Collective.
assign::AlphaBeta measure_link(comm::Communicator& communicator, comm::GroupId group, c10::Device device);

/// Seconds per d^3 of one eigendecomposition / damped inverse of a d x d SPD matrix of `dtype`,
/// measured on `device` (after one warm-up) and averaged over the world so that every rank gets the same
/// number. Collective.
double measure_decomposition(comm::Communicator& communicator, ComputeMethod method, torch::Dtype dtype,
                             c10::Device device);

}  // namespace dkfac::strategy
