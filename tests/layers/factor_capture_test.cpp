// FactorCapture (dkfac/layers/factor_capture.h) against dense float64 references written from
// docs/MATH.md section 1: A = [X, 1]^T [X, 1] / n, G = Y^T Y / n, Conv2d with the 1/S convention.
#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "dkfac/layers/factor_capture.h"
#include "tests/test_util.h"

namespace dkfac {
namespace {

namespace F = torch::nn::functional;
using testing::expect_error;

const auto kF64 = torch::TensorOptions().dtype(torch::kFloat64);

// X^T X / n over the rows of `x` reshaped to [n, last dim], with a column of ones appended when `bias`.
torch::Tensor dense_covariance(const torch::Tensor& x, bool bias) {
  auto rows = x.reshape({-1, x.size(-1)}).to(torch::kFloat64);
  if (bias) rows = torch::cat({rows, torch::ones({rows.size(0), 1}, kF64)}, 1);
  return rows.t().mm(rows) / static_cast<double>(rows.size(0));
}

FactorCapture linear_capture(bool bias) { return FactorCapture(LayerGeometry{LayerKind::kLinear, bias, {}}); }

TEST(FactorCapture, LinearInputGivesCovarianceWithBiasColumn) {
  torch::manual_seed(1);
  auto capture = linear_capture(/*bias=*/true);
  auto x = torch::randn({6, 4}, kF64);
  capture.capture_input(x);
  auto a = capture.take_a();
  ASSERT_EQ(a.sizes(), (std::vector<int64_t>{5, 5}));
  EXPECT_TENSOR_NEAR(a, dense_covariance(x, true), 1e-12);
  // The bias column's corner is exactly 1 and its border the input mean (MATH.md 1.1).
  EXPECT_DOUBLE_EQ(a[4][4].item<double>(), 1.0);
  EXPECT_TENSOR_NEAR(a.slice(0, 0, 4).select(1, 4), x.mean(0), 1e-12);
}

TEST(FactorCapture, LinearWithoutBiasAndWithLeadingDimensions) {
  torch::manual_seed(2);
  auto capture = linear_capture(/*bias=*/false);
  auto x = torch::randn({3, 5, 4}, kF64);  // [B, T, in]: n = B * T = 15 rows
  capture.capture_input(x);
  EXPECT_TENSOR_NEAR(capture.take_a(), dense_covariance(x, false), 1e-12);
}

TEST(FactorCapture, LinearOutputGradGivesGradCovariance) {
  torch::manual_seed(3);
  auto capture = linear_capture(true);
  auto dy = torch::randn({2, 7, 3}, kF64);
  capture.capture_output_grad(dy);
  auto g = capture.take_g();
  ASSERT_EQ(g.sizes(), (std::vector<int64_t>{3, 3}));
  EXPECT_TENSOR_NEAR(g, dense_covariance(dy, false), 1e-12);  // no bias column in G
}

TEST(FactorCapture, WorkedCheckOfMathSection1) {
  auto capture = linear_capture(true);
  capture.capture_input(torch::eye(2, kF64));
  auto expected = torch::tensor({{.5, 0., .5}, {0., .5, .5}, {.5, .5, 1.}}, kF64);
  EXPECT_TENSOR_NEAR(capture.take_a(), expected, 1e-15);
}

// Micro-batches are averaged as factors (each over its own rows), not pooled as rows.
TEST(FactorCapture, MicroBatchesAverageTheirFactors) {
  torch::manual_seed(4);
  auto capture = linear_capture(true);
  auto x1 = torch::randn({2, 3}, kF64);
  auto x2 = torch::randn({6, 3}, kF64) + 1.0;
  auto y1 = torch::randn({2, 2}, kF64);
  auto y2 = torch::randn({6, 2}, kF64) * 3.0;
  capture.capture_input(x1);
  capture.capture_output_grad(y1);
  capture.capture_input(x2);
  EXPECT_EQ(capture.a_count(), 2);
  EXPECT_EQ(capture.g_count(), 1);
  capture.capture_output_grad(y2);
  EXPECT_EQ(capture.g_count(), 2);

  const auto a_expected = (dense_covariance(x1, true) + dense_covariance(x2, true)) / 2;
  const auto g_expected = (dense_covariance(y1, false) + dense_covariance(y2, false)) / 2;
  EXPECT_TENSOR_NEAR(capture.mean_a(), a_expected, 1e-12);  // mean_a does not reset
  EXPECT_EQ(capture.a_count(), 2);
  EXPECT_TENSOR_NEAR(capture.take_a(), a_expected, 1e-12);
  EXPECT_TENSOR_NEAR(capture.take_g(), g_expected, 1e-12);
  // Pooling the 8 rows would give another matrix: the test tells the two apart.
  EXPECT_GT(testing::relative_error(a_expected, dense_covariance(torch::cat({x1, x2}), true)), 1e-2);

  EXPECT_EQ(capture.a_count(), 0);
  EXPECT_EQ(capture.g_count(), 0);
  EXPECT_FALSE(capture.take_a().defined());
  EXPECT_FALSE(capture.mean_g().defined());
}

TEST(FactorCapture, ClearDropsWhatWasCaptured) {
  auto capture = linear_capture(false);
  capture.capture_input(torch::ones({2, 2}, kF64));
  capture.capture_output_grad(torch::ones({2, 2}, kF64));
  capture.clear();
  EXPECT_EQ(capture.a_count(), 0);
  EXPECT_EQ(capture.g_count(), 0);
  EXPECT_FALSE(capture.take_a().defined());
  EXPECT_FALSE(capture.take_g().defined());
}

TEST(FactorCapture, GradScaleDividesTheOutputGradient) {
  torch::manual_seed(5);
  auto capture = linear_capture(true);
  const double scale = 4.0;
  capture.set_grad_scale([scale] { return torch::scalar_tensor(scale, kF64); });
  auto dy = torch::randn({5, 3}, kF64);
  capture.capture_output_grad(dy * scale);  // a loss scaled by 4 gives 4 times the gradient
  EXPECT_TENSOR_NEAR(capture.take_g(), dense_covariance(dy, false), 1e-12);
  // A is untouched by the scale.
  auto x = torch::randn({5, 2}, kF64);
  capture.capture_input(x);
  EXPECT_TENSOR_NEAR(capture.take_a(), dense_covariance(x, true), 1e-12);
}

TEST(FactorCapture, GradScaleMustBeOneNumber) {
  auto capture = linear_capture(false);
  capture.set_grad_scale([] { return torch::ones({2}, kF64); });
  expect_error([&] { capture.capture_output_grad(torch::ones({3, 2}, kF64)); },
               {"grad scaler returned a tensor of shape [2]", "one number"});
  EXPECT_EQ(capture.g_count(), 0);
}

// Conv2d: A = [P, 1]^T [P, 1] / (B S^3), G = Y^T Y / (B S^3), with P the im2col patches [B*S, C kh kw]
// (unfold's order: channel, kernel row, kernel column) and Y the output gradient as [B*S, C_out].
struct ConvCase {
  int64_t channels, kernel, stride, padding;
};

class FactorCaptureConv : public ::testing::TestWithParam<ConvCase> {};

TEST_P(FactorCaptureConv, MatchesDensePatchReference) {
  const auto c = GetParam();
  torch::manual_seed(6);
  LayerGeometry geometry{LayerKind::kConv2d, /*has_bias=*/true, {}};
  geometry.conv.kernel_size = {c.kernel, c.kernel};
  geometry.conv.stride = {c.stride, c.stride};
  geometry.conv.padding = {c.padding, c.padding, c.padding, c.padding};
  FactorCapture capture(geometry);

  const int64_t batch = 2, out_channels = 3;
  auto x = torch::randn({batch, c.channels, 7, 6}, kF64);
  auto patches = F::unfold(x, F::UnfoldFuncOptions({c.kernel, c.kernel}).stride(c.stride).padding(c.padding));
  const int64_t spatial = patches.size(2);
  auto p = patches.transpose(1, 2).reshape({batch * spatial, -1});
  p = torch::cat({p, torch::ones({p.size(0), 1}, kF64)}, 1);
  const double norm = static_cast<double>(batch) * spatial * spatial * spatial;
  const auto a_expected = p.t().mm(p) / norm;

  const int64_t out_h = (7 + 2 * c.padding - c.kernel) / c.stride + 1;
  const int64_t out_w = (6 + 2 * c.padding - c.kernel) / c.stride + 1;
  ASSERT_EQ(out_h * out_w, spatial);
  auto dy = torch::randn({batch, out_channels, out_h, out_w}, kF64);
  auto y = dy.permute({0, 2, 3, 1}).reshape({batch * spatial, out_channels});
  const auto g_expected = y.t().mm(y) / norm;

  capture.capture_input(x);
  capture.capture_output_grad(dy);
  EXPECT_TENSOR_NEAR(capture.take_a(), a_expected, 1e-12);
  EXPECT_TENSOR_NEAR(capture.take_g(), g_expected, 1e-12);

  // An unbatched [C, H, W] input is a batch of one.
  auto x0 = x[0];
  auto p0 = p.slice(0, 0, spatial);
  capture.capture_input(x0);
  EXPECT_TENSOR_NEAR(capture.take_a(), p0.t().mm(p0) / (norm / batch), 1e-12);
}

INSTANTIATE_TEST_SUITE_P(Shapes, FactorCaptureConv,
                         ::testing::Values(ConvCase{3, 3, 2, 1},    // unfold path
                                           ConvCase{8, 3, 1, 1},    // kernel-row-shift path (C >= 8, stride 1)
                                           ConvCase{2, 1, 1, 0}));  // 1x1

TEST(FactorCapture, ListenerHearsEachAddWithItsCount) {
  auto capture = linear_capture(false);
  std::vector<std::pair<bool, int64_t>> heard;
  capture.set_listener([&](bool is_a, int64_t count) { heard.emplace_back(is_a, count); });
  capture.capture_input(torch::ones({2, 2}, kF64));
  capture.capture_output_grad(torch::ones({2, 2}, kF64));
  capture.add_a(torch::eye(2, kF64), 0.5);
  const std::vector<std::pair<bool, int64_t>> expected{{true, 1}, {false, 1}, {true, 2}};
  EXPECT_EQ(heard, expected);

  // Each capture leaves a span of device marks; add_a's seconds are counted directly.
  auto timing = capture.take_timing();
  EXPECT_EQ(timing.spans.size(), 2u);
  EXPECT_DOUBLE_EQ(timing.seconds, 0.5);
  EXPECT_TRUE(capture.take_timing().spans.empty());
}

// A Linear's and a Conv2d's A factor is built when the output gradient arrives (or when read), from the input
// kept meanwhile (autograd keeps it for the weight's gradient): nothing is built during the forward pass, and the
// factor is exactly the one built at once (the same kernel on the same tensor).
TEST(FactorCapture, InputFactorIsBuiltWhenItsGradientArrives) {
  torch::manual_seed(3);
  const auto x = torch::randn({6, 5}, kF64);
  const auto y = torch::randn({6, 3}, kF64);
  const auto expected = math::linear_a_factor(x, /*bias=*/true);

  auto capture = linear_capture(/*bias=*/true);
  capture.capture_input(x);
  EXPECT_EQ(capture.a_count(), 1) << "a kept input counts";
  EXPECT_FALSE(capture.mean_a().defined()) << "nothing built during the forward pass";
  EXPECT_EQ(capture.pending_bytes().first, x.numel() * 8) << "what is held: the input autograd keeps";
  std::vector<std::pair<bool, int64_t>> heard;
  capture.set_listener([&](bool is_a, int64_t count) { heard.emplace_back(is_a, count); });
  capture.capture_output_grad(y);
  EXPECT_EQ(heard, (std::vector<std::pair<bool, int64_t>>{{true, 1}, {false, 1}})) << "A before G, in backward";
  EXPECT_EQ(capture.pending_bytes().first, 6 * 6 * 8);
  EXPECT_TRUE(torch::equal(capture.take_a(), expected));

  // Read without a backward pass (a forward whose output was not used): built when read, in the order captured.
  auto read = linear_capture(/*bias=*/true);
  const auto x2 = torch::randn({4, 5}, kF64);
  read.capture_input(x);
  read.capture_input(x2);
  EXPECT_EQ(read.a_count(), 2);
  EXPECT_TRUE(torch::equal(read.take_a(), (expected + math::linear_a_factor(x2, true)) / 2.0));
  EXPECT_EQ(read.a_count(), 0);

  // at_once (a compiled graph's input, whose buffer its memory plan may reuse once the capture returns): built now,
  // from the input as it is now, the same factor bit for bit; writing over the input afterwards changes nothing.
  auto now = linear_capture(/*bias=*/true);
  auto buffer = x.clone();
  now.capture_input(buffer, /*at_once=*/true);
  EXPECT_EQ(now.pending_bytes().first, 6 * 6 * 8) << "the factor is held, not the input";
  buffer.fill_(7.0);
  now.capture_output_grad(y);
  EXPECT_TRUE(torch::equal(now.take_a(), expected));

  // Dropped with the rest.
  read.capture_input(x);
  read.clear();
  EXPECT_EQ(read.a_count(), 0);
  EXPECT_EQ(read.pending_bytes().first, 0);

  // With a listener (the FactorPipeline overlaps the factors' reduction with forward and backward), at once.
  auto listened = linear_capture(/*bias=*/true);
  int64_t heard_a = 0;
  listened.set_listener([&](bool is_a, int64_t) { heard_a += is_a; });
  listened.capture_input(x);
  EXPECT_EQ(heard_a, 1);
  EXPECT_TRUE(torch::equal(listened.mean_a(), expected));

  // Forward passes without a backward pass keep at most kMaxWaitingInputs inputs, then build in order.
  auto many = linear_capture(/*bias=*/true);
  for (size_t k = 0; k < FactorCapture::kMaxWaitingInputs; ++k) many.capture_input(x);
  EXPECT_FALSE(many.mean_a().defined());
  many.capture_input(x2);
  EXPECT_EQ(many.pending_bytes().first, 6 * 6 * 8) << "every input built: only the sum is held";
  auto sum = expected;
  for (size_t k = 1; k < FactorCapture::kMaxWaitingInputs; ++k) sum = sum + expected;
  sum = sum + math::linear_a_factor(x2, true);
  EXPECT_TRUE(torch::equal(many.take_a(), sum / static_cast<double>(FactorCapture::kMaxWaitingInputs + 1)));

  // An Embedding's factor (token counts) is built at once.
  FactorCapture embedding(embedding_geometry(7));
  embedding.capture_input(torch::tensor({1, 3, 3}, torch::kInt64));
  EXPECT_TRUE(embedding.mean_a().defined());
}

TEST(FactorCapture, ActiveOnlyWhenEnabledTrainingAndGradMode) {
  auto capture = linear_capture(false);
  EXPECT_FALSE(capture.active(true));  // off until the preconditioner arms it
  capture.set_enabled(true);
  EXPECT_TRUE(capture.active(true));
  EXPECT_FALSE(capture.active(false));
  torch::NoGradGuard no_grad;
  EXPECT_FALSE(capture.active(true));
}

// Reduced-precision storage: the activations are cast before the factor is built, and the factor stays
// in that dtype, close to the float64 reference within the dtype's rounding.
class FactorCaptureStorage : public ::testing::TestWithParam<torch::ScalarType> {};

TEST_P(FactorCaptureStorage, FactorsAreBuiltAndKeptInTheFactorDtype) {
  const auto dtype = GetParam();
  torch::manual_seed(7);
  auto capture = linear_capture(true);
  capture.set_factor_dtype(dtype);
  auto x = torch::randn({16, 4}, kF64);
  auto dy = torch::randn({16, 3}, kF64);
  capture.capture_input(x);
  capture.capture_output_grad(dy);
  auto a = capture.take_a();
  auto g = capture.take_g();
  EXPECT_EQ(a.scalar_type(), dtype);
  EXPECT_EQ(g.scalar_type(), dtype);
  // The reference is built from the inputs rounded the same way, so only the products' rounding remains.
  const double tol = dtype == torch::kBFloat16 ? 3e-2 : dtype == torch::kHalf ? 5e-3 : 1e-6;
  EXPECT_TENSOR_NEAR(a, dense_covariance(x.to(dtype), true), tol);
  EXPECT_TENSOR_NEAR(g, dense_covariance(dy.to(dtype), false), tol);
}

// float16 factors of a batch whose sums pass float16's 65504 but whose mean fits: built from the float16 values
// in float32 and rounded once, so finite and within float16's rounding of the mean. They used to be inf (summed
// in float16, then divided), and the layer fell back to its plain gradient at that step.
TEST(FactorCapture, Float16FactorsOfLargeSumsStayFinite) {
  auto capture = linear_capture(true);
  capture.set_factor_dtype(torch::kHalf);
  const auto x = torch::full({256, 3}, 40.0, kF64) + torch::randn({256, 3}, kF64);  // rows^2 ~ 1600, sum ~ 4e5
  const auto dy = torch::full({256, 2}, 30.0, kF64);
  capture.capture_input(x);
  capture.capture_output_grad(dy);
  const auto a = capture.take_a();
  const auto g = capture.take_g();
  EXPECT_EQ(a.scalar_type(), torch::kHalf);
  EXPECT_TRUE(torch::isfinite(a).all().item<bool>()) << a;
  EXPECT_TRUE(torch::isfinite(g).all().item<bool>()) << g;
  EXPECT_TENSOR_NEAR(a, dense_covariance(x.to(torch::kHalf), true), 2e-3);
  EXPECT_TENSOR_NEAR(g, dense_covariance(dy.to(torch::kHalf), false), 2e-3);
}

// Mixed precision (FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16), or a model cast for the forward only):
// a float32 layer whose input and output gradient arrive in bfloat16 builds its factors in float32 from those
// values, not in bfloat16; a bfloat16 layer keeps bfloat16 factors, as kfac_pytorch does.
TEST(FactorCapture, LowerPrecisionInputsOfAFloat32LayerBuildFloat32Factors) {
  torch::manual_seed(12);
  const auto x = torch::randn({512, 6}, kF64).to(torch::kBFloat16);
  const auto dy = torch::randn({512, 3}, kF64).to(torch::kBFloat16);
  auto capture = linear_capture(true);
  capture.set_weight_dtype(torch::kFloat32);
  capture.capture_input(x);
  capture.capture_output_grad(dy);
  const auto a = capture.take_a();
  const auto g = capture.take_g();
  EXPECT_EQ(a.scalar_type(), torch::kFloat32);
  EXPECT_EQ(g.scalar_type(), torch::kFloat32);
  EXPECT_TENSOR_NEAR(a, dense_covariance(x, true), 1e-5);  // float32 round-off over 512 rows; bfloat16 sums: ~4e-3
  EXPECT_TENSOR_NEAR(g, dense_covariance(dy, false), 1e-5);
  auto half_layer = linear_capture(true);
  half_layer.set_weight_dtype(torch::kBFloat16);
  half_layer.capture_input(x);
  EXPECT_EQ(half_layer.take_a().scalar_type(), torch::kBFloat16);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, FactorCaptureStorage, ::testing::Values(torch::kBFloat16, torch::kHalf, torch::kFloat32));

// MATH.md 7.6, K-FAC reduce: a Linear over [B, T, in] builds its factors from one row per sample, the input
// averaged and the output gradient summed over T; a [B, in] input has nothing to reduce.
TEST(FactorCapture, ReduceAveragesInputsAndSumsOutputGradientsPerSample) {
  torch::manual_seed(12);
  auto capture = linear_capture(/*bias=*/true);
  capture.set_reduce(true);
  EXPECT_TRUE(capture.reduce());
  const auto x = torch::randn({3, 5, 4}, kF64);
  const auto g = torch::randn({3, 5, 2}, kF64);
  capture.capture_input(x);
  capture.capture_output_grad(g);
  EXPECT_TENSOR_NEAR(capture.take_a(), dense_covariance(x.mean(1), true), 1e-12);
  EXPECT_TENSOR_NEAR(capture.take_g(), dense_covariance(g.sum(1), false), 1e-12);
  EXPECT_EQ(capture.rows_per_sample(), 1);
  EXPECT_EQ(capture.samples_per_pass(), 3);

  auto flat = linear_capture(true);
  flat.set_reduce(true);
  const auto x2 = torch::randn({6, 4}, kF64);
  flat.capture_input(x2);
  EXPECT_TENSOR_NEAR(flat.take_a(), dense_covariance(x2, true), 1e-12);

  FactorCapture conv(LayerGeometry{LayerKind::kConv2d, false, {}});
  conv.set_reduce(true);
  EXPECT_FALSE(conv.reduce()) << "Conv2d keeps its own convention";
  auto late = linear_capture(false);
  late.capture_input(x);
  expect_error([&] { late.set_reduce(true); }, {"set_reduce after factors were captured"});
}

}  // namespace
}  // namespace dkfac
