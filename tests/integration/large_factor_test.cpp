// Factors of dimension 8192 in float32, for real: LAPACK's float32 workspace query breaks past 2894.
#include <gtest/gtest.h>

#include "dkfac/dkfac.h"
#include "tests/test_util.h"

namespace dkfac {
namespace {

TEST(LargeFactor, Dimension8192EigenAndInverseSolveTheKroneckerSystem) {
  torch::set_num_threads(2);
  torch::manual_seed(3);
  const int64_t in = 8191;  // + bias = 8192
  const int64_t out = 8;
  auto fc = nn::Linear(in, out);
  auto model = std::make_shared<torch::nn::Sequential>(fc);
  const double damping = 0.05;
  Preconditioner kfac(model->ptr(), Options().damping(damping).kl_clip(0).factor_decay(0.0));
  auto x = torch::randn({512, in});
  auto y = fc->forward(x);
  (y * torch::randn_like(y)).sum().backward();
  auto grad = kfac.layers()[0].gradient().clone();
  kfac.step();
  auto v = kfac.layers()[0].gradient();
  const auto& a = kfac.layers()[0].a_factor();
  const auto& g = kfac.layers()[0].g_factor();
  ASSERT_EQ(a.size(0), 8192);
  ASSERT_EQ(a.scalar_type(), torch::kFloat32);

  // Eigen method: (A kron G + damping I) vec(V) = vec(grad)  <=>  G V A + damping V = grad.
  auto residual = torch::mm(torch::mm(g, v), a) + damping * v - grad;
  EXPECT_LT((residual.norm() / grad.norm()).item<double>(), 1e-4);
  const auto& eig = kfac.layers()[0].second_order().a_eigen;
  auto rebuilt = torch::mm(eig.eigenvectors * eig.eigenvalues, eig.eigenvectors.t());
  EXPECT_LT(((rebuilt - a).norm() / a.norm()).item<double>(), 1e-5);

  // Inverse method on the same factors: (G + damping I) V (A + damping I) = grad.
  auto a_inv = math::damped_inverse(a, damping);
  auto g_inv = math::damped_inverse(g, damping);
  auto v_inv = math::precondition_inverse(a_inv, g_inv, grad);
  auto eye_a = torch::eye(8192);
  auto eye_g = torch::eye(out);
  auto residual_inv = torch::mm(torch::mm(g + damping * eye_g, v_inv), a + damping * eye_a) - grad;
  EXPECT_LT((residual_inv.norm() / grad.norm()).item<double>(), 1e-4);
}

}  // namespace
}  // namespace dkfac
