#include "dkfac/assign/assignment.h"

#include <gtest/gtest.h>

namespace dkfac::assign {
namespace {

const std::vector<LayerShape> kLayers = {{"l0", 10, 4}, {"l1", 30, 8}, {"l2", 20, 20}, {"l3", 5, 3}};

TEST(Assignment, GridOfFourRanksHalfFraction) {
  auto a = assign_kaisa(kLayers, 4, 0.5);
  EXPECT_EQ(a.grad_workers, 2);
  EXPECT_EQ(a.columns(), (std::vector<std::vector<int>>{{0, 2}, {1, 3}}));
  EXPECT_EQ(a.rows(), (std::vector<std::vector<int>>{{0, 1}, {2, 3}}));
  // Costs (dim^3): l1 27512, l2 16000, l0 1064, l3 152. LPT: l1 -> column 0 (rank 0),
  // l2 -> column 1 (rank 1), l0 -> column 1 (rank 3), l3 -> column 1 (16000+1064 vs 27512: column 1, rank 3).
  EXPECT_EQ(a.layers[1].grad_workers, (std::vector<int>{0, 2}));
  EXPECT_EQ(a.layers[1].a_worker, 0);
  EXPECT_EQ(a.layers[2].grad_workers, (std::vector<int>{1, 3}));
  EXPECT_EQ(a.layers[2].a_worker, 1);
  EXPECT_EQ(a.layers[0].grad_workers, (std::vector<int>{1, 3}));
  EXPECT_EQ(a.layers[0].a_worker, 3);
  EXPECT_EQ(a.layers[3].grad_workers, (std::vector<int>{1, 3}));
  EXPECT_EQ(a.layers[3].a_worker, 3);
  for (const auto& l : a.layers) EXPECT_EQ(l.a_worker, l.g_worker) << "colocated";
  // Who sends V to whom: rank 2 (row 1) gets layer 2 from rank 3, rank 1 gets layer 1 from rank 0.
  EXPECT_EQ(a.grad_source_for(2, 2), 3);
  EXPECT_EQ(a.grad_source_for(1, 1), 0);
  EXPECT_TRUE(a.is_grad_worker(1, 2));
  EXPECT_FALSE(a.is_grad_worker(1, 3));
}

TEST(Assignment, CommOptAndMemOpt) {
  auto comm_opt = assign_kaisa(kLayers, 4, 1.0);
  EXPECT_EQ(comm_opt.grad_workers, 4);
  EXPECT_EQ(comm_opt.columns().size(), 1u);
  for (const auto& l : comm_opt.layers) EXPECT_EQ(l.grad_workers, (std::vector<int>{0, 1, 2, 3}));
  // LPT over ranks: l1 -> 0, l2 -> 1, l0 -> 2, l3 -> 3.
  EXPECT_EQ(comm_opt.layers[1].a_worker, 0);
  EXPECT_EQ(comm_opt.layers[2].a_worker, 1);
  EXPECT_EQ(comm_opt.layers[0].a_worker, 2);
  EXPECT_EQ(comm_opt.layers[3].a_worker, 3);

  auto mem_opt = assign_kaisa(kLayers, 4, 0.25);
  EXPECT_EQ(mem_opt.grad_workers, 1);
  EXPECT_EQ(mem_opt.rows(), (std::vector<std::vector<int>>{{0, 1, 2, 3}}));
  for (const auto& l : mem_opt.layers) {
    ASSERT_EQ(l.grad_workers.size(), 1u);
    EXPECT_EQ(l.a_worker, l.grad_workers[0]);
  }
}

TEST(Assignment, SeparateFactorsAndMemoryBalance) {
  auto a = assign_kaisa(kLayers, 2, 1.0, Balance::kCompute, /*colocate=*/false);
  // l1: A (27000) -> 0, G (512) -> 1; l2: A (8000) -> 1, G (8000) -> 1 (8512 vs 27000 then 16512).
  EXPECT_EQ(a.layers[1].a_worker, 0);
  EXPECT_EQ(a.layers[1].g_worker, 1);
  EXPECT_EQ(a.layers[2].a_worker, 1);
  EXPECT_EQ(a.layers[2].g_worker, 1);
  auto m = assign_kaisa(kLayers, 2, 1.0, Balance::kMemory);
  // dim^2: l1 964 (rank 0), l2 800 (rank 1), l0 116 (rank 1: 800 < 964), l3 34 (rank 1: 916 < 964).
  EXPECT_EQ(m.layers[1].a_worker, 0);
  EXPECT_EQ(m.layers[2].a_worker, 1);
  EXPECT_EQ(m.layers[0].a_worker, 1);
  EXPECT_EQ(m.layers[3].a_worker, 1);
  EXPECT_NE(m.to_string(kLayers).find("l1 [a=30, g=8]: A on 0, G on 0"), std::string::npos) << m.to_string(kLayers);
}

TEST(Assignment, RejectsBadFractions) {
  EXPECT_THROW(grad_worker_count(4, 0.0), c10::Error);
  EXPECT_THROW(grad_worker_count(4, 1.5), c10::Error);
  EXPECT_THROW(grad_worker_count(6, 0.75), c10::Error);  // W = round(4.5) = 5 does not divide 6 (lround: 5)
  EXPECT_EQ(grad_worker_count(6, 0.5), 3);
  EXPECT_EQ(grad_worker_count(1, 0.5), 1);
}

}  // namespace
}  // namespace dkfac::assign
