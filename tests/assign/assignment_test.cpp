#include "dkfac/assign/assignment.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "tests/test_util.h"

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
}

TEST(Assignment, RejectsBadFractions) {
  EXPECT_EQ(grad_worker_count(4, 0.0), 1) << "0 means 1/P (MEM-OPT), as in kfac_pytorch";
  EXPECT_THROW(grad_worker_count(4, -0.5), c10::Error);
  EXPECT_THROW(grad_worker_count(4, 1.5), c10::Error);
  EXPECT_THROW(grad_worker_count(6, 0.75), c10::Error);  // W = round(4.5) = 5 does not divide 6 (lround: 5)
  EXPECT_EQ(grad_worker_count(6, 0.5), 3);
  EXPECT_EQ(grad_worker_count(1, 0.5), 1);
}

using Warnings = testing::CapturedWarnings;

// What the front ends report (kaisa_layout) at P f = k + 1/2: halves go up, so P = 5, f = 0.9 is COMM-OPT
// (Python's round() would say W = 4, HYBRID-OPT), and a W that does not divide P is refused.
TEST(KaisaLayout, RoundsHalvesAwayFromZero) {
  const auto five = kaisa_layout(5, 0.9, true);
  EXPECT_EQ(five.grad_workers, 5);
  EXPECT_EQ(five.distributed_strategy(), DistributedStrategy::kCommOpt);
  EXPECT_EQ(five.grad_worker_fraction, 0.9) << "the fraction as given";
  EXPECT_EQ(kaisa_layout(2, 0.25, true).grad_workers, 1);  // 0.5 -> 1
  EXPECT_EQ(kaisa_layout(2, 0.25, true).distributed_strategy(), DistributedStrategy::kMemOpt);
  EXPECT_EQ(kaisa_layout(6, 0.25, true).grad_workers, 2);  // 1.5 -> 2
  EXPECT_EQ(kaisa_layout(6, 0.25, true).distributed_strategy(), DistributedStrategy::kHybridOpt);
  EXPECT_THROW(kaisa_layout(8, 0.5625, true), c10::Error);  // 4.5 -> 5, which does not divide 8 (round(): 4)
  EXPECT_THROW(kaisa_layout(4, 0.625, true), c10::Error);   // 2.5 -> 3 (round(): 2)
  EXPECT_EQ(to_string(five.distributed_strategy()), std::string("comm-opt"));
}

TEST(KaisaLayout, FractionZeroIsOneOverPAndMemOptColocates) {
  const auto mem = kaisa_layout(4, 0.0, /*colocate_factors=*/false);
  EXPECT_EQ(mem.grad_workers, 1);
  EXPECT_EQ(mem.grad_worker_fraction, 0.25);
  EXPECT_EQ(mem.distributed_strategy(), DistributedStrategy::kMemOpt);
  EXPECT_TRUE(mem.colocate_factors) << "kfac_pytorch: MEM_OPT requires colocate_factors";
  EXPECT_FALSE(kaisa_layout(4, 0.5, false).colocate_factors) << "HYBRID_OPT keeps the choice";
  const auto one = kaisa_layout(1, 0.0, false);
  EXPECT_EQ(one.grad_worker_fraction, 1.0);
  EXPECT_EQ(one.distributed_strategy(), DistributedStrategy::kCommOpt) << "one rank is every rank";
  EXPECT_FALSE(one.colocate_factors);
}

// assign_kaisa places on kaisa_layout's grid for every world size and fraction, and refuses what it refuses.
TEST(KaisaLayout, IsTheGridAssignKaisaPlacesOn) {
  for (int p = 1; p <= 8; ++p) {
    for (double f : {0.0, 1.0 / p, 0.1, 0.25, 0.3, 0.5, 0.5625, 0.625, 0.75, 0.9, 1.0}) {
      for (bool colocate : {true, false}) {
        SCOPED_TRACE("P=" + std::to_string(p) + " f=" + std::to_string(f) + " colocate=" + std::to_string(colocate));
        Assignment layout;
        try {
          layout = kaisa_layout(p, f, colocate);
        } catch (const c10::Error&) {
          EXPECT_THROW(assign_kaisa(kLayers, p, f, Balance::kCompute, colocate), c10::Error);
          continue;
        }
        Warnings warnings;
        const auto placed = assign_kaisa(kLayers, p, f, Balance::kCompute, colocate);
        EXPECT_EQ(placed.grad_workers, layout.grad_workers);
        EXPECT_EQ(placed.grad_worker_fraction, layout.grad_worker_fraction);
        EXPECT_EQ(placed.colocate_factors, layout.colocate_factors);
        EXPECT_EQ(static_cast<int>(placed.columns().size()), p / layout.grad_workers);
        if (layout.colocate_factors) {
          for (const auto& l : placed.layers) EXPECT_EQ(l.a_worker, l.g_worker);
        }
        EXPECT_EQ(warnings.messages.size(), layout.colocate_factors != colocate ? 1u : 0u);
      }
    }
  }
}

TEST(KaisaLayout, AssignKaisaWarnsWhereMemOptTurnsColocationOn) {
  Warnings warnings;
  const auto a = assign_kaisa(kLayers, 4, 0.0, Balance::kCompute, /*colocate=*/false);
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_EQ(warnings.messages[0],
            "grad_worker_fraction=1/world_size (MEM_OPT) requires colocate_factors=True; enabling it");
  EXPECT_TRUE(a.colocate_factors);
  assign_kaisa(kLayers, 4, 0.5, Balance::kCompute, /*colocate=*/false);
  assign_kaisa(kLayers, 4, 0.25, Balance::kCompute, /*colocate=*/true);
  EXPECT_EQ(warnings.messages.size(), 1u) << "nothing to turn on";
}

