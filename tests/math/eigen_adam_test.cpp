#include "dkfac/math/eigen_adam.h"

#include <cmath>
#include <limits>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace dkfac::math {
namespace {

using dkfac::testing::kron_loops;
using dkfac::testing::random_spd;
using dkfac::testing::unvec;
using dkfac::testing::vec;

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();

/// The dense reference: the Kronecker eigenbasis K = Q_A kron Q_G as one matrix (vec(Q_G^T X Q_A) = K^T vec(X)),
/// and Adam on the entries of vec(P) one by one, in plain doubles.
struct DenseEigenAdam {
  torch::Tensor k;  // [g a, g a]
  std::vector<double> m, v;
  int steps = 0;
  AdamConstants c;

  DenseEigenAdam(const torch::Tensor& qa, const torch::Tensor& qg, AdamConstants constants)
      : k(kron_loops(qa, qg)), m(qa.size(0) * qg.size(0), 0.0), v(m.size(), 0.0), c(constants) {}

  torch::Tensor step(const torch::Tensor& grad) {
    auto p = torch::mv(k.t(), vec(grad.to(torch::kFloat64))).contiguous();
    auto u = torch::empty_like(p);
    ++steps;
    const double bc1 = 1.0 - std::pow(c.beta1, steps);
    const double bc2 = 1.0 - std::pow(c.beta2, steps);
    for (size_t i = 0; i < m.size(); ++i) {
      const double pi = p[i].item<double>();
      m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * pi;
      v[i] = c.beta2 * v[i] + (1.0 - c.beta2) * pi * pi;
      u[i] = (m[i] / bc1) / (std::sqrt(v[i] / bc2) + c.eps);
    }
    return unvec(torch::mv(k, u), grad.size(0), grad.size(1));
  }
};

TEST(EigenAdam, EqualsTheDenseKroneckerReferenceOverSteps) {
  torch::manual_seed(0);
  const int64_t a = 4, g = 3;
  const auto ea = eigen_decompose(random_spd(a, 8, torch::kFloat64));
  const auto eg = eigen_decompose(random_spd(g, 8, torch::kFloat64));
  const AdamConstants c{0.8, 0.95, 1e-6};
  DenseEigenAdam dense(ea.eigenvectors, eg.eigenvectors, c);
  auto moments = zero_moments(g, a, torch::TensorOptions().dtype(torch::kFloat64));
  for (int step = 0; step < 4; ++step) {
    const auto grad = torch::randn({g, a}, torch::kFloat64);
    EXPECT_TENSOR_NEAR(eigen_adam_step(ea, eg, moments, grad, c), dense.step(grad), 1e-10);
    EXPECT_EQ(moments.steps.item<double>(), step + 1);
  }
}

TEST(EigenAdam, FloatGradientsRunInTheMomentsDtypeAndComeBackInTheirs) {
  torch::manual_seed(1);
  const auto ea = eigen_decompose(random_spd(3, 6, torch::kFloat64));
  const auto eg = eigen_decompose(random_spd(2, 6, torch::kFloat64));
  const auto grad = torch::randn({2, 3}, torch::kFloat32);
  auto moments = zero_moments(2, 3, torch::kFloat64);
  const auto direction = eigen_adam_step(ea, eg, moments, grad, {});
  DenseEigenAdam dense(ea.eigenvectors, eg.eigenvectors, {});
  EXPECT_EQ(direction.scalar_type(), torch::kFloat32);
  EXPECT_TENSOR_NEAR(direction, dense.step(grad), 1e-6);
}

// A diagonal factor (an Embedding's A, a head's G) has no eigenvectors: that side's basis is the identity.
TEST(EigenAdam, ADiagonalSideIsTheIdentityBasis) {
  torch::manual_seed(2);
  const auto ea = eigen_decompose(torch::rand({5}, torch::kFloat64));  // diagonal: no eigenvectors
  ASSERT_FALSE(ea.eigenvectors.defined());
  const auto eg = eigen_decompose(random_spd(3, 6, torch::kFloat64));
  DenseEigenAdam dense(torch::eye(5, torch::kFloat64), eg.eigenvectors, {});
  auto moments = zero_moments(3, 5, torch::kFloat64);
  for (int step = 0; step < 3; ++step) {
    const auto grad = torch::randn({3, 5}, torch::kFloat64);
    EXPECT_TENSOR_NEAR(eigen_adam_step(ea, eg, moments, grad, {}), dense.step(grad), 1e-10);
  }
}

// docs/MATH.md section 8.3, worked: A = [[2, 1], [1, 2]] (Q_A's columns (1, -1)/sqrt 2 and (1, 1)/sqrt 2 for the
// eigenvalues 1 and 3), G = [4]; gradients [3, 1], then [1, 3]; beta 0.9 / 0.999, eps 0 (rounded to 1e-12 here).
TEST(EigenAdam, SpecWorkedExample) {
  const auto ea = eigen_decompose(torch::tensor({{2.0, 1.0}, {1.0, 2.0}}, torch::kFloat64));
  const auto eg = eigen_decompose(torch::tensor({{4.0}}, torch::kFloat64));
  const AdamConstants c{0.9, 0.999, 1e-12};
  auto moments = zero_moments(1, 2, torch::kFloat64);
  const auto first = eigen_adam_step(ea, eg, moments, torch::tensor({{3.0, 1.0}}, torch::kFloat64), c);
  EXPECT_TENSOR_NEAR(first, torch::tensor({{std::sqrt(2.0), 0.0}}, torch::kFloat64), 1e-9);
  const auto second = eigen_adam_step(ea, eg, moments, torch::tensor({{1.0, 3.0}}, torch::kFloat64), c);
  EXPECT_TENSOR_NEAR(second, torch::tensor({{0.669891, 0.744323}}, torch::kFloat64), 1e-6);
  // Plain Adam on the same gradients (docs/MATH.md): [1, 1], then [0.871064, 0.917781].
}

/// Eigenbases of random factors (A 3 x 3, G 2 x 2), and moments after one step on a random [2, 3] gradient.
struct AfterOneStep {
  EigenFactor ea, eg;
  EigenAdamMoments moments;
};
AfterOneStep after_one_step(uint64_t seed) {
  torch::manual_seed(seed);
  AfterOneStep s{eigen_decompose(random_spd(3, 6, torch::kFloat64)), eigen_decompose(random_spd(2, 6, torch::kFloat64)),
                 zero_moments(2, 3, torch::kFloat64)};
  eigen_adam_step(s.ea, s.eg, s.moments, torch::randn({2, 3}, torch::kFloat64), {});
  return s;
}

TEST(EigenAdam, ANonFiniteGradientLeavesTheMomentsAndGivesNaN) {
  auto [ea, eg, moments] = after_one_step(3);
  const auto m = moments.exp_avg.clone(), v = moments.exp_avg_sq.clone();
  auto bad = torch::randn({2, 3}, torch::kFloat64);
  bad[1][2] = kNan;
  const auto direction = eigen_adam_step(ea, eg, moments, bad, {});
  EXPECT_TRUE(torch::isnan(direction).all().item<bool>());
  EXPECT_TRUE(torch::equal(moments.exp_avg, m));
  EXPECT_TRUE(torch::equal(moments.exp_avg_sq, v));
  EXPECT_EQ(moments.steps.item<double>(), 1.0);
}

// m is linear in the gradients: accumulated in one basis and rotated into another, it is what accumulating in the
// other gives. v rotates entry by entry as the second moment of uncorrelated entries, and keeps its sum.
TEST(EigenAdam, RotationIsExactForTheFirstMomentAndEntryWiseForTheSecond) {
  torch::manual_seed(4);
  const int64_t a = 4, g = 3;
  const auto old_a = eigen_decompose(random_spd(a, 8, torch::kFloat64));
  const auto old_g = eigen_decompose(random_spd(g, 8, torch::kFloat64));
  const auto new_a = eigen_decompose(random_spd(a, 8, torch::kFloat64));
  const auto new_g = eigen_decompose(random_spd(g, 8, torch::kFloat64));
  auto in_old = zero_moments(g, a, torch::kFloat64);
  auto in_new = zero_moments(g, a, torch::kFloat64);
  for (int step = 0; step < 3; ++step) {
    const auto grad = torch::randn({g, a}, torch::kFloat64);
    eigen_adam_step(old_a, old_g, in_old, grad, {});
    eigen_adam_step(new_a, new_g, in_new, grad, {});
  }
  const auto rotated = rotate_moments(in_old, old_a, old_g, new_a, new_g);
  EXPECT_TENSOR_NEAR(rotated.exp_avg, in_new.exp_avg, 1e-10);
  EXPECT_EQ(rotated.steps.item<double>(), 3.0);
  // v' [k, l] = sum_ij R_G[k, i]^2 R_A[l, j]^2 v[i, j], written as loops.
  const auto r_a = torch::mm(new_a.eigenvectors.t(), old_a.eigenvectors);
  const auto r_g = torch::mm(new_g.eigenvectors.t(), old_g.eigenvectors);
  auto expected = torch::zeros({g, a}, torch::kFloat64);
  for (int64_t k = 0; k < g; ++k)
    for (int64_t l = 0; l < a; ++l)
      for (int64_t i = 0; i < g; ++i)
        for (int64_t j = 0; j < a; ++j) {
          const double rg = r_g[k][i].item<double>(), ra = r_a[l][j].item<double>();
          expected[k][l] += rg * rg * ra * ra * in_old.exp_avg_sq[i][j].item<double>();
        }
  EXPECT_TENSOR_NEAR(rotated.exp_avg_sq, expected, 1e-10);
  EXPECT_NEAR(rotated.exp_avg_sq.sum().item<double>(), in_old.exp_avg_sq.sum().item<double>(), 1e-12);
  // Into the same basis: unchanged.
  const auto same = rotate_moments(in_old, old_a, old_g, old_a, old_g);
  EXPECT_TENSOR_NEAR(same.exp_avg, in_old.exp_avg, 1e-12);
  EXPECT_TENSOR_NEAR(same.exp_avg_sq, in_old.exp_avg_sq, 1e-12);
}

// Several layers at once (Options::stack_layers): m units of c layers, a unit's Q_A shared by its c layers, held at
// widths padded with the identity (bases) and zeros (gradients) as LayerGroups holds them. Over three steps each
// layer's direction, moments and step count equal its own eigen_adam_step's (and the dense reference's), and the
// pad of every direction is zero; a layer whose gradient is not finite is NaN alone and keeps its moments.
TEST(EigenAdamStacked, EachLayerEqualsItsOwnStep) {
  torch::manual_seed(6);
  const int64_t g = 3, a = 5;
  for (const int64_t c : {1, 3}) {
    for (const int64_t pad : {0, 3}) {
      const int64_t units = 2, n = units * c, pg = g + pad, pa = a + pad;
      std::vector<EigenFactor> ea, eg;
      for (int64_t u = 0; u < units; ++u) ea.push_back(eigen_decompose(random_spd(a, 9, torch::kFloat64)));
      for (int64_t k = 0; k < n; ++k) eg.push_back(eigen_decompose(random_spd(g, 9, torch::kFloat64)));
      auto qa = torch::eye(pa, torch::kFloat64).repeat({units, 1, 1});
      auto qg = torch::eye(pg, torch::kFloat64).repeat({n, 1, 1});
      for (int64_t u = 0; u < units; ++u) qa[u].narrow(0, 0, a).narrow(1, 0, a).copy_(ea[u].eigenvectors);
      for (int64_t k = 0; k < n; ++k) qg[k].narrow(0, 0, g).narrow(1, 0, g).copy_(eg[k].eigenvectors);
      const AdamConstants constants{0.8, 0.95, 1e-6};
      std::vector<EigenAdamMoments> stacked, alone;
      std::vector<DenseEigenAdam> dense;
      for (int64_t k = 0; k < n; ++k) {
        stacked.push_back(zero_moments(g, a, torch::kFloat64));
        alone.push_back(zero_moments(g, a, torch::kFloat64));
        dense.emplace_back(ea[k / c].eigenvectors, eg[k].eigenvectors, constants);
      }
      std::vector<EigenAdamMoments*> pointers;
      for (auto& m : stacked) pointers.push_back(&m);
      for (int step = 0; step < 3; ++step) {
        auto grads = torch::zeros({n, pg, pa}, torch::kFloat64);
        grads.narrow(1, 0, g).narrow(2, 0, a).copy_(torch::randn({n, g, a}, torch::kFloat64));
        const int64_t broken = step == 2 ? n - 1 : -1;  // the last layer's gradient is not finite at step 2
        if (broken >= 0) grads[broken][1][2] = kNan;
        const auto before = stacked[static_cast<size_t>(n - 1)].exp_avg.clone();
        const auto got = eigen_adam_step_stacked(qa, qg, pointers, grads, g, a, constants);
        ASSERT_EQ(got.sizes(), grads.sizes());
        const std::string where = "c " + std::to_string(c) + " pad " + std::to_string(pad) + " step " +
                                  std::to_string(step);
        for (int64_t k = 0; k < n; ++k) {
          const auto grad = grads[k].narrow(0, 0, g).narrow(1, 0, a);
          const auto own = eigen_adam_step(ea[k / c], eg[k], alone[static_cast<size_t>(k)], grad, constants);
          const auto layer = got[k].narrow(0, 0, g).narrow(1, 0, a);
          if (k == broken) {
            EXPECT_TRUE(torch::isnan(layer).all().item<bool>()) << where;
            EXPECT_TRUE(torch::equal(stacked[static_cast<size_t>(k)].exp_avg, before)) << where;
            continue;
          }
          EXPECT_TENSOR_NEAR(layer, own, 1e-13) << where << " layer " << k;
          EXPECT_TENSOR_NEAR(layer, dense[static_cast<size_t>(k)].step(grad), 1e-10) << where << " layer " << k;
          EXPECT_TENSOR_NEAR(stacked[static_cast<size_t>(k)].exp_avg_sq, alone[static_cast<size_t>(k)].exp_avg_sq,
                             1e-13) << where;
          EXPECT_EQ(stacked[static_cast<size_t>(k)].steps.item<double>(), alone[static_cast<size_t>(k)].steps.item<double>())
              << where;
          if (pad > 0) {
            EXPECT_EQ(got[k].narrow(0, g, pad).abs().max().item<double>(), 0.0) << where;
            EXPECT_EQ(got[k].narrow(1, a, pad).abs().max().item<double>(), 0.0) << where;
          }
        }
      }
    }
  }
  std::vector<EigenAdamMoments*> none;
  try {
    eigen_adam_step_stacked(torch::zeros({1, 2, 2}), torch::zeros({1, 2, 2}), none, torch::zeros({1, 2, 2}), 2, 2, {});
    FAIL() << "a gradient without moments was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("0 layers' moments for 1 gradients"), std::string::npos) << e.what();
  }
  auto narrow = zero_moments(2, 1, torch::kFloat64);  // a [2, 1] layer's moments where the layers are [2, 2]
  std::vector<EigenAdamMoments*> one{&narrow};
  const auto eye = torch::eye(2, torch::kFloat64).unsqueeze(0);
  try {
    eigen_adam_step_stacked(eye, eye, one, torch::ones({1, 2, 2}, torch::kFloat64), 2, 2, {});
    FAIL() << "moments of another width were accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("moments of shape [2, 1] for a gradient of shape [2, 2]"), std::string::npos)
        << e.what();
  }
}

TEST(EigenAdam, RotationOutOfABasisThatHeldNaNRestartsFromZero) {
  const auto [ea, eg, moments] = after_one_step(5);
  EigenFactor broken{torch::full({3, 3}, kNan, torch::kFloat64), torch::ones({3}, torch::kFloat64)};
  const auto rotated = rotate_moments(moments, broken, eg, ea, eg);
  EXPECT_TRUE(torch::equal(rotated.exp_avg, torch::zeros({2, 3}, torch::kFloat64)));
  EXPECT_TRUE(torch::equal(rotated.exp_avg_sq, torch::zeros({2, 3}, torch::kFloat64)));
  EXPECT_EQ(rotated.steps.item<double>(), 0.0);
}

}  // namespace
}  // namespace dkfac::math
