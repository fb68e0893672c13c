// Strategy auto: the rates' fits, the time model against hand sums, and choose_strategy's decisions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>
#include <thread>

#include "dkfac/comm/communicator.h"

#include "dkfac/strategy/candidates.h"
#include "dkfac/strategy/measure.h"
#include "dkfac/strategy/prediction.h"
#include "dkfac/strategy/rates.h"
#include "dkfac/strategy/time_model.h"
#include "tests/multi_rank.h"
#include "tests/strategy/uniform_rates.h"

namespace dkfac::strategy {
namespace {

std::vector<assign::LayerShape> shapes() {
  using math::FactorKernel;
  return {{"conv1", 28, 16, 64, FactorKernel::kConvUnfold, FactorKernel::kConvGradient},
          {"conv2", 145, 32, 16, FactorKernel::kConvPatches, FactorKernel::kConvGradient},
          {"fc1", 513, 128, 1},
          {"fc2", 129, 10, 1}};
}

/// testing::uniform_rates on `world` ranks for Options' default method (eigen), in float32.
Rates rates(double seconds_per_flop, double alpha, double beta, int world = 4) {
  return testing::uniform_rates(seconds_per_flop, alpha, beta, world, ComputeMethod::kEigen, c10::kFloat);
}

int64_t update_bytes(const StepPlan& plan) {
  int64_t most = 0;
  for (const auto& r : predict(plan, 4, 32)) most = std::max(most, r.factor_bytes + r.second_order_bytes + r.gradient_bytes);
  return most;
}

TEST(Rates, NonNegativeFitRecoversCoefficientsAndDropsNegativeOnes) {
  std::vector<std::vector<double>> x;
  std::vector<double> t;
  for (double n : {1.0, 10.0, 100.0, 1000.0}) {
    x.push_back({1.0, n});
    t.push_back(2e-3 + 5e-6 * n);
  }
  auto c = fit_nonnegative(x, t);
  EXPECT_NEAR(c[0], 2e-3, 1e-9);
  EXPECT_NEAR(c[1], 5e-6, 1e-12);
  // A decreasing trend has no non-negative slope: the fit keeps the intercept alone.
  c = fit_nonnegative(x, {4.0, 3.0, 2.0, 1.0});
  EXPECT_EQ(c[1], 0.0);
  EXPECT_GT(c[0], 0.0);
}

TEST(Rates, DecompositionTableInterpolatesAndExtrapolates) {
  DecompositionRate d;
  d.dims = {16, 64, 256};
  d.seconds = {1e-5, 1e-4, 4e-3};
  EXPECT_DOUBLE_EQ(d.seconds_for(64), 1e-4);
  EXPECT_DOUBLE_EQ(d.seconds_for(4), 1e-5);  // latency-bound: the smallest point's time
  EXPECT_NEAR(d.seconds_for(32), std::sqrt(1e-5 * 1e-4), 1e-12);  // log-log midpoint
  EXPECT_NEAR(d.seconds_for(512), 4e-3 * 8, 1e-12);  // d^3 beyond the table
  DecompositionRate fit;
  fit.latency = 1e-4;
  fit.per_cubed_dim = 1e-9;
  EXPECT_DOUBLE_EQ(fit.seconds_for(100), 1e-4 + 1e-3);
}

TEST(Rates, GroupsScaleAndAGroupOfOneIsFree) {
  Rates r = rates(0, 1e-3, 1e-9, 4);
  EXPECT_EQ(r.allreduce_seconds(1, 1e6), 0.0);
  EXPECT_DOUBLE_EQ(r.allreduce_seconds(4, 1e6), 1e-3 + 1e-3);
  EXPECT_DOUBLE_EQ(r.broadcast_seconds(4, 1e6), 2e-3);
  EXPECT_NEAR(r.broadcast_seconds(2, 1e6), 2e-3 / 3, 1e-15);
  r.allreduce.alpha = -1;
  EXPECT_THROW(r.validate(), c10::Error);
}

TEST(TimeModel, SingleProcessIsTheSumOfItsKernels) {
  const Rates r = rates(1e-9, 0, 0, 1);
  const auto plan = StepPlan::single_process(shapes(), ComputeMethod::kInverse);
  double expected = 0;
  for (const auto& s : shapes()) {
    const double rows = 32.0 * s.rows_per_sample;
    expected += 1e-9 * 2 * rows * (s.a_dim * s.a_dim + s.g_dim * s.g_dim);                  // factors
    expected += 1e-9 * (std::pow(s.a_dim, 3) + std::pow(s.g_dim, 3));                        // inverses
    expected += 1e-9 * 2.0 * s.g_dim * s.a_dim * (s.g_dim + s.a_dim);                          // precondition
  }
  const auto t = predict_time(plan, r, 32, {1, 1});
  EXPECT_NEAR(t.step_seconds, expected, 1e-12);
  ASSERT_EQ(t.ranks.size(), 1u);
  EXPECT_NEAR(t.ranks[0].total(), expected, 1e-12);
  // Factors every 10 steps and inverses every 100: those phases count 1/10 and 1/100 per step.
  const auto sparse = predict_time(plan, r, 32, {10, 100});
  EXPECT_NEAR(sparse.ranks[0].factor_build, t.ranks[0].factor_build / 10, 1e-15);
  EXPECT_NEAR(sparse.ranks[0].decomposition, t.ranks[0].decomposition / 100, 1e-15);
  EXPECT_NEAR(sparse.step_seconds, sparse.ranks[0].total(), 1e-12);
}

// Options::eigh_interval k: each second-order update is priced as the average of one full decomposition and k - 1
// refreshes (Rates::refresh); a refresh not measured (rates given by hand) is priced as a full decomposition.
TEST(TimeModel, EighIntervalAveragesFullDecompositionsAndRefreshes) {
  Rates r = rates(1e-9, 0, 0, 1);
  auto plan = StepPlan::single_process(shapes(), ComputeMethod::kEigen);
  const double full = predict_time(plan, r, 32, {1, 1}).ranks[0].decomposition;
  double expected_full = 0;
  for (const auto& s : shapes()) expected_full += 1e-9 * (std::pow(s.a_dim, 3) + std::pow(s.g_dim, 3));
  EXPECT_NEAR(full, expected_full, 1e-12);
  plan.eigh_interval = 4;
  EXPECT_DOUBLE_EQ(predict_time(plan, r, 32, {1, 1}).ranks[0].decomposition, full) << "refresh not measured";
  r.refresh.per_cubed_dim = 0.25e-9;
  EXPECT_NEAR(predict_time(plan, r, 32, {1, 1}).ranks[0].decomposition, full * (1 + 3 * 0.25) / 4, 1e-12);
  EXPECT_NEAR(r.second_order_seconds(100, 4), (1e-3 + 3 * 0.25e-3) / 4, 1e-15);
  EXPECT_DOUBLE_EQ(r.second_order_seconds(100, 1), 1e-3);
  // A profiled step is priced as what it was: a full decomposition or a refresh (the re-check's calibration).
  const double full_step = predict_step_seconds(plan, r, 32, {false, true, false});
  const double refresh_step = predict_step_seconds(plan, r, 32, {false, true, true});
  const double plain_step = predict_step_seconds(plan, r, 32, {false, false, false});
  EXPECT_NEAR(full_step - plain_step, full, 1e-12);
  EXPECT_NEAR(refresh_step - plain_step, full * 0.25, 1e-12);
  r.refresh.dims = {16, 64};
  r.refresh.seconds = {1.0};
  EXPECT_THROW(r.validate(), c10::Error) << "a refresh table of 2 dims and 1 time";
}

// Options::second_order_lag k: each update's decompositions (D seconds) run beside the next w = min(k, inverse
// interval) steps, whose own work is W = w x the non-update step's: the inverse step pays max(side_work_cost x D,
// D - W). Unmeasured (cost 1), that is the exact mode's price.
TEST(TimeModel, SecondOrderLagPaysTheSideWorksShareOrTheWaitAtInstallation) {
  Rates r = rates(1e-9, 0, 0, 1);
  auto plan = StepPlan::single_process(shapes(), ComputeMethod::kEigen);
  plan.stack_layers = false;
  const auto exact = predict_time(plan, r, 32, {1, 10});
  const double decompose = 10 * exact.ranks[0].decomposition;  // one update's seconds
  ASSERT_GT(decompose, 0.0);
  plan.second_order_lag = 3;
  const auto unmeasured = predict_time(plan, r, 32, {1, 10});
  EXPECT_DOUBLE_EQ(unmeasured.step_seconds, exact.step_seconds) << "side_work_cost 1: priced as the exact mode";
  r.side_work_cost = 0.25;
  // Each of the 4 layers' products costs `fixed`: the window is 3 steps x 4 x fixed.
  const auto with_products = [&](double fixed) {
    r.precondition = {fixed, 0};
    return predict_time(plan, r, 32, {1, 10});
  };
  auto t = with_products(decompose / 24);  // W = D / 2: the update outlasts its window, the step waits D / 2
  EXPECT_NEAR(t.ranks[0].decomposition, 0.5 * decompose / 10, 1e-15);
  t = with_products(decompose);  // W = 12 D: it hides, but for the share the steps lose beside it
  EXPECT_NEAR(t.ranks[0].decomposition, 0.25 * decompose / 10, 1e-15);
  EXPECT_NEAR(t.step_seconds, t.ranks[0].total(), 1e-12);
  r.side_work_cost = 0;
  EXPECT_EQ(with_products(decompose).ranks[0].decomposition, 0.0) << "beside free compute, an update costs nothing";
  // The next inverse step installs an update still in flight: at an interval of 2, the window is 2 steps.
  r.side_work_cost = 0.25;
  r.precondition = {decompose / 24, 0};
  EXPECT_NEAR(predict_time(plan, r, 32, {1, 2}).ranks[0].decomposition, (decompose - decompose / 3) / 2, 1e-15);
  // A profiled inverse step is priced with the plan's whole lag, its kind alone.
  const double inverse_step = predict_step_seconds(plan, r, 32, {false, true});
  const double plain_step = predict_step_seconds(plan, r, 32, {false, false});
  EXPECT_NEAR(inverse_step - plain_step, 0.5 * decompose, 1e-12);
  // strategy auto's candidates carry the option: with the lag, every candidate that decomposes is cheaper.
  r.precondition = {decompose, 0};
  r.side_work_cost = 0;
  const Options base = Options().second_order_lag(3);
  const auto lagged = choose_strategy(shapes(), 1, base, r, kNoMemoryBudget, 32, {1, 10});
  const auto at_once = choose_strategy(shapes(), 1, Options(), r, kNoMemoryBudget, 32, {1, 10});
  ASSERT_EQ(lagged.candidates.size(), at_once.candidates.size());
  for (size_t k = 0; k < lagged.candidates.size(); ++k) {
    EXPECT_LT(lagged.candidates[k].time.step_seconds, at_once.candidates[k].time.step_seconds)
        << lagged.candidates[k].name;
  }
}

// Under the lag, full decompositions and refreshes (Options::eigh_interval) are each priced so, then averaged: a
// refresh that hides behind its window does not hide a full decomposition that outlasts it.
TEST(TimeModel, SecondOrderLagPricesFullDecompositionsAndRefreshesEachAlone) {
  Rates r = rates(1e-9, 0, 0, 1);
  r.refresh.per_cubed_dim = 0.1e-9;
  r.side_work_cost = 0;
  auto plan = StepPlan::single_process(shapes(), ComputeMethod::kEigen);
  plan.stack_layers = false;
  plan.eigh_interval = 10;
  const double full = predict_step_seconds(plan, r, 32, {false, true, false}) -
                      predict_step_seconds(plan, r, 32, {false, false, false});
  ASSERT_GT(full, 0.0);
  r.precondition = {full / 8, 0};  // 4 layers: W = 2 steps x full / 2 = full, 10 refreshes' worth
  plan.second_order_lag = 2;
  // A full decomposition (full) outlasts W by nothing, a refresh (full / 10) hides: 0 for both.
  EXPECT_NEAR(predict_time(plan, r, 32, {1, 10}).ranks[0].decomposition, 0.0, 1e-15);
  r.precondition = {full / 16, 0};  // W = full / 2: the full decomposition waits full / 2, a refresh hides
  EXPECT_NEAR(predict_time(plan, r, 32, {1, 10}).ranks[0].decomposition, (0.5 * full + 9 * 0.0) / 10 / 10, 1e-15)
      << "the average of the kinds' prices, not the price of their average (0.19 full, under W: 0)";
}

// On several ranks the window is each rank's own non-update work: its products and its V broadcasts.
TEST(TimeModel, SecondOrderLagWindowIsEachRanksProductsAndBroadcasts) {
  Rates r = rates(1e-9, 1e-4, 1e-9, 4);
  r.side_work_cost = 0.3;
  const Options options = Options().compute_method(ComputeMethod::kEigen).grad_worker_fraction(0.5);
  const auto exact_plan = make_step_plan(shapes(), 4, options);
  ASSERT_TRUE(exact_plan.broadcast_gradients);
  const auto exact = predict_time(exact_plan, r, 32, {1, 4});
  const auto lagged = predict_time(make_step_plan(shapes(), 4, Options(options).second_order_lag(3)), r, 32, {1, 4});
  bool waits = false, hides = false;
  for (size_t k = 0; k < exact.ranks.size(); ++k) {
    const auto& x = exact.ranks[k];
    ASSERT_GT(x.gradient_comm, 0.0);
    const double decompose = 4 * x.decomposition;
    const double beside = 3 * (x.precondition + x.gradient_comm);
    EXPECT_NEAR(lagged.ranks[k].decomposition, std::max(0.3 * decompose, decompose - beside) / 4, 1e-15) << k;
    waits |= decompose - beside > 0.3 * decompose;
    hides |= decompose > 0 && decompose - beside < 0.3 * decompose;
  }
  EXPECT_TRUE(waits || hides);
}

// Options::stack_layers: the layers of one shape a rank preconditions pay the products' fixed cost once per batch of
// kStackedBatchBytes of gradients (LayerGroups' groups: a shared-input unit whole), the others once each; the FLOPs
// are the same. make_step_plan sets the flag where stacking applies.
TEST(TimeModel, StackedLayersPayTheFixedCostOncePerBatch) {
  Rates r = rates(1e-12, 0, 0, 1);
  r.precondition.seconds = 1e-3;
  // Three 64 x 65 layers, two 64 x 129 layers of a shared-input unit (a follower of the first), one 10 x 65 layer.
  std::vector<assign::LayerShape> layers = {{"a0", 65, 64, 1}, {"a1", 65, 64, 1}, {"a2", 65, 64, 1},
                                            {"q", 129, 64, 1},  {"k", 129, 64, 1}, {"b", 65, 10, 1}};
  layers[4].a_shared_with = 3;
  const auto options = Options().compute_method(ComputeMethod::kInverse).pad_widths(1);  // padded: below
  auto plan = make_step_plan(layers, 1, options);
  ASSERT_TRUE(plan.stack_layers);
  double flops = 0;
  for (const auto& s : layers) flops += 2.0 * s.g_dim * s.a_dim * (s.g_dim + s.a_dim);
  const auto precondition = [&](const StepPlan& p) { return predict_time(p, r, 32, {1, 1}).ranks[0].precondition; };
  // a0-a2: one batch; q and k: one unit, one batch; b: alone.
  EXPECT_NEAR(precondition(plan), 3e-3 + 1e-12 * flops, 1e-12);
  // Padded (pad_widths 8, the default): the stacked layers' products at their padded widths (64 x 72, 64 x 136); b,
  // alone, unpadded; the same batches.
  double padded_flops = 0;
  for (const auto& s : layers) {
    const bool stacked = s.name != "b";
    const double g = stacked ? padded_width(s.g_dim, 8) : s.g_dim;
    const double a = stacked ? padded_width(s.a_dim, 8) : s.a_dim;
    padded_flops += 2.0 * g * a * (g + a);
  }
  EXPECT_NEAR(precondition(make_step_plan(layers, 1, Options(options).pad_widths(8))), 3e-3 + 1e-12 * padded_flops,
              1e-12);
  plan.stack_layers = false;
  EXPECT_NEAR(precondition(plan), 6e-3 + 1e-12 * flops, 1e-12);
  EXPECT_FALSE(make_step_plan(layers, 1, Options(options).stack_layers(false)).stack_layers);
  EXPECT_TRUE(make_step_plan(layers, 1, Options(options).second_order_lag(1)).stack_layers);
  // eigen_adam stacks the bases (its moments stay per layer); the eigen method without the outer product does not.
  EXPECT_TRUE(make_step_plan(layers, 1, Options().eigen_adam(true).kl_clip(0)).stack_layers);
  EXPECT_TRUE(make_step_plan(layers, 1, Options().eigen_adam(true).kl_clip(0).compute_eigenvalue_outer_product(false))
                  .stack_layers);
  EXPECT_FALSE(make_step_plan(layers, 1, Options().compute_eigenvalue_outer_product(false)).stack_layers);
  EXPECT_FALSE(make_step_plan(layers, 2, Options(options).stack_layers(false)).stack_layers);
  EXPECT_TRUE(make_step_plan(layers, 2, options).stack_layers);
  // Layers whose gradients pass kStackedBatchBytes in one batch: a batch per kStackedBatchBytes (float32 here).
  const int64_t d = 2048;
  ASSERT_EQ(kStackedBatchBytes / (d * d * 4), 4);
  plan = make_step_plan(std::vector<assign::LayerShape>(9, {"big", d, d, 1}), 1, options);
  const double per_layer_flops = 1e-12 * 2.0 * d * d * (2.0 * d);
  EXPECT_NEAR(precondition(plan), 3e-3 + 9 * per_layer_flops, 1e-9) << "batches of 4, 4 and 1";
}

TEST(TimeModel, FactorsArePricedByTheKernelThatBuildsThemAndFoldedPerLayer) {
  // Each kernel's rate differs; every factor must be priced at its own kernel's (shapes(): an unfold and a
  // patches convolution, two Linear layers), and each layer built pays one fold.
  Rates r;
  r.factor = {1e-6, 0, 1e-9};
  r.conv_factor = {0, 0, 1e-3};  // row shifts: no layer of shapes() uses it
  r.conv_patches_factor = {2e-6, 1e-8, 2e-9};
  r.conv_unfold_factor = {3e-6, 2e-8, 3e-9};
  r.conv_g_factor = {4e-6, 0, 4e-9};
  r.fold = {5e-6, 1e-9};
  const auto plan = StepPlan::single_process(shapes(), ComputeMethod::kInverse);
  const auto price = [](const FactorRate& rate, double rows, double d) {
    return rate.seconds + rate.per_entry * rows * d + rate.per_flop * 2 * rows * d * d;
  };
  double expected = 0;
  for (const auto& s : shapes()) {
    const double rows = 32.0 * s.rows_per_sample;
    const bool conv = s.rows_per_sample > 1;
    const FactorRate& a_rate = !conv ? r.factor : s.a_dim == 28 ? r.conv_unfold_factor : r.conv_patches_factor;
    expected += price(a_rate, rows, s.a_dim) + price(conv ? r.conv_g_factor : r.factor, rows, s.g_dim);
    expected += 5e-6 + 1e-9 * (s.a_dim * s.a_dim + s.g_dim * s.g_dim);
  }
  EXPECT_NEAR(predict_time(plan, r, 32, {1, 1}).ranks[0].factor_build, expected, 1e-12);
  // Layers a rank does not build (DP-KFAC: the owner's only) cost it neither the factors nor the fold.
  const auto dp = make_step_plan(shapes(), 2, Options().strategy(Strategy::kDp).compute_method(ComputeMethod::kInverse));
  const auto t = predict_time(dp, r, 32, {1, 1});
  EXPECT_NEAR(t.ranks[0].factor_build + t.ranks[1].factor_build, expected, 1e-12);
  EXPECT_LT(t.ranks[0].factor_build, expected);
}

TEST(TimeModel, CalibrateFindsEachGroupsScaleFromMeasuredPhases) {
  // Phases "measured" on a machine where every group of rates is off by its own factor: calibrate recovers
  // the factors, whatever mix of step kinds was profiled, on a plan with sharing, waiting and collectives.
  Rates r = rates(1e-9, 6e-3, 1e-9, 4);  // each group over 10% of the step
  r.fold = {2e-6, 1e-9};
  r.ranks_per_node = 4;
  r.parallel_ranks = 2;
  const auto plan = make_step_plan(shapes(), 4, Options().compute_method(ComputeMethod::kInverse).grad_worker_fraction(0.5));
  constexpr auto kF = KfacPhase::kFactors, kS = KfacPhase::kSecondOrder, kP = KfacPhase::kPrecondition,
                 kC = KfacPhase::kCommunication;
  const auto truth = RateScales::of({{kF, 1.5}, {kS, 0.8}, {kP, 2.0}, {kC, 3.0}});
  // Each group's time as the plan runs it with that group's rates alone, scaled by the truth.
  const auto alone = [&](KfacPhase phase, double scale) {
    auto scales = RateScales::of({{kF, 0}, {kS, 0}, {kP, 0}, {kC, 0}});
    scales[phase] = scale;
    return scales;
  };
  ProfiledSteps measured;
  measured.kinds = {{true, true}, {true, false}, {false, false}, {false, true}};
  for (const auto& kind : measured.kinds) {
    for (const auto phase : kCalibratedPhases) {
      measured.seconds[phase] += predict_step_seconds(plan, scaled(r, alone(phase, truth[phase])), 32, kind);
    }
  }
  const auto got = calibrate(plan, r, 32, measured);
  EXPECT_NEAR(got[kF], 1.5, 1e-9);
  EXPECT_NEAR(got[kS], 0.8, 1e-9);
  EXPECT_NEAR(got[kP], 2.0, 1e-9);
  EXPECT_NEAR(got[kC], 3.0, 1e-9);
  EXPECT_EQ(got[KfacPhase::kApply], 1.0) << "not modelled: not calibrated";
  EXPECT_FALSE(got.within(kRecheckTolerance));
  EXPECT_NE(got.describe().find("factors x1.5, second order x0.8, preconditioning x2, communication x3"),
            std::string::npos)
      << got.describe();
  // A group measured under kLeastCalibratedShare of the phases' sum keeps its scale, however far off its
  // prediction: here the collectives took a sliver of the profiled time.
  ProfiledSteps sliver = measured;
  sliver.seconds[kC] = 0.05 * (measured.seconds[kF] + measured.seconds[kS] + measured.seconds[kP]);
  EXPECT_EQ(calibrate(plan, r, 32, sliver)[kC], 1.0);
  EXPECT_NEAR(calibrate(plan, r, 32, sliver)[kF], 1.5, 1e-9);
  // A group that was not run in the profiled steps (no second-order step) or measured 0 keeps its scale.
  ProfiledSteps plain;
  plain.kinds = {{false, false}};
  plain.seconds[kP] = 2 * predict_step_seconds(plan, scaled(r, alone(kP, 1)), 32, {false, false});
  const auto partial = calibrate(plan, r, 32, plain);
  EXPECT_EQ(partial[kF], 1.0);
  EXPECT_EQ(partial[kS], 1.0);
  EXPECT_NEAR(partial[kP], 2.0, 1e-9);
  EXPECT_EQ(partial[kC], 1.0);  // measured 0
  EXPECT_TRUE(RateScales{}.within(kRecheckTolerance));
  EXPECT_TRUE(RateScales::of({{kF, 1.19}, {kS, 0.81}}).within(kRecheckTolerance));
  EXPECT_FALSE(RateScales::of({{kC, 0.79}}).within(kRecheckTolerance));
}

// Under Options::second_order_lag a profiled step's second-order time is an installation's wait: the decomposition
// rates keep their scale, and the other groups are calibrated as before.
TEST(TimeModel, CalibrateUnderSecondOrderLagLeavesTheDecompositionsScale) {
  Rates r = rates(1e-9, 6e-3, 1e-9, 4);
  r.side_work_cost = 0.5;
  auto plan = make_step_plan(shapes(), 4, Options().compute_method(ComputeMethod::kInverse).grad_worker_fraction(0.5)
                                              .second_order_lag(2));
  ASSERT_EQ(plan.second_order_lag, 2);
  constexpr auto kF = KfacPhase::kFactors, kS = KfacPhase::kSecondOrder, kP = KfacPhase::kPrecondition,
                 kC = KfacPhase::kCommunication;
  const auto truth = RateScales::of({{kF, 1.5}, {kS, 0.8}, {kP, 2.0}, {kC, 3.0}});
  ProfiledSteps measured;
  measured.kinds = {{true, true}, {true, false}, {false, false}, {false, true}};
  for (const auto& kind : measured.kinds) {
    for (const auto phase : kCalibratedPhases) {
      auto only = RateScales::of({{kF, 0}, {kS, 0}, {kP, 0}, {kC, 0}});
      only[phase] = truth[phase];
      measured.seconds[phase] += predict_step_seconds(plan, scaled(r, only), 32, kind);
    }
  }
  ASSERT_GT(measured.seconds[kS], 0.0);
  const auto got = calibrate(plan, r, 32, measured);
  EXPECT_EQ(got[kS], 1.0);
  EXPECT_NEAR(got[kF], 1.5, 1e-9);
  EXPECT_NEAR(got[kP], 2.0, 1e-9);
  EXPECT_NEAR(got[kC], 3.0, 1e-9);
  plan.second_order_lag = 0;
  EXPECT_NEAR(calibrate(plan, r, 32, measured)[kS], 0.8, 1e-9) << "without the lag, the same figures scale it";
}

TEST(TimeModel, ChoosingWithCalibratedRatesFollowsTheMeasuredMachine) {
  // Rates that put the cost in compute pick DP-KFAC (it splits every kernel); a job that then measures its
  // communication 1e6 times the prediction and its compute 1e-3 of it is latency-bound, and the choice with
  // the rates scaled so is the one made from such rates directly.
  const Options base;  // the eigen method, as rates() measured
  const Rates believed = rates(1e-8, 1e-9, 1e-15, 4);
  const auto first = choose_strategy(shapes(), 4, base, believed, kNoMemoryBudget, 32, {1, 1});
  EXPECT_EQ(first.pick().name, "dp") << first.describe();
  const auto measured = RateScales::of({{KfacPhase::kFactors, 1e-3}, {KfacPhase::kSecondOrder, 1e-3},
                                        {KfacPhase::kPrecondition, 1e-3}, {KfacPhase::kCommunication, 1e6}});
  const auto again = choose_strategy(shapes(), 4, base, scaled(believed, measured), kNoMemoryBudget, 32, {1, 1});
  const auto direct = choose_strategy(shapes(), 4, base, rates(1e-11, 1e-3, 1e-9, 4), kNoMemoryBudget, 32, {1, 1});
  EXPECT_NE(again.pick().name, "dp") << again.describe();
  EXPECT_EQ(again.pick().name, direct.pick().name) << again.describe() << direct.describe();
}

TEST(ChooseStrategy, TheRecheckKeepsTheRunningPlanUnlessThePickIsFivePercentFaster) {
  const Options base;
  const auto choice = choose_strategy(shapes(), 4, base, rates(1e-9, 1e-4, 1e-9, 4), kNoMemoryBudget, 32, {1, 1});
  ASSERT_GE(choice.candidates.size(), 2u);
  const auto& pick = choice.pick();
  // The running plan: another candidate, made 4% and then 6% slower than the pick.
  const size_t other = choice.chosen == 0 ? 1 : 0;
  for (const double slower : {1.04, 1.06}) {
    auto again = choice;
    again.candidates[other].time.step_seconds = slower * pick.time.step_seconds;
    const Options running = again.candidates[other].options;
    EXPECT_TRUE(runs_as(again.candidates[other], running));
    EXPECT_FALSE(runs_as(pick, running));
    prefer_running(again, running);
    if (slower < 1.05) {
      EXPECT_EQ(again.chosen, other);
      EXPECT_NE(again.reason.find("kept " + again.candidates[other].name), std::string::npos) << again.reason;
      EXPECT_NE(again.reason.find("less than 5% faster"), std::string::npos) << again.reason;
    } else {
      EXPECT_EQ(again.chosen, choice.chosen);
      EXPECT_EQ(again.reason, choice.reason);
    }
  }
  // A running plan over the budget gives way whatever the gain.
  auto over = choice;
  over.candidates[other].time.step_seconds = pick.time.step_seconds;
  over.candidates[other].fits = false;
  prefer_running(over, over.candidates[other].options);
  EXPECT_EQ(over.chosen, choice.chosen);
}

TEST(TimeModel, CommunicationFollowsThePlansCollectives) {
  // Link only: D-KFAC f=1 in one bucket pays one allreduce of every factor, then each inverse's broadcast.
  const Rates r = rates(0, 1e-3, 1e-9, 4);
  const auto plan = make_step_plan(shapes(), 4, Options().compute_method(ComputeMethod::kInverse));
  ASSERT_EQ(plan.reduction, FactorReduction::kHookBuckets);
  double factor_bytes = 0, broadcasts = 0;
  for (const auto& s : shapes()) {
    factor_bytes += 4.0 * (s.a_dim * s.a_dim + s.g_dim * s.g_dim);
    broadcasts += 2e-3 + 1e-9 * 4.0 * (s.a_dim * s.a_dim + s.g_dim * s.g_dim);
  }
  const auto t = predict_time(plan, r, 32, {1, 1});
  EXPECT_NEAR(t.ranks[0].factor_comm, 1e-3 + 1e-9 * factor_bytes, 1e-12);
  EXPECT_NEAR(t.ranks[0].second_order_comm, broadcasts, 1e-12);
  EXPECT_EQ(t.ranks[0].gradient_comm, 0.0);
  EXPECT_NEAR(t.step_seconds, t.ranks[0].factor_comm + t.ranks[0].second_order_comm, 1e-12);
  // Without buckets (factors reduced in step(), one allreduce each): 8 start-ups instead of one.
  const auto each = make_step_plan(shapes(), 4, Options().update_factors_in_hook(false));
  EXPECT_NEAR(predict_time(each, r, 32, {1, 1}).ranks[0].factor_comm, 8e-3 + 1e-9 * factor_bytes, 1e-12);
}

// Owner placement on FSDP (W = 1, rows of 4): each owner's bucket is a reduce over the world, priced as a ring's (half
// the allreduce's start-ups, N bytes where it sends 2 (P - 1) / P N); on HSDP 2 x 3 (W = 2, rows of 3) a reduce over
// each row, then each owner's share allreduced among the column's 2 owners; rows of 2 keep the world's allreduce.
TEST(TimeModel, OwnerPlacementPricesAReduceToTheOwners) {
  auto layers = shapes();
  for (auto& shape : layers) shape.sharded = true;
  double factor_bytes = 0;
  for (const auto& s : layers) factor_bytes += 4.0 * (s.a_dim * s.a_dim + s.g_dim * s.g_dim);
  const auto owner = Options().compute_method(ComputeMethod::kInverse).sharded_placement(ShardedPlacement::kOwner);
  const auto destinations = [&](const StepPlan& plan) {
    std::set<int> seen;
    for (size_t i = 0; i < layers.size(); ++i) seen.insert(plan.factor_destination(i));
    return static_cast<double>(seen.size());  // one bucket each: the cap is larger than all the factors
  };
  const auto fsdp = make_step_plan(layers, 4, Options(owner).grad_worker_fraction(0.0));
  EXPECT_NEAR(predict_time(fsdp, rates(0, 1e-3, 1e-9, 4), 32, {1, 1}).ranks[0].factor_comm,
              0.5 * destinations(fsdp) * 1e-3 + 1e-9 * factor_bytes * 4 / 6, 1e-12);
  // On k of P = 6 ranks a ring allreduce's start-ups scale by (k - 1) / 5 and its bytes by ((k - 1) / k) / (5 / 6).
  const auto hsdp = make_step_plan(layers, 6, Options(owner).grad_worker_fraction(1.0 / 3));
  ASSERT_EQ(hsdp.grad_workers(), 2);
  const double row = 0.5 * destinations(hsdp) * 1e-3 * 2 / 5 + 1e-9 * factor_bytes * 0.8 * 3 / 4;
  const double column = 1e-3 / 5 + 1e-9 * (factor_bytes / 3) * 0.6;
  EXPECT_NEAR(predict_time(hsdp, rates(0, 1e-3, 1e-9, 6), 32, {1, 1}).ranks[0].factor_comm, row + column, 1e-12);
  const auto rows_of_two = make_step_plan(layers, 4, Options(owner).grad_worker_fraction(0.5));
  EXPECT_EQ(destinations(rows_of_two), 1.0);
  EXPECT_NEAR(predict_time(rows_of_two, rates(0, 1e-3, 1e-9, 4), 32, {1, 1}).ranks[0].factor_comm,
              1e-3 + 1e-9 * factor_bytes, 1e-12);
}

TEST(TimeModel, CollectivesStartedDuringBackwardCostTheBusyLink) {
  // Link only; a collective started while the ranks compute costs ten times as much. The factors' ready
  // order is A in layer order, then G in reverse layer order.
  Rates r = rates(0, 1e-3, 1e-9, 4);
  r.allreduce_busy = {1e-2, 1e-8};
  std::vector<double> slot_bytes;
  for (const auto& s : shapes()) slot_bytes.push_back(4.0 * s.a_dim * s.a_dim);
  for (auto s = shapes().rbegin(); s != shapes().rend(); ++s) slot_bytes.push_back(4.0 * s->g_dim * s->g_dim);
  const auto idle = [&](double bytes) { return 1e-3 + 1e-9 * bytes; };
  const auto busy = [&](double bytes) { return 1e-2 + 1e-8 * bytes; };
  // KAISA with a bucket per factor (cap 0): every bucket but the last is sent from the hooks during backward.
  const auto buckets = make_step_plan(shapes(), 4, Options().allreduce_bucket_cap_mb(0));
  ASSERT_EQ(buckets.reduction, FactorReduction::kHookBuckets);
  double expected = idle(slot_bytes.back());
  for (size_t k = 0; k + 1 < slot_bytes.size(); ++k) expected += busy(slot_bytes[k]);
  EXPECT_NEAR(predict_time(buckets, r, 32, {1, 1}).ranks[0].factor_comm, expected, 1e-12);
  // SPD-KFAC (upper triangles) fused into two groups of four: the first during backward, the second after it.
  const auto spd =
      make_step_plan(shapes(), 4, Options().strategy(Strategy::kSpd).spd(SpdOptions().fusion({4, 4}).redundant_dim(0)));
  ASSERT_EQ(spd.reduction, FactorReduction::kSpdPipeline);
  std::vector<double> triangle_bytes;
  for (double b : slot_bytes) {
    const double n = std::sqrt(b / 4.0);
    triangle_bytes.push_back(4.0 * n * (n + 1) / 2);
  }
  const double first = triangle_bytes[0] + triangle_bytes[1] + triangle_bytes[2] + triangle_bytes[3];
  const double second = triangle_bytes[4] + triangle_bytes[5] + triangle_bytes[6] + triangle_bytes[7];
  EXPECT_NEAR(predict_time(spd, r, 32, {1, 1}).ranks[0].factor_comm, busy(first) + idle(second), 1e-12);
  // Factors reduced after backward, in step(): the idle link, one allreduce each.
  const auto after = make_step_plan(shapes(), 4, Options().update_factors_in_hook(false));
  double each = 0;
  for (double b : slot_bytes) each += idle(b);
  EXPECT_NEAR(predict_time(after, r, 32, {1, 1}).ranks[0].factor_comm, each, 1e-12);
}

TEST(TimeModel, TheJobWaitsForItsSlowestRank) {
  // Compute only, DP-KFAC: each owner builds, inverts and preconditions its layers; V's broadcast makes
  // every rank wait for the busiest owner.
  const Rates r = rates(1e-9, 0, 0, 4);
  const auto plan = make_step_plan(shapes(), 4, Options().strategy(Strategy::kDp).compute_method(ComputeMethod::kInverse));
  const auto t = predict_time(plan, r, 32, {1, 1});
  double slowest = 0;
  for (const auto& x : t.ranks) slowest = std::max(slowest, x.total());
  EXPECT_NEAR(t.step_seconds, slowest, 1e-12);
}

TEST(TimeModel, RanksSharingCoresSlowDownOnlyWhileTheyComputeTogether) {
  // Factors only, on every rank: 4 ranks on a node with 2 full speeds take twice as long as alone.
  Rates r;
  r.world_size = 4;
  r.factor.per_flop = 1e-9;
  r.conv_factor.per_flop = 1e-9;
  r.conv_g_factor.per_flop = 1e-9;
  const auto plan = make_step_plan(shapes(), 4, Options().compute_method(ComputeMethod::kInverse));
  const double alone = predict_time(plan, r, 32, {1, 1000}).step_seconds;
  r.ranks_per_node = 4;
  r.parallel_ranks = 2;
  EXPECT_NEAR(predict_time(plan, r, 32, {1, 1000}).step_seconds, 2 * alone, 1e-9 * alone);
  // Decompositions only: the rank with the largest share finishes alone at full speed once the others
  // are done; sharing costs at most the others' work.
  Rates d;
  d.world_size = 4;
  d.decomposition.per_cubed_dim = 1e-9;
  const auto solo = predict_time(plan, d, 32, {1000, 1});
  d.ranks_per_node = 4;
  d.parallel_ranks = 2;
  const auto shared = predict_time(plan, d, 32, {1000, 1});
  double most = 0, all = 0;
  for (const auto& x : solo.ranks) {
    most = std::max(most, x.decomposition);
    all += x.decomposition;
  }
  EXPECT_NEAR(solo.step_seconds, most, 1e-12);
  EXPECT_GE(shared.step_seconds, most - 1e-12);
  EXPECT_LE(shared.step_seconds, all / 2 + most);
  EXPECT_GE(shared.step_seconds, all / 2 - 1e-12);  // 2 speeds cannot do the total work faster
}

TEST(ChooseStrategy, TheTableListsEveryCandidate) {
  const auto choice = choose_strategy(shapes(), 4, Options(), rates(1e-10, 1e-4, 1e-9), kNoMemoryBudget, 32, {1, 1});
  // W in {4, 2, 1}, each with and without triangles, then SPD-KFAC and DP-KFAC.
  ASSERT_EQ(choice.candidates.size(), 8u);
  std::set<std::string> names;
  const auto text = choice.describe();
  for (const auto& c : choice.candidates) {
    names.insert(c.name);
    EXPECT_NE(text.find(c.name), std::string::npos) << c.name;
    EXPECT_TRUE(c.fits);
    EXPECT_GT(c.time.step_seconds, 0.0);
  }
  EXPECT_EQ(names.size(), 8u);
  EXPECT_EQ(choice.candidates[0].name, "kaisa f=1 (W=4)");
  EXPECT_EQ(choice.candidates[5].name, "kaisa f=1/4 (W=1) triangles");
  EXPECT_NE(text.find(choice.reason), std::string::npos);
  // The pick is the fastest.
  for (const auto& c : choice.candidates) EXPECT_LE(choice.pick().time.step_seconds, c.time.step_seconds);
}

std::vector<std::string> names_of(const std::vector<NamedOptions>& all) {
  std::vector<std::string> names;
  for (const auto& c : all) names.push_back(c.name);
  return names;
}

TEST(Candidates, NamesSayWhatRuns) {
  const auto all = candidates(4, Options());
  EXPECT_EQ(names_of(all), (std::vector<std::string>{"kaisa f=1 (W=4)", "kaisa f=1 (W=4) triangles", "kaisa f=1/2 (W=2)",
                                                     "kaisa f=1/2 (W=2) triangles", "kaisa f=1/4 (W=1)",
                                                     "kaisa f=1/4 (W=1) triangles", "spd", "dp"}));
  for (const auto& c : all) {
    SCOPED_TRACE(c.name);
    c.options.validate();
    const auto plan = make_step_plan(shapes(), 4, c.options, 64);
    if (c.name.rfind("kaisa", 0) == 0) {
      EXPECT_EQ(plan.strategy, Strategy::kKaisa);
      EXPECT_EQ(c.name.find("(W=" + std::to_string(plan.grad_workers()) + ")") != std::string::npos, true);
      EXPECT_EQ(plan.factor_triangles, c.name.find("triangles") != std::string::npos);
    }
  }
  EXPECT_EQ(all[6].options.strategy(), Strategy::kSpd);
  EXPECT_EQ(all[7].options.strategy(), Strategy::kDp);
  // Strategy auto chooses among exactly these.
  const auto choice = choose_strategy(shapes(), 4, Options(), rates(1e-10, 1e-4, 1e-9), kNoMemoryBudget, 32, {1, 1});
  std::vector<std::string> chosen_among;
  for (const auto& c : choice.candidates) chosen_among.push_back(c.name);
  EXPECT_EQ(chosen_among, names_of(all));
}

TEST(Candidates, ChosenWorkersLayoutsAndShardedPlacements) {
  CandidateSpace space;
  space.grad_workers = {8, 4, 1, 4};  // a repeat is listed once
  space.both_layouts = false;
  const auto base = Options().symmetric_comm(true).spd(SpdOptions().redundant_dim(64));
  EXPECT_EQ(names_of(candidates(8, base, space)),
            (std::vector<std::string>{"kaisa f=1 (W=8) triangles", "kaisa f=1/2 (W=4) triangles",
                                      "kaisa f=1/8 (W=1) triangles", "spd (redundant dim <= 64)", "dp"}));
  space.shard_ranks = 4;  // HSDP: 2 replicas of 4
  const auto sharded = candidates(8, base, space);
  ASSERT_EQ(sharded.size(), 6u);
  EXPECT_EQ(sharded[0].name, "kaisa f=1 (W=8) triangles, replicated");
  EXPECT_EQ(sharded[0].options.sharded_placement(), ShardedPlacement::kReplicated);
  EXPECT_EQ(sharded[5].name, "owner (kaisa, W=2)");
  EXPECT_EQ(sharded[5].options.sharded_placement(), ShardedPlacement::kOwner);
  EXPECT_DOUBLE_EQ(sharded[5].options.grad_worker_fraction(), 0.25);
  space.shard_ranks = 8;  // FSDP: one replica, so DP-KFAC's one owner per layer fits the mesh
  EXPECT_EQ(candidates(8, base, space).back().name, "owner (dp)");
  // SPD-KFAC reduces factors from the hooks: not a candidate where ranks may skip layers.
  const auto skipping = names_of(candidates(2, Options().unused_layer_policy(UnusedLayerPolicy::kSkip)));
  EXPECT_EQ(std::count(skipping.begin(), skipping.end(), "spd"), 0);
  space = {};
  space.grad_workers = {3};
  EXPECT_THROW(candidates(8, base, space), c10::Error);
}

TEST(ChooseStrategy, ASlowLinkPrefersFewerBytes) {
  Rates slow = rates(1e-12, 1e-5, 1e-6);
  slow.method = ComputeMethod::kInverse;
  const auto choice = choose_strategy(shapes(), 4, Options().compute_method(ComputeMethod::kInverse), slow,
                                      kNoMemoryBudget, 32, {1, 1});
  const int64_t chosen = update_bytes(choice.pick().plan);
  for (const auto& c : choice.candidates) EXPECT_LE(chosen, update_bytes(c.plan)) << c.name;
  EXPECT_EQ(choice.pick().options.strategy(), Strategy::kDp);
  // Free links and dear decompositions: spreading inverses over ranks beats moving nothing.
  Rates dear = rates(1e-9, 0, 0);
  dear.method = ComputeMethod::kInverse;
  const auto compute = choose_strategy(shapes(), 4, Options().compute_method(ComputeMethod::kInverse), dear,
                                       kNoMemoryBudget, 32, {100, 1});
  EXPECT_LT(compute.pick().time.step_seconds,
            predict_time(StepPlan::single_process(shapes(), ComputeMethod::kInverse), rates(1e-9, 0, 0, 1), 32, {100, 1})
                .step_seconds);
}

TEST(ChooseStrategy, ATinyBudgetPicksTheLeastMemoryAndSaysNoneFits) {
  const auto choice = choose_strategy(shapes(), 4, Options(), rates(1e-10, 1e-4, 1e-9), 1, 32, {1, 1});
  EXPECT_FALSE(choice.fits);
  for (const auto& c : choice.candidates) {
    EXPECT_FALSE(c.fits);
    EXPECT_LE(choice.pick().memory_bytes, c.memory_bytes);
  }
  EXPECT_NE(choice.reason.find("no candidate fits"), std::string::npos) << choice.reason;
  // A budget between the smallest and the largest excludes the larger candidates.
  int64_t least = INT64_MAX, most = 0;
  for (const auto& c : choice.candidates) {
    least = std::min(least, c.memory_bytes);
    most = std::max(most, c.memory_bytes);
  }
  ASSERT_LT(least, most);
  const auto fitted = choose_strategy(shapes(), 4, Options(), rates(1e-10, 1e-4, 1e-9), least, 32, {1, 1});
  EXPECT_TRUE(fitted.fits);
  EXPECT_LE(fitted.pick().memory_bytes, least);
  EXPECT_TRUE(fitted.pick().fits);
}

TEST(ChooseStrategy, TiesAreBrokenByMemoryThenOrderAndTheChoiceIsRepeatable) {
  // Free everything: every candidate takes 0 s, so the least memory wins, the earliest among equals.
  const auto a = choose_strategy(shapes(), 4, Options(), rates(0, 0, 0), kNoMemoryBudget, 32, {1, 1});
  const auto b = choose_strategy(shapes(), 4, Options(), rates(0, 0, 0), kNoMemoryBudget, 32, {1, 1});
  EXPECT_EQ(a.chosen, b.chosen);
  for (size_t k = 0; k < a.candidates.size(); ++k) {
    EXPECT_EQ(a.candidates[k].time.step_seconds, 0.0);
    EXPECT_LE(a.pick().memory_bytes, a.candidates[k].memory_bytes);
    if (a.candidates[k].memory_bytes == a.pick().memory_bytes) EXPECT_GE(k, a.chosen);
  }
}

TEST(ChooseStrategy, ApplySetsOnlyTheStrategysOptions) {
  const Options base = Options().damping(0.3).inv_update_steps(7).compute_method(ComputeMethod::kInverse);
  Rates r = rates(1e-12, 1e-5, 1e-6);
  r.method = ComputeMethod::kInverse;
  const auto choice = choose_strategy(shapes(), 4, base, r, kNoMemoryBudget, 32, {1, 7});
  EXPECT_THROW(choose_strategy(shapes(), 4, Options(), r, kNoMemoryBudget, 32, {1, 7}), c10::Error);
  const Options o = choice.apply(base);
  EXPECT_EQ(o.strategy(), choice.pick().options.strategy());
  EXPECT_EQ(o.grad_worker_fraction(), choice.pick().options.grad_worker_fraction());
  EXPECT_EQ(o.damping()(0), 0.3);
  EXPECT_EQ(o.inv_update_steps()(0), 7);
  EXPECT_EQ(o.compute_method(), ComputeMethod::kInverse);
  o.validate();
}

// This machine's rates for `method`, measured on one intra-op thread: with two, a test running beside this one on
// a 2-core machine made a 16 x 16 inverse take 1 ms instead of 17 us (the threads' barrier waits for a
// descheduled thread), so that the sizes' order, which these tests check, was the load's and not the kernels'.
Rates measured_on_one_thread(ComputeMethod method) {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const auto r = measure_local_rates(c10::Device(c10::kCPU), c10::kFloat, method);
  at::set_num_threads(threads);
  r.validate();
  return r;
}

TEST(Rates, MeasuredLocallyArePositiveAndGrowWithSize) {
  const auto r = measured_on_one_thread(ComputeMethod::kInverse);
  EXPECT_EQ(r.world_size, 1);
  EXPECT_EQ(r.threads, 1);
  EXPECT_GT(r.factor.seconds_for(4096, 256), r.factor.seconds_for(64, 16));
  EXPECT_GT(r.decomposition.seconds_for(1024), r.decomposition.seconds_for(16));
  EXPECT_GT(r.precondition.seconds_for(256, 256, ComputeMethod::kInverse), 0.0);
  EXPECT_FALSE(r.refresh.measured()) << "the inverse method has no eigenbasis to refresh";
}

// The eigen method's rates also time the eigenbasis refresh (Options::eigh_interval), at the decomposition's dims.
TEST(Rates, EigenRatesTimeTheRefreshToo) {
  const auto r = measured_on_one_thread(ComputeMethod::kEigen);
  ASSERT_TRUE(r.refresh.measured());
  EXPECT_EQ(r.refresh.dims, r.decomposition.dims);
  for (double seconds : r.refresh.seconds) EXPECT_GT(seconds, 0.0);
  EXPECT_GT(r.refresh.seconds_for(640), r.refresh.seconds_for(16));
}

// A decomposition beside the steps costs them the share of its time they lose: none where it hides behind them, all
// of it where the two take turns, never outside [0, 1].
TEST(Rates, SideWorkCostIsTheShareOfTheSideWorkTheMainWorkLoses) {
  EXPECT_DOUBLE_EQ(side_work_cost_from({3.0, 1.0, 3.0}), 0.0) << "beside the loop at no cost";
  EXPECT_DOUBLE_EQ(side_work_cost_from({3.0, 1.0, 4.0}), 1.0) << "taking turns: the sum";
  EXPECT_DOUBLE_EQ(side_work_cost_from({3.0, 1.0, 3.25}), 0.25);
  EXPECT_DOUBLE_EQ(side_work_cost_from({3.0, 1.0, 2.9}), 0.0) << "faster together is noise: 0";
  EXPECT_DOUBLE_EQ(side_work_cost_from({3.0, 1.0, 5.0}), 1.0) << "slower than one after the other: 1";
  EXPECT_DOUBLE_EQ(side_work_cost_from({3.0, 0.0, 3.0}), 1.0) << "nothing measured beside: as on the step";
  EXPECT_THROW(side_work_cost_from({3.0, std::nan(""), 3.0}), c10::Error);
  Rates r = rates(1e-9, 0, 0, 1);
  r.side_work_cost = 1.5;
  EXPECT_THROW(r.validate(), c10::Error);
  r.side_work_cost = -0.1;
  EXPECT_THROW(r.validate(), c10::Error);
}

// On this CPU: both ran (neither finished faster together than alone, within noise), the loop outlasts the
// decomposition, and the measured rates hold the share. The three timings are taken one after another, and another
// test's threads (ctest --parallel 2 on 2 cores) can slow one of them alone: up to three measurements, the first
// that holds the bounds counts (a wrong sizing or a timing that skips the loop fails all three).
TEST(Rates, SideWorkIsTimedAloneAndTogether) {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  std::string failures;
  for (int attempt = 0; attempt < 3; ++attempt) {
    const auto t = time_side_work(ComputeMethod::kEigen, c10::kFloat, c10::Device(c10::kCPU));
    std::ostringstream why;
    if (!(t.side > 0.0)) why << " the side work took no time;";
    if (!(t.main > t.side)) why << " the loop (sized to about 3 decompositions) was shorter than the side work;";
    if (!(t.together >= 0.8 * t.main)) why << " together was shorter than the loop alone;";
    // Each ran once: even with both at half speed beside another test, well under 3x.
    if (!(t.together <= 3.0 * (t.main + t.side))) why << " together took over 3x both alone;";
    if (why.str().empty()) {
      failures.clear();
      break;
    }
    failures += "attempt " + std::to_string(attempt) + " (side " + std::to_string(t.side) + " s, loop " +
                std::to_string(t.main) + " s, together " + std::to_string(t.together) + " s):" + why.str() + "\n";
  }
  at::set_num_threads(threads);
  EXPECT_TRUE(failures.empty()) << failures;
}

// How many ranks compute at full speed together follows the probe's slowdown when all run it at once, within
// the cores the machine has.
TEST(Rates, RanksComputingTogetherFollowTheProbesSlowdownWithinTheCores) {
  EXPECT_DOUBLE_EQ(parallel_ranks_from(4, 1.0, 1.0, 16), 4.0) << "no slowdown: every rank at full speed";
  EXPECT_DOUBLE_EQ(parallel_ranks_from(4, 1.0, 2.0, 16), 2.0) << "twice as slow together: two full speeds";
  EXPECT_DOUBLE_EQ(parallel_ranks_from(4, 1.0, 8.0, 16), 1.0) << "slower than one at a time: still one rank";
  EXPECT_DOUBLE_EQ(parallel_ranks_from(4, 1.0, 1.0, 2), 2.0) << "2 cores run 2 ranks at once, however fast";
  EXPECT_DOUBLE_EQ(parallel_ranks_from(4, 2.0, 1.0, 16), 4.0) << "rank 0 alone was slowed: never above the world";
  EXPECT_DOUBLE_EQ(parallel_ranks_from(4, 1.0, 0.0, 0.5), 1.0) << "under one core per rank: one";
}

// Measured on four CPU ranks of one intra-op thread each: every rank holds the same figure, rank 0's.
TEST(Rates, RanksComputingTogetherAreMeasuredTheSameOnEveryRank) {
  std::vector<double> parallel(4);
  testing::run_ranks(4, [&](int rank, std::shared_ptr<comm::Communicator> communicator) {
    at::set_num_threads(1);
    parallel[rank] =
        measure_rates(*communicator, c10::Device(c10::kCPU), c10::kFloat, ComputeMethod::kInverse).parallel_ranks;
  });
  for (double p : parallel) EXPECT_EQ(p, parallel[0]);
}

TEST(Rates, MeasuredOnTwoRanksAreTheSameOnBothAndRankZerosChoiceWins) {
  std::vector<Rates> out(2);
  std::vector<size_t> agreed(2);
  testing::run_ranks(2, [&](int rank, std::shared_ptr<comm::Communicator> communicator) {
    at::set_num_threads(1);
    out[rank] = measure_rates(*communicator, c10::Device(c10::kCPU), c10::kFloat, ComputeMethod::kInverse);
    agreed[rank] = agree_on_choice(*communicator, rank == 0 ? 3 : 5);
  });
  out[0].validate();
  EXPECT_EQ(out[0].world_size, 2);
  EXPECT_EQ(out[0].ranks_per_node, 2);
  EXPECT_GE(out[0].parallel_ranks, 1.0);
  EXPECT_LE(out[0].parallel_ranks, 2.0);
  EXPECT_GT(out[0].allreduce.seconds(1 << 20), 0.0);
  EXPECT_GT(out[0].allreduce_busy.seconds(1 << 20), 0.0);
  EXPECT_EQ(out[0].allreduce.alpha, out[1].allreduce.alpha);
  EXPECT_EQ(out[0].allreduce_busy.beta, out[1].allreduce_busy.beta);
  EXPECT_EQ(out[0].broadcast.beta, out[1].broadcast.beta);
  EXPECT_EQ(out[0].parallel_ranks, out[1].parallel_ranks);
  EXPECT_EQ(out[0].side_work_cost, out[1].side_work_cost) << "averaged over the ranks";
  EXPECT_EQ(out[0].factor.per_flop, out[1].factor.per_flop);
  EXPECT_EQ(out[0].decomposition.seconds, out[1].decomposition.seconds);
  EXPECT_EQ(out[0].precondition.per_flop, out[1].precondition.per_flop);
  EXPECT_EQ(agreed[0], 3u);
  EXPECT_EQ(agreed[1], 3u);
}

}  // namespace
}  // namespace dkfac::strategy
