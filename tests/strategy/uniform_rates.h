#pragma once
// Rates written by hand for the time model's and strategy auto's tests.

#include "dkfac/strategy/rates.h"

namespace dkfac::testing {

/// Rates with every compute cost from one FLOP rate and a link of `alpha` (seconds) and `beta` (seconds per
/// byte) for both collectives (idle and busy), as if measured on `world` ranks for `method` in `dtype`.
inline strategy::Rates uniform_rates(double seconds_per_flop, double alpha, double beta, int world, ComputeMethod method,
                           c10::ScalarType dtype) {
  strategy::Rates r;
  r.world_size = world;
  r.dtype = dtype;
  r.method = method;
  r.allreduce = {alpha, beta};
  r.allreduce_busy = {alpha, beta};
  r.broadcast = {alpha, beta};
  for (const auto kernel : math::kFactorKernels) r.for_kernel(kernel).per_flop = seconds_per_flop;
  r.decomposition.per_cubed_dim = seconds_per_flop;
  r.precondition.per_flop = seconds_per_flop;
  return r;
}

}  // namespace dkfac::testing
