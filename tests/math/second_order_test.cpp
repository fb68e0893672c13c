#include "dkfac/math/second_order.h"

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace dkfac::math {
namespace {

using dkfac::testing::dense_eigen_reference;
using dkfac::testing::dense_inverse_reference;
using dkfac::testing::random_spd;

// docs/MATH.md section 2.5 worked example.
struct Worked {
  torch::Tensor grad = torch::tensor({{1.0, 2.0}, {3.0, 4.0}}, torch::kFloat64);
  torch::Tensor a = torch::diag(torch::tensor({2.0, 0.5}, torch::kFloat64));
  torch::Tensor g = torch::diag(torch::tensor({4.0, 1.0}, torch::kFloat64));
  double damping = 0.1;
};

TEST(SecondOrder, SpecWorkedEigen) {
  Worked w;
  auto v = precondition_eigen(eigen_decompose(w.a), eigen_decompose(w.g), w.grad, w.damping);
  EXPECT_TENSOR_NEAR(v, torch::tensor({{0.123457, 0.952381}, {1.428571, 6.666667}}, torch::kFloat64), 1e-6);
}

TEST(SecondOrder, SpecWorkedInverse) {
  Worked w;
  auto v = precondition_inverse(damped_inverse(w.a, w.damping), damped_inverse(w.g, w.damping), w.grad);
  EXPECT_TENSOR_NEAR(v, torch::tensor({{0.116144, 0.813008}, {1.298701, 6.060606}}, torch::kFloat64), 1e-6);
}

TEST(SecondOrder, SpecWorkedPiDamping) {
  Worked w;
  auto [da, dg] = pi_damping(w.a, w.g, w.damping);
  const double pi = 0.707107;
  EXPECT_NEAR(da, std::sqrt(0.1) * pi, 1e-6);
  EXPECT_NEAR(dg, std::sqrt(0.1) / pi, 1e-6);
  auto v = precondition_inverse(damped_inverse(w.a, da), damped_inverse(w.g, dg), w.grad);
  EXPECT_TENSOR_NEAR(v, torch::tensor({{0.101124, 0.621497}, {0.932246, 3.819660}}, torch::kFloat64), 1e-6);
}

TEST(SecondOrder, SpecWorkedKlClip) {
  Worked w;
  auto v = precondition_eigen(eigen_decompose(w.a), eigen_decompose(w.g), w.grad, w.damping);
  const double lr = 0.1;
  const double vg = (v * w.grad).sum().item<double>() * lr * lr;
  EXPECT_NEAR(kl_clip_scale(vg, 0.001), 0.055064, 1e-6);
  EXPECT_EQ(kl_clip_scale(0.0, 0.001), 1.0);
  EXPECT_EQ(kl_clip_scale(vg, 0.0), 1.0);
  EXPECT_EQ(kl_clip_scale(1e-9, 0.001), 1.0);
}

TEST(SecondOrder, EigenvaluesClampedAtZero) {
  auto m = torch::tensor({{1.0, 0.0}, {0.0, -1e-3}}, torch::kFloat64);
  auto e = eigen_decompose(m);
  EXPECT_GE(e.eigenvalues.min().item<double>(), 0.0);
}

TEST(SecondOrder, RejectsNonFiniteFactor) {
  auto m = torch::eye(3, torch::kFloat64);
  m[1][1] = std::nan("");
  EXPECT_THROW(eigen_decompose(m), c10::Error);
}

// docs/MATH.md section 2.6's worked refresh: F = [[2, 1], [1, 2]] (eigenvalues 1 and 3) from the identity basis with
// eigenvalues {1, 2}: Q R = F [e2, e1] gives q = (1, 2) / sqrt(5) and (2, -1) / sqrt(5), Rayleigh quotients 14/5 and
// 6/5; a second refresh gives 122/41 and 42/41, toward 3 and 1.
TEST(SecondOrder, SpecWorkedRefresh) {
  const auto f = torch::tensor({{2.0, 1.0}, {1.0, 2.0}}, torch::kFloat64);
  const EigenFactor start{torch::eye(2, torch::kFloat64), torch::tensor({1.0, 2.0}, torch::kFloat64)};
  const auto once = refresh_eigenbasis(f, start);
  EXPECT_TENSOR_NEAR(once.eigenvalues, torch::tensor({1.2, 2.8}, torch::kFloat64), 1e-12);
  const auto top = once.eigenvectors.select(1, 1);  // for the larger value, up to its sign
  EXPECT_TENSOR_NEAR(top * top.sum().sign(), torch::tensor({1.0, 2.0}, torch::kFloat64) / std::sqrt(5.0), 1e-12);
  const auto twice = refresh_eigenbasis(f, once);
  EXPECT_TENSOR_NEAR(twice.eigenvalues, torch::tensor({42.0 / 41.0, 122.0 / 41.0}, torch::kFloat64), 1e-12);
}

// From a factor's own eigenbasis the refresh gives that eigendecomposition back: the same eigenvalues, and a
// basis that rebuilds the factor.
TEST(SecondOrder, RefreshFromTheExactBasisIsTheEigendecomposition) {
  torch::manual_seed(5);
  const auto f = dkfac::testing::random_spd(24, 64, torch::kFloat64);
  const auto exact = eigen_decompose(f);
  const auto refreshed = refresh_eigenbasis(f, exact);
  EXPECT_TENSOR_NEAR(refreshed.eigenvalues, exact.eigenvalues, 1e-10);
  const auto& q = refreshed.eigenvectors;
  EXPECT_TENSOR_NEAR(torch::mm(q.t(), q), torch::eye(24, torch::kFloat64), 1e-12);
  EXPECT_TENSOR_NEAR(torch::mm(q * refreshed.eigenvalues, q.t()), f, 1e-10);
}

// From a stale basis: an orthonormal basis, its eigenvalues the Rayleigh quotients diag(Q^T F Q), in ascending
// order; each refresh brings the rebuilt factor closer to F, and repeated refreshes (subspace iteration) reach F's
// eigendecomposition. F's spectrum is geometric (ratio 0.7) so that the convergence is quick and sure.
TEST(SecondOrder, RefreshMovesAStaleBasisTowardTheFactors) {
  torch::manual_seed(6);
  const int64_t d = 16;
  const auto rotation = std::get<0>(torch::linalg_qr(torch::randn({d, d}, torch::kFloat64)));
  const auto spectrum = torch::pow(0.7, torch::arange(d, torch::kFloat64));
  const auto f = torch::mm(rotation * spectrum, rotation.t());
  auto rebuilt_error = [&](const EigenFactor& e) {
    return (torch::mm(e.eigenvectors * e.eigenvalues, e.eigenvectors.t()) - f).norm().item<double>();
  };
  // A basis of a nearby factor (F plus noise), as between two inverse updates.
  auto basis = eigen_decompose(f + 0.05 * dkfac::testing::random_spd(d, 4, torch::kFloat64));
  double error = rebuilt_error({basis.eigenvectors, (basis.eigenvectors * torch::mm(f, basis.eigenvectors)).sum(0)});
  for (int k = 0; k < 3; ++k) {
    basis = refresh_eigenbasis(f, basis);
    const auto& q = basis.eigenvectors;
    EXPECT_TENSOR_NEAR(torch::mm(q.t(), q), torch::eye(d, torch::kFloat64), 1e-12);
    EXPECT_TENSOR_NEAR(basis.eigenvalues, (q * torch::mm(f, q)).sum(0), 1e-12);
    EXPECT_TRUE(torch::equal(basis.eigenvalues, std::get<0>(torch::sort(basis.eigenvalues))));
    const double now = rebuilt_error(basis);
    EXPECT_LT(now, error) << "refresh " << k;
    error = now;
  }
  for (int k = 0; k < 200; ++k) basis = refresh_eigenbasis(f, basis);
  EXPECT_TENSOR_NEAR(basis.eigenvalues, std::get<0>(torch::sort(spectrum)), 1e-9);
  EXPECT_LT(rebuilt_error(basis), 1e-9);
}

// A non-finite previous basis (a part never received) gives a non-finite result: the caller's check sees it. A
// diagonal factor has no basis to refresh.
TEST(SecondOrder, RefreshPassesNonFiniteOnAndKeepsDiagonalsDiagonal) {
  const auto f = torch::tensor({{2.0, 1.0}, {1.0, 2.0}}, torch::kFloat64);
  const EigenFactor lost{torch::full({2, 2}, std::nan(""), torch::kFloat64), torch::tensor({1.0, 2.0}, torch::kFloat64)};
  EXPECT_FALSE(torch::isfinite(refresh_eigenbasis(f, lost).eigenvectors).all().item<bool>());
  const auto diagonal = refresh_eigenbasis(torch::tensor({3.0, -1.0}, torch::kFloat64), {});
  EXPECT_FALSE(diagonal.eigenvectors.defined());
  EXPECT_TENSOR_NEAR(diagonal.eigenvalues, torch::tensor({3.0, 0.0}, torch::kFloat64), 0.0);
  EXPECT_THROW(refresh_eigenbasis(f, {torch::eye(3, torch::kFloat64), torch::ones({3}, torch::kFloat64)}),
               c10::Error);
}

class DenseKronecker : public ::testing::TestWithParam<std::tuple<torch::Dtype, int64_t, int64_t>> {};

// The eigen method solves (A kron G + damping I) vec(V) = vec(grad); the inverse method solves
// ((A + damping I) kron (G + damping I)) vec(V) = vec(grad). Both against the explicit Kronecker product.
TEST_P(DenseKronecker, MethodsMatchDenseSolve) {
  const auto [dtype, a_dim, g_dim] = GetParam();
  const double tol = dtype == torch::kFloat64 ? 1e-5 : 1e-4;
  torch::manual_seed(5 + a_dim * 7 + g_dim);
  auto a = random_spd(a_dim, a_dim + 3, dtype);
  // Rank deficient in float64 on purpose; float32 keeps the conditioning its precision can resolve.
  auto g = random_spd(g_dim, dtype == torch::kFloat64 ? 2 : g_dim + 3, dtype);
  auto grad = torch::randn({g_dim, a_dim}, dtype);
  for (double damping : {1e-3, 0.1}) {
    auto v_eig = precondition_eigen(eigen_decompose(a), eigen_decompose(g), grad, damping);
    EXPECT_TENSOR_NEAR(v_eig, dense_eigen_reference(a, g, grad, damping), tol) << "damping " << damping;
    auto v_inv = precondition_inverse(damped_inverse(a, damping), damped_inverse(g, damping), grad);
    EXPECT_TENSOR_NEAR(v_inv, dense_inverse_reference(a, g, grad, damping, damping), tol) << "damping " << damping;
    auto [da, dg] = pi_damping(a, g, damping);
    auto v_pi = precondition_inverse(damped_inverse(a, da), damped_inverse(g, dg), grad);
    EXPECT_TENSOR_NEAR(v_pi, dense_inverse_reference(a, g, grad, da, dg), tol) << "damping " << damping;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, DenseKronecker,
                         ::testing::Combine(::testing::Values(torch::kFloat64, torch::kFloat32),
                                            ::testing::Values(1, 3, 7), ::testing::Values(1, 4, 5)));

}  // namespace
}  // namespace dkfac::math
