#include "dkfac/math/factors.h"
#include "dkfac/math/gemm.h"

#include <gtest/gtest.h>

#include <limits>

#include "tests/test_util.h"

namespace dkfac::math {
namespace {

using dkfac::testing::relative_error;

// docs/MATH.md section 1.6 worked check: Linear(2->2, bias), inputs [[1,0],[0,1]].
TEST(Factors, SpecWorkedLinearAFactor) {
  auto x = torch::tensor({{1.0, 0.0}, {0.0, 1.0}}, torch::kFloat64);
  auto a = linear_a_factor(x, /*with_bias=*/true);
  auto expected = torch::tensor({{.5, 0., .5}, {0., .5, .5}, {.5, .5, 1.}}, torch::kFloat64);
  EXPECT_TENSOR_NEAR(a, expected, 1e-15);
  auto running = torch::eye(3, torch::kFloat64) * 0.95 + a * 0.05;
  auto expected_running = torch::tensor({{.975, 0., .025}, {0., .975, .025}, {.025, .025, 1.}}, torch::kFloat64);
  EXPECT_TENSOR_NEAR(running, expected_running, 1e-15);
}

TEST(Factors, CovarianceMatchesDenseDefinition) {
  torch::manual_seed(1);
  auto x = torch::randn({37, 5}, torch::kFloat64);
  auto ones = torch::ones({37, 1}, torch::kFloat64);
  auto xb = torch::cat({x, ones}, 1) * 0.25;
  auto expected = torch::mm(xb.t(), xb) / 37.0;
  EXPECT_TENSOR_NEAR(covariance(x, true, 0.25), expected, 1e-14);
  EXPECT_TENSOR_NEAR(covariance(x), torch::mm(x.t(), x) / 37.0, 1e-14);
  auto c = covariance(x.to(torch::kFloat32), true);
  EXPECT_TRUE(torch::equal(c, c.t())) << "factor must be exactly symmetric";
}

TEST(Factors, LinearFlattensLeadingDimensions) {
  torch::manual_seed(2);
  auto x = torch::randn({3, 4, 6}, torch::kFloat64);
  auto g = torch::randn({3, 4, 2}, torch::kFloat64);
  EXPECT_TENSOR_NEAR(linear_a_factor(x, false), covariance(x.reshape({12, 6})), 1e-15);
  EXPECT_TENSOR_NEAR(linear_g_factor(g), covariance(g.reshape({12, 2})), 1e-15);
}

// Patches written as plain loops over (b, out row, out col) x (channel, kernel row, kernel col), zero padding.
torch::Tensor patches_by_loops(const torch::Tensor& input, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph,
                               int64_t pw, int64_t dh, int64_t dw) {
  auto x = input.to(torch::kFloat64).contiguous();
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t Ho = (H + 2 * ph - dh * (kh - 1) - 1) / sh + 1;
  const int64_t Wo = (W + 2 * pw - dw * (kw - 1) - 1) / sw + 1;
  auto out = torch::zeros({B * Ho * Wo, C * kh * kw}, torch::kFloat64);
  auto X = x.accessor<double, 4>();
  auto O = out.accessor<double, 2>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t oy = 0; oy < Ho; ++oy)
      for (int64_t ox = 0; ox < Wo; ++ox)
        for (int64_t c = 0; c < C; ++c)
          for (int64_t ky = 0; ky < kh; ++ky)
            for (int64_t kx = 0; kx < kw; ++kx) {
              const int64_t y = oy * sh - ph + ky * dh;
              const int64_t xx = ox * sw - pw + kx * dw;
              const double v = (y >= 0 && y < H && xx >= 0 && xx < W) ? X[b][c][y][xx] : 0.0;
              O[(b * Ho + oy) * Wo + ox][(c * kh + ky) * kw + kx] = v;
            }
  return out;
}

struct ConvCase {
  int64_t kh, kw, sh, sw, ph, pw, dh, dw;
};

class ConvFactors : public ::testing::TestWithParam<ConvCase> {};

TEST_P(ConvFactors, PatchesAndFactorsMatchLoops) {
  const auto p = GetParam();
  torch::manual_seed(3);
  // 3 channels: patches by unfold; 9: by the channels-last copy and a permuted factor.
  for (int64_t channels : {3, 9}) {
    SCOPED_TRACE("channels " + std::to_string(channels));
    auto input = torch::randn({2, channels, 7, 6}, torch::kFloat64);
    Conv2dGeometry geometry;
    geometry.kernel_size = {p.kh, p.kw};
    geometry.stride = {p.sh, p.sw};
    geometry.dilation = {p.dh, p.dw};
    geometry.padding = {p.pw, p.pw, p.ph, p.ph};
    auto expected = patches_by_loops(input, p.kh, p.kw, p.sh, p.sw, p.ph, p.pw, p.dh, p.dw);
    auto patches = conv2d_patches(input, geometry);
    EXPECT_TENSOR_NEAR(patches, expected, 1e-15);

    // A = cov([P, 1] / S) with S spatial positions per example, written densely.
    const int64_t S = expected.size(0) / 2;
    auto with_ones = torch::cat({expected, torch::ones({expected.size(0), 1}, torch::kFloat64)}, 1) / double(S);
    auto a_expected = torch::mm(with_ones.t(), with_ones) / double(expected.size(0));
    EXPECT_TENSOR_NEAR(conv2d_a_factor(input, geometry, true), a_expected, 1e-13);
    auto no_bias = expected / double(S);
    EXPECT_TENSOR_NEAR(conv2d_a_factor(input, geometry, false),
                       torch::mm(no_bias.t(), no_bias) / double(expected.size(0)), 1e-13);
  }
}

INSTANTIATE_TEST_SUITE_P(Geometries, ConvFactors,
                         ::testing::Values(ConvCase{3, 3, 1, 1, 1, 1, 1, 1}, ConvCase{3, 3, 2, 2, 0, 0, 1, 1},
                                           ConvCase{3, 2, 1, 2, 1, 0, 2, 1}, ConvCase{1, 1, 1, 1, 0, 0, 1, 1},
                                           ConvCase{2, 3, 2, 1, 2, 1, 1, 2}, ConvCase{3, 3, 1, 1, 2, 2, 2, 2}));

// Stride 1 in height takes the row-shift path (no im2col matrix). Its edge cases: inputs so small that no row
// is shared by every block of a shift (height 1 and 2 with 3 x 3 and 5 x 5 kernels), dilation, a stride in
// width, non-zero padding modes; against the covariance of the im2col patches written out densely.
TEST(Factors, ConvAFactorWithoutIm2colMatchesPatches) {
  torch::manual_seed(5);
  struct Case {
    int64_t height, width, kh, kw, dh, dw, sw, pad;
    torch::nn::functional::PadFuncOptions::mode_t mode;
  };
  const std::vector<Case> cases = {
      {1, 5, 3, 3, 1, 1, 1, 1, torch::kConstant},  {2, 3, 3, 3, 1, 1, 1, 1, torch::kConstant},
      {2, 2, 5, 5, 1, 1, 1, 2, torch::kConstant},  {3, 4, 5, 3, 1, 1, 1, 2, torch::kConstant},
      {9, 7, 3, 3, 2, 1, 2, 2, torch::kConstant},  {6, 6, 3, 3, 1, 1, 1, 1, torch::kReflect},
      {5, 8, 3, 2, 1, 2, 1, 1, torch::kReplicate}, {4, 5, 2, 3, 1, 1, 1, 0, torch::kConstant},
      {12, 10, 3, 3, 1, 1, 1, 0, torch::kConstant}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c10::str("input ", c.height, "x", c.width, ", kernel ", c.kh, "x", c.kw, ", dilation ", c.dh, "x",
                          c.dw, ", stride 1x", c.sw, ", padding ", c.pad));
    auto input = torch::randn({3, 8, c.height, c.width}, torch::kFloat64);
    Conv2dGeometry geometry;
    geometry.kernel_size = {c.kh, c.kw};
    geometry.stride = {1, c.sw};
    geometry.dilation = {c.dh, c.dw};
    geometry.padding = {c.pad, c.pad, c.pad, c.pad};
    geometry.padding_mode = c.mode;
    const auto patches = conv2d_patches(input, geometry);
    const double S = double(patches.size(0) / 3);
    for (bool bias : {true, false}) {
      auto rows = bias ? torch::cat({patches, torch::ones({patches.size(0), 1}, torch::kFloat64)}, 1) : patches;
      rows = rows / S;
      const auto expected = torch::mm(rows.t(), rows) / double(patches.size(0));
      const auto a = conv2d_a_factor(input, geometry, bias);
      EXPECT_TENSOR_NEAR(a, expected, 1e-13);
      EXPECT_TRUE(torch::equal(a, a.t())) << "not exactly symmetric";
    }
  }
  // float32 at the cnn's conv2 shape: the same factor as the dense product within float rounding.
  auto input = torch::randn({16, 32, 14, 14});
  Conv2dGeometry geometry;
  geometry.kernel_size = {3, 3};
  geometry.padding = {1, 1, 1, 1};
  const auto patches = conv2d_patches(input.to(torch::kFloat64), geometry) / 196.0;
  const auto rows = torch::cat({patches, torch::ones({patches.size(0), 1}, torch::kFloat64) / 196.0}, 1);
  const auto expected = torch::mm(rows.t(), rows) / double(patches.size(0));
  const auto a = conv2d_a_factor(input, geometry, true);
  EXPECT_LT((a.to(torch::kFloat64) - expected).abs().max().item<double>(), 1e-6 * expected.abs().max().item<double>());
}

