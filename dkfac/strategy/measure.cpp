#include "dkfac/strategy/measure.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <numeric>
#include <sstream>
#include <thread>

#include <torch/torch.h>

#include "dkfac/device.h"
#include "dkfac/math/second_order.h"
#include "dkfac/numbers.h"

namespace dkfac::strategy {
namespace {

/// Solves the small dense system m x = b in place (Gaussian elimination, partial pivoting); false when singular.
bool solve(std::vector<std::vector<double>> m, std::vector<double> b, std::vector<double>& x) {
  const size_t n = b.size();
  for (size_t c = 0; c < n; ++c) {
    size_t pivot = c;
    for (size_t r = c + 1; r < n; ++r) {
      if (std::abs(m[r][c]) > std::abs(m[pivot][c])) pivot = r;
    }
    if (std::abs(m[pivot][c]) < 1e-12) return false;
    std::swap(m[c], m[pivot]);
    std::swap(b[c], b[pivot]);
    for (size_t r = c + 1; r < n; ++r) {
      const double k = m[r][c] / m[c][c];
      for (size_t j = c; j < n; ++j) m[r][j] -= k * m[c][j];
      b[r] -= k * b[c];
    }
  }
  x.assign(n, 0.0);
  for (size_t c = n; c-- > 0;) {
    double s = b[c];
    for (size_t j = c + 1; j < n; ++j) s -= m[c][j] * x[j];
    x[c] = s / m[c][c];
  }
  return true;
}

// Seconds per d^3 from the probe's time (decomposition costs d^3).
double per_cubed_dim(double probe_seconds) {
  const double probe = static_cast<double>(kSpdProbeDim);
  return probe_seconds / (probe * probe * probe);
}

/// The d x d symmetric positive definite matrix the decomposition probes time (seeded: the same on every rank).
torch::Tensor probe_factor(int64_t d, c10::ScalarType dtype, c10::Device device) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  auto x = torch::randn({d, d}, gen, torch::TensorOptions().dtype(torch::kFloat32));
  return (x.matmul(x.t()) / d + torch::eye(d)).to(torch::TensorOptions().dtype(dtype).device(device));
}

}  // namespace

std::vector<double> time_runs(c10::Device device, int repeats, const std::function<void()>& work) {
  work();
  std::vector<double> runs;
  for (int r = 0; r < repeats; ++r) {
    const auto start = device::Mark::now(device);
    work();
    runs.push_back(device::Mark::seconds_between(start, device::Mark::now(device)));
  }
  return runs;
}

double time_median(c10::Device device, int repeats, const std::function<void()>& work) {
  return median(time_runs(device, repeats, work));
}

const std::vector<int64_t>& link_sizes() {
  static const std::vector<int64_t> sizes = {1, 1 << 14, 1 << 18, 1 << 20};
  return sizes;
}

std::vector<double> link_bytes() {
  std::vector<double> bytes;
  for (int64_t n : link_sizes()) bytes.push_back(4.0 * static_cast<double>(n));
  return bytes;
}

std::vector<double> time_link(comm::Communicator& communicator, comm::GroupId group, c10::Device device,
                              Collective collective, int repeats, bool mean) {
  std::vector<double> seconds;
  for (int64_t n : link_sizes()) {
    auto t = torch::zeros({n}, torch::TensorOptions().dtype(torch::kFloat32).device(device));
    const auto runs = time_runs(device, repeats, [&] {
      auto handle = collective == Collective::kBroadcast ? communicator.broadcast(t, 0, group, comm::Purpose::kCalibration)
                                                         : communicator.allreduce_sum(t, group, comm::Purpose::kCalibration);
      handle.wait();
    });
    seconds.push_back(mean ? std::accumulate(runs.begin(), runs.end(), 0.0) / static_cast<double>(runs.size())
                           : median(runs));
  }
  return seconds;
}

std::pair<double, double> fit_affine(const std::vector<double>& units, const std::vector<double>& seconds) {
  std::vector<std::vector<double>> features;
  for (double u : units) features.push_back({1.0, u});
  const auto c = fit_nonnegative(features, seconds);
  return {c[0], c[1]};
}

assign::AlphaBeta fit_link(const std::vector<double>& seconds) {
  const auto bytes = link_bytes();
  TORCH_CHECK(seconds.size() == bytes.size(), "fit_link: ", seconds.size(), " times for ", bytes.size(),
              " link sizes");
  const auto [alpha, beta] = fit_affine(bytes, seconds);
  return assign::AlphaBeta{alpha, beta};
}

