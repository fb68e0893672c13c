#include "dkfac/strategy/rates.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <thread>
#include <utility>

#include <torch/torch.h>

#include "dkfac/comm/communicator.h"
#include "dkfac/device.h"
#include "dkfac/math/factors.h"
#include "dkfac/math/second_order.h"
#include "dkfac/numbers.h"
#include "dkfac/strategy/measure.h"

namespace dkfac::strategy {
namespace {

double cube(int64_t d) { return static_cast<double>(d) * d * d; }

/// The points at which measure_rates and measure_local_rates time each kernel (kernel_probes).
struct KernelPlan {
  // (rows, d) of covariances, up to the sizes of real layers (a few GFLOP-equivalents in all).
  std::vector<std::pair<int64_t, int64_t>> factor_shapes = {{64, 16}, {16384, 16}, {4096, 64}, {8192, 256}, {128, 1024}};
  // 3 x 3 stride-1 convolutions' inputs {batch, channels, height (= width)}: rows = batch height^2, d = 9 channels;
  // and output gradients of the same shapes for the G factor: d = channels. Up to [64, 16, 28, 28] (a
  // ResNet's first stage at batch 64: 50176 rows); why not larger: docs/STRATEGIES.md, "Choosing
  // automatically", Rates.
  std::vector<std::array<int64_t, 3>> conv_inputs = {{2, 8, 8}, {8, 16, 28}, {16, 32, 14}, {32, 64, 7}, {32, 16, 32},
                                                     {64, 16, 28}};
  // Convolutions of the patches kernel, {batch, channels, height (= width), kernel (square), stride}: the
  // strided 3 x 3 and 1 x 1 (projection shortcut) convolutions of a ResNet's downsampling blocks.
  std::vector<std::array<int64_t, 5>> patch_convs = {
      {8, 16, 28, 3, 2}, {32, 16, 28, 1, 2}, {32, 32, 14, 3, 2}, {64, 16, 28, 3, 2}, {16, 64, 14, 3, 2}};
  // 3 x 3 stride-1 convolutions of the unfold kernel (fewer than math::kChannelsLastMin channels: a first layer
  // on images), {batch, channels, height (= width)}.
  std::vector<std::array<int64_t, 3>> unfold_convs = {{8, 1, 28}, {16, 3, 16}, {32, 3, 32}, {64, 1, 28}};
  // Folds of one layer's two factors, {a, g}.
  std::vector<std::pair<int64_t, int64_t>> fold_shapes = {{10, 16}, {145, 32}, {577, 64}, {1153, 256}};
  std::vector<int64_t> decomposition_dims;
  std::vector<std::pair<int64_t, int64_t>> precondition_shapes = {{10, 16}, {32, 64}, {64, 145}, {128, 577}, {256, 256}};
};

KernelPlan kernel_plan(ComputeMethod method) {
  KernelPlan k;
  // Eigendecompositions cost ~9 d^3 against an inverse's ~d^3: stop earlier to keep the measurement short.
  // No powers of two: LAPACK on CPUs is measurably slower at d = 512 or 1024 (cache associativity) than at
  // the dimensions around them (inverse, one thread: 4.2 ms at 512, 4.2 ms at 576), which a table of powers
  // of two would spread over every dimension between.
  // 256 is the one power of two: kSpdProbeDim, where SPD-KFAC's threshold reads the table
  // (Rates::spd_redundant_dim) and its own executor times the same decomposition (measure_spd).
  k.decomposition_dims = method == ComputeMethod::kEigen ? std::vector<int64_t>{16, 48, 96, 192, 256, 384, 640}
                                                         : std::vector<int64_t>{16, 48, 96, 192, 256, 384, 768, 1536};
  return k;
}

torch::Tensor spd_matrix(int64_t d, const torch::TensorOptions& options, at::Generator& gen) {
  auto x = torch::randn({d, d}, gen, torch::TensorOptions().dtype(torch::kFloat32)).to(options);
  return x.matmul(x.t()) / d + torch::eye(d, options);
}

/// A square `kernel` x `kernel` convolution with stride `stride` and 'same'-style padding kernel / 2.
math::Conv2dGeometry conv_geometry(int64_t kernel, int64_t stride) {
  math::Conv2dGeometry geometry;
  geometry.kernel_size = {kernel, kernel};
  geometry.stride = {stride, stride};
  const int64_t pad = kernel / 2;
  geometry.padding = {pad, pad, pad, pad};
  return geometry;
}

/// Rows and d of a convolution's A factor: {batch, channels, side} input, square kernel, stride, kernel / 2 padding.
std::pair<double, double> conv_a_point(int64_t batch, int64_t channels, int64_t side, int64_t kernel, int64_t stride) {
  const int64_t out = (side + 2 * (kernel / 2) - kernel) / stride + 1;
  return {static_cast<double>(batch * out * out), static_cast<double>(channels * kernel * kernel)};
}

/// A covariance loop on a thread of its own for as long as the object lives: a rank that computes while
/// its collectives are timed.
class ComputeLoop {
 public:
  ComputeLoop(c10::Device device, c10::ScalarType dtype) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(17);
    auto x = torch::randn({2048, 256}, gen, torch::TensorOptions().dtype(torch::kFloat32))
                 .to(torch::TensorOptions().dtype(dtype).device(device));
    thread_ = std::thread([this, x, device] {
      torch::NoGradGuard no_grad;
      while (!stop_.load()) {
        const auto start = device::Mark::now(device);
        (void)math::covariance(x);
        (void)device::Mark::seconds_between(start, device::Mark::now(device));  // waits for a device
      }
    });
  }
  ~ComputeLoop() {
    stop_ = true;
    thread_.join();
  }
  ComputeLoop(const ComputeLoop&) = delete;
  ComputeLoop& operator=(const ComputeLoop&) = delete;

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

/// The kernel every rank runs at once to measure how ranks share the machine: a [8192, 256] covariance.
double time_probe(c10::Device device, c10::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(13);
  auto x = torch::randn({8192, 256}, gen, torch::TensorOptions().dtype(torch::kFloat32))
               .to(torch::TensorOptions().dtype(dtype).device(device));
  torch::NoGradGuard no_grad;
  return time_median(device, 5, [&] { (void)math::covariance(x); });
}

/// The FactorRate fitted to one figure per (rows, d) point.
FactorRate fit_factor_rate(const std::vector<std::pair<double, double>>& points, const double* figures) {
  std::vector<std::vector<double>> features;
  std::vector<double> seconds(figures, figures + points.size());
  for (const auto& [r, d] : points) features.push_back({1.0, r * d, 2.0 * r * d * d});
  const auto c = fit_nonnegative(features, seconds);
  return FactorRate{c[0], c[1], c[2]};
}

/// One group of kernel timings of Rates: how its points are timed (one figure each, appended) and how its
/// figures become its rate. Measurement and fit iterate the one list of kernel_probes, in its order, so that
/// ranks can average the figures element by element in between; adding a kernel is one probe.
struct KernelProbe {
  size_t points = 0;
  std::function<void(std::vector<double>& figures)> time;
  std::function<void(const double* figures, Rates& rates)> fit;
};

std::vector<KernelProbe> kernel_probes(const KernelPlan& k, c10::Device device, c10::ScalarType dtype,
                                       ComputeMethod method) {
  const auto options = torch::TensorOptions().dtype(dtype).device(device);
  auto gen = std::make_shared<at::Generator>(at::make_generator<at::CPUGeneratorImpl>(11));
  const auto random = [gen, options](std::vector<int64_t> sizes) {
    return torch::randn(sizes, *gen, torch::TensorOptions().dtype(torch::kFloat32)).to(options);
  };
  const auto spd = [gen, options](int64_t d) { return spd_matrix(d, options, *gen); };
  const auto timed = [device](const std::function<void()>& kernel) { return time_median(device, 3, kernel); };
  // A factor kernel timed by `run(point)` at each (rows, d) of `at`, fitted as a FactorRate into `rate`.
  const auto factor_probe = [](std::function<double(size_t)> run, std::vector<std::pair<double, double>> at,
                               FactorRate Rates::*rate) {
    const size_t points = at.size();
    return KernelProbe{points,
                       [points, run](std::vector<double>& figures) {
                         for (size_t i = 0; i < points; ++i) figures.push_back(run(i));
                       },
                       [at, rate](const double* figures, Rates& rates) { rates.*rate = fit_factor_rate(at, figures); }};
  };
  const auto conv_a = [random, timed](std::array<int64_t, 5> c) {  // {batch, channels, side, kernel, stride}
    const auto geometry = conv_geometry(c[3], c[4]);
    auto x = random({c[0], c[1], c[2], c[2]});
    return timed([&] { (void)math::conv2d_a_factor(x, geometry, false); });
  };
  std::vector<KernelProbe> probes;
  {
    std::vector<std::pair<double, double>> at;
    for (const auto& [rows, d] : k.factor_shapes) at.emplace_back(static_cast<double>(rows), static_cast<double>(d));
    probes.push_back(factor_probe(
        [k, random, timed](size_t i) {
          auto x = random({k.factor_shapes[i].first, k.factor_shapes[i].second});
          return timed([&] { (void)math::covariance(x); });
        },
        at, &Rates::factor));
  }
  std::vector<std::array<int64_t, 5>> stride_one, unfold;  // 3 x 3, stride 1
  std::vector<std::pair<double, double>> conv_a_at, conv_g_at, patches_at, unfold_at;
  for (const auto& [batch, channels, side] : k.conv_inputs) {
    stride_one.push_back({batch, channels, side, 3, 1});
    conv_a_at.push_back(conv_a_point(batch, channels, side, 3, 1));
    conv_g_at.emplace_back(static_cast<double>(batch * side * side), static_cast<double>(channels));
  }
  for (const auto& c : k.patch_convs) patches_at.push_back(conv_a_point(c[0], c[1], c[2], c[3], c[4]));
  for (const auto& [batch, channels, side] : k.unfold_convs) {
    unfold.push_back({batch, channels, side, 3, 1});
    unfold_at.push_back(conv_a_point(batch, channels, side, 3, 1));
  }
  probes.push_back(factor_probe([stride_one, conv_a](size_t i) { return conv_a(stride_one[i]); },
                                conv_a_at, &Rates::conv_factor));
  probes.push_back(factor_probe(
      [k, random, timed](size_t i) {
        const auto& [batch, channels, side] = k.conv_inputs[i];
        auto y = random({batch, channels, side, side});
        return timed([&] { (void)math::conv2d_g_factor(y); });
      },
      conv_g_at, &Rates::conv_g_factor));
  probes.push_back(factor_probe([k, conv_a](size_t i) { return conv_a(k.patch_convs[i]); },
                                patches_at, &Rates::conv_patches_factor));
  probes.push_back(factor_probe([unfold, conv_a](size_t i) { return conv_a(unfold[i]); }, unfold_at,
                                &Rates::conv_unfold_factor));
  probes.push_back(KernelProbe{
      k.fold_shapes.size(),
      [k, spd, timed](std::vector<double>& figures) {
        for (const auto& [a, g] : k.fold_shapes) {
          auto a_factor = spd(a), g_factor = spd(g), a_batch = spd(a), g_batch = spd(g);
          figures.push_back(timed([&] { (void)math::fold_factors(a_factor, g_factor, a_batch, g_batch, 0.95); }));
        }
      },
      [k](const double* figures, Rates& rates) {
        std::vector<double> entries;
        for (const auto& [a, g] : k.fold_shapes) entries.push_back(static_cast<double>(a * a + g * g));
        const auto [seconds, per_entry] = fit_affine(entries, {figures, figures + entries.size()});
        rates.fold = FoldRate{seconds, per_entry};
      }});
  probes.push_back(KernelProbe{
      k.decomposition_dims.size(),
      [k, method, dtype, device](std::vector<double>& figures) {
        for (int64_t d : k.decomposition_dims) figures.push_back(time_decomposition(d, method, dtype, device));
      },
      [k](const double* figures, Rates& rates) {
        rates.decomposition = DecompositionRate{};
        rates.decomposition.dims = k.decomposition_dims;
        rates.decomposition.seconds.assign(figures, figures + k.decomposition_dims.size());
      }});
  if (method == ComputeMethod::kEigen) {  // the eigenbasis refresh (Options::eigh_interval), at the same dims
    probes.push_back(KernelProbe{
        k.decomposition_dims.size(),
        [k, dtype, device](std::vector<double>& figures) {
          for (int64_t d : k.decomposition_dims) figures.push_back(time_refresh(d, dtype, device));
        },
        [k](const double* figures, Rates& rates) {
          rates.refresh = DecompositionRate{};
          rates.refresh.dims = k.decomposition_dims;
          rates.refresh.seconds.assign(figures, figures + k.decomposition_dims.size());
        }});
  }
  probes.push_back(KernelProbe{
      k.precondition_shapes.size(),
      [k, method, random, spd, timed](std::vector<double>& figures) {
        for (const auto& [g, a] : k.precondition_shapes) {
          auto grad = random({g, a});
          if (method == ComputeMethod::kEigen) {
            const auto ea = math::eigen_decompose(spd(a));
            const auto eg = math::eigen_decompose(spd(g));
            const auto denominator = math::eigen_denominator(ea, eg, 1e-3);
            figures.push_back(timed([&] { (void)math::precondition_eigen(ea, eg, denominator, grad); }));
          } else {
            const auto ia = math::damped_inverse(spd(a), 1e-3);
            const auto ig = math::damped_inverse(spd(g), 1e-3);
            figures.push_back(timed([&] { (void)math::precondition_inverse(ia, ig, grad); }));
          }
        }
      },
      [k, method](const double* figures, Rates& rates) {
        std::vector<double> flops;
        for (const auto& [g, a] : k.precondition_shapes) {
          flops.push_back((method == ComputeMethod::kEigen ? 4.0 : 2.0) * g * a * static_cast<double>(g + a));
        }
        const auto [seconds, per_flop] = fit_affine(flops, {figures, figures + flops.size()});
        rates.precondition = PreconditionRate{seconds, per_flop};
      }});
  return probes;
}

size_t figure_count(const std::vector<KernelProbe>& probes) {
  size_t n = 0;
  for (const auto& probe : probes) n += probe.points;
  return n;
}

void time_kernels(const std::vector<KernelProbe>& probes, std::vector<double>& figures) {
  torch::NoGradGuard no_grad;
  for (const auto& probe : probes) {
    const size_t before = figures.size();
    probe.time(figures);
    TORCH_INTERNAL_ASSERT(figures.size() == before + probe.points, "a kernel probe timed ", figures.size() - before,
                          " points of ", probe.points);
  }
}

/// Fits every probe's rate from its figures, which start at `figures[at]` in time_kernels' order.
void fit_kernels(const std::vector<KernelProbe>& probes, const std::vector<double>& figures, size_t at, Rates& rates) {
  TORCH_CHECK(at + figure_count(probes) <= figures.size(), "rates: ", figures.size(), " figures, ",
              at + figure_count(probes), " needed");
  for (const auto& probe : probes) {
    probe.fit(figures.data() + at, rates);
    at += probe.points;
  }
}

Rates conditions(c10::Device device, c10::ScalarType dtype, ComputeMethod method, int world_size) {
  Rates rates;
  rates.world_size = world_size;
  rates.ranks_per_node = world_size;
  rates.parallel_ranks = world_size;  // measure_rates measures it
  rates.device = device.str();
  rates.dtype = dtype;
  rates.method = method;
  rates.threads = at::get_num_threads();
  return rates;
}

}  // namespace

double FactorRate::seconds_for(int64_t rows, int64_t d) const {
  const double r = static_cast<double>(rows);
  return seconds + per_entry * r * d + per_flop * 2.0 * r * d * d;
}

double FoldRate::seconds_for(int64_t a, int64_t g) const {
  return seconds + per_entry * static_cast<double>(a * a + g * g);
}

double DecompositionRate::seconds_for(int64_t d) const {
  if (dims.empty()) return latency + per_cubed_dim * cube(d);
  if (d <= dims.front()) return seconds.front();
  if (d >= dims.back()) return seconds.back() * cube(d) / cube(dims.back());
  const size_t hi = static_cast<size_t>(std::lower_bound(dims.begin(), dims.end(), d) - dims.begin());
  if (dims[hi] == d) return seconds[hi];
  const size_t lo = hi - 1;
  // Log-log interpolation: exact for a power law between the two measured points.
  const double t = (std::log(static_cast<double>(d)) - std::log(static_cast<double>(dims[lo]))) /
                   (std::log(static_cast<double>(dims[hi])) - std::log(static_cast<double>(dims[lo])));
  const double low = std::max(seconds[lo], 1e-12);
  const double high = std::max(seconds[hi], 1e-12);
  return std::exp(std::log(low) + t * (std::log(high) - std::log(low)));
}

double PreconditionRate::seconds_for(int64_t g, int64_t a, ComputeMethod method) const {
  const double flops = (method == ComputeMethod::kEigen ? 4.0 : 2.0) * g * a * static_cast<double>(g + a);
  return seconds + per_flop * flops;
}

FactorRate& Rates::for_kernel(math::FactorKernel kernel) {
  return const_cast<FactorRate&>(std::as_const(*this).for_kernel(kernel));
}

const FactorRate& Rates::for_kernel(math::FactorKernel kernel) const {
  switch (kernel) {
    case math::FactorKernel::kCovariance: return factor;
    case math::FactorKernel::kConvRowShift: return conv_factor;
    case math::FactorKernel::kConvPatches: return conv_patches_factor;
    case math::FactorKernel::kConvUnfold: return conv_unfold_factor;
    case math::FactorKernel::kConvGradient: return conv_g_factor;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown factor kernel ", static_cast<int>(kernel));
}

int64_t Rates::element_bytes() const { return static_cast<int64_t>(c10::elementSize(dtype)); }

namespace {

/// An allreduce `link` measured on `world_size` ranks, scaled to a group of `group_size` as a ring would.
double ring_seconds(const assign::AlphaBeta& link, int world_size, int group_size, double bytes) {
  if (group_size <= 1) return 0.0;
  if (world_size <= 1) return link.seconds(bytes);  // nothing measured to scale from
  const double k = group_size;
  const double p = world_size;
  return link.alpha * (k - 1) / (p - 1) + link.beta * bytes * ((k - 1) / k) / ((p - 1) / p);
}

}  // namespace

double Rates::allreduce_seconds(int group_size, double bytes) const {
  return ring_seconds(allreduce, world_size, group_size, bytes);
}

double Rates::busy_allreduce_seconds(int group_size, double bytes) const {
  return ring_seconds(allreduce_busy, world_size, group_size, bytes);
}

double Rates::broadcast_seconds(int group_size, double bytes) const {
  if (group_size <= 1) return 0.0;
  if (world_size <= 1) return broadcast.seconds(bytes);
  const double scale = static_cast<double>(group_size - 1) / (world_size - 1);
  return scale * broadcast.seconds(bytes);
}

int64_t Rates::spd_redundant_dim(int group_size) const {
  const double alpha = allreduce_seconds(group_size, 0.0);
  const assign::AlphaBeta link{alpha, allreduce_seconds(group_size, 1.0) - alpha};
  return strategy::spd_redundant_dim(decomposition.seconds_for(kSpdProbeDim), link, dtype, method);
}

void Rates::validate() const {
  TORCH_CHECK(world_size >= 1, "rates: world_size must be >= 1, got ", world_size);
  TORCH_CHECK(threads >= 1, "rates: threads must be >= 1, got ", threads);
  TORCH_CHECK(ranks_per_node >= 1, "rates: ranks_per_node must be >= 1, got ", ranks_per_node);
  TORCH_CHECK(std::isfinite(parallel_ranks) && parallel_ranks >= 1 && parallel_ranks <= ranks_per_node,
              "rates: parallel_ranks must be in [1, ranks_per_node = ", ranks_per_node, "], got ", parallel_ranks);
  const auto check = [](const std::string& name, double v) {
    TORCH_CHECK(std::isfinite(v) && v >= 0, "rates: ", name, " must be finite and >= 0, got ", v);
  };
  check("allreduce.alpha", allreduce.alpha);
  check("allreduce.beta", allreduce.beta);
  check("allreduce_busy.alpha", allreduce_busy.alpha);
  check("allreduce_busy.beta", allreduce_busy.beta);
  check("broadcast.alpha", broadcast.alpha);
  check("broadcast.beta", broadcast.beta);
  const auto check_factor = [&](const std::string& name, const FactorRate& rate) {
    check(name + ".seconds", rate.seconds);
    check(name + ".per_entry", rate.per_entry);
    check(name + ".per_flop", rate.per_flop);
  };
  check_factor("factor", factor);
  check_factor("conv_factor", conv_factor);
  check_factor("conv_g_factor", conv_g_factor);
  check_factor("conv_patches_factor", conv_patches_factor);
  check_factor("conv_unfold_factor", conv_unfold_factor);
  check("fold.seconds", fold.seconds);
  check("fold.per_entry", fold.per_entry);
  TORCH_CHECK(std::isfinite(side_work_cost) && side_work_cost >= 0 && side_work_cost <= 1,
              "rates: side_work_cost must be in [0, 1], got ", side_work_cost);
  check("precondition.seconds", precondition.seconds);
  check("precondition.per_flop", precondition.per_flop);
  const auto check_table = [&](const std::string& name, const DecompositionRate& rate) {
    check(name + ".latency", rate.latency);
    check(name + ".per_cubed_dim", rate.per_cubed_dim);
    TORCH_CHECK(rate.dims.size() == rate.seconds.size(), "rates: ", name, " has ", rate.dims.size(),
                " dims but ", rate.seconds.size(), " times");
    for (size_t i = 0; i < rate.dims.size(); ++i) {
      TORCH_CHECK(rate.dims[i] >= 1 && (i == 0 || rate.dims[i] > rate.dims[i - 1]), "rates: ", name,
                  " dims must be ascending and >= 1, got ", rate.dims[i], " at ", i);
      check(name + ".seconds", rate.seconds[i]);
    }
  };
  check_table("decomposition", decomposition);
  check_table("refresh", refresh);
}

double Rates::refresh_seconds(int64_t d) const {
  return refresh.measured() ? refresh.seconds_for(d) : decomposition.seconds_for(d);
}

double averaged_update_seconds(double full, double refresh, int64_t eigh_interval) {
  if (eigh_interval <= 1) return full;
  const double k = static_cast<double>(eigh_interval);
  return (full + (k - 1) * refresh) / k;
}

double Rates::second_order_seconds(int64_t d, int64_t eigh_interval) const {
  return averaged_update_seconds(decomposition.seconds_for(d), refresh_seconds(d), eigh_interval);
}

Rates measure_rates(comm::Communicator& communicator, c10::Device device, c10::ScalarType dtype,
                    ComputeMethod method) {
  constexpr int kBusyRepeats = 25;
  const int world = communicator.size();
  Rates rates = conditions(device, dtype, method, world);
  std::vector<double> figures;
  // Collectives first, while every rank is at the same point, timed as SPD-KFAC's link is (measure.h).
  const auto time_collectives = [&](Collective collective, bool busy) {
    const auto seconds = busy ? time_link(communicator, comm::kWorld, device, collective, kBusyRepeats, /*mean=*/true)
                              : time_link(communicator, comm::kWorld, device, collective);
    figures.insert(figures.end(), seconds.begin(), seconds.end());
  };
  if (world > 1) {
    time_collectives(Collective::kAllreduce, /*busy=*/false);
    time_collectives(Collective::kBroadcast, /*busy=*/false);
    // The allreduces again, with this rank computing meanwhile. Where ranks outnumber the cores, waiting to be
    // scheduled comes and goes (docs/STRATEGIES.md, "Choosing automatically", Rates), and a job pays the mean
    // of many: the mean of 25.
    ComputeLoop computing(device, dtype);
    time_collectives(Collective::kAllreduce, /*busy=*/true);
  }
  if (world > 1) comm::average_over(communicator, comm::kWorld, figures);
  // Kernels by rank 0 alone; the others wait in the broadcast of its figures (blocked, not computing).
  const auto probes = kernel_probes(kernel_plan(method), device, dtype, method);
  const size_t kernels_at = figures.size();
  std::vector<double> kernels;
  if (communicator.rank() == 0) {
    time_kernels(probes, kernels);
    kernels.push_back(time_probe(device, dtype));
  }
  if (world > 1) {
    auto t = torch::zeros({static_cast<int64_t>(figure_count(probes) + 1)}, torch::kFloat64);
    if (communicator.rank() == 0) t.copy_(torch::tensor(kernels, torch::kFloat64));
    t = t.to(communicator.control_device());
    communicator.broadcast(t, 0, comm::kWorld, comm::Purpose::kCalibration).wait();
    t = t.cpu();
    kernels.assign(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
    // The same kernel on every rank at once: how many ranks compute at full speed together.
    std::vector<double> together = {time_probe(device, dtype)};
    comm::average_over(communicator, comm::kWorld, together);
    const double cores = std::max(1u, std::thread::hardware_concurrency());
    const double most = device.is_cpu() ? cores / std::max(1, rates.threads) : world;
    rates.parallel_ranks = parallel_ranks_from(world, kernels.back(), together[0], most);
  }
  // Options::second_order_lag: a decomposition beside the steps, timed by every rank at once as a job's ranks run
  // theirs (where ranks fill a machine's cores, the side thread takes another rank's), averaged over the ranks.
  const auto side = time_side_work(method, dtype, device, [&] {
    std::vector<double> nothing = {0.0};
    if (world > 1) comm::average_over(communicator, comm::kWorld, nothing);  // every rank at the same timing
  });
  std::vector<double> side_figures = {side.main, side.side, side.together};
  if (world > 1) comm::average_over(communicator, comm::kWorld, side_figures);
  rates.side_work_cost = side_work_cost_from({side_figures[0], side_figures[1], side_figures[2]});
  figures.insert(figures.end(), kernels.begin(), kernels.end() - 1);
  if (world > 1) {
    const auto n = static_cast<std::ptrdiff_t>(link_sizes().size());
    auto at = figures.begin();
    for (auto* link : {&rates.allreduce, &rates.broadcast, &rates.allreduce_busy}) {  // in the order timed above
      *link = fit_link(std::vector<double>(at, at + n));
      at += n;
    }
  }
  fit_kernels(probes, figures, kernels_at, rates);
  return rates;
}

double parallel_ranks_from(int world, double alone_seconds, double together_seconds, double most) {
  const double cap = std::clamp(most, 1.0, static_cast<double>(world));
  return std::clamp(world * alone_seconds / std::max(together_seconds, 1e-12), 1.0, cap);
}

size_t agree_on_choice(comm::Communicator& communicator, size_t index) {
  if (communicator.size() <= 1) return index;
  auto t = torch::tensor({static_cast<int64_t>(index)}, torch::kInt64).to(communicator.control_device());
  communicator.broadcast(t, 0, comm::kWorld, comm::Purpose::kCalibration).wait();
  return static_cast<size_t>(t.item<int64_t>());
}

Rates measure_local_rates(c10::Device device, c10::ScalarType dtype, ComputeMethod method) {
  Rates rates = conditions(device, dtype, method, 1);
  const auto probes = kernel_probes(kernel_plan(method), device, dtype, method);
  std::vector<double> figures;
  time_kernels(probes, figures);
  fit_kernels(probes, figures, 0, rates);
  rates.side_work_cost = side_work_cost_from(time_side_work(method, dtype, device));
  return rates;
}

}  // namespace dkfac::strategy
