#include "dkfac/preconditioner.h"

#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <sstream>
#include <atomic>
#include <thread>

#include "dkfac/dkfac.h"
#include "dkfac/strategy/prediction.h"
#include "tests/multi_rank.h"
#include "tests/test_util.h"

namespace dkfac {
namespace {

using dkfac::testing::dense_eigen_reference;
using dkfac::testing::dense_inverse_reference;

// conv (stride 2, dilation 2) -> relu -> fc1 (bias) on [B, T, F] sequence-like features -> relu -> fc2 (no bias).
struct TinyNet : torch::nn::Module {
  TinyNet() {
    conv = register_module("conv", nn::Conv2d(torch::nn::Conv2dOptions(2, 3, 3).stride(2).padding(2).dilation(2)));
    fc1 = register_module("fc1", nn::Linear(torch::nn::LinearOptions(3 * 3, 5)));
    fc2 = register_module("fc2", nn::Linear(torch::nn::LinearOptions(5, 2).bias(false)));
  }
  // Intermediate tensors with retained gradients, for the reference.
  struct Taps {
    torch::Tensor x, conv_out, fc1_in, fc1_out, fc2_in, fc2_out;
  };
  Taps forward_taps(const torch::Tensor& x) {
    Taps t;
    t.x = x;
    t.conv_out = conv->forward(x);                                   // [B, 3, 3, 3]
    t.fc1_in = torch::relu(t.conv_out).permute({0, 2, 1, 3}).reshape({x.size(0), 3, 9});  // [B, T=3, 9]
    t.fc1_out = fc1->forward(t.fc1_in);                              // [B, 3, 5]
    t.fc2_in = torch::relu(t.fc1_out);
    t.fc2_out = fc2->forward(t.fc2_in);                              // [B, 3, 2]
    for (auto* o : {&t.conv_out, &t.fc1_out, &t.fc2_out}) o->retain_grad();
    return t;
  }
  torch::Tensor loss(const Taps& t, const torch::Tensor& target) { return (t.fc2_out - target).pow(2).mean(); }
  nn::Conv2d conv{nullptr};
  nn::Linear fc1{nullptr}, fc2{nullptr};
};

struct Batch {
  torch::Tensor x, target;
};

Batch make_batch(int64_t seed, int64_t b = 4) {
  torch::manual_seed(seed);
  return {torch::randn({b, 2, 5, 5}, torch::kFloat64), torch::randn({b, 3, 2}, torch::kFloat64)};
}

// zero_grad, forward on make_batch(seed) and backward: the start of every step below.
TinyNet::Taps zero_grad_and_backward(TinyNet& net, int64_t seed) {
  auto batch = make_batch(seed);
  net.zero_grad();
  auto taps = net.forward_taps(batch.x);
  net.loss(taps, batch.target).backward();
  return taps;
}

std::shared_ptr<TinyNet> make_net() {
  torch::manual_seed(42);
  auto net = std::make_shared<TinyNet>();
  net->to(torch::kFloat64);
  return net;
}

// Everything the reference needs from one forward/backward.
struct LayerBatch {
  torch::Tensor a, g, grad;
};

std::vector<LayerBatch> reference_batch(TinyNet& net, const TinyNet::Taps& t) {
  std::vector<LayerBatch> out(3);
  out[0].a = math::conv2d_a_factor(t.x, net.conv->geometry(), true);
  out[0].g = math::conv2d_g_factor(t.conv_out.grad());
  out[0].grad = torch::cat({net.conv->weight.grad().reshape({3, -1}), net.conv->bias.grad().reshape({-1, 1})}, 1);
  out[1].a = math::linear_a_factor(t.fc1_in.detach(), true);
  out[1].g = math::linear_g_factor(t.fc1_out.grad());
  out[1].grad = torch::cat({net.fc1->weight.grad(), net.fc1->bias.grad().reshape({-1, 1})}, 1);
  out[2].a = math::linear_a_factor(t.fc2_in.detach(), false);
  out[2].g = math::linear_g_factor(t.fc2_out.grad());
  out[2].grad = net.fc2->weight.grad().clone();
  return out;
}

std::vector<torch::Tensor> gradients(TinyNet& net) {
  return {torch::cat({net.conv->weight.grad().reshape({3, -1}), net.conv->bias.grad().reshape({-1, 1})}, 1),
          torch::cat({net.fc1->weight.grad(), net.fc1->bias.grad().reshape({-1, 1})}, 1),
          net.fc2->weight.grad().clone()};
}

// Reference V for one layer from running factors.
torch::Tensor reference_v(const torch::Tensor& a, const torch::Tensor& g, const torch::Tensor& grad,
                          const Options& options, double damping) {
  if (options.compute_method() == ComputeMethod::kEigen) return dense_eigen_reference(a, g, grad, damping);
  double da = damping, dg = damping;
  if (options.pi_damping()) std::tie(da, dg) = math::pi_damping(a, g, damping);
  return dense_inverse_reference(a, g, grad, da, dg);
}

std::vector<torch::Tensor> reference_step(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& g,
                                          const std::vector<torch::Tensor>& grads, const Options& options,
                                          double damping, double lr, double kl_clip) {
  std::vector<torch::Tensor> v;
  double vg = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    v.push_back(reference_v(a[i], g[i], grads[i], options, damping));
    vg += (v.back() * grads[i]).sum().item<double>() * lr * lr;
  }
  const double nu = kl_clip > 0 ? std::min(1.0, std::sqrt(kl_clip / std::abs(vg))) : 1.0;
  for (auto& t : v) t = t * nu;
  return v;
}

class PreconditionerMethods : public ::testing::TestWithParam<int> {
 protected:
  Options options() const {
    Options o = Options().lr(0.1).damping(0.01).factor_decay(0.9).kl_clip(1e-6);
    if (GetParam() >= 1) o.compute_method(ComputeMethod::kInverse);
    if (GetParam() == 2) o.pi_damping(true);
    return o;
  }
};

// Two steps with factor/inverse updates every step: running averages from I, every layer kind,
// KL clipping (active: nu < 1), against dense Kronecker solves.
TEST_P(PreconditionerMethods, MatchesDenseReferenceOverSteps) {
  auto net = make_net();
  const auto opts = options();
  Preconditioner kfac(net, opts);
  ASSERT_EQ(kfac.layers().size(), 3u);
  std::vector<torch::Tensor> a_run(3), g_run(3);
  for (int64_t step = 0; step < 2; ++step) {
    auto taps = zero_grad_and_backward(*net, 100 + step);
    auto ref = reference_batch(*net, taps);
    std::vector<torch::Tensor> grads;
    for (size_t i = 0; i < 3; ++i) {
      auto a_prev = a_run[i].defined() ? a_run[i] : torch::eye(ref[i].a.size(0), torch::kFloat64);
      auto g_prev = g_run[i].defined() ? g_run[i] : torch::eye(ref[i].g.size(0), torch::kFloat64);
      a_run[i] = 0.9 * a_prev + 0.1 * ref[i].a;
      g_run[i] = 0.9 * g_prev + 0.1 * ref[i].g;
      grads.push_back(ref[i].grad);
    }
    auto expected = reference_step(a_run, g_run, grads, opts, 0.01, 0.1, 1e-6);
    kfac.step();
    EXPECT_LT(kfac.last_kl_scale(), 1.0) << "test must exercise KL clipping";
    auto actual = gradients(*net);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_TENSOR_NEAR(actual[i], expected[i], 1e-5) << "layer " << i << " step " << step;
      EXPECT_TENSOR_NEAR(kfac.layers()[i].a_factor(), a_run[i], 1e-12);
      EXPECT_TENSOR_NEAR(kfac.layers()[i].g_factor(), g_run[i], 1e-12);
    }
  }
  EXPECT_EQ(kfac.steps(), 2);
}

INSTANTIATE_TEST_SUITE_P(Methods, PreconditionerMethods, ::testing::Values(0, 1, 2),
                         [](const auto& info) {
                           return std::string(info.param == 0 ? "Eigen" : info.param == 1 ? "Inverse" : "PiInverse");
                         });

TEST(Preconditioner, Float32MatchesFloat64Reference) {
  torch::manual_seed(42);
  auto net = std::make_shared<TinyNet>();
  Preconditioner kfac(net, Options().damping(0.01).kl_clip(0));
  auto batch = make_batch(7);
  auto taps = net->forward_taps(batch.x.to(torch::kFloat32));
  net->loss(taps, batch.target.to(torch::kFloat32)).backward();
  auto ref = reference_batch(*net, taps);
  kfac.step();
  auto actual = gradients(*net);
  for (size_t i = 0; i < 3; ++i) {
    auto a = 0.95 * torch::eye(ref[i].a.size(0)) + 0.05 * ref[i].a;
    auto g = 0.95 * torch::eye(ref[i].g.size(0)) + 0.05 * ref[i].g;
    EXPECT_TENSOR_NEAR(actual[i], dense_eigen_reference(a, g, ref[i].grad, 0.01), 1e-4) << "layer " << i;
  }
}

TEST(Preconditioner, IntervalsCaptureOnlyOnFactorSteps) {
  auto net = make_net();
  Preconditioner kfac(net, Options().factor_update_steps(2).inv_update_steps(3).kl_clip(0));
  std::vector<torch::Tensor> last_eigvecs;
  for (int64_t step = 0; step < 6; ++step) {
    zero_grad_and_backward(*net, 200 + step);
    const bool factor_step = step % 2 == 0;
    EXPECT_EQ(kfac.is_factor_step(step), factor_step);
    // Held, or folded in the hooks (Options::fold_in_hooks: from the second factor update on).
    const auto& capture = net->fc1->factor_capture();
    EXPECT_EQ(capture.folded_passes() + capture.a_count(), factor_step ? 1 : 0) << "step " << step;
    EXPECT_EQ(capture.folded_passes() + capture.g_count(), factor_step ? 1 : 0) << "step " << step;
    auto a_before = kfac.layers()[1].a_factor();
    kfac.step();
    if (step > 0 && !factor_step) EXPECT_TRUE(torch::equal(a_before, kfac.layers()[1].a_factor()));
    auto q = kfac.layers()[1].second_order().a_eigen.eigenvectors;
    if (step % 3 == 0) {
      last_eigvecs.push_back(q);
    } else {
      EXPECT_TRUE(q.is_same(last_eigvecs.back())) << "second order must only change on inverse steps";
    }
  }
  EXPECT_EQ(last_eigvecs.size(), 2u);
}

TEST(Preconditioner, ScheduledIntervalsAndDamping) {
  auto net = make_net();
  std::vector<double> dampings;
  Preconditioner kfac(net, Options()
                               .kl_clip(0)
                               .factor_update_steps([](int64_t step) -> int64_t { return step < 2 ? 1 : 4; })
                               .damping([&](int64_t step) {
                                 dampings.push_back(step);
                                 return step < 1 ? 0.1 : 0.01;
                               }));
  for (int64_t step = 0; step < 4; ++step) {
    zero_grad_and_backward(*net, 300 + step);
    const auto& capture = net->fc2->factor_capture();  // held, or folded in the hooks
    EXPECT_EQ(capture.folded_passes() + capture.a_count(), step < 2 ? 1 : 0) << "step " << step;
    kfac.step();
  }
  ASSERT_GE(dampings.size(), 4u);
  auto& so = kfac.layers()[2].second_order();
  auto expected = math::eigen_denominator(so.a_eigen, so.g_eigen, 0.01);
  EXPECT_TENSOR_NEAR(so.denominator, expected, 1e-12) << "damping schedule must be read at the step";
}

