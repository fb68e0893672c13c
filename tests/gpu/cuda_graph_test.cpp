// Options::cuda_graphs on CUDA (Note [a step's CUDA graph], dkfac/preconditioner_graph.cpp): steps replayed from
// a captured graph write what eager steps write, bit for bit, through factor and second-order updates, a learning
// rate that changes at every step, KL clipping and a NaN gradient; gradients that move at every step are never
// replayed, and the report says why. Registered under ctest's gpu label; every test skips, saying why, without a
// CUDA device.
#include <gtest/gtest.h>

#include <deque>
#include <limits>

#include "dkfac/dkfac.h"
#include "tests/test_util.h"

namespace dkfac {
namespace {

// A convolution, a Linear, two Linears of one shape (one stacked group) and a head without bias.
struct Net : torch::nn::Module {
  Net() {
    conv = register_module("conv", nn::Conv2d(torch::nn::Conv2dOptions(3, 6, 3).padding(1).stride(2)));
    fc1 = register_module("fc1", nn::Linear(6 * 4 * 4, 32));
    fc2 = register_module("fc2", nn::Linear(32, 32));
    fc3 = register_module("fc3", nn::Linear(32, 32));
    head = register_module("head", nn::Linear(torch::nn::LinearOptions(32, 10).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(fc1->forward(torch::relu(conv->forward(x)).flatten(1)));
    h = torch::tanh(fc3->forward(torch::tanh(fc2->forward(h))));
    return head->forward(h);
  }
  nn::Conv2d conv{nullptr};
  nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr}, head{nullptr};
};

constexpr int64_t kSteps = 24;
constexpr int64_t kNanStep = 17;  // a step without updates (factor_update_steps 2), after graphs were replayed

struct Run {
  std::vector<std::vector<torch::Tensor>> grads;  // each parameter's gradient after each step(), on the CPU
  CudaGraphReport report;
  LayerEvents events;
  std::vector<std::string> warnings;
};

// kSteps steps of SGD on `options` (cuda_graphs as given), the same batches and weights whatever the options.
// `moved`: every gradient copied to new memory after each backward pass (the old ones kept alive, so no address
// comes back). At kNanStep fc2's weight gradient gets a NaN, which the guard keeps out of the others.
Run run(Options options, bool cuda_graphs, bool moved = false) {
  const c10::Device cuda(c10::kCUDA, 0);
  torch::manual_seed(5);
  auto net = std::make_shared<Net>();
  net->to(cuda);
  testing::CapturedWarnings warnings;
  Preconditioner kfac(net, options.cuda_graphs(cuda_graphs));
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05));
  std::deque<torch::Tensor> held;
  Run out;
  for (int64_t step = 0; step < kSteps; ++step) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(200 + step);
    auto x = torch::randn({16, 3, 8, 8}, g).to(cuda);
    auto y = torch::randint(0, 10, {16}, g, torch::kLong).to(cuda);
    sgd.zero_grad(/*set_to_none=*/false);  // the gradients stay where they are
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    if (moved) {
      for (auto& p : net->parameters()) {
        held.push_back(p.grad());
        p.mutable_grad() = p.grad().clone();
      }
    }
    if (step == kNanStep) {
      torch::NoGradGuard no_grad;
      net->fc2->weight.grad()[0][0] = std::numeric_limits<double>::quiet_NaN();
    }
    kfac.step();
    std::vector<torch::Tensor> grads;
    for (auto& p : net->parameters()) {
      grads.push_back(p.grad().to(torch::kCPU));
      torch::NoGradGuard no_grad;
      p.grad().nan_to_num_(0.0);  // the NaN step's plain gradient, kept out of the weights
    }
    out.grads.push_back(grads);
    sgd.step();
  }
  out.report = kfac.cuda_graph_report();
  out.events = kfac.events();
  out.warnings = warnings.messages;
  return out;
}

// Equal bit for bit, NaN where NaN.
void expect_same(const Run& got, const Run& expected, const std::string& what) {
  ASSERT_EQ(got.grads.size(), expected.grads.size());
  for (size_t step = 0; step < got.grads.size(); ++step) {
    for (size_t p = 0; p < got.grads[step].size(); ++p) {
      const auto& a = got.grads[step][p];
      const auto& b = expected.grads[step][p];
      EXPECT_TRUE(torch::equal(torch::isnan(a), torch::isnan(b)) && torch::equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))
          << what << ": step " << step << ", parameter " << p << ", largest difference "
          << (a.nan_to_num(0.0) - b.nan_to_num(0.0)).abs().max().item<double>();
    }
  }
  EXPECT_EQ(got.events.fallbacks, expected.events.fallbacks) << what;
}

