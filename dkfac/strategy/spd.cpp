#include "dkfac/strategy/spd.h"

#include "dkfac/device.h"
#include "dkfac/math/second_order.h"
#include "dkfac/numbers.h"

namespace dkfac::strategy {

assign::AlphaBeta measure_link(comm::Communicator& communicator, comm::GroupId group, c10::Device device) {
  // Start-up timings are noisy where ranks share cores (a 4 B allreduce took 6-9 ms with 4 processes on 2
  // cores, and 5 repeats of sizes up to 1 MiB fitted beta anywhere from 0 to 2.3 ns/B): 9 repeats, and sizes
  // up to 4 MiB so that the slope rests on messages whose transfer dominates their start-up.
  constexpr int kRepeats = 9;
  const std::vector<int64_t> sizes = {1, 1 << 14, 1 << 18, 1 << 20};  // float32: 4 B, 64 KiB, 1 MiB, 4 MiB
  std::vector<double> bytes;
  std::vector<double> seconds;
  for (int64_t n : sizes) {
    auto t = torch::zeros({n}, torch::TensorOptions().dtype(torch::kFloat32).device(device));
    communicator.allreduce_sum(t, group, comm::Phase::kCalibration).wait();  // warm-up
    std::vector<double> runs;
    for (int r = 0; r < kRepeats; ++r) {
      const auto start = device::Mark::now(device);
      communicator.allreduce_sum(t, group, comm::Phase::kCalibration).wait();
      runs.push_back(device::Mark::seconds_between(start, device::Mark::now(device)));
    }
    bytes.push_back(static_cast<double>(n * 4));
    seconds.push_back(median(runs));
  }
  comm::average_over(communicator, group, seconds);
  return assign::fit_alpha_beta(bytes, seconds);
}

double measure_decomposition(comm::Communicator& communicator, ComputeMethod method, torch::Dtype dtype,
                             c10::Device device) {
  constexpr int64_t kDim = 256;
  constexpr int kRepeats = 3;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  auto x = torch::randn({kDim, kDim}, gen, torch::TensorOptions().dtype(dtype)).to(device);
  auto spd = x.matmul(x.t()) / kDim + torch::eye(kDim, x.options());
  std::vector<double> runs;
  for (int r = 0; r < kRepeats + 1; ++r) {  // the first run warms up the solver (cuSOLVER's handle)
    const auto start = device::Mark::now(device);
    if (method == ComputeMethod::kEigen) {
      (void)math::eigen_decompose(spd);
    } else {
      (void)math::damped_inverse(spd, 1e-3);
    }
    if (r > 0) runs.push_back(device::Mark::seconds_between(start, device::Mark::now(device)));
  }
  std::vector<double> per_cubed_dim = {median(runs) / static_cast<double>(kDim * kDim * kDim)};
  comm::average_over(communicator, comm::kWorld, per_cubed_dim);
  return per_cubed_dim[0];
}

}  // namespace dkfac::strategy