assign::AlphaBeta measure_link(comm::Communicator& communicator, comm::GroupId group, c10::Device device) {
  auto seconds = time_link(communicator, group, device, Collective::kAllreduce);
  comm::average_over(communicator, group, seconds, comm::Purpose::kCalibration);
  return fit_link(seconds);
}

double time_decomposition(int64_t d, ComputeMethod method, c10::ScalarType dtype, c10::Device device) {
  const auto spd = probe_factor(d, dtype, device);
  return time_median(device, d >= 640 ? 2 : 3, [&] {
    if (method == ComputeMethod::kEigen) {
      (void)math::eigen_decompose(spd);
    } else {
      (void)math::damped_inverse(spd, 1e-3);
    }
  });
}

double time_refresh(int64_t d, c10::ScalarType dtype, c10::Device device) {
  const auto before = probe_factor(d, dtype, device);
  const auto basis = math::eigen_decompose(before);
  const auto after = (0.95 * before + 0.05 * torch::eye(d, before.options())).contiguous();
  return time_median(device, d >= 640 ? 2 : 3, [&] { (void)math::refresh_eigenbasis(after, basis); });
}

SideWorkTimes time_side_work(ComputeMethod method, c10::ScalarType dtype, c10::Device device,
                             const std::function<void()>& meet) {
  torch::NoGradGuard no_grad;
  const int64_t d = kSideWorkDim;
  const auto spd = probe_factor(d, dtype, device);
  const bool eigen = method == ComputeMethod::kEigen;
  const auto decompose = [&] {
    if (eigen) {
      (void)math::eigen_decompose(spd);
    } else {
      (void)math::damped_inverse(spd, 1e-3);
    }
  };
  // The products a step runs: a [d, d] gradient preconditioned by d x d factors' second-order state.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(19);
  const auto grad = torch::randn({d, d}, gen, torch::TensorOptions().dtype(torch::kFloat32)).to(spd.options());
  const auto basis = eigen ? math::eigen_decompose(spd) : math::EigenFactor{};
  const auto denominator = eigen ? math::eigen_denominator(basis, basis, 1e-3) : torch::Tensor();
  const auto inverse = eigen ? torch::Tensor() : math::damped_inverse(spd, 1e-3);
  const auto product = [&] {
    if (eigen) {
      (void)math::precondition_eigen(basis, basis, denominator, grad);
    } else {
      (void)math::precondition_inverse(inverse, inverse, grad);
    }
  };
  constexpr int kRepeats = 3;
  const auto in_step = [&] {
    if (meet) meet();
  };
  SideWorkTimes t;
  in_step();
  t.side = time_median(device, kRepeats, decompose);
  const double one = time_median(device, kRepeats, product);
  const int64_t products = std::clamp<int64_t>(static_cast<int64_t>(std::ceil(3.0 * t.side / std::max(one, 1e-9))), 1,
                                               100000);
  const auto loop = [&] {
    for (int64_t k = 0; k < products; ++k) product();
  };
  in_step();
  t.main = time_median(device, kRepeats, loop);
  in_step();
  t.together = time_median(device, kRepeats, [&] {
    // As Preconditioner::start_second_order_job hands an update over (device::SideWork::run: the process's
    // intra-op threads, no autograd, no TF32), and this thread's stream waits for it at the end, whether it failed
    // or not (its kernels may still read `spd`).
    device::SideWork side(device);
    std::exception_ptr failed;
    std::thread worker([&] {
      try {
        side.run(decompose);
      } catch (...) {
        failed = std::current_exception();
      }
    });
    std::exception_ptr looping;
    try {
      loop();
    } catch (...) {
      looping = std::current_exception();
    }
    worker.join();
    side.join({});
    if (looping) std::rethrow_exception(looping);
    if (failed) std::rethrow_exception(failed);
  });
  return t;
}

double side_work_cost_from(const SideWorkTimes& times) {
  TORCH_CHECK(std::isfinite(times.main) && std::isfinite(times.side) && std::isfinite(times.together) &&
                  times.main >= 0 && times.side >= 0 && times.together >= 0,
              "side work times must be finite and >= 0, got main ", times.main, " s, side ", times.side,
              " s, together ", times.together, " s");
  if (times.side <= 0) return 1.0;  // nothing measured beside: priced as if run on the step
  return std::clamp((times.together - times.main) / times.side, 0.0, 1.0);
}