// G = sum over examples and positions of (g / S)(g / S)^T / n, written as loops.
torch::Tensor g_factor_by_loops(const torch::Tensor& grad) {
  const int64_t B = grad.size(0), C = grad.size(1), H = grad.size(2), W = grad.size(3);
  auto G = grad.accessor<double, 4>();
  auto expected = torch::zeros({C, C}, torch::kFloat64);
  auto E = expected.accessor<double, 2>();
  const double S = double(H * W);
  const double n = double(B * H * W);
  for (int64_t i = 0; i < C; ++i)
    for (int64_t j = 0; j < C; ++j) {
      double sum = 0;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t y = 0; y < H; ++y)
          for (int64_t x = 0; x < W; ++x) sum += (G[b][i][y][x] / S) * (G[b][j][y][x] / S);
      E[i][j] = sum / n;
    }
  return expected;
}

TEST(Factors, ConvGFactorMatchesLoops) {
  torch::manual_seed(4);
  // Fewer channels than positions (batched product), more (transposed copy), and a non-contiguous gradient.
  for (auto grad : {torch::randn({2, 4, 3, 5}, torch::kFloat64), torch::randn({2, 6, 1, 2}, torch::kFloat64),
                    torch::randn({2, 5, 3, 4}, torch::kFloat64).transpose(2, 3)}) {
    SCOPED_TRACE("gradient " + c10::str(grad.sizes()));
    EXPECT_TENSOR_NEAR(conv2d_g_factor(grad), g_factor_by_loops(grad), 1e-14);
  }
}