TEST(Preconditioner, AccumulationAveragesMicroBatchFactors) {
  auto net = make_net();
  Preconditioner kfac(net, Options().accumulation_steps(2).kl_clip(0).factor_decay(0.5));
  std::vector<std::vector<LayerBatch>> refs;
  for (int micro = 0; micro < 2; ++micro) {
    auto batch = make_batch(400 + micro, 3);
    auto taps = net->forward_taps(batch.x);
    net->loss(taps, batch.target).backward();
    refs.push_back(reference_batch(*net, taps));  // grads are cumulative; only factors are used
  }
  auto grads = gradients(*net);
  kfac.step();
  auto actual = gradients(*net);
  for (size_t i = 0; i < 3; ++i) {
    auto a_batch = (refs[0][i].a + refs[1][i].a) / 2;
    auto g_batch = (refs[0][i].g + refs[1][i].g) / 2;
    auto a = 0.5 * torch::eye(a_batch.size(0), torch::kFloat64) + 0.5 * a_batch;
    auto g = 0.5 * torch::eye(g_batch.size(0), torch::kFloat64) + 0.5 * g_batch;
    EXPECT_TENSOR_NEAR(kfac.layers()[i].a_factor(), a, 1e-12);
    EXPECT_TENSOR_NEAR(actual[i], dense_eigen_reference(a, g, grads[i], 0.001), 1e-5);
  }
}

TEST(Preconditioner, SkipLayersByPatternKeepsPlainGradient) {
  auto net = make_net();
  Preconditioner kfac(net, Options().skip_layers({"^fc2$"}));
  ASSERT_EQ(kfac.layers().size(), 2u);
  EXPECT_EQ(kfac.layers()[0].name(), "conv");
  EXPECT_EQ(kfac.layers()[1].name(), "fc1");
  auto batch = make_batch(5);
  auto taps = net->forward_taps(batch.x);
  net->loss(taps, batch.target).backward();
  auto plain = gradients(*net);
  EXPECT_EQ(net->fc2->factor_capture().a_count(), 0) << "skipped layers capture nothing";
  kfac.step();
  auto after = gradients(*net);
  EXPECT_TRUE(torch::equal(after[2], plain[2]));
  EXPECT_FALSE(torch::equal(after[1], plain[1]));

  Preconditioner by_kind(make_net(), Options().skip_layers({"Conv2d"}));
  EXPECT_EQ(by_kind.layers().size(), 2u);
  EXPECT_THROW(Preconditioner(make_net(), Options().skip_layers({"."})), c10::Error);
}

using testing::CapturedWarnings;

TEST(Preconditioner, SkipLayersPatternThatMatchesNothingIsWarned) {
  CapturedWarnings warnings;
  Preconditioner kfac(make_net(), Options().skip_layers({"^fc2$", "fc3", "Embedding"}));
  EXPECT_EQ(kfac.layers().size(), 2u);
  ASSERT_EQ(warnings.messages.size(), 2u) << warnings.all();
  EXPECT_NE(warnings.messages[0].find("skip_layers pattern 'fc3' matches no layer"), std::string::npos);
  EXPECT_NE(warnings.messages[0].find("'conv' (Conv2d), 'fc1' (Linear), 'fc2' (Linear)"), std::string::npos)
      << warnings.messages[0];
  EXPECT_NE(warnings.messages[1].find("skip_layers pattern 'Embedding' matches no layer"), std::string::npos);
  CapturedWarnings none;
  Preconditioner all_used(make_net(), Options().skip_layers({"^fc2$", "Conv2d"}));
  EXPECT_TRUE(none.messages.empty()) << none.all();
}

TEST(Preconditioner, LargeFactorsAreReportedAtConstruction) {
  // A Linear(8 * 28 * 28, 10) as in the README's former snippet: A is 6273 x 6273.
  // One preconditioner on the model at a time (each block's goes at its end).
  auto model = std::make_shared<torch::nn::Sequential>(nn::Linear(8 * 28 * 28, 10), nn::Linear(10, 5));
  {
    CapturedWarnings warnings;
    Preconditioner kfac(model->ptr(), Options());
    ASSERT_EQ(warnings.messages.size(), 1u) << warnings.all();
    const auto& message = warnings.messages[0];
    for (const char* needle : {"layer '0' (Linear)", "Options::large_factor_dim 4096", "A factor 6273 x 6273",
                               "150.11 MiB (Float)", "eigendecomposition 150.13 MiB",
                               "2.22 TFLOP per second-order update (9 d^3)"}) {
      EXPECT_NE(message.find(needle), std::string::npos) << needle << " not in: " << message;
    }
    EXPECT_EQ(message.find("G factor"), std::string::npos) << "G is 10 wide: not reported";
  }
  {
    CapturedWarnings inverse;
    Preconditioner by_inverse(model->ptr(), Options().compute_method(ComputeMethod::kInverse).large_factor_dim(6000));
    ASSERT_EQ(inverse.messages.size(), 1u) << inverse.all();
    EXPECT_NE(inverse.messages[0].find("inverse 150.11 MiB, 246.85 GFLOP per second-order update (d^3)"),
              std::string::npos)
        << inverse.messages[0];
  }
  CapturedWarnings quiet;
  { Preconditioner high(model->ptr(), Options().large_factor_dim(6273)); }
  { Preconditioner off(model->ptr(), Options().large_factor_dim(0)); }
  EXPECT_TRUE(quiet.messages.empty()) << quiet.all();
  EXPECT_THROW(Preconditioner(model->ptr(), Options().large_factor_dim(-1)), c10::Error);
}

// A vocabulary-sized output (300000 wide) keeps its G factor diagonal by default; with every factor dense it would
// need 335 GiB per copy, and construction refuses, before allocating anything, naming the layer and the option.
TEST(Preconditioner, FactorsBeyondTheMachinesMemoryAreRefusedAtConstruction) {
  auto model = std::make_shared<torch::nn::Sequential>(nn::Linear(2, 300000));
  {
    Preconditioner diagonal(model->ptr(), Options());
    EXPECT_TRUE(diagonal.layers()[0].g_diagonal());
    EXPECT_FALSE(diagonal.layers()[0].a_diagonal());
  }
  testing::expect_error<c10::Error>([&] { Preconditioner dense(model->ptr(), Options().diagonal_factor_dim(0)); },
                                    {"the K-FAC factors of these layers need about", "more than this machine's",
                                     "the widest is '0' (Linear)'s G factor 300000 x 300000 (335.28 GiB)",
                                     "Options::diagonal_factor_dim 8192"});
}

// A second Preconditioner on a model that one still hooks (its captures are the modules' own) was accepted, and its
// step() then failed with an unrelated cause; refused at construction now, and accepted once the first is gone.
// One step() at a time: a second thread's is refused, naming why.
TEST(Preconditioner, OnePreconditionerPerModelAndOneStepAtATime) {
  auto net = make_net();
  {
    Preconditioner first(net, Options());
    testing::expect_error<c10::Error>([&] { Preconditioner second(net, Options()); },
                                      {"is already registered with another Preconditioner",
                                       "destroy the other first"});
  }
  Preconditioner again(net, Options());
  zero_grad_and_backward(*net, 5);
  std::atomic<bool> inside{false}, release{false};
  auto slow = make_net();
  Preconditioner paused(slow, Options().damping([&](int64_t) {
    inside = true;
    while (!release) std::this_thread::yield();
    return 0.01;
  }));
  zero_grad_and_backward(*slow, 6);
  std::thread stepping([&] { paused.step(); });
  while (!inside) std::this_thread::yield();
  testing::expect_error<c10::Error>([&] { paused.step(); }, {"step() is already running on another thread"});
  release = true;
  stepping.join();
  EXPECT_EQ(paused.steps(), 1);
  again.step();
}

TEST(Preconditioner, FrozenLayersAreNotPreconditioned) {
  auto net = make_net();
  net->fc1->weight.set_requires_grad(false);
  Preconditioner kfac(net, Options());
  EXPECT_EQ(kfac.layers().size(), 2u);
}

// A layer's weight replaced after registration (`fc->weight = w`, which forward uses; LibTorch's
// register_parameter refuses a name twice) keeps being preconditioned: the same steps as a model that
// kept its tensors. Without following, step() writes the old tensor's gradient and the new one stays plain.
TEST(Preconditioner, ReplacedParametersKeepBeingPreconditioned) {
  auto kept = make_net();
  auto replaced = make_net();
  const auto options = Options().kl_clip(0);
  Preconditioner kfac_kept(kept, options);
  Preconditioner kfac_replaced(replaced, options);
  for (int64_t s = 0; s < 3; ++s) {
    if (s == 1) {
      auto& fc1 = *replaced->fc1;
      fc1.weight = fc1.weight.detach().clone().requires_grad_();
      fc1.bias = fc1.bias.detach().clone().requires_grad_();
      auto& conv = *replaced->conv;
      conv.weight = conv.weight.detach().clone().requires_grad_();
    }
    // Module::zero_grad reaches the registered tensors only: the replacements' gradients are cleared here.
    for (auto* t : {&replaced->fc1->weight, &replaced->fc1->bias, &replaced->conv->weight}) t->mutable_grad() = torch::Tensor();
    zero_grad_and_backward(*kept, s);
    zero_grad_and_backward(*replaced, s);
    const auto plain = gradients(*replaced);
    kfac_kept.step();
    kfac_replaced.step();
    const auto want = gradients(*kept);
    const auto got = gradients(*replaced);
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_TRUE(torch::allclose(got[i], want[i], 1e-12, 1e-12)) << "step " << s << " layer " << i;
      EXPECT_FALSE(torch::allclose(got[i], plain[i])) << "step " << s << " layer " << i << " kept its plain gradient";
    }
  }
  EXPECT_TRUE(kfac_replaced.layers()[1].weight().is_same(replaced->fc1->weight));
}

// A module replaced in the model after the build (replace_module: a new head) is named at the next step, a factor
// step or not; its old module is held, never called through a freed pointer (the step ended in "pure virtual method
// called"), and a new Preconditioner takes the new module.
TEST(Preconditioner, AModuleReplacedAfterTheBuildIsNamedAtTheNextStep) {
  auto net = make_net();
  {
    Preconditioner kfac(net, Options().factor_update_steps(3));  // step 1 updates no factors
    zero_grad_and_backward(*net, 1);
    kfac.step();
    net->fc2 = net->replace_module("fc2", nn::Linear(5, 2));
    net->to(torch::kFloat64);
    zero_grad_and_backward(*net, 2);
    testing::expect_error<c10::Error>([&] { kfac.step(); },
                                      {"K-FAC layer 'fc2' (Linear) was replaced in the model after the Preconditioner "
                                       "was built", "Build a new Preconditioner"});
  }
  Preconditioner again(net, Options());
  zero_grad_and_backward(*net, 3);
  const auto plain = net->fc2->weight.grad().clone();
  again.step();
  EXPECT_FALSE(torch::allclose(plain, net->fc2->weight.grad()));
}