int64_t spd_redundant_dim(double probe_seconds, const assign::AlphaBeta& link, c10::ScalarType dtype,
                          ComputeMethod method) {
  const double element = static_cast<double>(c10::elementSize(dtype));
  const double per_entry = method == ComputeMethod::kEigen ? element : element / 2;
  return assign::redundant_dim_threshold(per_cubed_dim(probe_seconds), link, per_entry);
}

SpdMeasurement measure_spd(comm::Communicator& communicator, c10::Device device, c10::ScalarType dtype,
                           ComputeMethod method, bool threshold) {
  SpdMeasurement m;
  m.measured = true;
  m.link = measure_link(communicator, comm::kWorld, device);
  if (!threshold) return m;
  std::vector<double> probe = {time_decomposition(kSpdProbeDim, method, dtype, device)};
  comm::average_over(communicator, comm::kWorld, probe, comm::Purpose::kCalibration);
  m.probe_seconds = probe[0];
  m.redundant_dim = spd_redundant_dim(m.probe_seconds, m.link, dtype, method);
  return m;
}

std::vector<double> fit_nonnegative(const std::vector<std::vector<double>>& features,
                                    const std::vector<double>& seconds) {
  TORCH_CHECK(!features.empty() && features.size() == seconds.size(), "fit_nonnegative: ", features.size(),
              " rows of features for ", seconds.size(), " times");
  const size_t n = features.front().size();
  TORCH_CHECK(n >= 1 && n <= 8, "fit_nonnegative: 1 to 8 features, got ", n);
  std::vector<double> best(n, 0.0);
  double best_error = std::numeric_limits<double>::infinity();
  const auto weight = [&](size_t i) { return 1.0 / std::max(seconds[i], 1e-12); };
  for (unsigned mask = 1; mask < (1u << n); ++mask) {
    std::vector<size_t> used;
    for (size_t j = 0; j < n; ++j) {
      if (mask & (1u << j)) used.push_back(j);
    }
    // Columns scaled to unit maximum so that the normal equations stay well conditioned.
    std::vector<double> scale(used.size(), 0.0);
    for (size_t u = 0; u < used.size(); ++u) {
      for (size_t i = 0; i < features.size(); ++i) scale[u] = std::max(scale[u], std::abs(features[i][used[u]] * weight(i)));
      if (scale[u] == 0) scale[u] = 1;
    }
    std::vector<std::vector<double>> m(used.size(), std::vector<double>(used.size(), 0.0));
    std::vector<double> b(used.size(), 0.0);
    for (size_t i = 0; i < features.size(); ++i) {
      const double w = weight(i);
      for (size_t u = 0; u < used.size(); ++u) {
        const double xu = features[i][used[u]] * w / scale[u];
        b[u] += xu * seconds[i] * w;
        for (size_t v = 0; v < used.size(); ++v) m[u][v] += xu * features[i][used[v]] * w / scale[v];
      }
    }
    std::vector<double> x;
    if (!solve(m, b, x)) continue;
    if (std::any_of(x.begin(), x.end(), [](double c) { return c < 0; })) continue;
    std::vector<double> c(n, 0.0);
    for (size_t u = 0; u < used.size(); ++u) c[used[u]] = x[u] / scale[u];
    double error = 0;
    for (size_t i = 0; i < features.size(); ++i) {
      double predicted = 0;
      for (size_t j = 0; j < n; ++j) predicted += c[j] * features[i][j];
      const double r = (predicted - seconds[i]) * weight(i);
      error += r * r;
    }
    if (error < best_error) {
      best_error = error;
      best = c;
    }
  }
  return best;
}

std::string describe(const SpdMeasurement& m) {
  if (!m.measured) return "";
  std::ostringstream out;
  out << "measured: link alpha " << m.link.alpha * 1e6 << " us, beta " << m.link.beta * 1e9 << " ns/B";
  if (m.redundant_dim >= 0) {
    out << "; decomposition " << per_cubed_dim(m.probe_seconds) * 1e9 << " ns/d^3, so factors of dim <= "
        << m.redundant_dim << " are decomposed on every rank";
  }
  return out.str();
}

}  // namespace dkfac::strategy
