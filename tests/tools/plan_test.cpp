// `dkfac plan` on the paper-scale models: sums over ranks against sums over layers, flag errors, units.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include <c10/util/Exception.h>

#include "tools/models/paper_shapes.h"
#include "tools/common/report_json.h"
#include "tools/plan/plan_report.h"

namespace dkfac::plan {
namespace {

// The row `row` names (a KAISA row may end in " triangles", a sharded one in ", replicated").
const nlohmann::json& strategy(const nlohmann::json& report, const std::string& row) {
  for (const auto& s : report["strategies"]) {
    const auto name = s["strategy"].get<std::string>();
    if (name == row || name.rfind(row + " ", 0) == 0 || name.rfind(row + ",", 0) == 0) return s;
  }
  throw std::runtime_error("no strategy " + row);
}

int64_t sum_over_ranks(const nlohmann::json& s, const char* key) {
  int64_t n = 0;
  for (const auto& r : s["ranks"]) n += r[key].get<int64_t>();
  return n;
}

std::string error_of(const PlanRequest& request) {
  try {
    plan_report(request);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(Plan, ResNet50At64RanksSumsMatchTheLayers) {
  PlanRequest request;
  request.model = "resnet50";
  request.nproc = 64;
  request.batch_size = 32;
  const auto model = models::paper_model("resnet50");
  for (const auto method : {ComputeMethod::kInverse, ComputeMethod::kEigen}) {
    SCOPED_TRACE(to_string(method));
    request.compute_method = method;
    const auto report = plan_report(request).json;
    EXPECT_EQ(report["dataset"], "imagenet");
    EXPECT_EQ(report["parameters"].get<int64_t>(), 25557032);
    ASSERT_EQ(report["layers"].size(), model.layers.size());
    ASSERT_EQ(report["strategies"].size(), 5u);
    int64_t factors = 0, second_order = 0, gradient = 0, factor_sent = 0;
    double factor_flops = 0;
    for (const auto& l : model.layers) {
      const int64_t a = l.a_dim, g = l.g_dim;
      factors += 4 * (a * a + g * g);
      second_order += 4 * (method == ComputeMethod::kEigen ? a * a + a + g * g + g + g * a : a * a + g * g);
      gradient += 4 * g * a;
      factor_sent += 4 * (a * a + g * g);
      factor_flops += 2.0 * 32 * l.rows_per_sample * (static_cast<double>(a) * a + static_cast<double>(g) * g);
    }
    // DP-KFAC: each layer's factors and second-order state live on its owner alone, nothing but V moves.
    const auto& dp = strategy(report, "dp");
    ASSERT_EQ(dp["ranks"].size(), 64u);
    EXPECT_EQ(sum_over_ranks(dp, "memory_bytes"), factors + second_order);
    EXPECT_EQ(sum_over_ranks(dp, "factor_bytes"), 0);
    EXPECT_EQ(sum_over_ranks(dp, "second_order_bytes"), 0);
    EXPECT_EQ(sum_over_ranks(dp, "gradient_bytes"), 64 * gradient);
    EXPECT_NEAR(dp["summary"]["factor_flops"]["sum"].get<double>(), factor_flops, 1e-9 * factor_flops);
    // D-KFAC (KAISA f = 1): every rank holds everything and allreduces every factor.
    const auto& dk = strategy(report, "kaisa f=1 (W=64)");
    EXPECT_EQ(dk["grad_workers"].get<int>(), 64);
    for (const auto& r : dk["ranks"]) {
      EXPECT_EQ(r["memory_bytes"].get<int64_t>(), factors + second_order);
      EXPECT_EQ(r["factor_bytes"].get<int64_t>(), factor_sent);
      EXPECT_EQ(r["gradient_bytes"].get<int64_t>(), 0);
      EXPECT_DOUBLE_EQ(r["factor_flops"].get<double>(), factor_flops);
      EXPECT_EQ(r["update_bytes"].get<int64_t>(), r["factor_bytes"].get<int64_t>() +
                                                      r["second_order_bytes"].get<int64_t>() +
                                                      r["gradient_bytes"].get<int64_t>());
    }
    // Each factor decomposed exactly once over the ranks, under every placement.
    const double decomposed = strategy(report, "kaisa f=1 (W=64)")["summary"]["decomposition_flops"]["sum"].get<double>();
    EXPECT_DOUBLE_EQ(strategy(report, "dp")["summary"]["decomposition_flops"]["sum"].get<double>(), decomposed);
    EXPECT_DOUBLE_EQ(strategy(report, "kaisa f=1/64 (W=1)")["summary"]["decomposition_flops"]["sum"].get<double>(), decomposed);
    EXPECT_EQ(strategy(report, "kaisa f=1/2 (W=32)")["grad_workers"].get<int>(), 32);
    EXPECT_EQ(strategy(report, "spd")["grad_workers"].get<int>(), 64);
  }
}

TEST(Plan, SymmetricCommSendsTriangles) {
  PlanRequest request;
  request.model = "densenet201";
  request.nproc = 64;
  request.symmetric_comm = true;
  int64_t triangles = 0;
  for (const auto& l : models::paper_model("densenet201").layers) {
    triangles += 4 * (l.a_dim * (l.a_dim + 1) / 2 + l.g_dim * (l.g_dim + 1) / 2);
  }
  const auto report = plan_report(request).json;
  EXPECT_EQ(strategy(report, "kaisa f=1 (W=64) triangles")["ranks"][0]["factor_bytes"].get<int64_t>(), triangles);
  EXPECT_EQ(strategy(report, "spd")["ranks"][0]["factor_bytes"].get<int64_t>(), triangles);
}

TEST(Plan, EveryPaperModelPlansAt64Ranks) {
  for (const auto& name : models::paper_model_names()) {
    SCOPED_TRACE(name);
    PlanRequest request;
    request.model = name;
    request.nproc = 64;
    request.batch_size = 32;
    const auto report = plan_report(request);
    const auto& json = report.json;
    EXPECT_EQ(json["parameters"].get<int64_t>(), models::paper_model(name).parameters);
    EXPECT_EQ(report.placements.size(), json["strategies"].size());
    const auto& dp = strategy(json, "dp");
    const auto& dk = strategy(json, "kaisa f=1 (W=64)");
    // DP-KFAC holds and computes less per rank than D-KFAC on every paper model.
    EXPECT_LT(dp["summary"]["memory_bytes"]["max"].get<double>(), dk["summary"]["memory_bytes"]["max"].get<double>());
    EXPECT_LT(dp["summary"]["update_flops"]["max"].get<double>(), dk["summary"]["update_flops"]["max"].get<double>());
    // Text at 64 ranks: a summary, not 64 rows per strategy.
    const auto text = plan_text(report, false);
    EXPECT_NE(text.find("median"), std::string::npos);
    EXPECT_LT(std::count(text.begin(), text.end(), '\n'), 60);
    const auto full = plan_text(report, true);
    EXPECT_GT(std::count(full.begin(), full.end(), '\n'), 5 * 64);
  }
}

TEST(Plan, ShardedBertLargeAt64RanksPrintsThePlacements) {
  PlanRequest request;
  request.model = "bert-large";
  request.nproc = 64;
  request.batch_size = 8;
  request.shard_ranks = 64;  // --fsdp
  const auto json = plan_report(request).json;
  EXPECT_EQ(json["sharding"], "fsdp");
  const auto& replicated = strategy(json, "kaisa f=1/64 (W=1), replicated");
  const auto& owner = strategy(json, "owner (kaisa, W=1)");
  strategy(json, "owner (dp)");
  // Owner placement holds each layer's factors once instead of on every rank, and moves rows instead of V.
  EXPECT_LT(owner["summary"]["memory_bytes"]["max"].get<double>(),
            replicated["summary"]["memory_bytes"]["max"].get<double>() / 10);
  EXPECT_LT(owner["summary"]["gradient_bytes"]["median"].get<double>(),
            replicated["summary"]["gradient_bytes"]["median"].get<double>() / 10);
  request.shard_ranks = 16;  // --hsdp 4
  const auto hsdp = plan_report(request).json;
  EXPECT_EQ(hsdp["sharding"], "hsdp");
  EXPECT_EQ(strategy(hsdp, "owner (kaisa, W=4)")["grad_workers"], 4);
  EXPECT_THROW(strategy(hsdp, "owner (dp)"), std::exception) << "DP-KFAC has one owner in a world of one row";
}

TEST(Plan, ExtraGradWorkerFractions) {
  PlanRequest request;
  request.model = "resnet50";
  request.nproc = 64;
  request.grad_worker_fractions = {1.0 / 16, 0.25};
  const auto report = plan_report(request).json;
  ASSERT_EQ(report["strategies"].size(), 7u);
  EXPECT_EQ(report["strategies"][3]["strategy"], "kaisa f=1/16 (W=4)");
  EXPECT_EQ(report["strategies"][3]["grad_workers"].get<int>(), 4);
  EXPECT_EQ(report["strategies"][4]["strategy"], "kaisa f=1/4 (W=16)");
  // Fewer grad workers: less second-order memory on the fullest rank.
  EXPECT_LT(report["strategies"][3]["summary"]["memory_bytes"]["max"].get<double>(),
            report["strategies"][4]["summary"]["memory_bytes"]["max"].get<double>());
  request.grad_worker_fractions = {0.3};  // W = 19 does not divide 64
  EXPECT_NE(error_of(request).find("--grad-worker-fraction"), std::string::npos);
}

// Bytes a rank holds for a layer under KAISA f = 1 with the inverse method: each factor and its inverse (a
// diagonal side: d values each), float32.
int64_t inverse_held(int64_t a, bool a_diagonal, int64_t g, bool g_diagonal) {
  const auto side = [](int64_t n, bool diagonal) { return 2 * (diagonal ? n : n * n); };
  return 4 * (side(a, a_diagonal) + side(g, g_diagonal));
}

TEST(Plan, TensorAndPipelineParallelSplitTheLayers) {
  PlanRequest request;
  request.model = "gpt-1.3b";
  request.nproc = 16;
  request.batch_size = 1;
  request.compute_method = ComputeMethod::kInverse;
  request.pad_widths = 1;  // the sums below are the layers' own state (Plan.PadWidthsHoldThePadsBesideTheState: pads)
  const int64_t wpe = inverse_held(2048, true, 2048, false);  // replicated over tp: A diagonal, G whole
  // Without tensor parallelism: mlp.c_proj's A (8193) is wider than diagonal_factor_dim, so diagonal.
  const int64_t whole = inverse_held(2049, false, 6144, false) + inverse_held(2049, false, 2048, false) +
                        inverse_held(2049, false, 8192, false) + inverse_held(8193, true, 2048, false);
  auto json = plan_report(request).json;
  EXPECT_EQ(json["dp"], 16);
  EXPECT_FALSE(json["strategies"][0].contains("stages"));
  EXPECT_EQ(strategy(json, "kaisa f=1 (W=16)")["ranks"][0]["memory_bytes"].get<int64_t>(), wpe + 24 * whole);
  // tp 2, for the group's first rank: QKV and c_fc keep half their outputs (G), the projections half their inputs
  // plus the bias (A): mlp.c_proj's A, 4097 wide, is dense again.
  const int64_t split = inverse_held(2049, false, 3072, false) + inverse_held(1025, false, 2048, false) +
                        inverse_held(2049, false, 4096, false) + inverse_held(4097, false, 2048, false);
  request.tp = 2;
  json = plan_report(request).json;
  EXPECT_EQ(json["dp"], 8);
  const auto& tp = strategy(json, "kaisa f=1 (W=8)");
  ASSERT_EQ(tp["ranks"].size(), 8u);
  EXPECT_EQ(tp["ranks"][0]["memory_bytes"].get<int64_t>(), wpe + 24 * split);
  ASSERT_EQ(tp["stages"].size(), 1u);
  // tp 2 x pp 2: blocks 0-11 and the position embedding on stage 0, blocks 12-23 on stage 1; stage 0 is the fuller.
  request.pp = 2;
  json = plan_report(request).json;
  EXPECT_EQ(json["dp"], 4);
  const auto& both = strategy(json, "kaisa f=1 (W=4)");
  ASSERT_EQ(both["stages"].size(), 2u);
  EXPECT_EQ(both["stages"][0]["layers"], 49);
  EXPECT_EQ(both["stages"][1]["layers"], 48);
  EXPECT_EQ(both["stage"], 0);
  EXPECT_EQ(both["stages"][0]["memory_bytes"].get<int64_t>(), wpe + 12 * split);
  EXPECT_EQ(both["stages"][1]["memory_bytes"].get<int64_t>(), 12 * split);
  EXPECT_EQ(both["ranks"][0]["memory_bytes"].get<int64_t>(), wpe + 12 * split);
  // DP-KFAC over the 4 data-parallel ranks of a position holds each of its layers once.
  int64_t held = 0;
  for (const auto& r : strategy(json, "dp")["ranks"]) held += r["memory_bytes"].get<int64_t>();
  EXPECT_EQ(held, wpe + 12 * split);
  // FSDP over the data-parallel ranks: the owner placement's rows go to one owner among them.
  request.shard_ranks = 4;
  json = plan_report(request).json;
  strategy(json, "owner (kaisa, W=1)");
  const auto text = plan_text(plan_report(request), false);
  EXPECT_NE(text.find("tp 2 x pp 2 x dp 4"), std::string::npos);
  EXPECT_NE(text.find("* 0 (49)"), std::string::npos);

  // Exact factors: the split layers whole on every tensor-parallel rank (as without tensor parallelism), and per
  // update, for one block, the all-gathers of the column layers' output gradients (QKV 6144 and c_fc 8192 wide, 2048
  // rows) and gradients (2049 x 6144, 2049 x 8192), and of the row layers' inputs and gradients (2048 and 8192
  // inputs over 2048 rows and 2048 outputs), half of each from the other rank; block-diagonal: the row layers'
  // bias gradients (2048 each) broadcast.
  request.shard_ranks = 0;
  request.pp = 1;
  request.tp_exact = true;
  json = plan_report(request).json;
  EXPECT_EQ(json["tensor_parallel_factors"], "exact");
  const auto& exact = strategy(json, "kaisa f=1 (W=8)");
  EXPECT_EQ(exact["ranks"][0]["memory_bytes"].get<int64_t>(), wpe + 24 * whole);
  const double column = 2048.0 * 6144 + 2049.0 * 6144 + 2048.0 * 8192 + 2049.0 * 8192;
  const double row = (2048.0 + 2048) * 2048 + (2048.0 + 2048) * 8192;
  EXPECT_DOUBLE_EQ(exact["stages"][0]["tensor_parallel_bytes"].get<double>(), 4 * 24 * 0.5 * (column + row));
  request.tp_exact = false;
  json = plan_report(request).json;
  EXPECT_DOUBLE_EQ(strategy(json, "kaisa f=1 (W=8)")["stages"][0]["tensor_parallel_bytes"].get<double>(),
                   4 * 24 * 2 * 2048.0);

  request.tp = 3;  // the projections' 2048 inputs do not split in three
  request.pp = 1;
  request.nproc = 12;
  EXPECT_NE(error_of(request).find("--tp 3"), std::string::npos);
  request.tp = 4;  // 4 x 1 does not divide 6
  request.nproc = 6;
  EXPECT_NE(error_of(request).find("must divide --nproc"), std::string::npos);
  request.model = "resnet50";
  request.nproc = 8;
  request.tp = 2;
  EXPECT_NE(error_of(request).find("--tp and --pp need a transformer"), std::string::npos);
}

TEST(Plan, BertLargeSequenceLength) {
  PlanRequest request;
  request.model = "bert-large";
  request.nproc = 8;
  auto json = plan_report(request).json;
  EXPECT_EQ(json["dataset"], "wikipedia");
  EXPECT_EQ(json["seq_len"].get<int64_t>(), 128);
  EXPECT_EQ(json["layers"][0]["rows_per_sample"].get<int64_t>(), 128);
  request.seq_len = 512;
  json = plan_report(request).json;
  EXPECT_EQ(json["layers"][0]["rows_per_sample"].get<int64_t>(), 512);
  EXPECT_EQ(json["layers"].back()["name"], "pooler.dense");
  EXPECT_EQ(json["layers"].back()["rows_per_sample"].get<int64_t>(), 1);
}

TEST(Plan, BadCombinationsNameTheFlag) {
  PlanRequest r;
  r.model = "resnet50";
  r.dataset = "cifar10";
  EXPECT_NE(error_of(r).find("--dataset"), std::string::npos);
  r.model = "bert-large";
  r.dataset = "imagenet";
  EXPECT_NE(error_of(r).find("--dataset"), std::string::npos);
  r.model = "cnn";
  r.dataset = "imagenet";
  EXPECT_NE(error_of(r).find("--dataset"), std::string::npos);
  r.dataset = "";
  r.model = "inception-v4";
  r.seq_len = 128;
  EXPECT_NE(error_of(r).find("--seq-len"), std::string::npos);
  r.model = "bert-large";
  r.seq_len = 1024;
  EXPECT_NE(error_of(r).find("--seq-len"), std::string::npos);
  r.model = "vgg16";
  r.seq_len = 0;
  EXPECT_NE(error_of(r).find("--model"), std::string::npos);
}

TEST(Plan, SmallModelsKeepTheirDefaults) {
  PlanRequest request;  // cnn, fashion-mnist, 4 ranks
  const auto report = plan_report(request);
  EXPECT_EQ(report.json["dataset"], "fashion-mnist");
  EXPECT_EQ(report.json["layers"].size(), 4u);
  const auto text = plan_text(report, false);
  EXPECT_NE(text.find("step plan: "), std::string::npos);  // per-layer placement and per-rank rows
  EXPECT_EQ(text.find("median"), std::string::npos);
}

strategy::Rates given_rates(ComputeMethod method) {
  strategy::Rates r;
  r.world_size = 4;
  r.method = method;
  r.allreduce = {1e-4, 1e-9};
  r.allreduce_busy = {3e-3, 2e-8};
  r.broadcast = {5e-5, 5e-10};
  r.factor = {1e-6, 1e-10, 1e-11};
  r.conv_factor = {2e-6, 0, 5e-12};
  r.conv_g_factor = {3e-6, 1e-10, 7e-12};
  r.conv_patches_factor = {4e-6, 2e-10, 8e-12};
  r.conv_unfold_factor = {5e-6, 3e-10, 9e-12};
  r.fold = {6e-6, 4e-10};
  r.decomposition.dims = {16, 96, 768};
  r.decomposition.seconds = {1e-5, 1e-4, 1e-2};
  if (method == ComputeMethod::kEigen) {
    r.refresh.dims = {16, 96, 768};
    r.refresh.seconds = {8e-6, 6e-5, 5e-3};
  }
  r.precondition = {1e-6, 1e-11};
  r.conditions = "test";
  return r;
}

TEST(PlanAuto, RatesRoundTripThroughJson) {
  auto r = given_rates(ComputeMethod::kEigen);
  r.side_work_cost = 0.375;
  const auto back = nlohmann::json(r).get<strategy::Rates>();
  EXPECT_EQ(back.world_size, 4);
  EXPECT_EQ(back.method, ComputeMethod::kEigen);
  EXPECT_EQ(back.dtype, c10::kFloat);
  EXPECT_EQ(back.allreduce.alpha, r.allreduce.alpha);
  EXPECT_EQ(back.allreduce_busy.alpha, r.allreduce_busy.alpha);
  EXPECT_EQ(back.allreduce_busy.beta, r.allreduce_busy.beta);
  EXPECT_EQ(back.broadcast.beta, r.broadcast.beta);
  EXPECT_EQ(back.factor.per_flop, r.factor.per_flop);
  EXPECT_EQ(back.conv_factor.seconds, r.conv_factor.seconds);
  EXPECT_EQ(back.conv_g_factor.per_entry, r.conv_g_factor.per_entry);
  EXPECT_EQ(back.conv_patches_factor.per_flop, r.conv_patches_factor.per_flop);
  EXPECT_EQ(back.conv_unfold_factor.per_entry, r.conv_unfold_factor.per_entry);
  EXPECT_EQ(back.fold.seconds, r.fold.seconds);
  EXPECT_EQ(back.fold.per_entry, r.fold.per_entry);
  EXPECT_EQ(back.decomposition.dims, r.decomposition.dims);
  EXPECT_EQ(back.decomposition.seconds, r.decomposition.seconds);
  EXPECT_EQ(back.refresh.dims, r.refresh.dims);
  EXPECT_EQ(back.refresh.seconds, r.refresh.seconds);
  EXPECT_EQ(back.precondition.per_flop, r.precondition.per_flop);
  EXPECT_EQ(back.side_work_cost, r.side_work_cost);
  EXPECT_EQ(back.conditions, "test");
  auto broken = nlohmann::json(r);
  broken["factor"].erase("per_flop_s");
  try {
    broken.get<strategy::Rates>();
    FAIL() << "a missing field must be named";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("factor.per_flop_s"), std::string::npos);
  }
  broken = nlohmann::json(r);
  broken["allreduce"]["alpha_s"] = -1.0;
  EXPECT_THROW(broken.get<strategy::Rates>(), c10::Error);
  // One format: a file without a part that to_json writes is refused naming it, not read with a stand-in.
  for (const char* part :
       {"allreduce_busy", "conv_g_factor", "conv_patches_factor", "conv_unfold_factor", "fold", "refresh",
        "side_work_cost"}) {
    auto older = nlohmann::json(r);
    older.erase(part);
    try {
      older.get<strategy::Rates>();
      ADD_FAILURE() << "rates without " << part << " were read";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find(std::string("rates: missing field ") + part),
                std::string::npos) << e.what_without_backtrace();
    }
  }
}

TEST(PlanAuto, ResNet50At64RanksListsEveryCandidateAndThePick) {
  PlanRequest request;
  request.model = "resnet50";
  request.nproc = 64;
  request.batch_size = 32;
  request.factor_update_steps = 10;
  request.inv_update_steps = 100;
  const auto report = auto_report(request, given_rates(ComputeMethod::kInverse));
  // W in {64, 32, 16, 8, 4, 2, 1} with and without triangles, SPD-KFAC, DP-KFAC.
  ASSERT_EQ(report.json["candidates"].size(), 16u);
  bool chosen_listed = false;
  for (const auto& c : report.json["candidates"]) {
    const auto name = c["name"].get<std::string>();
    EXPECT_NE(report.text.find(name), std::string::npos) << name;
    EXPECT_GT(c["step_seconds"].get<double>(), 0.0);
    EXPECT_GT(c["memory_bytes"].get<int64_t>(), 0);
    chosen_listed |= name == report.json["chosen"].get<std::string>();
  }
  EXPECT_TRUE(chosen_listed);
  EXPECT_TRUE(report.json["fits"].get<bool>());
  EXPECT_NE(report.text.find("picked " + report.json["chosen"].get<std::string>()), std::string::npos);
  EXPECT_NE(report.text.find("measured on 4 ranks"), std::string::npos);
  // A budget below every candidate's memory: said so, and the least memory is picked.
  request.memory_budget_bytes = 1024;
  const auto tight = auto_report(request, given_rates(ComputeMethod::kInverse));
  EXPECT_FALSE(tight.json["fits"].get<bool>());
  EXPECT_NE(tight.text.find("no candidate fits"), std::string::npos);
}

// --second-order-lag: every plan's memory holds the update in flight, and strategy auto prices the decompositions
// beside the steps at the rates' side_work_cost (0 here, with preconditioning long enough to hide them).
TEST(PlanAuto, SecondOrderLagHoldsTheUpdateInFlightAndIsPricedBesideTheSteps) {
  PlanRequest request;
  request.model = "resnet50";
  request.nproc = 4;
  request.batch_size = 32;
  const auto at_once = plan_report(request).json;
  request.second_order_lag = 5;
  const auto lagged = plan_report(request).json;
  EXPECT_EQ(lagged["second_order_lag"].get<int64_t>(), 5);
  ASSERT_EQ(at_once["strategies"].size(), lagged["strategies"].size());
  for (size_t k = 0; k < lagged["strategies"].size(); ++k) {
    const auto& s = lagged["strategies"][k];
    EXPECT_GT(sum_over_ranks(s, "in_flight_bytes"), 0) << s["strategy"];
    EXPECT_EQ(sum_over_ranks(at_once["strategies"][k], "in_flight_bytes"), 0);
    EXPECT_EQ(sum_over_ranks(s, "memory_bytes"),
              sum_over_ranks(at_once["strategies"][k], "memory_bytes") + sum_over_ranks(s, "in_flight_bytes"));
  }
  auto rates = given_rates(ComputeMethod::kInverse);
  rates.side_work_cost = 0;
  rates.precondition.seconds = 1.0;  // a second per layer's products: every update hides behind 5 steps
  const auto beside = auto_report(request, rates);
  EXPECT_EQ(beside.json["second_order_lag"].get<int64_t>(), 5);
  EXPECT_NE(beside.text.find("costs them 0 of its time"), std::string::npos) << beside.text;
  request.second_order_lag = 0;
  const auto exact = auto_report(request, rates);
  ASSERT_EQ(beside.json["candidates"].size(), exact.json["candidates"].size());
  for (size_t k = 0; k < exact.json["candidates"].size(); ++k) {
    EXPECT_GT(exact.json["candidates"][k]["max_over_ranks_seconds"]["decomposition"].get<double>(), 0.0);
    EXPECT_EQ(beside.json["candidates"][k]["max_over_ranks_seconds"]["decomposition"].get<double>(), 0.0);
  }
}

// --pad-widths (8 by default, as a job's): every strategy's memory holds the pads of its ranks' stacks
// (BERT-Large's (1024, 1025) and (1024, 4097) layers padded to (1024, 1032) and (1024, 4104)), beside the unpadded
// plan's memory; the JSON says so.
TEST(Plan, PadWidthsHoldThePadsBesideTheState) {
  PlanRequest request;
  request.model = "bert-large";
  request.nproc = 4;
  EXPECT_EQ(request.pad_widths, 8) << "a job's default";
  const auto padded = plan_report(request).json;
  request.pad_widths = 1;
  const auto unpadded = plan_report(request).json;
  EXPECT_EQ(padded["pad_widths"].get<int64_t>(), 8);
  ASSERT_EQ(unpadded["strategies"].size(), padded["strategies"].size());
  for (size_t k = 0; k < padded["strategies"].size(); ++k) {
    const auto& s = padded["strategies"][k];
    EXPECT_GT(sum_over_ranks(s, "stack_padding_bytes"), 0) << s["strategy"];
    EXPECT_EQ(sum_over_ranks(unpadded["strategies"][k], "stack_padding_bytes"), 0);
    EXPECT_EQ(sum_over_ranks(s, "memory_bytes"),
              sum_over_ranks(unpadded["strategies"][k], "memory_bytes") + sum_over_ranks(s, "stack_padding_bytes"))
        << s["strategy"];
  }
  // By hand, from the plan's layers: KAISA f = 1 has every rank precondition every layer, so each rank holds every
  // group's pads: per layer (the inverse method, no shared inputs) a'^2 - a^2 + g'^2 - g^2 float32 entries.
  std::map<std::pair<int64_t, int64_t>, int64_t> shapes;
  for (const auto& layer : padded["layers"]) {
    if (!layer["a_diagonal"].get<bool>() && !layer["g_diagonal"].get<bool>()) {
      ++shapes[{layer["g_dim"].get<int64_t>(), layer["a_dim"].get<int64_t>()}];
    }
  }
  const auto pad = [](int64_t n) { return (n + 7) / 8 * 8; };
  int64_t by_hand = 0;
  for (const auto& [shape, count] : shapes) {
    const auto [g, a] = shape;
    if (count >= 2) by_hand += 4 * count * (pad(a) * pad(a) - a * a + pad(g) * pad(g) - g * g);
  }
  EXPECT_EQ(by_hand, 12480188) << "97 of (1024, 1025), 24 of (4096, 1025) and 24 of (1024, 4097)";
  const auto& kaisa = padded["strategies"][0];
  ASSERT_EQ(kaisa["strategy"].get<std::string>(), "kaisa f=1 (W=4)");
  for (const auto& rank : kaisa["ranks"]) EXPECT_EQ(rank["stack_padding_bytes"].get<int64_t>(), by_hand);
}

TEST(PlanAuto, RatesOfAnotherMethodAreRefused) {
  PlanRequest request;
  request.model = "cnn";
  request.compute_method = ComputeMethod::kEigen;
  try {
    auto_report(request, given_rates(ComputeMethod::kInverse));
    FAIL() << "rates of the inverse method must not plan the eigen method";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("--compute-method"), std::string::npos);
  }
}

}  // namespace
}  // namespace dkfac::plan
