#include "dkfac/strategy/step_plan.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "dkfac/comm/packing.h"
#include "dkfac/strategy/prediction.h"

namespace dkfac::strategy {
namespace {

const std::vector<assign::LayerShape> kLayers = {{"l0", 10, 4}, {"l1", 30, 8}, {"l2", 20, 20}, {"l3", 5, 3}};

TEST(StepPlan, OneProcessDoesEverythingAndMovesNothing) {
  for (const auto& options : {Options(), Options().strategy(Strategy::kSpd), Options().strategy(Strategy::kDp)}) {
    const auto plan = make_step_plan(kLayers, 1, options);
    EXPECT_EQ(plan.world_size(), 1);
    EXPECT_EQ(plan.reduction, FactorReduction::kNone);
    EXPECT_FALSE(plan.shares_second_order());
    EXPECT_FALSE(plan.broadcast_gradients);
    for (size_t i = 0; i < kLayers.size(); ++i) {
      EXPECT_TRUE(plan.builds_factors(i, 0) && plan.computes_a(i, 0) && plan.computes_g(i, 0) &&
                  plan.preconditions(i, 0));
    }
    const auto cost = predict(plan, 4, 8);
    EXPECT_EQ(cost[0].factor_bytes + cost[0].second_order_bytes + cost[0].gradient_bytes, 0);
    EXPECT_NE(plan.describe().find("single process"), std::string::npos) << plan.describe();
    EXPECT_EQ(plan.strategy, options.strategy()) << "recorded, though it places nothing";
  }
}

TEST(StepPlan, KaisaHybridBroadcastsInColumnsAndAlongRows) {
  const auto plan = make_step_plan(kLayers, 4, Options().grad_worker_fraction(0.5).symmetric_comm(true));
  EXPECT_EQ(plan.strategy, Strategy::kKaisa);
  EXPECT_EQ(plan.grad_workers(), 2);
  EXPECT_EQ(plan.reduction, FactorReduction::kHookBuckets);  // update_factors_in_hook is the default
  EXPECT_EQ(plan.bucket_cap_mb, 25.0);
  EXPECT_TRUE(plan.factor_triangles && plan.inverse_triangles && plan.broadcast_gradients);
  for (size_t i = 0; i < kLayers.size(); ++i) {
    const auto& placed = plan.placement.layers[i];
    EXPECT_EQ(plan.flows[i].factor_builder, assign::kEveryRank);
    EXPECT_TRUE(plan.flows[i].broadcast_a && plan.flows[i].broadcast_g) << "W = 2: the column's other rank needs it";
    for (int rank = 0; rank < 4; ++rank) {
      EXPECT_TRUE(plan.builds_factors(i, rank));
      EXPECT_EQ(plan.computes_a(i, rank), placed.a_worker == rank);
      // V comes from the grad worker in the rank's own row.
      EXPECT_EQ(plan.placement.row_of(plan.gradient_source(i, rank)), plan.placement.row_of(rank));
    }
  }
  EXPECT_EQ(make_step_plan(kLayers, 4, Options().update_factors_in_hook(false)).reduction, FactorReduction::kAllreduce);
  // COMM-OPT: every rank preconditions; second order still broadcast inside the one column (the world).
  const auto comm_opt = make_step_plan(kLayers, 4, Options());
  EXPECT_FALSE(comm_opt.broadcast_gradients);
  EXPECT_TRUE(comm_opt.shares_second_order());
  // MEM-OPT: one rank per column: nothing to broadcast inside it.
  EXPECT_FALSE(make_step_plan(kLayers, 4, Options().grad_worker_fraction(0.25)).shares_second_order());
}

TEST(StepPlan, SpdDecomposesSmallFactorsEverywhere) {
  const auto plan = make_step_plan(kLayers, 2, Options().strategy(Strategy::kSpd), /*measured_redundant_dim=*/8);
  EXPECT_EQ(plan.reduction, FactorReduction::kSpdPipeline);
  EXPECT_EQ(plan.redundant_dim, 8);
  EXPECT_TRUE(plan.factor_triangles && plan.inverse_triangles);
  EXPECT_FALSE(plan.broadcast_gradients);
  // l3 [5, 3]: both below 8, decomposed on every rank, nothing broadcast; l2 [20, 20]: both broadcast.
  EXPECT_FALSE(plan.flows[3].broadcast_a || plan.flows[3].broadcast_g);
  EXPECT_TRUE(plan.computes_a(3, 0) && plan.computes_a(3, 1));
  EXPECT_TRUE(plan.flows[2].broadcast_a && plan.flows[2].broadcast_g);
  EXPECT_NE(plan.describe().find("l3 [a=5, g=3]: factors on every rank; A on every rank, G on every rank"),
            std::string::npos)
      << plan.describe();
  // The option, when set, wins over a measurement; without either there is no plan.
  EXPECT_EQ(make_step_plan(kLayers, 2, Options().strategy(Strategy::kSpd).spd(SpdOptions().redundant_dim(3)), 8)
                .redundant_dim,
            3);
  EXPECT_THROW(make_step_plan(kLayers, 2, Options().strategy(Strategy::kSpd)), c10::Error);
  // Fusion: profiled for SpdOptions::profile_steps factor steps, unless the groups are given.
  EXPECT_EQ(plan.profile_steps, 3);
  EXPECT_NE(plan.describe().find("after 3 profiled factor step(s)"), std::string::npos) << plan.describe();
  const auto given = make_step_plan(kLayers, 2, Options().strategy(Strategy::kSpd).spd(SpdOptions().fusion({4, 4})), 8);
  EXPECT_EQ(given.fusion, (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(given.profile_steps, 0);
  EXPECT_NE(given.describe().find("fused in the given groups of [4, 4] factors"), std::string::npos) << given.describe();
  // Every factor below the threshold: nothing broadcast, the threshold still said.
  const auto all_redundant = make_step_plan(kLayers, 2, Options().strategy(Strategy::kSpd), 30);
  EXPECT_FALSE(all_redundant.shares_second_order());
  EXPECT_NE(all_redundant.describe().find("factors of dim <= 30 decomposed on every rank"), std::string::npos);
}

TEST(StepPlan, DpOwnersBuildKeepAndBroadcastV) {
  const auto plan = make_step_plan(kLayers, 2, Options().strategy(Strategy::kDp));
  EXPECT_EQ(plan.reduction, FactorReduction::kNone);
  EXPECT_EQ(plan.grad_workers(), 1);
  EXPECT_TRUE(plan.broadcast_gradients);
  EXPECT_FALSE(plan.shares_second_order());
  for (size_t i = 0; i < kLayers.size(); ++i) {
    const int owner = plan.placement.layers[i].a_worker;
    EXPECT_EQ(plan.flows[i].factor_builder, owner);
    EXPECT_TRUE(plan.builds_factors(i, owner));
    EXPECT_FALSE(plan.builds_factors(i, 1 - owner));
    EXPECT_EQ(plan.gradient_source(i, 1 - owner), owner);
  }
  const auto cost = predict(plan, 4, 1);
  EXPECT_EQ(cost[0].factor_bytes + cost[1].factor_bytes, 0) << "DP-KFAC reduces no factor";
  EXPECT_EQ(cost[0].gradient_bytes, 4 * (10 * 4 + 30 * 8 + 20 * 20 + 5 * 3));
}

std::vector<assign::LayerShape> sharded(std::vector<assign::LayerShape> shapes) {
  for (auto& shape : shapes) shape.sharded = true;
  return shapes;
}

TEST(StepPlan, OwnerPlacementKeepsEachLayerWithItsOwnerAndMovesOnlyRows) {
  // FSDP on 4 ranks: one owner per layer (W = 1), rows gathered to it and scattered back, nothing broadcast.
  const auto options = Options().grad_worker_fraction(0.0).sharded_placement(ShardedPlacement::kOwner);
  const auto plan = make_step_plan(sharded(kLayers), 4, options);
  const auto replicated = make_step_plan(sharded(kLayers), 4, Options().grad_worker_fraction(0.0));
  EXPECT_EQ(plan.shard_ranks, 4);
  const auto cost = predict(plan, 4, 1);
  const auto kept = predict(replicated, 4, 1);
  int64_t owned_memory = 0;
  for (size_t i = 0; i < kLayers.size(); ++i) {
    const int owner = plan.placement.layers[i].a_worker;
    EXPECT_TRUE(plan.flows[i].owner_rows);
    EXPECT_FALSE(replicated.flows[i].owner_rows);
    for (int rank = 0; rank < 4; ++rank) {
      EXPECT_TRUE(plan.builds_factors(i, rank)) << "every rank's batch goes into the factors";
      EXPECT_EQ(plan.keeps_factors(i, rank), rank == owner) << "layer " << i << ", rank " << rank;
      EXPECT_TRUE(replicated.keeps_factors(i, rank));
    }
  }
  for (int rank = 0; rank < 4; ++rank) {
    owned_memory += cost[rank].memory_bytes;
    EXPECT_LT(cost[rank].memory_bytes, kept[rank].memory_bytes) << "rank " << rank;
    int64_t rows = 0;  // what this rank's rows cost: 2 (g a / 4) per layer, 2 (3 g a / 4) for the layers it owns
    for (size_t i = 0; i < kLayers.size(); ++i) {
      const int64_t ga = kLayers[i].g_dim * kLayers[i].a_dim;
      rows += 2 * 4 * ga * (plan.placement.layers[i].a_worker == rank ? 3 : 1) / 4;
    }
    EXPECT_EQ(cost[rank].gradient_bytes, rows) << "rank " << rank;
  }
  // The state the replicated placement holds on every rank, each layer's once over the ranks: its factors as
  // held, plus the owner's second-order state (the same in both).
  int64_t factors = 0;
  for (const auto& l : kLayers) factors += 4 * (l.a_dim * l.a_dim + l.g_dim * l.g_dim);
  int64_t replicated_memory = 0;
  for (int rank = 0; rank < 4; ++rank) replicated_memory += kept[rank].memory_bytes;
  EXPECT_EQ(owned_memory, replicated_memory - 3 * factors) << "the factors once, not on all 4 ranks";
  EXPECT_NE(plan.describe().find("sharded layers (4 of 4): owner"), std::string::npos) << plan.describe();
}

TEST(StepPlan, OwnerPlacementOnHsdpHasOneOwnerPerReplica) {
  // HSDP 2 x 2: W = 2 grad workers per layer, one in each row of 2 ranks (a shard group).
  const auto options = Options().grad_worker_fraction(0.5).sharded_placement(ShardedPlacement::kOwner);
  const auto plan = make_step_plan(sharded(kLayers), 4, options);
  EXPECT_EQ(plan.shard_ranks, 2);
  for (size_t i = 0; i < kLayers.size(); ++i) {
    int keepers = 0;
    for (int rank = 0; rank < 4; ++rank) {
      keepers += plan.keeps_factors(i, rank) ? 1 : 0;
      EXPECT_EQ(plan.keeps_factors(i, rank), plan.preconditions(i, rank));
      const int owner = plan.gradient_source(i, rank);
      EXPECT_EQ(plan.placement.row_of(owner), plan.placement.row_of(rank)) << "the owner is in the rank's row";
    }
    EXPECT_EQ(keepers, 2) << "layer " << i;
  }
}

// Owner placement sends each layer's factors to its owners alone where rows have 3 ranks or more: factor_destination
// names the owners' column, KAISA's buckets are formed apart for each one (a collective has one root), and an owner's
// column sums (HSDP 2 x 3, W = 2) add to what it hands to collectives; FSDP (W = 1) has none. Rows of 2 (HSDP 2 x 2)
// keep the world's allreduce.
TEST(StepPlan, OwnerPlacementSumsEachLayersFactorsIntoItsOwners) {
  for (const auto& [world, fraction] : std::vector<std::pair<int, double>>{{4, 0.0}, {6, 1.0 / 3}, {4, 0.5}}) {
    const auto options = Options().grad_worker_fraction(fraction).sharded_placement(ShardedPlacement::kOwner);
    const auto plan = make_step_plan(sharded(kLayers), world, options);
    const auto replicated = make_step_plan(sharded(kLayers), world, Options().grad_worker_fraction(fraction));
    const bool reduces = world / plan.grad_workers() >= 3;
    std::vector<int> destinations;
    std::vector<int64_t> bytes;
    for (size_t slot = 0; slot < 2 * kLayers.size(); ++slot) {
      const size_t i = slot < kLayers.size() ? slot : 2 * kLayers.size() - 1 - slot;
      EXPECT_EQ(plan.factor_destination(i),
                reduces ? plan.placement.column_of(plan.placement.layers[i].grad_workers[0]) : -1);
      EXPECT_EQ(replicated.factor_destination(i), -1);
      destinations.push_back(plan.factor_destination(i));
      bytes.push_back(100);
    }
    const auto buckets = factor_buckets(bytes, destinations, /*cap_bytes=*/250);
    std::vector<size_t> seen;
    for (size_t b = 0; b < buckets.size(); ++b) {
      EXPECT_LE(buckets[b].size(), 2u) << "at most 250 bytes";
      if (b > 0) EXPECT_LT(buckets[b - 1].front(), buckets[b].front()) << "ordered by their first slot";
      for (const size_t slot : buckets[b]) {
        EXPECT_EQ(destinations[slot], destinations[buckets[b].front()]) << "one root per bucket";
        seen.push_back(slot);
      }
    }
    std::sort(seen.begin(), seen.end());
    EXPECT_EQ(seen.size(), 2 * kLayers.size());
    EXPECT_EQ(std::adjacent_find(seen.begin(), seen.end()), seen.end()) << "each slot once";
    const auto cost = predict(plan, 4, 1);
    const auto kept = predict(replicated, 4, 1);
    for (int rank = 0; rank < world; ++rank) {
      int64_t column_sums = 0;  // the layers it owns, again, where W > 1
      for (size_t i = 0; i < kLayers.size() && reduces && plan.grad_workers() > 1; ++i) {
        const auto& l = kLayers[i];
        if (plan.preconditions(i, rank)) column_sums += 4 * (l.a_dim * l.a_dim + l.g_dim * l.g_dim);
      }
      EXPECT_EQ(cost[rank].factor_bytes, kept[rank].factor_bytes + column_sums) << world << " rank " << rank;
    }
    EXPECT_EQ(plan.describe().find("the row's factors are summed into it (a reduce") != std::string::npos, reduces)
        << plan.describe();
  }
  // One destination: kfac_pytorch's buckets (comm::bucket_groups).
  const std::vector<int64_t> bytes = {100, 200, 50, 300, 10};
  const auto one = factor_buckets(bytes, std::vector<int>(bytes.size(), -1), 300);
  std::vector<int64_t> sizes;
  for (const auto& bucket : one) sizes.push_back(static_cast<int64_t>(bucket.size()));
  EXPECT_EQ(sizes, comm::bucket_groups(bytes, 300));
}

// Replicated placement on HSDP 2 x 2: each sharded gradient is all-gathered over its shard group of 2, which the
// plan takes from make_step_plan (nothing patches it afterwards); the 1-D mesh's group is the world.
TEST(StepPlan, ReplicatedPlacementTakesItsShardGroup) {
  const auto options = Options().grad_worker_fraction(1.0);
  const auto fsdp = make_step_plan(sharded(kLayers), 4, options);
  const auto hsdp = make_step_plan(sharded(kLayers), 4, options, -1, 2);
  EXPECT_EQ(fsdp.shard_ranks, 4);
  EXPECT_EQ(hsdp.shard_ranks, 2);
  int64_t values = 0;
  for (const auto& shape : kLayers) values += shape.g_dim * shape.a_dim;
  // Each rank gathers the (S - 1) / S of every gradient it lacks; W = P: no gradient broadcast.
  EXPECT_EQ(predict(fsdp, 4, 8)[0].gradient_bytes, 4 * values * 3 / 4);
  EXPECT_EQ(predict(hsdp, 4, 8)[0].gradient_bytes, 4 * values * 1 / 2);
  EXPECT_THROW(make_step_plan(sharded(kLayers), 4, options, -1, 3), c10::Error);
}

TEST(StepPlan, RejectsBadOptions) {
  EXPECT_THROW(make_step_plan(kLayers, 4, Options().strategy(Strategy::kSpd).sharded_placement(ShardedPlacement::kOwner)),
               c10::Error);
  EXPECT_THROW(make_step_plan(kLayers, 4, Options().grad_worker_fraction(0.75)), c10::Error);
  EXPECT_THROW(make_step_plan(kLayers, 2, Options().spd(SpdOptions().profile_steps(0))), c10::Error);
}

}  // namespace
}  // namespace dkfac::strategy

namespace dkfac::strategy {
namespace {

// Options::stack_layers' grouping, the one rule LayerGroups and the time model both use: units whole (a shared A
// side's layers all held, not diagonal, of the leader's g and kind), one group per (g, a, share, kind) in the order
// its first unit appears, groups of one layer left out; and the units one batch takes.
TEST(StackGroups, WholeUnitsOfOneShapeAndKindInOrder) {
  std::vector<StackCandidate> layers(12);
  const auto set = [&](size_t i, bool held, int64_t g, int64_t a, bool diagonal = false, int leader = -1,
                       std::string kind = {}) { layers[i] = {held, g, a, diagonal, leader, std::move(kind)}; };
  set(0, true, 64, 65);
  set(1, true, 64, 65);
  set(2, false, 64, 65);                   // not held here
  set(3, true, 64, 129);                   // a unit: 3 and 4
  set(4, true, 64, 129, false, 3);
  set(5, true, 64, 129);                   // its follower has another g: not whole, neither stacked
  set(6, true, 32, 129, false, 5);
  set(7, true, 64, 65, true);              // diagonal
  set(8, true, 64, 65, false, -1, "x");    // another kind, alone in its group: left out
  set(9, true, 64, 129);                   // a second unit of share 2: 9 and 10
  set(10, true, 64, 129, false, 9);
  set(11, true, 10, 65);                   // alone
  const auto groups = stack_groups(layers);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].share, 1);
  EXPECT_EQ(groups[0].units, (std::vector<size_t>{0, 1}));
  EXPECT_EQ(groups[0].members, (std::vector<size_t>{0, 1}));
  EXPECT_EQ(groups[1].share, 2);
  EXPECT_EQ(groups[1].units, (std::vector<size_t>{3, 9}));
  EXPECT_EQ(groups[1].members, (std::vector<size_t>{3, 4, 9, 10}));
  set(10, false, 64, 129, false, 9);       // a follower not held: its unit leaves; 3's unit (two layers) stays
  const auto fewer = stack_groups(layers);
  ASSERT_EQ(fewer.size(), 2u);
  EXPECT_EQ(fewer[1].units, (std::vector<size_t>{3}));
  EXPECT_EQ(fewer[1].members, (std::vector<size_t>{3, 4}));
  set(0, false, 64, 65);                   // one layer of (64, 65) left: no group of it
  EXPECT_EQ(stack_groups(layers).size(), 1u);

  EXPECT_EQ(stacked_batch_units(2048, 2048, 1, 4), 4);  // 16 MiB a layer in 64 MiB
  EXPECT_EQ(stacked_batch_units(1024, 1024, 2, 4), 4);  // two gradients and the A side repeated: 16 MiB a unit
  EXPECT_EQ(stacked_batch_units(8192, 4096, 1, 4), 1);  // 128 MiB: one layer a batch all the same
}

}  // namespace
}  // namespace dkfac::strategy