// gram() multiplies only the upper block triangle of large products and mirrors it (over threads): it must
// equal the plain product and be exactly symmetric.
TEST(Gemm, GramMatchesThePlainProduct) {
  torch::manual_seed(5);
  for (auto dims : {std::array<int64_t, 2>{37, 5}, std::array<int64_t, 2>{300, 129}, std::array<int64_t, 2>{513, 260}}) {
    SCOPED_TRACE("x " + std::to_string(dims[0]) + "x" + std::to_string(dims[1]));
    auto x = torch::randn({dims[0], dims[1]}, torch::kFloat64);
    auto g = gram(x);
    EXPECT_TENSOR_NEAR(g, torch::mm(x.t(), x), 1e-11);
    EXPECT_TRUE(torch::equal(g, g.t()));
  }
  EXPECT_THROW(gram(torch::zeros({2, 3, 4})), c10::Error);
}

// mirror_upper's general path (a GPU's, and any dtype or layout the CPU tiles do not take; garbage below the
// diagonal, as gram() leaves it): the strict upper triangle copied onto the lower, the upper one unchanged.
TEST(Gemm, MirrorUpperOfAnyLayoutCopiesTheUpperTriangle) {
  torch::manual_seed(6);
  const auto values = torch::randn({7, 7}, torch::kFloat64);
  const auto expected = values.triu() + values.triu(1).t();
  const auto nan_below = torch::full({7, 7}, std::numeric_limits<double>::quiet_NaN(), torch::kFloat64).tril(-1);
  const auto garbage = values.triu() + nan_below;  // NaN below the diagonal, the values on and above it
  for (auto dtype : {torch::kFloat64, torch::kBFloat16}) {
    auto transposed = garbage.to(dtype).t().contiguous().t();  // not contiguous: the general path
    ASSERT_FALSE(transposed.is_contiguous());
    mirror_upper(transposed);
    EXPECT_TRUE(torch::equal(transposed, expected.to(dtype))) << dtype;
  }
}

TEST(Factors, RejectsBadShapes) {
  EXPECT_THROW(conv2d_g_factor(torch::zeros({2, 3})), c10::Error);
  EXPECT_THROW(conv2d_patches(torch::zeros({2, 3}), Conv2dGeometry{}), c10::Error);
  EXPECT_THROW(covariance(torch::zeros({0, 3})), c10::Error);
}