struct Case {
  const char* name;
  Options options;
};

class OnCudaGraphs : public ::testing::TestWithParam<Case> {};

Options base() {
  return Options()
      .lr([](int64_t step) { return 0.05 * (1.0 + 0.1 * static_cast<double>(step)); })  // new at every step
      .damping(0.01)
      .kl_clip(1e-3)
      .factor_update_steps(2)
      .inv_update_steps(4);
}

// The steps without updates replay a graph (captured at the second of them with one key: step 3), and every
// step's gradients are the eager run's, bit for bit: the stacked products, the guard's rows and KL clipping's
// scale at each step's lr, the NaN layer's plain gradient.
TEST_P(OnCudaGraphs, ReplaysEqualEagerStepsBitForBit) {
  DKFAC_REQUIRE_CUDA();
  const auto& c = GetParam();
  const auto eager = run(c.options, false);
  const auto graphed = run(c.options, true);
  expect_same(graphed, eager, c.name);
  EXPECT_EQ(eager.events.fallbacks, 1) << "the NaN gradient's layer at step " << kNanStep;
  const auto& r = graphed.report;
  EXPECT_EQ(r.off, "") << c.name;
  EXPECT_GE(r.captures, 1) << c.name << ": " << r.last_eager;
  // 12 steps without updates (the odd ones); the first runs eagerly, the second captures and replays.
  EXPECT_GE(r.replays, 6) << c.name << ": " << r.captures << " captures, last eager step: " << r.last_eager;
  EXPECT_EQ(r.replays + r.eager_steps, kSteps) << c.name;
  EXPECT_EQ(eager.report.replays + eager.report.captures + eager.report.eager_steps, 0) << "option off: no report";
}

INSTANTIATE_TEST_SUITE_P(
    Variants, OnCudaGraphs,
    ::testing::Values(Case{"eigenStacked", base()}, Case{"unpadded", base().pad_widths(1)},
                      Case{"inverse", base().compute_method(ComputeMethod::kInverse)},
                      Case{"layerByLayer", base().stack_layers(false)},
                      Case{"noKlClip", base().kl_clip(0.0)},
                      Case{"tf32", base().precondition_dtype(PreconditionDtype::kTf32)},
                      Case{"lag", base().second_order_lag(2)},
                      // the moments stepped and rotated in place, the steps that rotate them eager
                      Case{"eigenAdam", base().kl_clip(0.0).eigen_adam(true)},
                      Case{"eigenAdamLayerByLayer", base().kl_clip(0.0).eigen_adam(true).stack_layers(false)}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// Gradients in new memory at every step: no graph is ever captured (each eligible step's key is new), every step is
// eager and equal to the eager run, and after 8 such steps in a row a warning says what moved.
TEST(OnCudaGraphsMoved, GradientsInNewMemoryRunEagerlyAndSaySo) {
  DKFAC_REQUIRE_CUDA();
  const auto eager = run(base(), false, /*moved=*/true);
  const auto graphed = run(base(), true, /*moved=*/true);
  expect_same(graphed, eager, "moved gradients");
  EXPECT_EQ(graphed.report.captures, 0);
  EXPECT_EQ(graphed.report.replays, 0);
  EXPECT_EQ(graphed.report.eager_steps, kSteps);
  EXPECT_NE(graphed.report.last_eager.find("gradients' memory"), std::string::npos) << graphed.report.last_eager;
  std::string all;
  for (const auto& w : graphed.warnings) all += w + "\n";
  EXPECT_NE(all.find("steps in a row that a CUDA graph could replay ran eagerly"), std::string::npos) << all;
}

// eigen_adam: the step that rotates the moments into a new eigenbasis is an update step here (the update and the
// rotation at one step); the one after it replays. Under lag 2 an update installs two steps after it starts, at a
// step that updates factors, and the rotation comes with it: at most one capture per basis either way, and each
// report names the reason of an eager step, none naming the moments once they exist.
TEST(OnCudaGraphsMoved, EigenAdamReplaysBetweenRotations) {
  DKFAC_REQUIRE_CUDA();
  for (const int64_t lag : {0, 2}) {
    const auto options = base().kl_clip(0.0).eigen_adam(true).second_order_lag(lag);
    const auto eager = run(options, false);
    const auto graphed = run(options, true);
    const std::string what = "eigen_adam, lag " + std::to_string(lag);
    expect_same(graphed, eager, what);
    EXPECT_GE(graphed.report.replays, 6) << what << ": " << graphed.report.last_eager;
    EXPECT_EQ(graphed.report.last_eager.find("eigen_adam"), std::string::npos) << what << ": "
                                                                              << graphed.report.last_eager;
  }
}

}  // namespace
}  // namespace dkfac