// optimizer.step() before step(): the optimizer has applied the gradients step() would precondition (K-FAC had no
// effect, silently). Refused before anything changed, naming the layers, whether the hooks fold or not; a backward
// pass after a discard_step() or in the right order trains on.
TEST(Preconditioner, AStepAfterTheOptimizersIsRefusedNamingTheLayers) {
  for (const bool fold : {true, false}) {
    auto net = make_net();
    Preconditioner kfac(net, Options().fold_in_hooks(fold));
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    zero_grad_and_backward(*net, 1);
    sgd.step();
    const auto plain = gradients(*net);
    testing::expect_error<c10::Error>([&] { kfac.step(); },
                                      {"step 0 refused: the weights of 3 layers ('conv' (Conv2d), 'fc1' (Linear), "
                                       "'fc2' (Linear)) were written in place after their backward pass and before "
                                       "step(): optimizer.step() ran before",
                                       "Call step() after the backward pass and before optimizer.step()"});
    const auto after = gradients(*net);
    for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], after[i])) << i;
    EXPECT_EQ(kfac.steps(), 0);
    zero_grad_and_backward(*net, 2);
    sgd.step();
    kfac.discard_step();  // drops the batch and what its backward pass saw
    for (int64_t seed = 3; seed < 5; ++seed) {
      zero_grad_and_backward(*net, seed);
      kfac.step();
      sgd.step();
    }
    EXPECT_EQ(kfac.steps(), 2) << "fold " << fold;
  }
  // A first step from lr 0 (a warmup) moves nothing: LibTorch's SGD, which moves no version, is seen at the next.
  auto net = make_net();
  Preconditioner kfac(net, Options());
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.0));
  zero_grad_and_backward(*net, 1);
  sgd.step();
  kfac.step();
  static_cast<torch::optim::SGDOptions&>(sgd.param_groups()[0].options()).lr(0.1);
  zero_grad_and_backward(*net, 2);
  sgd.step();
  testing::expect_error<c10::Error>([&] { kfac.step(); }, {"step 1 refused: the weights of 3 layers"});
}

// A rank whose weights were written before its step() (here the only one whose optimizer stepped first) refuses,
// and the other ranks refuse with it rather than wait for it in the step's collectives.
TEST(Preconditioner, AStepAfterTheOptimizersOnOneRankIsRefusedOnEveryRank) {
  std::vector<std::string> errors(2);
  testing::run_ranks(2, [&](int rank, std::shared_ptr<comm::Communicator> communicator) {
    auto net = make_net();
    Preconditioner kfac(net, Options(), communicator);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    zero_grad_and_backward(*net, 1 + rank);
    if (rank == 0) sgd.step();
    try {
      kfac.step();
    } catch (const c10::Error& e) {
      errors[static_cast<size_t>(rank)] = e.what_without_backtrace();
    }
  });
  EXPECT_NE(errors[0].find("step 0 refused: the weights of 3 layers"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("rank 0 refused step 0: the weights of its layers were written in place after their "
                           "backward pass"), std::string::npos) << errors[1];
}

// discard_step() drops the step whatever ran since the last one: a forward whose loss was not finite (no backward),
// nothing at all, or a second discard. It used to refuse ("has a gradient, but its module's hooks saw no forward and
// backward pass", or "did not run forward/backward ... before step()", naming step()). The next full step is taken as
// in a run that never had the discarded ones (before the first step; after it, with fold_in_hooks off: folded in
// the hooks, a discarded batch stays in the factors, as documented).
TEST(Preconditioner, DiscardStepDropsWhateverRanSinceTheLastStep) {
  // p, q: forward and backward of batches 1 and 2; s: step(); d: discard_step(); f: a forward alone; z: zero_grad().
  const auto run = [](const std::string& sequence, bool fold) {
    auto net = make_net();
    Preconditioner kfac(net, Options().fold_in_hooks(fold));
    for (const char c : sequence) {
      if (c == 'p' || c == 'q') zero_grad_and_backward(*net, c == 'p' ? 1 : 2);
      if (c == 's') kfac.step();
      if (c == 'd') kfac.discard_step();
      if (c == 'f') net->forward_taps(make_batch(3).x);
      if (c == 'z') net->zero_grad();
    }
    return std::make_pair(kfac.steps(), gradients(*net));
  };
  const auto expect_equal = [&](const std::string& sequence, const std::string& reference, bool fold) {
    const auto [steps, got] = run(sequence, fold);
    const auto want = run(reference, fold);
    EXPECT_EQ(steps, want.first) << sequence;
    ASSERT_EQ(got.size(), want.second.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(torch::equal(got[i], want.second[i])) << sequence << " fold " << fold << " parameter " << i;
    }
  };
  for (const bool fold : {true, false}) {
    for (const std::string sequence : {"pfdqs", "pzfdqs", "pddqs", "pzdqs", "fdqs", "dqs"}) {
      expect_equal(sequence, "qs", fold);
    }
    for (const std::string sequence : {"qsfdqs", "qszfdqs", "qsddqs", "qspfdqs"}) {
      if (!fold || sequence != "qspfdqs") expect_equal(sequence, "qsqs", fold);
      EXPECT_EQ(run(sequence, fold).first, 2) << sequence;
    }
  }
}

// A replacement of another shape is refused at the next step, naming the layer, not preconditioned wrongly.
TEST(Preconditioner, ReplacedParameterOfAnotherShapeIsRefusedNamingTheLayer) {
  auto net = make_net();
  Preconditioner kfac(net, Options());
  auto& fc2 = *net->fc2;
  fc2.weight = torch::zeros({2, 4}, torch::kFloat64).requires_grad_();
  try {
    kfac.step();
    FAIL() << "a weight of another shape was accepted";
  } catch (const c10::Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("layer 'fc2': its weight was replaced by a tensor of shape [2, 4]"), std::string::npos)
        << message;
  }
}

TEST(Preconditioner, NonFiniteFactorFallsBackToPlainGradient) {
  auto net = make_net();
  // The poison is added after the backward pass, for step() to fold (fold_in_hooks would have folded the real
  // batch in the hook already: FoldInHooksGuard covers a non-finite batch there).
  Preconditioner kfac(net, Options().kl_clip(0).fold_in_hooks(false));
  for (int64_t step = 0; step < 2; ++step) {
    zero_grad_and_backward(*net, 500 + step);
    auto plain = gradients(*net);
    auto a_before = kfac.layers()[1].a_factor();
    if (step == 1) {
      auto poison = torch::full({10, 10}, std::numeric_limits<double>::quiet_NaN(), torch::kFloat64);
      net->fc1->factor_capture().add_a(poison, 0.0);
    }
    kfac.step();
    auto after = gradients(*net);
    if (step == 1) {
      EXPECT_TRUE(torch::equal(after[1], plain[1])) << "poisoned layer keeps its plain gradient";
      EXPECT_FALSE(torch::equal(after[0], plain[0])) << "other layers are still preconditioned";
      EXPECT_TRUE(torch::equal(kfac.layers()[1].a_factor(), a_before)) << "NaN never enters the running factor";
      EXPECT_TRUE(torch::isfinite(kfac.layers()[1].a_factor()).all().item<bool>());
    }
  }
  EXPECT_EQ(kfac.events().fallbacks, 1);
}

// A finite factor whose decomposition fails (here: entries so large that the damping is absorbed and the
// damped factor is exactly singular) keeps the layer's previous second-order state, with a warning.
TEST(Preconditioner, FailedDecompositionKeepsThePreviousState) {
  auto net = make_net();
  Preconditioner kfac(net, Options().kl_clip(0).compute_method(ComputeMethod::kInverse).fold_in_hooks(false));
  torch::Tensor inverse_before;
  for (int64_t step = 0; step < 2; ++step) {
    zero_grad_and_backward(*net, 700 + step);
    auto plain = gradients(*net);
    if (step == 1) {
      inverse_before = kfac.layers()[1].second_order().a_inverse.clone();
      auto huge = torch::full({10, 10}, std::numeric_limits<double>::max(), torch::kFloat64);
      net->fc1->factor_capture().add_a(huge, 0.0);
    }
    kfac.step();
    if (step == 1) {
      const auto& layer = kfac.layers()[1];
      EXPECT_TRUE(torch::isfinite(layer.a_factor()).all().item<bool>()) << "the factor itself is finite";
      EXPECT_TRUE(torch::equal(layer.second_order().a_inverse, inverse_before)) << "previous state kept";
      auto after = gradients(*net);
      EXPECT_TRUE(torch::isfinite(after[1]).all().item<bool>());
      EXPECT_FALSE(torch::equal(after[1], plain[1])) << "still preconditioned, with the previous state";
    }
  }
  EXPECT_EQ(kfac.events().second_order_failures, 1);
}

// Options::second_order_concurrency: layers decomposed two at a time, each on one thread, give the results of one
// layer at a time to rounding (each decomposition on one thread, not two), for both methods; a failed decomposition in
// a concurrent chunk keeps that layer's previous state, as one at a time does.
TEST(Preconditioner, ConcurrentSecondOrderIsOneLayerAtATimeToRounding) {
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  for (const auto method : {ComputeMethod::kEigen, ComputeMethod::kInverse}) {
    std::vector<std::vector<torch::Tensor>> got[2];
    int64_t failures[2] = {0, 0};
    for (const int64_t concurrency : {1, 2}) {
      auto net = make_net();
      Preconditioner kfac(net, Options().compute_method(method).second_order_concurrency(concurrency)
                                   .fold_in_hooks(false));  // the huge batch is added for step() to fold
      torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
      for (int64_t step = 0; step < 4; ++step) {
        zero_grad_and_backward(*net, 900 + step);
        if (step == 2 && method == ComputeMethod::kInverse) {  // fc1's damped A exactly singular: its inverse fails
          const double huge = std::numeric_limits<double>::max();
          net->fc1->factor_capture().add_a(torch::full({10, 10}, huge, torch::kFloat64), 0.0);
        }
        kfac.step();
        got[concurrency - 1].push_back(gradients(*net));
        sgd.step();
      }
      failures[concurrency - 1] = kfac.events().second_order_failures;
    }
    EXPECT_EQ(failures[1], failures[0]);
    EXPECT_EQ(failures[1] > 0, method == ComputeMethod::kInverse);  // steps 2 and 3: the huge A stays in the average
    for (size_t step = 0; step < got[0].size(); ++step) {
      for (size_t p = 0; p < got[0][step].size(); ++p) {
        EXPECT_TENSOR_NEAR(got[1][step][p], got[0][step][p], 1e-10)
            << to_string(method) << " step " << step << " " << p;
      }
    }
  }
  at::set_num_threads(threads);
}