// MATH.md section 6: a diagonal factor is the dense factor's diagonal, built without the k x k product.
TEST(Factors, DiagonalFactorsAreTheDenseFactorsDiagonals) {
  torch::manual_seed(31);
  const auto options = torch::TensorOptions().dtype(torch::kFloat64);
  const auto input = torch::randn({3, 5, 7}, options);
  for (const bool bias : {false, true}) {
    EXPECT_TRUE(torch::allclose(linear_a_diagonal(input, bias), torch::diagonal(linear_a_factor(input, bias)), 1e-14, 1e-14));
  }
  const auto grad = torch::randn({6, 4}, options);
  EXPECT_TRUE(torch::allclose(linear_g_diagonal(grad), torch::diagonal(linear_g_factor(grad)), 1e-14, 1e-14));
  EXPECT_TRUE(torch::allclose(diagonal_covariance(grad, true, 0.5), torch::diagonal(covariance(grad, true, 0.5)),
                              1e-14, 1e-14));
}

// The same for a Conv2d (the 1/S convention kept), with and without a bias, for the strided and padded geometry.
TEST(Factors, Conv2dDiagonalFactorsAreTheDenseFactorsDiagonals) {
  torch::manual_seed(32);
  const auto options = torch::TensorOptions().dtype(torch::kFloat64);
  Conv2dGeometry geometry;
  geometry.kernel_size = {3, 3};
  geometry.stride = {2, 1};
  geometry.padding = {1, 1, 1, 1};
  const auto input = torch::randn({2, 3, 7, 6}, options);
  for (const bool bias : {false, true}) {
    EXPECT_TRUE(torch::allclose(conv2d_a_diagonal(input, geometry, bias),
                                torch::diagonal(conv2d_a_factor(input, geometry, bias)), 1e-12, 1e-14));
  }
  const auto grad = torch::randn({2, 4, 4, 6}, options);
  EXPECT_TRUE(torch::allclose(conv2d_g_diagonal(grad), torch::diagonal(conv2d_g_factor(grad)), 1e-12, 1e-14));
}

// An Embedding is the Linear of one-hot rows: its A factor is that Linear's (diagonal) A factor.
TEST(Factors, EmbeddingAFactorIsTheOneHotLinearsFactor) {
  const auto tokens = torch::tensor({3, 0, 3, 5, 3, 1}, torch::kLong).reshape({2, 3});
  const auto one_hot = torch::one_hot(tokens, 7).to(torch::kFloat64);
  const auto dense = linear_a_factor(one_hot, /*with_bias=*/false);
  const auto a = embedding_a_factor(tokens, 7, torch::kFloat64);
  EXPECT_TRUE(torch::equal(torch::diag(a), dense)) << a << dense;  // counts / n: 3/6 for token 3, 0 for 2, 4, 6
  EXPECT_DOUBLE_EQ(a[3].item<double>(), 0.5);
  EXPECT_EQ(a.scalar_type(), torch::kFloat64);
  EXPECT_EQ(embedding_a_factor(tokens.to(torch::kInt), 7, torch::kFloat32).scalar_type(), torch::kFloat32);
  testing::expect_error<c10::Error>([&] { embedding_a_factor(one_hot, 7, torch::kFloat64); },
                                    {"Embedding input must hold integer token indices, got Double"});
}

// A slice of a vocabulary split over ranks: the whole vocabulary's entries [first, first + rows), every position
// counted in n (a token of another slice in no entry), at either end of the vocabulary and in the middle.
TEST(Factors, EmbeddingAFactorOfASliceIsThoseEntriesOfTheWholeOnes) {
  const auto tokens = torch::tensor({3, 0, 3, 5, 3, 1, 6, 2}, torch::kLong).reshape({2, 4});
  const auto whole = embedding_a_factor(tokens, 7, torch::kFloat64);
  for (const auto& [first, rows] : std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 2}, {5, 2}, {0, 7}}) {
    const auto slice = embedding_a_factor_slice(tokens, first, rows, torch::kFloat64);
    EXPECT_TRUE(torch::equal(slice, whole.slice(0, first, first + rows))) << first << " " << rows << slice << whole;
  }
  EXPECT_DOUBLE_EQ(embedding_a_factor_slice(tokens, 3, 2, torch::kFloat64)[0].item<double>(), 3.0 / 8.0);
  testing::expect_error<c10::Error>([&] { embedding_a_factor_slice(tokens, 2, 0, torch::kFloat64); },
                                    {"an Embedding slice needs rows [first, first + rows), got first 2, rows 0"});
}

TEST(Factors, RunningAverageOfADiagonalStartsFromOnes) {
  const auto batch = torch::tensor({2.0, 4.0}, torch::kFloat64);
  EXPECT_TRUE(torch::allclose(running_average({}, batch, 0.5), torch::tensor({1.5, 2.5}, torch::kFloat64)));
}

}  // namespace
}  // namespace dkfac::math
