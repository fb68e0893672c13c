// KfacLayer (dkfac/layers/kfac_layer.h) phase by phase against dense float64 references: the running
// average of docs/MATH.md 1.5, and preconditioning (2.1, 2.2) against an explicit Kronecker solve.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <string>

#include "dkfac/layers/kfac_layer.h"
#include "tests/test_util.h"

namespace dkfac {
namespace {

using testing::dense_eigen_reference;
using testing::dense_inverse_reference;
using testing::expect_error;
using testing::random_spd;

const auto kF64 = torch::TensorOptions().dtype(torch::kFloat64);
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A Linear(in -> out) layer's binding: weight [out, in], bias [out], a capture that knows it.
LayerBinding linear_binding(int64_t in, int64_t out, bool bias = true, torch::Dtype dtype = torch::kFloat64) {
  const auto options = torch::TensorOptions().dtype(dtype);
  return LayerBinding{"fc", torch::randn({out, in}, options), bias ? torch::randn({out}, options) : torch::Tensor(),
                      std::make_shared<FactorCapture>(LayerGeometry{LayerKind::kLinear, bias, {}})};
}

// A layer whose running factors are exactly `a` and `g` (alpha = 0 keeps nothing of the identity).
KfacLayer layer_with_factors(const torch::Tensor& a, const torch::Tensor& g) {
  KfacLayer layer(linear_binding(a.size(0) - 1, g.size(0), true, a.scalar_type()));
  EXPECT_TRUE(layer.fold_factors(a, g, 0.0).item<bool>());
  return layer;
}

TEST(KfacLayer, ConstructorChecksTheBinding) {
  auto no_capture = linear_binding(4, 3);
  no_capture.capture = nullptr;
  expect_error([&] { KfacLayer layer(no_capture); }, {"layer 'fc' needs a weight and a factor capture"});

  auto conv_weight = linear_binding(4, 3);
  conv_weight.weight = torch::randn({3, 4, 1, 1}, kF64);
  expect_error([&] { KfacLayer layer(conv_weight); }, {"(Linear)", "[3, 4, 1, 1]", "expected 2 dimensions"});

  auto wrong_bias = linear_binding(4, 3);
  wrong_bias.bias = torch::randn({2}, kF64);
  expect_error([&] { KfacLayer layer(wrong_bias); }, {"bias does not match the weight's 3 outputs"});

  auto unexpected_bias = linear_binding(4, 3, /*bias=*/false);
  unexpected_bias.bias = torch::randn({3}, kF64);  // the capture was told there is none
  expect_error([&] { KfacLayer layer(unexpected_bias); }, {"bias does not match"});
}

TEST(KfacLayer, DimensionsOfLinearAndConv2d) {
  KfacLayer linear(linear_binding(4, 3));
  EXPECT_EQ(linear.a_dim(), 5);
  EXPECT_EQ(linear.g_dim(), 3);
  EXPECT_EQ(linear.kind(), LayerKind::kLinear);
  KfacLayer no_bias(linear_binding(4, 3, false));
  EXPECT_EQ(no_bias.a_dim(), 4);

  LayerGeometry geometry{LayerKind::kConv2d, true, {}};
  geometry.conv.kernel_size = {3, 3};
  KfacLayer conv(LayerBinding{"conv", torch::randn({4, 2, 3, 3}, kF64), torch::randn({4}, kF64),
                              std::make_shared<FactorCapture>(geometry)});
  EXPECT_EQ(conv.a_dim(), 2 * 3 * 3 + 1);
  EXPECT_EQ(conv.g_dim(), 4);
  EXPECT_EQ(conv.kind(), LayerKind::kConv2d);
}

TEST(KfacLayer, GradientIsWeightThenBiasColumn) {
  torch::manual_seed(1);
  KfacLayer layer(linear_binding(4, 3));
  EXPECT_FALSE(layer.has_gradient());
  auto weight_grad = torch::randn({3, 4}, kF64);
  auto bias_grad = torch::randn({3}, kF64);
  layer.weight().mutable_grad() = weight_grad.clone();
  EXPECT_FALSE(layer.has_gradient());  // the bias has none yet
  layer.bias().mutable_grad() = bias_grad.clone();
  ASSERT_TRUE(layer.has_gradient());
  auto matrix = layer.gradient();
  ASSERT_EQ(matrix.sizes(), (std::vector<int64_t>{3, 5}));
  EXPECT_TRUE(torch::equal(matrix.slice(1, 0, 4), weight_grad));
  EXPECT_TRUE(torch::equal(matrix.select(1, 4), bias_grad));

  auto written = torch::arange(15, kF64).reshape({3, 5});
  layer.set_gradient(written);
  EXPECT_TRUE(torch::equal(layer.weight().grad(), written.slice(1, 0, 4)));
  EXPECT_TRUE(torch::equal(layer.bias().grad(), written.select(1, 4)));
}

// set_gradient_where writes the matrix where the device-side flag is true and keeps the gradients where it is
// false, weight and bias, the weight stored transposed too (transformers' Conv1D): as set_gradient of
// where(use, matrix, gradient()), without gathering the gradient.
TEST(KfacLayer, SetGradientWhereWritesOrKeepsEachPart) {
  torch::manual_seed(2);
  for (const bool transposed : {false, true}) {
    LayerGeometry geometry;
    geometry.has_bias = true;
    geometry.transposed = transposed;
    KfacLayer layer(LayerBinding{"fc", transposed ? torch::randn({4, 3}, kF64) : torch::randn({3, 4}, kF64),
                                 torch::randn({3}, kF64), std::make_shared<FactorCapture>(geometry)});
    const auto weight_grad = torch::randn(layer.weight().sizes(), kF64);
    const auto bias_grad = torch::randn({3}, kF64);
    layer.weight().mutable_grad() = weight_grad.clone();
    layer.bias().mutable_grad() = bias_grad.clone();
    const auto plain = layer.gradient();
    const auto written = torch::arange(15, kF64).reshape({3, 5});
    layer.set_gradient_where(torch::tensor(false), written);
    EXPECT_TRUE(torch::equal(layer.weight().grad(), weight_grad)) << "transposed " << transposed;
    EXPECT_TRUE(torch::equal(layer.bias().grad(), bias_grad));
    layer.set_gradient_where(torch::tensor(true), written);
    EXPECT_TRUE(torch::equal(layer.gradient(), written)) << "transposed " << transposed;
    EXPECT_FALSE(torch::equal(plain, written));
  }
}

TEST(KfacLayer, Conv2dGradientIsTheWeightViewedAsAMatrix) {
  LayerGeometry geometry{LayerKind::kConv2d, false, {}};
  geometry.conv.kernel_size = {2, 2};
  KfacLayer conv(LayerBinding{"conv", torch::randn({3, 2, 2, 2}, kF64), torch::Tensor(),
                              std::make_shared<FactorCapture>(geometry)});
  auto weight_grad = torch::randn({3, 2, 2, 2}, kF64);
  conv.weight().mutable_grad() = weight_grad.clone();
  EXPECT_TRUE(torch::equal(conv.gradient(), weight_grad.reshape({3, 8})));
  conv.set_gradient(torch::ones({3, 8}, kF64));
  EXPECT_TRUE(torch::equal(conv.weight().grad(), torch::ones({3, 2, 2, 2}, kF64)));
}

TEST(KfacLayer, TakeFactorBatchesEmptiesTheCapture) {
  torch::manual_seed(2);
  KfacLayer layer(linear_binding(2, 2));
  auto& capture = layer.capture();
  capture.capture_input(torch::randn({3, 2}, kF64));
  capture.capture_input(torch::randn({3, 2}, kF64));
  capture.capture_output_grad(torch::randn({3, 2}, kF64));
  EXPECT_EQ(layer.captured_batches(), 1);  // the smaller of the A and G counts
  auto expected_a = capture.mean_a();
  auto [a, g] = layer.take_factor_batches();
  EXPECT_TRUE(torch::equal(a, expected_a));
  EXPECT_EQ(g.sizes(), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(layer.captured_batches(), 0);
  auto [a2, g2] = layer.take_factor_batches();
  EXPECT_FALSE(a2.defined());
  EXPECT_FALSE(g2.defined());
}

// MATH.md 1.5: F starts as I; each fold is alpha F + (1 - alpha) F_batch.
TEST(KfacLayer, FoldIsARunningAverageFromTheIdentity) {
  torch::manual_seed(3);
  KfacLayer layer(linear_binding(2, 2));
  EXPECT_FALSE(layer.a_factor().defined());
  // The worked check of MATH.md 1.6.
  auto a1 = torch::tensor({{.5, 0., .5}, {0., .5, .5}, {.5, .5, 1.}}, kF64);
  auto g1 = random_spd(2, 4, torch::kFloat64);
  ASSERT_TRUE(layer.fold_factors(a1, g1, 0.95).item<bool>());
  EXPECT_TENSOR_NEAR(layer.a_factor(), torch::tensor({{.975, 0., .025}, {0., .975, .025}, {.025, .025, 1.}}, kF64),
                     1e-15);
  EXPECT_TENSOR_NEAR(layer.g_factor(), 0.95 * torch::eye(2, kF64) + 0.05 * g1, 1e-15);

  auto a_old = layer.a_factor().clone();
  auto g_old = layer.g_factor().clone();
  auto a2 = random_spd(3, 5, torch::kFloat64);
  auto g2 = random_spd(2, 5, torch::kFloat64);
  const auto a_expected = 0.7 * a_old + 0.3 * a2;
  ASSERT_TRUE(layer.fold_factors(a2, g2, 0.7).item<bool>());
  EXPECT_TENSOR_NEAR(layer.a_factor(), a_expected, 1e-15);
  EXPECT_TENSOR_NEAR(layer.g_factor(), 0.7 * g_old + 0.3 * g2, 1e-15);
  // The batch is read, not kept: changing it afterwards changes nothing.
  a2.fill_(7.0);
  EXPECT_TENSOR_NEAR(layer.a_factor(), a_expected, 1e-15);
}

// A batch with NaN or Inf in either factor leaves both factors as they were and says so.
TEST(KfacLayer, NonFiniteBatchKeepsThePreviousFactors) {
  torch::manual_seed(4);
  KfacLayer layer(linear_binding(2, 2));
  ASSERT_TRUE(layer.fold_factors(random_spd(3, 4, torch::kFloat64), random_spd(2, 4, torch::kFloat64), 0.9)
                  .item<bool>());
  const auto a_before = layer.a_factor().clone();
  const auto g_before = layer.g_factor().clone();

  auto a_nan = random_spd(3, 4, torch::kFloat64);
  a_nan[1][2] = kNaN;
  EXPECT_FALSE(layer.fold_factors(a_nan, random_spd(2, 4, torch::kFloat64), 0.9).item<bool>());
  EXPECT_TRUE(torch::equal(layer.a_factor(), a_before));
  EXPECT_TRUE(torch::equal(layer.g_factor(), g_before));  // G's finite batch is not folded alone

  auto g_inf = random_spd(2, 4, torch::kFloat64);
  g_inf[0][0] = std::numeric_limits<double>::infinity();
  EXPECT_FALSE(layer.fold_factors(random_spd(3, 4, torch::kFloat64), g_inf, 0.9).item<bool>());
  EXPECT_TRUE(torch::equal(layer.a_factor(), a_before));
  EXPECT_TRUE(torch::equal(layer.g_factor(), g_before));
}

TEST(KfacLayer, NonFiniteFirstBatchLeavesNoFactors) {
  KfacLayer layer(linear_binding(2, 2));
  auto a = torch::full({3, 3}, kNaN, kF64);
  EXPECT_FALSE(layer.fold_factors(a, torch::eye(2, kF64), 0.9).item<bool>());
  EXPECT_FALSE(layer.a_factor().defined());
  EXPECT_FALSE(layer.g_factor().defined());
}

// MATH.md 2.1: A = Q_A diag(d_A) Q_A^T (ascending), D = 1 / (d_G d_A^T + lambda), and V solves
// (A kron G + lambda I) vec(V) = vec(grad).
TEST(KfacLayer, EigenStateAndPreconditioningMatchADenseKroneckerSolve) {
  torch::manual_seed(5);
  const auto a = random_spd(5, 8, torch::kFloat64);
  const auto g = random_spd(3, 8, torch::kFloat64);
  const double damping = 0.03;
  auto layer = layer_with_factors(a, g);
  layer.compute_second_order(ComputeMethod::kEigen, damping, /*pi_damping=*/false);

  const auto& s = layer.second_order();
  ASSERT_TRUE(s.defined());
  EXPECT_EQ(s.method, ComputeMethod::kEigen);
  auto rebuild = [](const math::EigenFactor& e) {
    return e.eigenvectors.mm(torch::diag(e.eigenvalues)).mm(e.eigenvectors.t());
  };
  EXPECT_TENSOR_NEAR(rebuild(s.a_eigen), a, 1e-12);
  EXPECT_TENSOR_NEAR(rebuild(s.g_eigen), g, 1e-12);
  EXPECT_TRUE(torch::all(s.a_eigen.eigenvalues.diff() >= 0).item<bool>());
  EXPECT_TENSOR_NEAR(s.denominator,
                     1.0 / (torch::outer(s.g_eigen.eigenvalues, s.a_eigen.eigenvalues) + damping), 1e-12);
  EXPECT_FALSE(s.a_inverse.defined());

  const auto grad = torch::randn({3, 5}, kF64);
  EXPECT_TENSOR_NEAR(s.precondition(grad), dense_eigen_reference(a, g, grad, damping), 1e-10);
}

// MATH.md 2.2: (A + mu_A I)^-1 and (G + mu_G I)^-1; with pi damping mu_A = sqrt(lambda) pi,
// mu_G = sqrt(lambda) / pi, pi = sqrt((tr(A) / a) / (tr(G) / g)).
class KfacLayerInverse : public ::testing::TestWithParam<bool> {};

TEST_P(KfacLayerInverse, InversesAndPreconditioningMatchADenseKroneckerSolve) {
  const bool pi = GetParam();
  torch::manual_seed(6);
  const auto a = random_spd(4, 9, torch::kFloat64) * 3.0;  // traces far apart, so pi is far from 1
  const auto g = random_spd(3, 9, torch::kFloat64) * 0.2;
  const double damping = 0.05;
  auto layer = layer_with_factors(a, g);
  layer.compute_second_order(ComputeMethod::kInverse, damping, pi);

  double mu_a = damping, mu_g = damping;
  if (pi) {
    const double p = std::sqrt((a.trace().item<double>() / 4) / (g.trace().item<double>() / 3));
    ASSERT_GT(std::abs(p - 1.0), 0.5);
    mu_a = std::sqrt(damping) * p;
    mu_g = std::sqrt(damping) / p;
  }
  const auto& s = layer.second_order();
  EXPECT_EQ(s.method, ComputeMethod::kInverse);
  EXPECT_TENSOR_NEAR(s.a_inverse, torch::linalg_inv(a + mu_a * torch::eye(4, kF64)), 1e-10);
  EXPECT_TENSOR_NEAR(s.g_inverse, torch::linalg_inv(g + mu_g * torch::eye(3, kF64)), 1e-10);
  EXPECT_FALSE(s.denominator.defined());

  const auto grad = torch::randn({3, 4}, kF64);
  EXPECT_TENSOR_NEAR(s.precondition(grad), dense_inverse_reference(a, g, grad, mu_a, mu_g), 1e-10);
  // The stored factors never receive the damping.
  EXPECT_TRUE(torch::equal(layer.a_factor(), a));
}

INSTANTIATE_TEST_SUITE_P(PiDamping, KfacLayerInverse, ::testing::Bool());

// A failed computation throws and keeps the state that was there (MATH.md 2.4).
class KfacLayerFailure : public ::testing::TestWithParam<ComputeMethod> {};

TEST_P(KfacLayerFailure, NonFiniteLoadedFactorIsRefusedKeepingTheState) {
  const auto method = GetParam();
  torch::manual_seed(7);
  auto layer = layer_with_factors(random_spd(3, 6, torch::kFloat64), random_spd(2, 6, torch::kFloat64));
  layer.compute_second_order(method, 0.1, false);
  const auto grad = torch::randn({2, 3}, kF64);
  const auto before = layer.second_order().precondition(grad);

  // A NaN running factor can no longer be loaded (a running average would keep it for good): refused, and the
  // layer keeps what it had.
  auto state = layer.state();
  const auto a_before = layer.a_factor().clone();
  state["a_factor"] = torch::full({3, 3}, kNaN, kF64);
  expect_error([&] { layer.load_state(state, method); }, {"checkpoint for layer 'fc': A factor holds NaN or Inf"});
  EXPECT_TRUE(torch::equal(layer.a_factor(), a_before));
  EXPECT_TRUE(torch::equal(layer.second_order().precondition(grad), before));
}

INSTANTIATE_TEST_SUITE_P(Methods, KfacLayerFailure, ::testing::Values(ComputeMethod::kEigen, ComputeMethod::kInverse));

// Layer by layer (the preconditioner's second-order phase): a new state goes in before its check is read and
// each part is chosen on the device, so a failed check leaves exactly the state that was there and a passed one
// exactly the new state; with no state of that shape to fall back on, the new one goes in and the old comes back.
TEST_P(KfacLayerFailure, InstalledStateIsChosenByItsCheck) {
  const auto method = GetParam();
  torch::manual_seed(11);
  auto layer = layer_with_factors(random_spd(4, 8, torch::kFloat64), random_spd(3, 8, torch::kFloat64));
  auto first = layer.start_second_order(method, 0.1, false);
  auto had = layer.install_second_order(first.state, first.ok);
  ASSERT_TRUE(had.has_value()) << "nothing to choose from on the first update: the old state is returned";
  EXPECT_FALSE(had->defined());
  ASSERT_TRUE(layer.second_order().defined());
  const auto grad = torch::randn({3, 4}, kF64);
  const auto v_first = layer.second_order().precondition(grad);

  // New factors, so that the new state differs from the installed one in every part.
  ASSERT_TRUE(layer.fold_factors(random_spd(4, 8, torch::kFloat64), random_spd(3, 8, torch::kFloat64), 0.0)
                  .item<bool>());
  auto next = layer.start_second_order(method, 0.1, false);
  const auto v_next = SecondOrderState(next.state).precondition(grad);
  ASSERT_FALSE(torch::allclose(v_next, v_first));

  auto failed = layer.start_second_order(method, 0.1, false);
  EXPECT_FALSE(layer.install_second_order(failed.state, torch::zeros({}, torch::kBool)).has_value());
  EXPECT_TRUE(torch::equal(layer.second_order().precondition(grad), v_first)) << "a failed check keeps the old state";

  EXPECT_FALSE(layer.install_second_order(next.state, torch::ones({}, torch::kBool)).has_value());
  EXPECT_TRUE(torch::equal(layer.second_order().precondition(grad), v_next)) << "a passed check installs the new one";

  // Another method: nothing of its shape to choose from, so it goes in and the previous state comes back.
  const auto other = method == ComputeMethod::kEigen ? ComputeMethod::kInverse : ComputeMethod::kEigen;
  auto switched = layer.start_second_order(other, 0.1, false);
  auto previous = layer.install_second_order(switched.state, switched.ok);
  ASSERT_TRUE(previous.has_value());
  EXPECT_EQ(previous->method, method);
  EXPECT_EQ(layer.second_order().method, other);
  layer.set_second_order(*previous);
  EXPECT_TRUE(torch::equal(layer.second_order().precondition(grad), v_next));
}

// What a receiving rank does: parts shaped and NaN-filled, filled by a broadcast, then the denominator
// rebuilt locally with the step's damping.
TEST(KfacLayer, PreparedPartsFinishLikeALocalComputation) {
  torch::manual_seed(8);
  const auto a = random_spd(4, 7, torch::kFloat64);
  const auto g = random_spd(3, 7, torch::kFloat64);
  auto computed = layer_with_factors(a, g);
  computed.compute_second_order(ComputeMethod::kEigen, 0.2, false);

  auto receiver = layer_with_factors(a, g);
  auto& parts = receiver.prepare_second_order(ComputeMethod::kEigen);
  ASSERT_EQ(parts.a_eigen.eigenvectors.sizes(), (std::vector<int64_t>{4, 4}));
  ASSERT_EQ(parts.g_eigen.eigenvalues.sizes(), (std::vector<int64_t>{3}));
  EXPECT_TRUE(torch::all(torch::isnan(parts.a_eigen.eigenvectors)).item<bool>());
  EXPECT_TRUE(parts.g_eigen.eigenvectors.is_contiguous());

  const auto& sent = computed.second_order();
  parts.a_eigen.eigenvectors.copy_(sent.a_eigen.eigenvectors);  // the broadcast writes into these buffers
  parts.a_eigen.eigenvalues.copy_(sent.a_eigen.eigenvalues);
  parts.g_eigen.eigenvectors.copy_(sent.g_eigen.eigenvectors);
  parts.g_eigen.eigenvalues.copy_(sent.g_eigen.eigenvalues);
  receiver.finish_second_order(0.2);
  EXPECT_TENSOR_NEAR(receiver.second_order().denominator, sent.denominator, 1e-15);
  const auto grad = torch::randn({3, 4}, kF64);
  EXPECT_TENSOR_NEAR(receiver.second_order().precondition(grad), dense_eigen_reference(a, g, grad, 0.2), 1e-10);

  auto& inverse_parts = receiver.prepare_second_order(ComputeMethod::kInverse);
  EXPECT_FALSE(inverse_parts.denominator.defined());  // another method starts from nothing
  EXPECT_EQ(inverse_parts.a_inverse.sizes(), (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(inverse_parts.g_inverse.sizes(), (std::vector<int64_t>{3, 3}));
}

TEST(KfacLayer, InvDtypeStoresTheStateAndReturnsTheGradientsDtype) {
  torch::manual_seed(9);
  const auto a = random_spd(4, 8, torch::kFloat64);
  const auto g = random_spd(3, 8, torch::kFloat64);
  auto layer = layer_with_factors(a, g);
  layer.set_inv_dtype(torch::kFloat32);
  EXPECT_EQ(layer.factor_dtype(), torch::kFloat64);
  EXPECT_EQ(layer.second_order_dtype(), torch::kFloat32);
  // float64 factors decompose in float64 even when stored in float32 (MATH.md 2.3).
  layer.compute_second_order(ComputeMethod::kEigen, 0.1, false);
  EXPECT_EQ(layer.second_order().a_eigen.eigenvectors.scalar_type(), torch::kFloat32);
  EXPECT_EQ(layer.second_order().denominator.scalar_type(), torch::kFloat32);
  const auto grad = torch::randn({3, 4}, kF64);
  const auto v = layer.second_order().precondition(grad);
  EXPECT_EQ(v.scalar_type(), torch::kFloat64);
  EXPECT_TENSOR_NEAR(v, dense_eigen_reference(a, g, grad, 0.1), 1e-5);
}

TEST(KfacLayer, StateRoundTripAndRefusals) {
  torch::manual_seed(10);
  auto layer = layer_with_factors(random_spd(3, 6, torch::kFloat64), random_spd(2, 6, torch::kFloat64));
  layer.compute_second_order(ComputeMethod::kEigen, 0.1, false);
  const auto state = layer.state();
  for (const char* key : {"a_factor", "g_factor", "a_eigenvectors", "a_eigenvalues", "g_eigenvectors",
                          "g_eigenvalues", "denominator"}) {
    EXPECT_EQ(state.count(key), 1u) << key;
  }
  EXPECT_EQ(state.count("a_inverse"), 0u);
  EXPECT_EQ(layer.memory_bytes(), (9 + 4 + 9 + 3 + 4 + 2 + 6) * 8);

  KfacLayer copy(linear_binding(2, 2));
  copy.load_state(state, ComputeMethod::kEigen);
  const auto grad = torch::randn({2, 3}, kF64);
  EXPECT_TRUE(torch::equal(copy.second_order().precondition(grad), layer.second_order().precondition(grad)));
  EXPECT_TRUE(torch::equal(copy.a_factor(), layer.a_factor()));

  KfacLayer fresh(linear_binding(2, 2));
  auto unknown = state;
  unknown["a_inverse_typo"] = torch::eye(3, kF64);
  expect_error([&] { fresh.load_state(unknown, ComputeMethod::kEigen); }, {"unknown entry 'a_inverse_typo'"});
  auto misshaped = state;
  misshaped["g_factor"] = torch::eye(3, kF64);
  expect_error([&] { fresh.load_state(misshaped, ComputeMethod::kEigen); },
               {"layer 'fc'", "G factor has shape [3, 3], the model expects [2, 2]"});
  EXPECT_FALSE(fresh.a_factor().defined());  // nothing was loaded
  EXPECT_FALSE(fresh.second_order().defined());
}

// bfloat16 and float16 storage: the factors fold in that dtype (the identity built without an eye kernel),
// decompose in float32, are stored in that dtype, survive state()/load_state bit for bit, and precondition
// close to the dense reference of the stored factors.
class KfacLayerStorage : public ::testing::TestWithParam<torch::ScalarType> {};

TEST_P(KfacLayerStorage, ReducedPrecisionFoldsDecomposesAndRoundTrips) {
  const auto dtype = GetParam();
  torch::manual_seed(11);
  auto binding = linear_binding(3, 2, true, torch::kFloat32);
  binding.capture->set_factor_dtype(dtype);
  KfacLayer layer(binding);
  EXPECT_EQ(layer.factor_dtype(), dtype);
  const auto a_batch = random_spd(4, 8, torch::kFloat64);
  const auto g_batch = random_spd(2, 8, torch::kFloat64);
  ASSERT_TRUE(layer.fold_factors(a_batch.to(dtype), g_batch.to(dtype), 0.5).item<bool>());
  ASSERT_EQ(layer.a_factor().scalar_type(), dtype);
  const double rounding = dtype == torch::kBFloat16 ? 1e-2 : 2e-3;
  EXPECT_TENSOR_NEAR(layer.a_factor(), 0.5 * torch::eye(4, kF64) + 0.5 * a_batch, rounding);

  const double damping = 0.3;
  layer.compute_second_order(ComputeMethod::kEigen, damping, false);
  EXPECT_EQ(layer.second_order().a_eigen.eigenvectors.scalar_type(), dtype);
  const auto grad = torch::randn({2, 4}, torch::kFloat32);
  const auto v = layer.second_order().precondition(grad);
  EXPECT_EQ(v.scalar_type(), torch::kFloat32);
  EXPECT_TENSOR_NEAR(v, dense_eigen_reference(layer.a_factor(), layer.g_factor(), grad, damping), 5 * rounding);

  auto same = linear_binding(3, 2, true, torch::kFloat32);
  same.capture->set_factor_dtype(dtype);
  KfacLayer copy(same);
  copy.load_state(layer.state(), ComputeMethod::kEigen);
  EXPECT_EQ(copy.a_factor().scalar_type(), dtype);
  EXPECT_TRUE(torch::equal(copy.a_factor(), layer.a_factor()));
  EXPECT_TRUE(torch::equal(copy.second_order().precondition(grad), v));
  // A layer that asked for float32 keeps float32 when it loads this state: the checkpoint's dtype does not
  // quietly replace the one asked for.
  KfacLayer wide(linear_binding(3, 2, true, torch::kFloat32));
  wide.load_state(layer.state(), ComputeMethod::kEigen);
  EXPECT_EQ(wide.a_factor().scalar_type(), torch::kFloat32);
  EXPECT_EQ(wide.second_order().a_eigen.eigenvectors.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(wide.a_factor(), layer.a_factor().to(torch::kFloat32)));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, KfacLayerStorage, ::testing::Values(torch::kBFloat16, torch::kHalf));

// MATH.md section 6. A layer whose weight is stored [in, out] (transformers' Conv1D) is the Linear it is: fed the
// same activations, its preconditioned gradient is the Linear's, transposed.
TEST(KfacLayer, TransposedWeightIsPreconditionedAsTheLinear) {
  torch::manual_seed(41);
  auto linear = linear_binding(5, 3);
  LayerGeometry transposed{LayerKind::kLinear, true, {}};
  transposed.transposed = true;
  LayerBinding conv1d{"conv1d", linear.weight.t().contiguous(), linear.bias.clone(),
                      std::make_shared<FactorCapture>(transposed)};
  KfacLayer a(linear), b(conv1d);
  EXPECT_EQ(b.a_dim(), 6);
  EXPECT_EQ(b.g_dim(), 3);
  const auto input = torch::randn({4, 2, 5}, kF64);
  const auto grad_output = torch::randn({4, 2, 3}, kF64);
  const auto weight_grad = torch::randn({3, 5}, kF64);
  const auto bias_grad = torch::randn({3}, kF64);
  a.weight().mutable_grad() = weight_grad.clone();
  a.bias().mutable_grad() = bias_grad.clone();
  b.weight().mutable_grad() = weight_grad.t().contiguous();
  b.bias().mutable_grad() = bias_grad.clone();
  EXPECT_TRUE(torch::equal(a.gradient(), b.gradient()));
  for (auto* layer : {&a, &b}) {
    layer->capture().set_enabled(true);
    layer->capture().capture_input(input);
    layer->capture().capture_output_grad(grad_output);
    auto [fa, fg] = layer->take_factor_batches();
    layer->fold_factors(fa, fg, 0.9);
    layer->compute_second_order(ComputeMethod::kEigen, 0.01, false);
    layer->set_gradient(layer->second_order().precondition(layer->gradient()));
  }
  EXPECT_TENSOR_NEAR(b.weight().grad(), a.weight().grad().t(), 1e-12);
  EXPECT_TENSOR_NEAR(b.bias().grad(), a.bias().grad(), 1e-12);
  EXPECT_FALSE(torch::allclose(a.weight().grad(), weight_grad)) << "preconditioning changed nothing";
}

// An Embedding of V tokens is the Linear(V -> d) of one-hot rows, its weight stored [V, d]: same factors (A
// diagonal), same preconditioned gradient, transposed, for both methods; a row no token used stays zero.
class EmbeddingAsOneHotLinear : public ::testing::TestWithParam<ComputeMethod> {};

TEST_P(EmbeddingAsOneHotLinear, SamePreconditionedGradient) {
  torch::manual_seed(42);
  const int64_t vocabulary = 6, dim = 4;
  LayerBinding embedding{"wte", torch::randn({vocabulary, dim}, kF64), {},
                         std::make_shared<FactorCapture>(embedding_geometry(vocabulary))};
  auto linear = linear_binding(vocabulary, dim, /*bias=*/false);
  KfacLayer e(embedding), l(linear);
  EXPECT_TRUE(e.a_diagonal());
  EXPECT_FALSE(e.g_diagonal());
  EXPECT_EQ(e.a_dim(), vocabulary);
  EXPECT_EQ(e.g_dim(), dim);
  const auto tokens = torch::tensor({0, 2, 2, 5, 1, 2, 0, 5}, torch::kLong).reshape({2, 4});  // token 3, 4 unused
  const auto grad_output = torch::randn({2, 4, dim}, kF64);
  // The weight gradient of y = W[x]: row t sums the output gradients at the positions holding t.
  auto embedding_grad = torch::zeros({vocabulary, dim}, kF64).index_add_(0, tokens.reshape({-1}), grad_output.reshape({-1, dim}));
  e.weight().mutable_grad() = embedding_grad.clone();
  l.weight().mutable_grad() = embedding_grad.t().contiguous();
  const auto method = GetParam();
  for (auto* layer : {&e, &l}) {
    layer->capture().set_enabled(true);
    if (layer == &e) {
      layer->capture().capture_input(tokens);
    } else {
      layer->capture().capture_input(torch::one_hot(tokens, vocabulary).to(torch::kFloat64));
    }
    layer->capture().capture_output_grad(grad_output);
    auto [fa, fg] = layer->take_factor_batches();
    layer->fold_factors(fa, fg, 0.5);
    layer->compute_second_order(method, 0.01, /*pi_damping=*/method == ComputeMethod::kInverse);
    layer->set_gradient(layer->second_order().precondition(layer->gradient()));
  }
  EXPECT_EQ(e.a_factor().dim(), 1);
  EXPECT_TENSOR_NEAR(torch::diag(e.a_factor()), l.a_factor(), 1e-14);
  EXPECT_TENSOR_NEAR(e.g_factor(), l.g_factor(), 1e-14);
  EXPECT_TENSOR_NEAR(e.weight().grad(), l.weight().grad().t(), 1e-10);
  EXPECT_TRUE(torch::equal(e.weight().grad()[3], torch::zeros({dim}, kF64))) << "an unused (padding) row moved";
  EXPECT_FALSE(torch::allclose(e.weight().grad(), embedding_grad)) << "preconditioning changed nothing";
  if (method == ComputeMethod::kEigen) {
    EXPECT_FALSE(e.second_order().a_eigen.eigenvectors.defined()) << "a diagonal factor holds no eigenvectors";
    EXPECT_EQ(e.memory_bytes(), 8 * (vocabulary + dim * dim + vocabulary + dim * dim + dim + dim * vocabulary));
  }
}

INSTANTIATE_TEST_SUITE_P(Methods, EmbeddingAsOneHotLinear,
                         ::testing::Values(ComputeMethod::kEigen, ComputeMethod::kInverse));

// A factor wider than the limit is kept diagonal: preconditioning is then a dense Kronecker solve with that
// factor's off-diagonal entries dropped, and its state is d values.
TEST(KfacLayer, DiagonalLimitKeepsWideFactorsDiagonal) {
  torch::manual_seed(43);
  auto binding = linear_binding(6, 3);
  KfacLayer layer(binding);
  layer.set_diagonal_limit(5);  // a = 7 > 5: diagonal; g = 3: dense
  EXPECT_TRUE(layer.a_diagonal());
  EXPECT_FALSE(layer.g_diagonal());
  const auto input = torch::randn({10, 6}, kF64);
  const auto grad_output = torch::randn({10, 3}, kF64);
  layer.capture().set_enabled(true);
  layer.capture().capture_input(input);
  layer.capture().capture_output_grad(grad_output);
  auto [fa, fg] = layer.take_factor_batches();
  ASSERT_EQ(fa.dim(), 1);
  layer.fold_factors(fa, fg, 0.0);
  const auto a_dense = math::linear_a_factor(input, true);
  EXPECT_TENSOR_NEAR(layer.a_factor(), torch::diagonal(a_dense), 1e-14);
  const double damping = 0.02;
  layer.compute_second_order(ComputeMethod::kEigen, damping, false);
  const auto grad = torch::randn({3, 7}, kF64);
  EXPECT_TENSOR_NEAR(layer.second_order().precondition(grad),
                     dense_eigen_reference(torch::diag(torch::diagonal(a_dense)), layer.g_factor(), grad, damping), 1e-10);

  // Its state round-trips, and a checkpoint made with the factor dense is refused, naming the option.
  auto state = layer.state();
  EXPECT_EQ(state.count("a_eigenvectors"), 0u);
  KfacLayer copy(linear_binding(6, 3));
  copy.set_diagonal_limit(5);
  copy.load_state(state, ComputeMethod::kEigen);
  EXPECT_TENSOR_NEAR(copy.second_order().precondition(grad), layer.second_order().precondition(grad), 0.0);
  KfacLayer dense(linear_binding(6, 3));
  dense.fold_factors(a_dense, fg, 0.0);
  dense.compute_second_order(ComputeMethod::kEigen, damping, false);
  expect_error([&] { copy.load_state(dense.state(), ComputeMethod::kEigen); },
               {"A factor has shape [7, 7], the model expects [7]", "diagonal_factor_dim"});
  auto eigenvectors_only = dense.state();
  eigenvectors_only.erase("a_factor");
  expect_error([&] { copy.load_state(eigenvectors_only, ComputeMethod::kEigen); },
               {"holds Q_A of shape [7, 7], but this layer keeps its A factor diagonal", "diagonal_factor_dim"});
  expect_error([&] { dense.load_state(state, ComputeMethod::kEigen); }, {"A factor has shape [7]", "diagonal_factor_dim"});
}

}  // namespace
}  // namespace dkfac