TEST(Preconditioner, NonFiniteGradientIsNotPreconditioned) {
  auto net = make_net();
  Preconditioner kfac(net, Options());
  auto batch = make_batch(9);
  auto taps = net->forward_taps(batch.x);
  net->loss(taps, batch.target).backward();
  net->fc1->weight.mutable_grad()[0][0] = std::numeric_limits<double>::infinity();
  kfac.step();
  EXPECT_EQ(kfac.events().fallbacks, 1);
  // KL clipping must not be poisoned by the bad layer: the others stay finite.
  EXPECT_TRUE(torch::isfinite(net->conv->weight.grad()).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(net->fc2->weight.grad()).all().item<bool>());
}

// The guard read on the device (a GPU's default: step() writes where(usable, V * nu, grad) without waiting, and
// reads the rows at the next step() or events()) against the host read (a CPU's): the same gradients, to the
// rounding of nu's sum, through a poisoned factor (step 1), an Inf gradient (step 2) and KL clipping; the same
// counts and warnings, which name the step they are about.
TEST(Preconditioner, GuardReadOnTheDeviceEqualsTheHostRead) {
  auto host_net = make_net();
  auto device_net = make_net();
  Preconditioner host(host_net, Options().kl_clip(1e-4).fold_in_hooks(false));  // the poison is added for step()
  Preconditioner device(device_net, Options().kl_clip(1e-4).fold_in_hooks(false));
  device.read_guard_at_once(false);
  CapturedWarnings warnings;
  bool clipped = false;
  for (int64_t step = 0; step < 4; ++step) {
    for (auto* net : {host_net.get(), device_net.get()}) {
      zero_grad_and_backward(*net, 800 + step);
      if (step == 1) {
        auto poison = torch::full({10, 10}, std::numeric_limits<double>::quiet_NaN(), torch::kFloat64);
        net->fc1->factor_capture().add_a(poison, 0.0);
      }
      if (step == 2) net->fc2->weight.mutable_grad()[0][0] = std::numeric_limits<double>::infinity();
    }
    const auto plain = gradients(*device_net);
    host.step();
    device.step();
    const auto want = gradients(*host_net);
    const auto got = gradients(*device_net);
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_TRUE(torch::allclose(got[i], want[i], 1e-13, 0.0, /*equal_nan=*/true)) << "step " << step << " tensor " << i;
    }
    if (step == 1) EXPECT_TRUE(torch::equal(got[1], plain[1])) << "the poisoned layer keeps its plain gradient";
    EXPECT_NEAR(device.last_kl_scale(), host.last_kl_scale(), 1e-13) << "step " << step;
    clipped = clipped || host.last_kl_scale() < 1.0;
  }
  EXPECT_TRUE(clipped) << "KL clipping took part";
  EXPECT_EQ(device.events().fallbacks, 2);
  EXPECT_EQ(host.events().fallbacks, 2);
  int factor_warnings = 0, gradient_warnings = 0;
  for (const auto& message : warnings.messages) {
    if (message.find("layer 'fc1' (Linear), step 1: captured factors contain NaN or Inf") != std::string::npos) ++factor_warnings;
    if (message.find("layer 'fc2' (Linear), step 2: gradient or preconditioned gradient contains NaN") != std::string::npos) {
      ++gradient_warnings;
    }
  }
  EXPECT_EQ(factor_warnings, 2) << warnings.all();  // one from each preconditioner, both naming step 1
  EXPECT_EQ(gradient_warnings, 2) << warnings.all();
}

// Options::cuda_graphs on a CPU: no graph (a CUDA device's), every step eager and bit for bit the steps without
// the option, with the guard read on the device as a GPU's, and the report says why. On CUDA:
// tests/gpu/cuda_graph_test.cpp.
TEST(Preconditioner, CudaGraphsOnACpuRunEveryStepEagerlySayingWhy) {
  auto plain_net = make_net();
  auto graphs_net = make_net();
  const auto options = Options().kl_clip(1e-4).lr([](int64_t step) { return 0.1 + 0.01 * static_cast<double>(step); });
  Preconditioner plain(plain_net, options);
  Preconditioner graphs(graphs_net, Options(options).cuda_graphs(true));
  plain.read_guard_at_once(false);
  graphs.read_guard_at_once(false);
  constexpr int64_t kSteps = 4;
  for (int64_t step = 0; step < kSteps; ++step) {
    for (auto* net : {plain_net.get(), graphs_net.get()}) zero_grad_and_backward(*net, 900 + step);
    plain.step();
    graphs.step();
    const auto want = gradients(*plain_net);
    const auto got = gradients(*graphs_net);
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_TRUE(torch::equal(got[i], want[i])) << "step " << step << " tensor " << i;
    }
    EXPECT_EQ(graphs.last_kl_scale(), plain.last_kl_scale()) << "step " << step;
  }
  const auto& report = graphs.cuda_graph_report();
  EXPECT_EQ(report.captures, 0);
  EXPECT_EQ(report.replays, 0);
  EXPECT_EQ(report.eager_steps, kSteps);
  EXPECT_NE(report.off.find("CUDA graphs need a CUDA device"), std::string::npos) << report.off;
  EXPECT_EQ(report.last_eager, report.off);
  EXPECT_EQ(plain.cuda_graph_report().eager_steps, 0) << "the option off: nothing counted";
}

struct NetWithUnused : TinyNet {
  NetWithUnused() { extra = register_module("extra", nn::Linear(3, 3)); }
  nn::Linear extra{nullptr};
};

TEST(Preconditioner, UnusedLayerIsAnErrorNamingIt) {
  torch::manual_seed(1);
  auto net = std::make_shared<NetWithUnused>();
  net->to(torch::kFloat64);
  Preconditioner kfac(net, Options());
  auto batch = make_batch(10);
  auto taps = net->forward_taps(batch.x);
  net->loss(taps, batch.target).backward();
  try {
    kfac.step();
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'extra'"), std::string::npos) << e.what();
  }
}

// A step() that throws (here: a layer without a gradient under the default policy) drops what its forward and
// backward captured: a caller who catches the error and goes on gets the factors of the batches after it only,
// as if the failed attempt had not run. They used to be averaged in with the next batch ("2 micro-batches").
// With fold_in_hooks (the default) the layers whose hooks folded the failed step's batch keep that fold, as if that
// step's factor update had run (docs/MATH.md section 1.8): nothing is held, and the next step warns of nothing.
TEST(Preconditioner, FailedStepDropsItsCapture) {
  auto run = [](bool with_failure, bool fold_in_hooks) {
    torch::manual_seed(1);
    auto net = std::make_shared<TinyNet>();
    net->to(torch::kFloat64);
    Preconditioner kfac(net, Options().fold_in_hooks(fold_in_hooks));
    zero_grad_and_backward(*net, 20);
    kfac.step();
    if (with_failure) {
      zero_grad_and_backward(*net, 21);
      net->fc2->weight.mutable_grad() = torch::Tensor();  // fc2 "has no gradient": step() throws
      EXPECT_THROW(kfac.step(), c10::Error);
    }
    zero_grad_and_backward(*net, 22);
    testing::CapturedWarnings warnings;
    kfac.step();
    EXPECT_EQ(warnings.all(), "");
    return std::make_pair(gradients(*net), kfac.steps());
  };
  const auto [expected, expected_steps] = run(false, false);
  const auto [got, steps] = run(true, false);
  EXPECT_EQ(steps, expected_steps);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i], expected[i])) << "parameter " << i;
  const auto [folded, folded_steps] = run(true, true);
  EXPECT_EQ(folded_steps, expected_steps);
  bool differs = false;  // the failed step's batch is in the factors
  for (size_t i = 0; i < got.size(); ++i) differs = differs || !torch::equal(folded[i], expected[i]);
  EXPECT_TRUE(differs);
}

// A front end's distributor frames the step: its gather runs before the step reads any gradient, its scatter after
// the step wrote them (also when the step failed after the gather), and their time is communication.
TEST(Preconditioner, ADistributorFramesTheStep) {
  const auto run = [](bool distributed) {
    torch::manual_seed(1);
    auto net = std::make_shared<TinyNet>();
    net->to(torch::kFloat64);
    Preconditioner kfac(net, Options());
    std::vector<std::string> order;
    std::vector<torch::Tensor> held;  // the gradients "on other ranks" until the gather brings them
    const auto own_gradients = [&] {
      std::vector<torch::Tensor> out;
      for (const auto& p : net->parameters()) out.push_back(p.grad().clone());
      return out;
    };
    std::vector<torch::Tensor> scattered;
    Distributor distributor;
    distributor.gather = [&] {
      order.push_back("gather");
      for (size_t i = 0; i < held.size(); ++i) net->parameters()[i].mutable_grad().copy_(held[i]);  // in place
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      return Distributor::Moved{1, 64};
    };
    distributor.scatter = [&] {
      order.push_back("scatter");
      scattered = gradients(*net);
      return Distributor::Moved{1, 32};
    };
    for (int64_t step = 0; step < 3; ++step) {
      zero_grad_and_backward(*net, 30 + step);
      if (!distributed) {
        kfac.step();
        continue;
      }
      held = own_gradients();
      for (auto& p : net->parameters()) p.mutable_grad().zero_();  // what the step would read without the gather
      kfac.step(distributor);
      EXPECT_EQ(kfac.last_step_times()[KfacPhase::kCommunication] >= 0.02, true) << "the gather's 20 ms";
      const auto written = gradients(*net);
      for (size_t i = 0; i < written.size(); ++i) EXPECT_TRUE(torch::equal(scattered[i], written[i]));
    }
    const auto result = gradients(*net);
    if (distributed) {
      EXPECT_EQ(order, (std::vector<std::string>{"gather", "scatter", "gather", "scatter", "gather", "scatter"}));
      order.clear();
      // A step that fails after the gather (fc2 "has no gradient") still runs the scatter: ranks stay in step.
      auto failing = distributor;
      failing.gather = [&] {
        order.push_back("gather");
        net->fc2->weight.mutable_grad() = torch::Tensor();
        return Distributor::Moved{};
      };
      zero_grad_and_backward(*net, 40);
      const int64_t before = kfac.steps();
      EXPECT_THROW(kfac.step(failing), c10::Error);
      EXPECT_EQ(order, (std::vector<std::string>{"gather", "scatter"}));
      EXPECT_EQ(kfac.steps(), before) << "a failed step is not counted";
      // A scatter that fails (a lost rank) after the step wrote the gradients: the step is counted, then the error.
      auto lost = distributor;
      lost.gather = [] { return Distributor::Moved{}; };
      lost.scatter = []() -> Distributor::Moved { TORCH_CHECK(false, "rank 1 is gone"); };
      zero_grad_and_backward(*net, 41);
      EXPECT_THROW(kfac.step(lost), c10::Error);
      EXPECT_EQ(kfac.steps(), before + 1);
      zero_grad_and_backward(*net, 42);
      kfac.step();  // the next step runs as usual
      EXPECT_EQ(kfac.steps(), before + 2);
    }
    return result;
  };
  const auto expected = run(false);
  const auto got = run(true);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i], expected[i])) << "parameter " << i;
}