// SPD-KFAC: factors largest first; small ones everywhere, large ones on the least dim^3-loaded rank.
TEST(SpdAssignment, SmallFactorsEverywhereLargeOnesBalanced) {
  // Factors by dim: l1.A 30, l2.A 20, l2.G 20, l0.A 10, l1.G 8, l3.A 5, l0.G 4, l3.G 3.
  auto a = assign_spd(kLayers, 2, /*redundant_dim=*/8);
  EXPECT_EQ(a.grad_workers, 2);
  EXPECT_EQ(a.layers[1].a_worker, 0);  // 30^3 = 27000 on rank 0
  EXPECT_EQ(a.layers[2].a_worker, 1);  // 8000 on rank 1
  EXPECT_EQ(a.layers[2].g_worker, 1);  // 16000 < 27000: rank 1 again
  EXPECT_EQ(a.layers[0].a_worker, 1);  // 17000 < 27000: rank 1
  for (auto [layer, is_a] : std::vector<std::pair<int, bool>>{{1, false}, {3, true}, {0, false}, {3, false}}) {
    EXPECT_EQ(is_a ? a.layers[layer].a_worker : a.layers[layer].g_worker, kEveryRank) << layer << is_a;
  }
  for (const auto& l : a.layers) EXPECT_EQ(l.grad_workers, (std::vector<int>{0, 1})) << "every rank preconditions";
  // Threshold 0: nothing redundant; threshold above every dimension: nothing broadcast.
  for (const auto& l : assign_spd(kLayers, 4, 0).layers) EXPECT_TRUE(l.a_worker >= 0 && l.g_worker >= 0);
  for (const auto& l : assign_spd(kLayers, 4, 30).layers) EXPECT_TRUE(l.a_worker == kEveryRank && l.g_worker == kEveryRank);
}

// DP-KFAC: one owner per layer (W = 1), LPT on dim^3 of A and G together.
TEST(DpAssignment, OneOwnerPerLayer) {
  auto a = assign_dp(kLayers, 2);
  EXPECT_EQ(a.grad_workers, 1);
  // Costs: l1 27512 -> rank 0; l2 16000 -> rank 1; l0 1064 -> rank 1; l3 152 -> rank 1 (17064 < 27512).
  const std::vector<int> owners = {1, 0, 1, 1};
  for (size_t i = 0; i < owners.size(); ++i) {
    EXPECT_EQ(a.layers[i].a_worker, owners[i]) << i;
    EXPECT_EQ(a.layers[i].g_worker, owners[i]) << i;
    EXPECT_EQ(a.layers[i].grad_workers, std::vector<int>{owners[i]}) << i;
    EXPECT_EQ(a.grad_source_for(i, 1 - owners[i]), owners[i]) << "the owner broadcasts V to everyone";
  }
}

TEST(RedundantThreshold, LargestDimensionCheaperToDecomposeThanToBroadcast) {
  // c d^3 <= alpha + beta b d^2 with c = 1e-9, alpha = 1e-3, beta b = 0: d^3 <= 1e6 -> d = 100.
  EXPECT_EQ(redundant_dim_threshold(1e-9, {1e-3, 0.0}, 4.0), 100);
  // alpha = 0, beta b = 4e-7: c d <= 4e-7 -> d <= 400.
  EXPECT_EQ(redundant_dim_threshold(1e-9, {0.0, 1e-7}, 4.0), 400);
  // Decomposition far more expensive than any broadcast: nothing is redundant.
  EXPECT_EQ(redundant_dim_threshold(1.0, {1e-6, 1e-9}, 4.0), 0);
}

TEST(Fusion, MergesWhenWaitingBeatsAStartUp) {
  // Start-up dominates (alpha 1 ms, tensors 1 us apart, tiny payloads): one group.
  EXPECT_EQ(fuse_groups({0, 1e-6, 2e-6, 3e-6}, {8, 8, 8, 8}, {1e-3, 1e-9}), (std::vector<int64_t>{4}));
  // Tensors far apart (10 ms) compared with alpha (1 us): each goes alone, overlapping compute.
  EXPECT_EQ(fuse_groups({0, 1e-2, 2e-2}, {8, 8, 8}, {1e-6, 1e-9}), (std::vector<int64_t>{1, 1, 1}));
  // Worked by hand, alpha = 1 ms, beta = 0, ready at 0, 0.5, 5, 5.2 ms (end times in ms):
  //   {0} alone ends 1, the next alone then ends 2; merged ends 1.5 -> merge.
  //   {0,1} alone ends 1.5, the next alone then ends 6; merged ends 6 -> merge (a tie merges).
  //   {0,1,2} alone ends 6, the next alone then ends 7; merged ends 6.2 -> merge: one group of 4.
  EXPECT_EQ(fuse_groups({0, 5e-4, 5e-3, 5.2e-3}, {8, 8, 8, 8}, {1e-3, 0.0}), (std::vector<int64_t>{4}));
  // With a large payload, splitting lets the first part travel while the rest is computed:
  // beta 1 ns/B, 4 MB each (4 ms), alpha 0.1 ms, ready 0 and 4 ms:
  //   alone: 0 + 4.1 = 4.1, then max(4, 4.1) + 4.1 = 8.2; merged: 4 + 8.1 = 12.1 -> separate.
  EXPECT_EQ(fuse_groups({0, 4e-3}, {4000000, 4000000}, {1e-4, 1e-9}), (std::vector<int64_t>{1, 1}));
  EXPECT_TRUE(fuse_groups({}, {}, {}).empty());
}

}  // namespace
}  // namespace dkfac::assign