// A pipeline stage's KL clip: sum(V * grad) summed over the model's parts (Distributor::sum_over_model) sets nu.
TEST(Preconditioner, KlClipSumsOverTheModelsParts) {
  const auto nu = [](bool other_parts) {
    torch::manual_seed(1);
    auto net = std::make_shared<TinyNet>();
    net->to(torch::kFloat64);
    Preconditioner kfac(net, Options().kl_clip(1e-4).lr(1.0));
    Distributor distributor;
    int calls = 0;
    if (other_parts) {
      distributor.sum_over_model = [&](torch::Tensor& sum) {
        ++calls;
        sum.mul_(4.0);  // three other stages whose sums equal this one's
      };
    }
    zero_grad_and_backward(*net, 50);
    kfac.step(distributor);
    EXPECT_EQ(calls, other_parts ? 1 : 0);
    return kfac.last_kl_scale();
  };
  const double alone = nu(false), summed = nu(true);
  ASSERT_LT(alone, 0.5) << "the clip must act: nu = sqrt(kl_clip / sum) < 1";
  EXPECT_NEAR(summed, alone / 2.0, 1e-12 * alone);  // sqrt(1/4)
}

// A tensor-parallel rank holds whole layers that every other one holds too: those another rank counts
// (Distributor::counted_elsewhere) leave this rank's part of the sum, so that the model's sum counts each once.
TEST(Preconditioner, KlClipLeavesOutTheLayersCountedElsewhere) {
  const auto nu = [](double kl_clip, const std::vector<bool>& counted_elsewhere) {
    torch::manual_seed(1);
    auto net = std::make_shared<TinyNet>();
    net->to(torch::kFloat64);
    Preconditioner kfac(net, Options().kl_clip(kl_clip).lr(1.0));
    Distributor distributor;
    distributor.sum_over_model = [](torch::Tensor&) {};  // the other ranks' parts: none here
    distributor.counted_elsewhere = counted_elsewhere;
    zero_grad_and_backward(*net, 50);
    kfac.step(distributor);
    return kfac.last_kl_scale();
  };
  // Unclipped, each layer's sum(V * grad): conv, fc1, fc2 (gradients() gives one matrix per layer).
  torch::manual_seed(1);
  auto net = std::make_shared<TinyNet>();
  net->to(torch::kFloat64);
  Preconditioner unclipped(net, Options().kl_clip(0.0));
  zero_grad_and_backward(*net, 50);
  const auto plain = gradients(*net);
  unclipped.step();
  const auto v = gradients(*net);
  const auto vg = [&](size_t first, size_t last) {
    double sum = 0.0;
    for (size_t i = first; i < last; ++i) sum += (v[i] * plain[i]).sum().item<double>();
    return sum;
  };
  const double kl_clip = 1e-4;
  const double nu_all = nu(kl_clip, {}), nu_fc2 = nu(kl_clip, {true, true, false});
  ASSERT_LT(nu_all, 0.5) << "the clip must act";
  EXPECT_NEAR(nu_all, std::sqrt(kl_clip / vg(0, 3)), 1e-10 * nu_all);
  EXPECT_NEAR(nu_fc2, std::sqrt(kl_clip / vg(2, 3)), 1e-10 * nu_fc2) << "conv and fc1 counted elsewhere";
}

// A layer called twice in one forward (weights shared) is not "2 micro-batches": the warning says what may
// have happened.
TEST(Preconditioner, LayerCalledTwicePerForwardIsDescribedSo) {
  struct Twice : torch::nn::Module {
    Twice() { fc = register_module("fc", nn::Linear(3, 3)); }
    torch::Tensor forward(const torch::Tensor& x) { return fc->forward(torch::tanh(fc->forward(x))); }
    nn::Linear fc{nullptr};
  };
  auto net = std::make_shared<Twice>();
  Preconditioner kfac(net, Options());
  net->forward(torch::randn({4, 3})).pow(2).sum().backward();
  testing::CapturedWarnings warnings;
  kfac.step();
  EXPECT_NE(warnings.all().find("ran forward and backward 2 times since the last factor update but "
                                "accumulation_steps is 1 (a layer called several times in one forward"),
            std::string::npos) << warnings.all();
}

TEST(Preconditioner, UnusedLayerCanBeSkipped) {
  torch::manual_seed(1);
  auto net = std::make_shared<NetWithUnused>();
  net->to(torch::kFloat64);
  Preconditioner kfac(net, Options().unused_layer_policy(UnusedLayerPolicy::kSkip));
  for (int step = 0; step < 2; ++step) {
    zero_grad_and_backward(*net, 11 + step);
    auto plain = gradients(*net);
    kfac.step();
    EXPECT_FALSE(torch::equal(gradients(*net)[1], plain[1]));
  }
  EXPECT_EQ(kfac.events().skipped_unused, 2);
}

TEST(Preconditioner, BadOptionsCarryTheValue) {
  auto build = [](Options o) { return [o] { Preconditioner p(make_net(), o); }; };
  testing::expect_error(build(Options().factor_decay(1.5)), {"factor_decay must be finite and in [0, 1], got 1.5"});
  testing::expect_error(build(Options().damping(-2.0)), {"damping must be finite and > 0, got -2"});
  testing::expect_error(build(Options().lr(-0.5)), {"lr must be finite and >= 0, got -0.5"});
  testing::expect_error(build(Options().kl_clip(-1.0)), {"kl_clip must be finite and >= 0"});
  testing::expect_error(build(Options().factor_update_steps(0)), {"factor_update_steps must be >= 1, got 0"});
  testing::expect_error(build(Options().inv_update_steps(-3)), {"inv_update_steps must be >= 1, got -3"});
  testing::expect_error(build(Options().accumulation_steps(0)), {"accumulation_steps must be >= 1, got 0"});
  testing::expect_error(build(Options().pi_damping(true)), {"pi_damping applies to the inverse compute_method only"});
  testing::expect_error(build(Options().skip_layers({"fc("})), {"skip_layers pattern 'fc(' is not a valid"});
  testing::expect_error(build(Options().eigh_interval(0)), {"eigh_interval must be >= 1, got 0"});
  testing::expect_error(build(Options().second_order_lag(-1)), {"second_order_lag must be >= 0, got -1"});
  testing::expect_error(build(Options().compute_method(ComputeMethod::kInverse).eigh_interval(4)),
                        {"eigh_interval refreshes eigenbases", "needs compute_method eigen, got inverse"});
  testing::expect_error(build(Options().start_preconditioning_step(-1)),
                        {"start_preconditioning_step must be >= 0, got -1"});
  testing::expect_error([] { Preconditioner p(std::make_shared<torch::nn::Module>(), Options()); },
                        {"found no Linear, Conv2d or Embedding layer to precondition in torch::nn::Module"});

  // A schedule that turns bad mid-run fails at that step, with the step.
  auto net = make_net();
  Preconditioner kfac(net, Options().damping([](int64_t step) { return step == 0 ? 0.01 : 0.0; }).kl_clip(0));
  auto run = [&] {
    zero_grad_and_backward(*net, 12);
    kfac.step();
  };
  run();
  testing::expect_error(run, {"damping must be finite and > 0, got 0 at step 1"});

  // The next step's factor interval, which the end of a step arms the captures by, fails the step that reads it
  // before it changes anything (it used to fail after the step was done: the step count advanced, the gradients
  // written, and a retry refused as a second step() on them).
  auto other = make_net();
  bool fail = false;  // once, when set
  Preconditioner flaky(other, Options().factor_update_steps([&fail](int64_t step) -> int64_t {
    if (step == 3 && fail) {
      fail = false;
      throw std::runtime_error("a schedule that failed once");
    }
    return 1;
  }));
  for (int64_t step = 0; step < 2; ++step) {
    zero_grad_and_backward(*other, 30 + step);
    flaky.step();
  }
  fail = true;
  zero_grad_and_backward(*other, 32);
  const auto before = gradients(*other);
  testing::expect_error<std::runtime_error>([&] { flaky.step(); }, {"a schedule that failed once"});
  EXPECT_EQ(flaky.steps(), 2);
  for (size_t p = 0; p < before.size(); ++p) EXPECT_TRUE(torch::equal(gradients(*other)[p], before[p]));
  flaky.step();  // the retry runs
  EXPECT_EQ(flaky.steps(), 3);
}

// Saves after 4 steps, loads into a new net and preconditioner, and checks that the next 3 steps (an inverse step
// among them) are bit-identical to the uninterrupted run's.
void expect_checkpoint_round_trip(const Options& options) {
  auto net = make_net();
  Preconditioner kfac(net, options);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  auto train_step = [](TinyNet& n, Preconditioner& k, torch::optim::SGD& opt, int64_t seed) {
    auto batch = make_batch(seed);
    opt.zero_grad();
    auto taps = n.forward_taps(batch.x);
    n.loss(taps, batch.target).backward();
    k.step();
    opt.step();
  };
  for (int64_t s = 0; s < 4; ++s) train_step(*net, kfac, sgd, 600 + s);

  std::stringstream model_bytes, kfac_bytes;
  torch::save(net, model_bytes);
  torch::save(kfac, kfac_bytes);

  auto restored = std::make_shared<TinyNet>();
  restored->to(torch::kFloat64);
  torch::load(restored, model_bytes);
  Preconditioner restored_kfac(restored, options);
  torch::load(restored_kfac, kfac_bytes);
  EXPECT_EQ(restored_kfac.steps(), 4);
  torch::optim::SGD restored_sgd(restored->parameters(), torch::optim::SGDOptions(0.1));

  for (int64_t s = 4; s < 7; ++s) {
    train_step(*net, kfac, sgd, 600 + s);
    train_step(*restored, restored_kfac, restored_sgd, 600 + s);
    auto a = gradients(*net);
    auto b = gradients(*restored);
    for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "layer " << i << " step " << s;
  }
  for (size_t i = 0; i < kfac.layers().size(); ++i) {
    const auto saved = kfac.layers()[i].state();
    const auto loaded = restored_kfac.layers()[i].state();
    ASSERT_EQ(saved.size(), loaded.size()) << "layer " << i;
    for (const auto& [key, tensor] : saved) EXPECT_TRUE(torch::equal(tensor, loaded.at(key))) << key;
  }
}

TEST(Preconditioner, CheckpointRoundTripGivesSameNextStep) {
  expect_checkpoint_round_trip(Options().factor_update_steps(2).inv_update_steps(3).kl_clip(1e-3));
}

// Options::eigh_interval 3 with inverse updates every 2 steps: steps 0, 6 and 12 decompose every factor in full, the
// other inverse steps refresh the basis each layer held (math::refresh_eigenbasis, against the kernel), and those
// refreshes are not the eigendecomposition (the factors moved since the basis was computed).
TEST(Preconditioner, EighIntervalRefreshesTheBasesBetweenFullDecompositions) {
  auto net = make_net();
  Preconditioner kfac(net, Options().inv_update_steps(2).eigh_interval(3));
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  int refreshes_unlike_eigh = 0;
  for (int64_t s = 0; s <= 12; ++s) {
    std::vector<SecondOrderState> before;
    for (const auto& layer : kfac.layers()) before.push_back(layer.second_order());
    zero_grad_and_backward(*net, 800 + s);
    kfac.step();
    sgd.step();
    if (s % 2 != 0) continue;
    for (size_t i = 0; i < kfac.layers().size(); ++i) {
      const auto& layer = kfac.layers()[i];
      const auto& now = layer.second_order();
      const std::pair<const math::EigenFactor*, const math::EigenFactor*> sides[] = {
          {&now.a_eigen, &before[i].a_eigen}, {&now.g_eigen, &before[i].g_eigen}};
      const torch::Tensor factors[] = {layer.a_factor(), layer.g_factor()};
      for (size_t side = 0; side < 2; ++side) {
        const auto& [got, had] = sides[side];
        const auto full = math::eigen_decompose(factors[side]);
        if (s % 6 == 0) {
          EXPECT_TENSOR_NEAR(got->eigenvalues, full.eigenvalues, 1e-12) << "step " << s << " layer " << i;
          EXPECT_TENSOR_NEAR(torch::mm(got->eigenvectors * got->eigenvalues, got->eigenvectors.t()), factors[side],
                             1e-12);
          continue;
        }
        const auto expected = math::refresh_eigenbasis(factors[side], *had);
        EXPECT_TENSOR_NEAR(got->eigenvectors, expected.eigenvectors, 1e-12) << "step " << s << " layer " << i;
        EXPECT_TENSOR_NEAR(got->eigenvalues, expected.eigenvalues, 1e-12) << "step " << s << " layer " << i;
        if ((got->eigenvalues - full.eigenvalues).abs().max().item<double>() > 1e-9) ++refreshes_unlike_eigh;
      }
    }
  }
  EXPECT_GT(refreshes_unlike_eigh, 0);
}

// A resumed run refreshes from the basis it loaded, at the steps the uninterrupted run does (step 4 and 5 refresh).
TEST(Preconditioner, EighIntervalCheckpointRoundTripGivesSameNextStep) {
  expect_checkpoint_round_trip(Options().factor_update_steps(2).inv_update_steps(1).eigh_interval(3));
}

// Options::second_order_lag 2, inverse updates every 3 steps, factors every step, nothing trained (both runs see
// the same factors): the update of step 0 is installed at once, each later one (3, 6, 9, 12) two steps after it
// starts, and until then the layers precondition with the state before it. Against the exact run, whose states at
// its inverse steps are the lagged run's two steps later: its gradients differ in those two steps only, and the
// state computed beside the steps is counted by memory_bytes until it is installed, with the factors it reads once
// the next factor update replaced them: then as strategy::predict's in_flight_bytes says, to the byte.
TEST(Preconditioner, SecondOrderLagInstallsEachUpdateLagStepsLater) {
  for (const auto method : {ComputeMethod::kEigen, ComputeMethod::kInverse}) {
    auto exact_net = make_net();
    auto lagged_net = make_net();
    const auto options = Options().compute_method(method).inv_update_steps(3);
    Preconditioner exact(exact_net, options);
    Preconditioner lagged(lagged_net, Options(options).second_order_lag(2));
    std::map<int64_t, std::vector<SecondOrderState>> exact_states;  // after each inverse step
    for (int64_t s = 0; s < 14; ++s) {
      zero_grad_and_backward(*exact_net, 300 + s);
      zero_grad_and_backward(*lagged_net, 300 + s);
      exact.step();
      lagged.step();
      if (s % 3 == 0) {
        for (const auto& layer : exact.layers()) exact_states[s].push_back(layer.second_order());
      }
      const int64_t installed = s < 5 ? 0 : (s - 2) / 3 * 3;  // the update the lagged run holds
      const bool window = s >= 3 && s % 3 != 2;               // an update in flight: steps 3-4, 6-7, ...
      const std::string where = std::string(to_string(method)) + " step " + std::to_string(s);
      for (size_t i = 0; i < lagged.layers().size(); ++i) {
        const auto& got = lagged.layers()[i].second_order();
        const auto& want = exact_states.at(installed)[i];
        const auto got_parts = got.parts();
        const auto want_parts = want.parts();
        for (size_t part = 0; part < got_parts.size(); ++part) {
          const auto* g = got_parts[part];
          const auto* w = want_parts[part];
          ASSERT_EQ(g->defined(), w->defined()) << where;
          if (g->defined()) EXPECT_TENSOR_NEAR(*g, *w, 1e-10) << where << " layer " << i;
        }
      }
      const auto a = gradients(*exact_net);
      const auto b = gradients(*lagged_net);
      double differs = 0.0;
      for (size_t p = 0; p < a.size(); ++p) {
        differs = std::max(differs, ((a[p] - b[p]).abs().max() / a[p].abs().max()).item<double>());
      }
      const auto in_flight = lagged.second_order_in_flight_bytes();
      EXPECT_EQ(lagged.memory_bytes() - in_flight, exact.memory_bytes()) << where;
      if (window) {
        EXPECT_GT(differs, 1e-6) << where << ": the lagged run still holds the update before";
        const auto predicted = strategy::predict(lagged.plan(), /*element_bytes=*/8, /*batch_size=*/1).at(0);
        EXPECT_EQ(predicted.memory_bytes - predicted.in_flight_bytes, exact.memory_bytes()) << where;
        if (s % 3 == 1) {  // the factors the update reads were replaced by this step's
          EXPECT_EQ(in_flight, predicted.in_flight_bytes) << where;
        } else {  // its start: the layers' second states alone
          EXPECT_GT(in_flight, 0) << where;
          EXPECT_LT(in_flight, predicted.in_flight_bytes) << where;
        }
      } else {
        EXPECT_LT(differs, 1e-10) << where;
        EXPECT_EQ(in_flight, 0) << where;
      }
    }
  }
}

// A lagged update that fails (fc1's damped A exactly singular: Cholesky and the general inverse both fail) keeps the
// layer's state before it when it is installed, counted and warned about as at once; the other layers take theirs.
TEST(Preconditioner, FailedLaggedUpdateKeepsThePreviousState) {
  auto net = make_net();
  Preconditioner kfac(net, Options().kl_clip(0).compute_method(ComputeMethod::kInverse).inv_update_steps(2)
                               .factor_decay(0.0).second_order_lag(1).fold_in_hooks(false));  // add_a for step()
  std::vector<SecondOrderState> first;
  for (int64_t step = 0; step < 4; ++step) {
    zero_grad_and_backward(*net, 700 + step);
    if (step == 2) {
      for (const auto& layer : kfac.layers()) first.push_back(layer.second_order());
      const double huge = std::numeric_limits<double>::max();
      net->fc1->factor_capture().add_a(torch::full({10, 10}, huge, torch::kFloat64), 0.0);
    }
    kfac.step();
    if (step == 2) EXPECT_EQ(kfac.events().second_order_failures, 0) << "computed beside the steps, not yet seen";
  }
  EXPECT_EQ(kfac.events().second_order_failures, 1);
  EXPECT_TRUE(torch::equal(kfac.layers()[1].second_order().a_inverse, first[1].a_inverse)) << "previous state kept";
  EXPECT_FALSE(torch::equal(kfac.layers()[0].second_order().a_inverse, first[0].a_inverse)) << "the others installed";
  EXPECT_FALSE(torch::equal(kfac.layers()[2].second_order().g_inverse, first[2].g_inverse));
}

// A step that starts a lagged update, then fails (here the model's KL sum, as a lost pipeline stage would) and is
// retried at the same step count drops that update and starts it again: the retried step keeps the state in use
// (not the failed attempt's update installed at once), and the next step installs the retry's.
TEST(Preconditioner, RetriedStepStartsItsLaggedUpdateAgain) {
  auto net = make_net();
  Preconditioner kfac(net, Options().inv_update_steps(2).second_order_lag(1));
  for (int64_t step = 0; step < 2; ++step) {
    zero_grad_and_backward(*net, 500 + step);
    kfac.step();
  }
  const auto before = kfac.layers()[1].second_order().a_eigen.eigenvalues;
  Distributor failing;
  failing.sum_over_model = [](torch::Tensor&) { throw std::runtime_error("a stage was lost"); };
  zero_grad_and_backward(*net, 502);
  EXPECT_THROW(kfac.step(failing), std::runtime_error);
  EXPECT_EQ(kfac.steps(), 2);
  zero_grad_and_backward(*net, 503);  // the retry, on another batch: its factors are not the failed attempt's
  kfac.step();
  EXPECT_TRUE(kfac.layers()[1].second_order().a_eigen.eigenvalues.is_same(before)) << "the state in use kept";
  const auto factor = kfac.layers()[1].a_factor();
  zero_grad_and_backward(*net, 504);
  kfac.step();  // step 3 installs the retry's update: the factor as it was after step 2's retry
  const auto expected = math::eigen_decompose(factor.to(torch::kFloat64));
  EXPECT_TENSOR_NEAR(kfac.layers()[1].second_order().a_eigen.eigenvalues, expected.eigenvalues, 1e-10);
}

// A checkpoint taken while an update is in flight (saved after step 3, whose update installs at step 5): the resumed
// run starts it again from what it loaded (no factor update came between) and installs it at step 5, as the
// uninterrupted run does.
TEST(Preconditioner, SecondOrderLagCheckpointRoundTripGivesSameNextStep) {
  expect_checkpoint_round_trip(Options().factor_update_steps(2).inv_update_steps(3).second_order_lag(2));
}

// docs/CPP.md's eigen_adam loop: SGD with weight decay over the dkfac layers' parameters gives AdamW's update with
// the core's step d, p (1 - lr wd) - lr d, and d is the math kernel's for the layer's gradient and eigenbasis.
TEST(Preconditioner, EigenAdamWithSgdOnItsLayersIsAdamWsUpdate) {
  auto net = make_net();
  Preconditioner kfac(net, Options().kl_clip(0).eigen_adam(true).adam_beta1(0.8).adam_eps(1e-6));
  std::vector<torch::Tensor> layers;
  for (const auto& layer : kfac.layers()) {
    layers.push_back(layer.weight());
    if (layer.bias().defined()) layers.push_back(layer.bias());
  }
  const double lr = 0.01, wd = 0.1;
  torch::optim::SGD step_layers(layers, torch::optim::SGDOptions(lr).weight_decay(wd));
  for (int64_t s = 0; s < 3; ++s) {
    auto batch = make_batch(700 + s);
    step_layers.zero_grad();
    auto taps = net->forward_taps(batch.x);
    net->loss(taps, batch.target).backward();
    std::vector<torch::Tensor> grads;
    for (const auto& layer : kfac.layers()) grads.push_back(layer.gradient());
    kfac.step();
    // fc1's step against the kernel, from the moments it had and the eigenbasis it holds now (refreshed each step:
    // the moments rotated into it first).
    const auto& fc1 = kfac.layers()[1];
    const auto& state = fc1.second_order();
    if (s == 0) {
      auto moments = math::zero_moments(5, 10, torch::kFloat64);
      const auto expected = math::eigen_adam_step(state.a_eigen, state.g_eigen, moments, grads[1], {0.8, 0.999, 1e-6});
      EXPECT_TENSOR_NEAR(fc1.gradient(), expected, 1e-12);
    }
    ASSERT_TRUE(fc1.adam_moments().defined());
    EXPECT_FALSE(state.denominator.defined()) << "Adam's step does not use the eigenvalues: no denominator held";
    EXPECT_EQ(fc1.state().count("denominator"), 0u);
    EXPECT_EQ(fc1.adam_moments().steps.item<double>(), s + 1.0);
    std::vector<torch::Tensor> before, steps;
    for (const auto& p : layers) {
      before.push_back(p.detach().clone());
      steps.push_back(p.grad().clone());
    }
    step_layers.step();
    for (size_t i = 0; i < layers.size(); ++i) {
      EXPECT_TENSOR_NEAR(layers[i].detach(), before[i] * (1 - lr * wd) - lr * steps[i], 1e-12) << "parameter " << i;
    }
  }
}

// Adam's moments in the eigenbasis are state too: saved, loaded, and rotated at the inverse step after the load.
TEST(Preconditioner, EigenAdamCheckpointRoundTripKeepsTheMoments) {
  expect_checkpoint_round_trip(Options().factor_update_steps(2).inv_update_steps(3).kl_clip(0).eigen_adam(true));
}

// The same with an update in flight, installed at the first step after the load (saved after step 3, whose update
// installs at step 4 with lag 1; lag 2 installs it at step 5, after a step in the loaded basis): the loaded moments
// are in the loaded basis, and the resumed update's install rotates them out of it, as the uninterrupted run does.
// (They were taken to be in whichever basis came next, and went unrotated.)
TEST(Preconditioner, EigenAdamLaggedCheckpointRotatesTheMomentsAtTheResumedInstall) {
  for (const int64_t lag : {1, 2}) {
    SCOPED_TRACE("second_order_lag " + std::to_string(lag));
    expect_checkpoint_round_trip(
        Options().factor_update_steps(2).inv_update_steps(3).second_order_lag(lag).kl_clip(0).eigen_adam(true));
  }
}

TEST(Preconditioner, LoadRejectsAnotherModelAndLeavesStateUnchanged) {
  auto net = make_net();
  Preconditioner kfac(net, Options());
  auto batch = make_batch(13);
  auto taps = net->forward_taps(batch.x);
  net->loss(taps, batch.target).backward();
  kfac.step();
  std::stringstream bytes;
  torch::save(kfac, bytes);

  torch::manual_seed(1);
  auto other = std::make_shared<NetWithUnused>();
  Preconditioner other_kfac(other, Options());
  testing::expect_error([&] { torch::load(other_kfac, bytes); }, {"checkpoint holds 3 K-FAC layers, the model has 4"});
  EXPECT_EQ(other_kfac.steps(), 0);

  std::stringstream garbage("this is not a checkpoint");
  Preconditioner fresh(make_net(), Options());
  EXPECT_THROW(torch::load(fresh, garbage), c10::Error);
  EXPECT_EQ(fresh.steps(), 0);
}

TEST(Preconditioner, ReportsMemoryAndTimes) {
  auto net = make_net();
  Preconditioner kfac(net, Options());
  EXPECT_EQ(kfac.memory_bytes(), 0);
  auto batch = make_batch(14);
  auto taps = net->forward_taps(batch.x);
  net->loss(taps, batch.target).backward();
  kfac.step();
  // conv: a=19, g=3; fc1: a=10, g=5; fc2: a=5, g=2. Factors + Q + d + denominator, float64.
  auto layer_bytes = [](int64_t a, int64_t g) { return 8 * (2 * (a * a + g * g) + a + g + g * a); };
  EXPECT_EQ(kfac.memory_bytes(), layer_bytes(19, 3) + layer_bytes(10, 5) + layer_bytes(5, 2));
  EXPECT_GT(kfac.last_step_times()[KfacPhase::kFactors], 0.0);
  EXPECT_GT(kfac.last_step_times()[KfacPhase::kSecondOrder], 0.0);
  EXPECT_GT(kfac.total_times().total(), 0.0);
}

// The API of the core issue, as the README's C++ snippet writes it (the README's model since issue 17: the
// pooling keeps fc's factor 393 wide instead of 6273, whose first step took ~44 s).
struct Net : torch::nn::Module {
  Net() {
    conv = register_module("conv", dkfac::nn::Conv2d(torch::nn::Conv2dOptions(1, 8, 3).padding(1)));
    fc = register_module("fc", dkfac::nn::Linear(torch::nn::LinearOptions(8 * 7 * 7, 10)));
  }
  torch::Tensor forward(torch::Tensor x) {
    return fc->forward(torch::max_pool2d(torch::relu(conv->forward(x)), 4).flatten(1));
  }
  dkfac::nn::Conv2d conv{nullptr};
  dkfac::nn::Linear fc{nullptr};
};

// The README's snippet and this test's copy of it stay the same code.
TEST(Preconditioner, ReadmeSnippetIsTheTestedNet) {
  std::ifstream in(std::string(DKFAC_SOURCE_DIR) + "/README.md");
  ASSERT_TRUE(in.good());
  const std::string readme((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const char* line : {
           "    fc = register_module(\"fc\", dkfac::nn::Linear(torch::nn::LinearOptions(8 * 7 * 7, 10)));\n",
           "    return fc->forward(torch::max_pool2d(torch::relu(conv->forward(x)), 4).flatten(1));\n",
           "dkfac::Preconditioner kfac(net, dkfac::Options()\n"}) {
    EXPECT_NE(readme.find(line), std::string::npos) << line;
  }
  CapturedWarnings warnings;
  dkfac::Preconditioner kfac(std::make_shared<Net>(), dkfac::Options());
  EXPECT_TRUE(warnings.messages.empty()) << "the README's model has no large factor: " << warnings.all();
}

TEST(Preconditioner, DocumentedApiTrainsOnASeparableProblem) {
  torch::manual_seed(0);
  auto net = std::make_shared<Net>();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  dkfac::Preconditioner kfac(net, dkfac::Options()
                                      .lr(0.1)
                                      .damping(3e-3)
                                      .factor_decay(0.95)
                                      .kl_clip(1e-3)
                                      .factor_update_steps(10)
                                      .inv_update_steps(100)
                                      .compute_method(dkfac::ComputeMethod::kEigen));
  auto x = torch::randn({16, 1, 28, 28});
  auto y = torch::arange(16) % 10;
  double first = 0, last = 0;
  for (int step = 0; step < 12; ++step) {
    sgd.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
    loss.backward();
    kfac.step();
    sgd.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, first);
  EXPECT_EQ(kfac.steps(), 12);
}

}  // namespace
}  // namespace dkfac

namespace dkfac {
namespace {

// One dkfac layer alone, for every kind, with and without bias and over several geometries: the
// preconditioned gradient equals the dense Kronecker solve built from independently computed factors.
class SingleLayer : public ::testing::TestWithParam<std::tuple<int, bool>> {};

torch::nn::Conv2dOptions single_conv_options(int index, bool bias) {
  switch (index) {
    case 0: return torch::nn::Conv2dOptions(2, 3, 3).padding(1).bias(bias);
    case 1: return torch::nn::Conv2dOptions(2, 3, 3).stride(2).bias(bias);
    case 2: return torch::nn::Conv2dOptions(2, 3, {2, 3}).stride({1, 2}).padding({1, 2}).dilation({2, 1}).bias(bias);
    default: return torch::nn::Conv2dOptions(2, 3, 3).padding(torch::kSame).dilation(2).bias(bias);
  }
}

TEST_P(SingleLayer, MatchesDenseKroneckerSolve) {
  const auto [index, bias] = GetParam();
  torch::manual_seed(index * 2 + bias);
  torch::nn::Sequential model;
  torch::Tensor x;
  std::function<torch::Tensor()> a_batch;
  if (index < 4) {
    auto conv = nn::Conv2d(single_conv_options(index, bias));
    model->push_back(conv);
    x = torch::randn({3, 2, 7, 6}, torch::kFloat64);
    a_batch = [conv, &x] { return math::conv2d_a_factor(x, conv->geometry(), conv->bias.defined()); };
  } else {
    model->push_back(nn::Linear(torch::nn::LinearOptions(6, 4).bias(bias)));
    x = torch::randn({3, 2, 6}, torch::kFloat64);
    a_batch = [&x, bias = bias] { return math::linear_a_factor(x, bias); };
  }
  model->to(torch::kFloat64);
  const double damping = 0.02;
  Preconditioner kfac(model.ptr(), Options().damping(damping).kl_clip(0).factor_decay(0.5));
  auto out = model->forward(x);
  out.retain_grad();
  (out * out).sum().backward();
  auto g_batch = index < 4 ? math::conv2d_g_factor(out.grad()) : math::linear_g_factor(out.grad());
  auto grad = kfac.layers()[0].gradient().clone();
  kfac.step();
  auto a = 0.5 * torch::eye(kfac.layers()[0].a_dim(), torch::kFloat64) + 0.5 * a_batch();
  auto g = 0.5 * torch::eye(kfac.layers()[0].g_dim(), torch::kFloat64) + 0.5 * g_batch;
  EXPECT_TENSOR_NEAR(kfac.layers()[0].gradient(), dense_eigen_reference(a, g, grad, damping), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(KindsAndGeometries, SingleLayer,
                         ::testing::Combine(::testing::Range(0, 5), ::testing::Bool()));

// A preconditioner of make_net() after `steps` steps of distinct batches.
std::unique_ptr<Preconditioner> trained(const std::shared_ptr<TinyNet>& net, const Options& options, int64_t steps) {
  auto kfac = std::make_unique<Preconditioner>(net, options);
  for (int64_t s = 0; s < steps; ++s) {
    net->zero_grad();
    auto batch = make_batch(700 + s);
    net->loss(net->forward_taps(batch.x), batch.target).backward();
    kfac->step();
  }
  return kfac;
}

// The one restore (Preconditioner::restore), single process: a saved state of this method with every layer's
// second-order state is taken exactly; one that lacks a layer's part, or of no known method, is recomputed from
// its factors (as update_second_order does); a per-rank state that lacks a factor this rank builds after the first
// step is refused naming the layer and what the front end said of the writer, and nothing changes.
TEST(Preconditioner, RestoreIsExactRecomputedOrRefused) {
  const Options options = Options().factor_update_steps(1).inv_update_steps(3);
  const auto source = trained(make_net(), options, 5);  // factors updated twice since the last inverse step
  std::vector<std::map<std::string, torch::Tensor>> states;
  for (const auto& layer : source->layers()) states.push_back(layer.state());
  const auto fresh = [&] { return std::make_unique<Preconditioner>(make_net(), options); };
  const auto same = [](const Preconditioner& p, const std::vector<std::map<std::string, torch::Tensor>>& want) {
    for (size_t i = 0; i < want.size(); ++i) {
      const auto have = p.layers()[i].state();
      ASSERT_EQ(have.size(), want[i].size()) << "layer " << i;
      for (const auto& [key, tensor] : want[i]) EXPECT_TRUE(torch::equal(have.at(key), tensor)) << i << " " << key;
    }
  };

  auto exact = fresh();
  const auto restored = exact->restore({5, states, ComputeMethod::kEigen, "", true});
  EXPECT_EQ(restored.placed_layers, 3);
  EXPECT_EQ(restored.recomputed_layers, 0);
  EXPECT_EQ(exact->steps(), 5);
  same(*exact, states);

  // The recompute is update_second_order on the loaded factors: not the saved state (the factors moved since).
  auto expected = fresh();
  expected->load_layer_states(5, states);
  expected->update_second_order();
  auto partial = states;
  partial[1].erase("g_eigenvalues");
  for (const auto& [saved, method] : {std::pair{partial, std::optional<ComputeMethod>(ComputeMethod::kEigen)},
                                      std::pair{states, std::optional<ComputeMethod>()}}) {
    auto recomputed = fresh();
    const auto r = recomputed->restore({5, saved, method, "", true});
    EXPECT_EQ(r.recomputed_layers, 3);
    std::vector<std::map<std::string, torch::Tensor>> want;
    for (const auto& layer : expected->layers()) want.push_back(layer.state());
    same(*recomputed, want);
    EXPECT_FALSE(torch::equal(recomputed->layers()[0].second_order().a_eigen.eigenvalues,
                              source->layers()[0].second_order().a_eigen.eigenvalues));
  }

  // A layer that never built factors (none saved) has nothing to restore: the others are still exact.
  auto without = states;
  without[2].clear();
  auto partly = fresh();
  const auto r = partly->restore({5, without, ComputeMethod::kEigen, "", true});
  EXPECT_EQ(r.placed_layers, 2);
  EXPECT_EQ(r.recomputed_layers, 0);
  EXPECT_TRUE(torch::equal(partly->layers()[0].second_order().a_eigen.eigenvalues,
                           source->layers()[0].second_order().a_eigen.eigenvalues));

  auto refused = trained(make_net(), options, 2);
  std::vector<std::map<std::string, torch::Tensor>> before;
  for (const auto& layer : refused->layers()) before.push_back(layer.state());
  auto lacking = states;
  lacking[2].erase("g_factor");
  testing::expect_error([&] { refused->restore({5, lacking, ComputeMethod::kEigen, "it is rank 3's share", true}); },
                        {"state holds no G factor of layer 'fc2', which this rank builds: it is rank 3's share"});
  same(*refused, before);
  EXPECT_EQ(refused->steps(), 2);
  // Not checked for a state of every layer (a layer that had no factors), nor before the first step.
  EXPECT_NO_THROW(fresh()->restore({5, lacking, ComputeMethod::kEigen, "", true}));
  EXPECT_NO_THROW(fresh()->restore({0, lacking, ComputeMethod::kEigen, "it is rank 3's share", true}));
}

// dkfac reads one format of its archive: another version (here 1, one rank's own state, which no release
// wrote) is refused naming both versions, and nothing changes.
TEST(Preconditioner, AnotherFormatVersionIsRefusedNamingIt) {
  auto net = make_net();
  auto kfac = trained(net, Options().inv_update_steps(2), 3);
  torch::serialize::OutputArchive archive;  // what format 1 wrote: each layer as KfacLayer::save writes it
  archive.write("format_version", c10::IValue(int64_t{1}));
  archive.write("steps", c10::IValue(kfac->steps()));
  archive.write("num_layers", c10::IValue(static_cast<int64_t>(kfac->layers().size())));
  for (size_t i = 0; i < kfac->layers().size(); ++i) {
    torch::serialize::OutputArchive nested;
    kfac->layers()[i].save(nested);
    archive.write("layer" + std::to_string(i), nested);
  }
  std::stringstream bytes;
  archive.save_to(bytes);
  Preconditioner restored(make_net(), Options().inv_update_steps(2));
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  try {
    restored.load(in);
    FAIL() << "format version 1 was read";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("dkfac preconditioner checkpoint has format version 1; this build reads "
                                         "version 2 only"), std::string::npos) << e.what();
  }
  EXPECT_EQ(restored.steps(), 0);
  for (const auto& layer : restored.layers()) EXPECT_FALSE(layer.a_factor().defined());
}

TEST(Preconditioner, FormatTwoRecordsWorldAndPlanAndRefusesDamage) {
  auto net = make_net();
  auto kfac = trained(net, Options(), 2);
  std::stringstream bytes;
  torch::save(*kfac, bytes);
  auto reload = [&](const std::function<void(torch::serialize::InputArchive&, torch::serialize::OutputArchive&)>& edit) {
    // A copy of the archive with its top-level entries passed through `edit`.
    bytes.clear();
    bytes.seekg(0);
    torch::serialize::InputArchive in;
    in.load_from(bytes);
    torch::serialize::OutputArchive out;
    edit(in, out);
    std::stringstream edited;
    out.save_to(edited);
    torch::serialize::InputArchive result;
    result.load_from(edited);
    return result;
  };
  auto copy_except = [](const std::set<std::string>& skip, std::map<std::string, c10::IValue> replace = {}) {
    return [skip, replace](torch::serialize::InputArchive& in, torch::serialize::OutputArchive& out) {
      for (const auto& key : in.keys()) {
        if (skip.count(key)) continue;
        if (replace.count(key)) {
          out.write(key, replace.at(key));
          continue;
        }
        c10::IValue value;
        torch::serialize::InputArchive nested;
        if (key.rfind("layer", 0) != 0 && in.try_read(key, value)) {
          out.write(key, value);
        } else if (in.try_read(key, nested)) {
          torch::serialize::OutputArchive copy;
          for (const auto& k : nested.keys()) {
            c10::IValue v;
            torch::Tensor t;
            if (nested.try_read(k, t, /*is_buffer=*/true)) {
              copy.write(k, t, /*is_buffer=*/true);
            } else if (nested.try_read(k, v)) {
              copy.write(k, v);
            }
          }
          out.write(key, copy);
        }
      }
    };
  };
  {
    Preconditioner restored(make_net(), Options());
    auto in = reload(copy_except({}));
    const auto restore = restored.load(in);
    EXPECT_EQ(restore.format_version, 2);
    EXPECT_EQ(restore.world_size, 1);
    EXPECT_TRUE(restore.same_plan);
    EXPECT_EQ(restore.placed_layers, 3);
    EXPECT_EQ(restore.recomputed_layers, 0);
  }
  const std::vector<std::pair<std::function<void(torch::serialize::InputArchive&, torch::serialize::OutputArchive&)>,
                              std::string>>
      damages = {
          {copy_except({}, {{"format_version", c10::IValue(int64_t{7})}}),
           "has format version 7; this build reads version 2 only"},
          {copy_except({"world_size"}), "has no integer 'world_size' entry: the archive is damaged"},
          {copy_except({}, {{"world_size", c10::IValue(int64_t{0})}}), "has world_size 0: the archive is damaged"},
          {copy_except({}, {{"method", c10::IValue(int64_t{9})}}), "has compute method 9: the archive is damaged"},
          {copy_except({"layer1"}), "has no entry for K-FAC layer 1"},
          {copy_except({}, {{"steps", c10::IValue(int64_t{-2})}}), "has steps -2: the archive is damaged"},
      };
  for (const auto& [edit, message] : damages) {
    Preconditioner restored(make_net(), Options());
    auto in = reload(edit);
    testing::expect_error([&] { restored.load(in); }, {message});
    EXPECT_EQ(restored.steps(), 0) << message;
    for (const auto& layer : restored.layers()) EXPECT_FALSE(layer.a_factor().defined()) << message;
  }
}

// torch's zip reader does not check its records: of 97 single-byte changes to an archive, 23 loaded changed state
// (one a 1.75e38 in an eigenvector). The archive's checksum now refuses every change to its contents: each changed
// byte below is refused, or loads the very state saved (a byte torch does not read).
TEST(Preconditioner, EveryChangedByteIsRefusedOrChangesNothing) {
  auto net = make_net();
  auto kfac = trained(net, Options(), 2);
  std::stringstream saved;
  torch::save(*kfac, saved);
  const std::string bytes = saved.str();
  const auto original = kfac->gathered_layer_states();
  int refused = 0, unchanged = 0;
  const size_t stride = std::max<size_t>(1, bytes.size() / 400);
  for (size_t at = 0; at < bytes.size(); at += stride) {
    std::string damaged = bytes;
    damaged[at] = static_cast<char>(damaged[at] ^ 0x10);
    std::stringstream stream(damaged);
    Preconditioner restored(make_net(), Options());
    torch::serialize::InputArchive in;
    try {
      in.load_from(stream);  // torch's reader: what it refuses (zip structure, pickles) it throws, of any kind
    } catch (const std::exception&) {
      ++refused;
      continue;
    }
    try {
      restored.load(in);  // dkfac's: a c10::Error, before anything changed
    } catch (const c10::Error&) {
      ++refused;
      EXPECT_EQ(restored.steps(), 0) << "byte " << at;
      continue;
    }
    const auto loaded = restored.gathered_layer_states();
    ASSERT_EQ(loaded.size(), original.size());
    for (size_t i = 0; i < loaded.size(); ++i) {
      ASSERT_EQ(loaded[i].size(), original[i].size()) << "byte " << at;
      for (const auto& [key, tensor] : original[i]) {
        const auto it = loaded[i].find(key);
        ASSERT_NE(it, loaded[i].end()) << "byte " << at << ", layer " << i << ": no " << key;
        EXPECT_TRUE(torch::equal(it->second, tensor)) << "byte " << at << ", layer " << i << ", " << key;
      }
    }
    ++unchanged;
  }
  EXPECT_GT(refused, 0);
  RecordProperty("refused", refused);
  RecordProperty("unchanged", unchanged);
}

TEST(Preconditioner, AnotherComputeMethodIsRecomputedFromTheFactors) {
  // Saved with eigendecompositions, loaded with inverses: the factors are kept and the inverses computed
  // from them, as a preconditioner that had always used inverses computes them.
  auto net = make_net();
  auto kfac = trained(net, Options().compute_method(ComputeMethod::kEigen), 2);
  std::stringstream bytes;
  torch::save(*kfac, bytes);
  const auto inverse = Options().compute_method(ComputeMethod::kInverse);
  Preconditioner restored(make_net(), inverse);
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  const auto restore = restored.load(in);
  EXPECT_EQ(restore.recomputed_layers, 3);
  EXPECT_EQ(restore.placed_layers, 0);
  EXPECT_NE(restore.describe(1).find("recomputed from the factors"), std::string::npos) << restore.describe(1);
  Preconditioner reference(make_net(), inverse);
  std::vector<std::map<std::string, torch::Tensor>> factors;
  for (const auto& layer : kfac->layers()) {
    factors.push_back({{"a_factor", layer.a_factor()}, {"g_factor", layer.g_factor()}});
  }
  reference.load_layer_states(2, factors);
  reference.update_second_order();
  for (size_t i = 0; i < restored.layers().size(); ++i) {
    const auto& got = restored.layers()[i].second_order();
    ASSERT_EQ(got.method, ComputeMethod::kInverse);
    EXPECT_TRUE(torch::equal(got.a_inverse, reference.layers()[i].second_order().a_inverse)) << "layer " << i;
    EXPECT_TRUE(torch::equal(got.g_inverse, reference.layers()[i].second_order().g_inverse)) << "layer " << i;
    EXPECT_FALSE(got.a_eigen.eigenvectors.defined()) << "layer " << i;
  }
}

}  // namespace
}  // namespace dkfac
