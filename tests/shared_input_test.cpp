// Options::shared_input_layers: layers that read one input share one A factor and its decomposition. Exact: the
// run that shares equals the run that keeps a copy per layer, bit for bit in one process, to rounding across
// ranks (where the reductions' sums are grouped differently); what is shared is built, sent, held and saved once.

#include <gtest/gtest.h>

#include <mutex>
#include <sstream>

#include "dkfac/dkfac.h"
#include "dkfac/comm/packing.h"
#include "dkfac/layers/discovery.h"
#include "dkfac/strategy/prediction.h"
#include "dkfac/strategy/step_plan.h"
#include "tests/multi_rank.h"
#include "tests/test_util.h"

namespace dkfac {
namespace {

// One attention-like block: query, key and value read one input.
struct Block : torch::nn::Module {
  Block(int64_t in, int64_t out) {
    query = register_module("query", nn::Linear(in, out));
    key = register_module("key", nn::Linear(in, out));
    value = register_module("value", nn::Linear(in, out));
  }
  // `copy_for_key`: the key is given a copy of the input (not the same tensor): sharing must refuse it.
  torch::Tensor forward(const torch::Tensor& h, bool copy_for_key = false) {
    return query->forward(h) * key->forward(copy_for_key ? h.clone() : h) + value->forward(h);
  }
  nn::Linear query{nullptr}, key{nullptr}, value{nullptr};
};

// pre -> block0 (a = 7, g = 5) -> block1 (a = 6, g = 3) -> head: 8 K-FAC layers, two groups of three.
struct Net : torch::nn::Module {
  Net() {
    pre = register_module("pre", nn::Linear(4, 6));
    block0 = register_module("block0", std::make_shared<Block>(6, 5));
    block1 = register_module("block1", std::make_shared<Block>(5, 3));
    head = register_module("head", nn::Linear(torch::nn::LinearOptions(3, 2).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto h = torch::tanh(pre->forward(x));
    return head->forward(block1->forward(torch::tanh(block0->forward(h)), copy_for_key));
  }
  nn::Linear pre{nullptr}, head{nullptr};
  std::shared_ptr<Block> block0, block1;
  bool copy_for_key = false;
};

std::shared_ptr<Net> make_net() { return testing::seeded_float64<Net>(7); }

// A fresh net holding `net`'s parameters (a resumed job's model).
std::shared_ptr<Net> copy_of(Net& net) {
  auto copy = make_net();
  torch::NoGradGuard no_grad;
  const auto from = net.parameters();
  auto to = copy->parameters();
  for (size_t p = 0; p < to.size(); ++p) to[p].copy_(from[p]);
  return copy;
}

const std::vector<std::string> kShared = {"(query|key|value)$"};

torch::Tensor loss(Net& net, int64_t step, int rank = 0) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(100 * step + rank + 1);
  const auto x = torch::randn({3, 4, 4}, g, torch::kFloat64);  // [B, T, features]
  const auto y = torch::randn({3, 4, 2}, g, torch::kFloat64);
  return (net.forward(x) - y).pow(2).mean();
}

std::vector<torch::Tensor> grads_of(Net& net) {
  std::vector<torch::Tensor> out;
  for (const auto& p : net.parameters()) out.push_back(p.grad().clone());
  return out;
}

// `steps` steps of one process; the gradients after each kfac.step().
std::vector<std::vector<torch::Tensor>> train(Net& net, Preconditioner& kfac, int64_t steps, int64_t first = 0) {
  torch::optim::SGD sgd(net.parameters(), torch::optim::SGDOptions(0.1));
  std::vector<std::vector<torch::Tensor>> out;
  const int64_t micro = kfac.options().accumulation_steps();
  for (int64_t s = first; s < first + steps; ++s) {
    sgd.zero_grad();
    for (int64_t m = 0; m < micro; ++m) (loss(net, s, static_cast<int>(m)) / static_cast<double>(micro)).backward();
    kfac.step();
    out.push_back(grads_of(net));
    sgd.step();
  }
  return out;
}

void expect_equal(const std::vector<std::vector<torch::Tensor>>& got,
                  const std::vector<std::vector<torch::Tensor>>& expected, const std::string& what) {
  ASSERT_EQ(got.size(), expected.size());
  for (size_t s = 0; s < got.size(); ++s) {
    for (size_t p = 0; p < got[s].size(); ++p) {
      EXPECT_TRUE(torch::equal(got[s][p], expected[s][p]))
          << what << ": step " << s << " parameter " << p << " differs by "
          << (got[s][p] - expected[s][p]).abs().max().item<double>();
    }
  }
}

int64_t bytes_of(const torch::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

TEST(SharedInput, GroupsByTheCapturedText) {
  const std::vector<std::string> names = {"pre", "b0.attn.query", "b0.attn.key", "b0.attn.value", "b1.attn.query",
                                          "b1.attn.key", "b1.out", "b1.attn.value"};
  EXPECT_EQ(input_groups(names, kShared), (std::vector<int>{-1, -1, 1, 1, -1, 4, -1, 4}));
  EXPECT_EQ(input_groups(names, {}), std::vector<int>(names.size(), -1));
  {
    testing::CapturedWarnings warnings;
    EXPECT_EQ(input_groups(names, {"(pre)"}), std::vector<int>(names.size(), -1));
    ASSERT_EQ(warnings.messages.size(), 1u);
    EXPECT_NE(warnings.messages[0].find("forms no group of two"), std::string::npos) << warnings.messages[0];
  }
  try {
    input_groups(names, {"(query|key)$", "attn\\.(key|value)$"});
    ADD_FAILURE() << "a layer in two groups was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'b0.attn.key' is in a group of pattern"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Options().shared_input_layers({"query|key"}).validate(), c10::Error);  // no capture group
  EXPECT_THROW(Options().shared_input_layers({"(query"}).validate(), c10::Error);
  const auto pi_damped = Options().compute_method(ComputeMethod::kInverse).pi_damping(true);
  EXPECT_THROW(Options(pi_damped).shared_input_layers(kShared).validate(), c10::Error);
}

// Without the option, the first factor step names the layers that were given one tensor and the patterns that would
// share it, once; layers given other tensors (the key's copy) are not among them.
TEST(SharedInput, LayersGivenOneTensorAreSuggested) {
  for (const bool copy : {false, true}) {
    auto net = make_net();
    net->copy_for_key = copy;
    Preconditioner kfac(net, Options());
    testing::CapturedWarnings warnings;
    for (int64_t step = 0; step < 2; ++step) {
      net->zero_grad();
      loss(*net, step).backward();
      kfac.step();
    }
    std::vector<std::string> suggestions;
    for (const auto& m : warnings.messages) {
      if (m.find("were given one input tensor") != std::string::npos) suggestions.push_back(m);
    }
    ASSERT_EQ(suggestions.size(), 1u) << "once, at the first factor step";
    const auto& m = suggestions[0];
    EXPECT_NE(m.find("2 group(s)"), std::string::npos) << m;
    EXPECT_NE(m.find("'block0.query', 'block0.key', 'block0.value'"), std::string::npos) << m;
    // block1's key had a copy: block1's query and value only, whose short pattern would also match block0's query
    // and value: each pattern then names its block.
    const std::string patterns = copy ? "Options::shared_input_layers ['^block0\\.(query|key|value)$', "
                                        "'^block1\\.(query|value)$']"
                                      : "Options::shared_input_layers ['(query|key|value)$']";
    EXPECT_NE(m.find(patterns), std::string::npos) << m;
  }
  {
    auto net = make_net();
    Preconditioner kfac(net, Options().shared_input_layers(kShared));
    testing::CapturedWarnings warnings;
    loss(*net, 0).backward();
    kfac.step();
    for (const auto& m : warnings.messages) EXPECT_EQ(m.find("were given one input tensor"), std::string::npos) << m;
  }
}

struct ExactCase {
  std::string name;
  Options options;
};
class SharedInputExact : public ::testing::TestWithParam<ExactCase> {};

// The run that shares equals the run that does not, bit for bit; the followers alias their leader's A side, build
// no A factor, and the shared state is counted once.
TEST_P(SharedInputExact, EqualsSeparateFactorsBitForBit) {
  const auto& options = GetParam().options;
  auto separate_net = make_net();
  Preconditioner separate(separate_net, options);
  auto shared_net = make_net();
  Preconditioner shared(shared_net, Options(options).shared_input_layers(kShared));
  const auto expected = train(*separate_net, separate, 6);
  expect_equal(train(*shared_net, shared, 6), expected, GetParam().name);

  int64_t saved = 0;  // the followers' A side in the separate run
  for (size_t i = 0; i < shared.layers().size(); ++i) {
    const auto& layer = shared.layers()[i];
    const auto& alone = separate.layers()[i];
    if (!layer.follows_a()) {
      EXPECT_EQ(layer.state().size(), alone.state().size()) << layer.name();
      continue;
    }
    const auto& leader = shared.layers()[static_cast<size_t>(layer.a_leader())];
    EXPECT_TRUE(layer.a_factor().is_same(leader.a_factor())) << layer.name();
    EXPECT_TRUE(torch::equal(alone.a_factor(), separate.layers()[static_cast<size_t>(layer.a_leader())].a_factor()))
        << layer.name() << ": the copies the sharing run does without were equal";
    const auto& s = layer.second_order();
    EXPECT_TRUE(s.a_eigen.eigenvectors.is_same(leader.second_order().a_eigen.eigenvectors)) << layer.name();
    EXPECT_TRUE(s.a_inverse.is_same(leader.second_order().a_inverse)) << layer.name();
    for (const auto& [key, tensor] : layer.state()) EXPECT_NE(layer_state_entry(key)->side, 'a') << key;
    for (const auto& [key, tensor] : alone.state()) {
      if (layer_state_entry(key)->side == 'a') saved += bytes_of(tensor);
    }
  }
  EXPECT_GT(saved, 0);
  EXPECT_EQ(shared.memory_bytes(), separate.memory_bytes() - saved);
}

// Unpadded (pad_widths 1): separate factors put the members into one group of three units and sharing into one unit
// of three, which padded stacks would batch (and round) differently; bit for bit holds where each layer's products are
// the GEMMs it takes alone.
const ExactCase kExactCases[] = {
    {"eigen", Options().pad_widths(1)},
    {"inverse", Options().compute_method(ComputeMethod::kInverse).pad_widths(1)},
    {"eigen_adam", Options().eigen_adam(true).kl_clip(0).pad_widths(1)},
    {"eigh_interval_2", Options().eigh_interval(2).pad_widths(1)},
    {"reduce", Options().kfac_approx(KfacApprox::kReduce).pad_widths(1)},
    {"outer_product_every_step",
     Options().compute_eigenvalue_outer_product(false).inv_update_steps(3).pad_widths(1)},
    {"accumulation_and_intervals",
     Options().accumulation_steps(2).factor_update_steps(2).inv_update_steps(2).pad_widths(1)},
    {"float32_second_order", Options().inv_dtype(torch::kFloat32).pad_widths(1)},
};
INSTANTIATE_TEST_SUITE_P(Options, SharedInputExact, ::testing::ValuesIn(kExactCases),
                         [](const ::testing::TestParamInfo<ExactCase>& info) { return info.param.name; });

// A follower given another tensor than its leader (a copy) would get the wrong A: the step is refused, naming both.
TEST(SharedInput, AnotherInputIsRefusedNamingBothLayers) {
  auto net = make_net();
  net->copy_for_key = true;
  Preconditioner kfac(net, Options().shared_input_layers(kShared));
  loss(*net, 0).backward();
  try {
    kfac.step();
    ADD_FAILURE() << "a copy of the input was taken for the same tensor";
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    // Whichever of the two captured second finds the difference (C++ leaves the order of `*`'s operands open).
    const auto npos = std::string::npos;
    const bool key_first = what.find("'block1.key' (Linear) shares its A factor with 'block1.query'") != npos;
    const bool query_first = what.find("'block1.query' (Linear) shares its A factor with 'block1.key'") != npos;
    EXPECT_TRUE(key_first || query_first) << what;
    EXPECT_NE(what.find("was given another input at pass 1"), std::string::npos) << what;
  }
  // The same tensor again: accepted (the refused step's captures were dropped).
  net->copy_for_key = false;
  for (auto& p : net->parameters()) p.mutable_grad().zero_();
  loss(*net, 1).backward();
  EXPECT_NO_THROW(kfac.step());
}

// Under DP-KFAC only a group's owner captures its inputs: the ranks agree, and every rank refuses the step.
TEST(SharedInput, AnotherInputIsRefusedOnEveryRankWhereOnlyTheOwnerCaptures) {
  std::vector<std::string> errors(2);
  testing::run_ranks(2, [&](int rank, std::shared_ptr<comm::Communicator> communicator) {
    auto net = make_net();
    net->copy_for_key = true;
    Preconditioner kfac(net, Options().strategy(Strategy::kDp).shared_input_layers(kShared), communicator);
    loss(*net, 0, rank).backward();
    try {
      kfac.step();
    } catch (const c10::Error& e) {
      errors[rank] = e.what_without_backtrace();
    }
  });
  const auto& plan_owner = assign::assign_dp(
      Preconditioner(make_net(), Options().shared_input_layers(kShared)).plan().shapes, 2).layers[4].a_worker;
  const auto& owner = errors[static_cast<size_t>(plan_owner)];
  const auto& other = errors[static_cast<size_t>(1 - plan_owner)];
  EXPECT_NE(owner.find("was given another input at pass 1"), std::string::npos) << owner;
  EXPECT_NE(other.find("another rank found that the layers of a group were not given the same input"),
            std::string::npos)
      << other;
}

// Checkpoints hold the shared A once; a run that shares loads a checkpoint of one that did not, exactly; one that
// does not share refuses a checkpoint of one that did, naming the option.
TEST(SharedInput, CheckpointsHoldTheSharedFactorOnce) {
  const Options options = Options().inv_update_steps(2);
  auto separate_net = make_net();
  Preconditioner separate(separate_net, options);
  train(*separate_net, separate, 3);
  auto shared_net = make_net();
  Preconditioner shared(shared_net, Options(options).shared_input_layers(kShared));
  train(*shared_net, shared, 3);

  const auto round_trip = [](const Preconditioner& from, Preconditioner& into) {
    std::stringstream buffer;
    torch::serialize::OutputArchive out;
    from.save(out);
    out.save_to(buffer);
    torch::serialize::InputArchive in;
    in.load_from(buffer);
    into.load(in);
  };
  // The separate run's checkpoint into a sharing run: the next steps are the separate run's.
  auto continued_net = copy_of(*separate_net);
  Preconditioner continued(continued_net, Options(options).shared_input_layers(kShared));
  round_trip(separate, continued);
  expect_equal(train(*continued_net, continued, 3, 3), train(*separate_net, separate, 3, 3), "separate into shared");

  // The sharing run's checkpoint: its followers hold no A entry; into a separate run it is refused.
  std::vector<std::map<std::string, torch::Tensor>> states;
  for (const auto& layer : shared.layers()) states.push_back(layer.state());
  EXPECT_EQ(states[2].count("a_factor"), 0u);  // block0.key
  EXPECT_EQ(states[1].count("a_factor"), 1u);  // block0.query, its leader
  auto refusing_net = make_net();
  Preconditioner refusing(refusing_net, options);
  try {
    round_trip(shared, refusing);
    ADD_FAILURE() << "a separate run loaded a checkpoint without the followers' A factors";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("saved with shared_input_layers"), std::string::npos) << e.what();
  }
  EXPECT_EQ(refusing.steps(), 0) << "a refused load changes nothing";
  // And into a sharing run: the same next steps.
  auto resumed_net = copy_of(*shared_net);
  Preconditioner resumed(resumed_net, Options(options).shared_input_layers(kShared));
  round_trip(shared, resumed);
  expect_equal(train(*resumed_net, resumed, 3, 3), train(*shared_net, shared, 3, 3), "shared into shared");
}

// The plan places a group as one unit (one column, its A on one rank), computes and sends no follower's A, and
// predicts the bytes and memory that saves.
TEST(SharedInput, PlanPlacesAGroupAsOneUnitAndCountsItsAOnce) {
  auto net = make_net();
  const auto separate_shapes = Preconditioner(net, Options()).plan().shapes;
  const auto shapes = Preconditioner(make_net(), Options().shared_input_layers(kShared)).plan().shapes;
  ASSERT_EQ(shapes.size(), 8u);
  EXPECT_EQ(shapes[2].a_shared_with, 1);
  EXPECT_EQ(shapes[3].a_shared_with, 1);
  EXPECT_EQ(shapes[6].a_shared_with, 4);
  EXPECT_EQ(shapes[4].a_shared_with, -1);
  EXPECT_EQ(shapes[7].a_shared_with, -1);
  // Unpadded (pad_widths 1): padded stacks would add pads where a shared group is placed whole on one rank and the
  // separate layers are spread out (docs/MATH.md section 2.9), which this count is not about.
  for (const auto& options : {Options().grad_worker_fraction(0.0).pad_widths(1),
                              Options().grad_worker_fraction(0.5).colocate_factors(false).pad_widths(1),
                              Options().strategy(Strategy::kDp).pad_widths(1),
                              Options().strategy(Strategy::kSpd).spd(SpdOptions().redundant_dim(5).fusion({16}))
                                  .pad_widths(1)}) {
    const auto plan = strategy::make_step_plan(shapes, 4, options);
    const auto separate = strategy::make_step_plan(separate_shapes, 4, options);
    for (size_t i = 0; i < shapes.size(); ++i) {
      if (shapes[i].a_shared_with < 0) continue;
      const auto leader = static_cast<size_t>(shapes[i].a_shared_with);
      const auto& placed = plan.placement.layers[i];
      EXPECT_EQ(placed.grad_workers, plan.placement.layers[leader].grad_workers) << i;
      EXPECT_EQ(placed.a_worker, plan.placement.layers[leader].a_worker) << i;
      EXPECT_FALSE(plan.flows[i].broadcast_a) << i;
      for (int rank = 0; rank < 4; ++rank) {
        EXPECT_FALSE(plan.computes_a(i, rank)) << i;
        EXPECT_EQ(plan.builds_factors(i, rank), plan.builds_factors(leader, rank)) << i;
      }
    }
    EXPECT_NE(plan.describe().find("block0.key [a=7, g=5]: factors on"), std::string::npos) << plan.describe();
    EXPECT_NE(plan.describe().find("A shared with block0.query"), std::string::npos) << plan.describe();
    // What the followers' A would have cost: their factors (sent when reduced), their decompositions where held.
    const auto costs = strategy::predict(plan, 8, 3);
    const auto separate_costs = strategy::predict(separate, 8, 3);
    int64_t factor_bytes = 0, followers_a = 0;
    for (size_t i = 0; i < shapes.size(); ++i) {
      if (shapes[i].a_shared_with < 0) continue;
      followers_a += 1;
      factor_bytes += 8 * comm::packed_length(shapes[i].a_dim, plan.factor_triangles, false);
    }
    EXPECT_EQ(followers_a, 4);
    // Per rank the group placement may load ranks otherwise; summed over the ranks, every follower's A is gone.
    double memory = 0, separate_memory = 0, flops = 0, separate_flops = 0;
    for (int rank = 0; rank < 4; ++rank) {
      if (plan.reduction != strategy::FactorReduction::kNone) {
        EXPECT_EQ(costs[rank].factor_bytes, separate_costs[rank].factor_bytes - factor_bytes) << rank;
      }
      memory += static_cast<double>(costs[rank].memory_bytes);
      separate_memory += static_cast<double>(separate_costs[rank].memory_bytes);
      flops += costs[rank].decomposition_flops;
      separate_flops += separate_costs[rank].decomposition_flops;
    }
    EXPECT_LT(memory, separate_memory);
    EXPECT_LT(flops, separate_flops);
  }
  // Without groups the placement is the one it always was (assign_kaisa's own tests pin it).
  const auto a = assign::assign_kaisa(separate_shapes, 4, 0.5, assign::Balance::kCompute, false);
  auto no_groups = shapes;
  for (auto& s : no_groups) s.a_shared_with = -1;
  const auto b = assign::assign_kaisa(no_groups, 4, 0.5, assign::Balance::kCompute, false);
  for (size_t i = 0; i < shapes.size(); ++i) {
    EXPECT_EQ(a.layers[i].a_worker, b.layers[i].a_worker);
    EXPECT_EQ(a.layers[i].g_worker, b.layers[i].g_worker);
    EXPECT_EQ(a.layers[i].grad_workers, b.layers[i].grad_workers);
  }
}

// DP-KFAC's reference: one process without sharing; each layer's factors from its owner's batch (in the sharing
// run's placement: a group's owner is the one rank of its unit), the gradient the mean over every rank's batch.
std::vector<std::vector<std::vector<torch::Tensor>>> dp_reference(int world, const Options& options, int64_t steps) {
  const auto shapes = Preconditioner(make_net(), Options().shared_input_layers(kShared)).plan().shapes;
  const auto owners = assign::assign_dp(shapes, world);
  auto net = make_net();
  Preconditioner kfac(net, Options(options).strategy(Strategy::kKaisa));
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  std::vector<std::vector<torch::Tensor>> out;
  for (int64_t step = 0; step < steps; ++step) {
    sgd.zero_grad();
    for (int rank = 0; rank < world; ++rank) {
      for (size_t l = 0; l < kfac.layers().size(); ++l) {
        kfac.layers()[l].set_capture(kfac.is_factor_step(step) && owners.layers[l].a_worker == rank);
      }
      loss(*net, step, rank).backward();
    }
    for (auto& p : net->parameters()) p.mutable_grad().div_(world);
    kfac.step();
    out.push_back(grads_of(*net));
    sgd.step();
  }
  return std::vector<std::vector<std::vector<torch::Tensor>>>(world, out);
}

// Every strategy on 2 and 4 ranks (threads over Gloo): the sharing run equals the separate run of the same
// strategy, to 1e-10 (the factor reductions are grouped differently, so their sums are rounded differently), on
// every rank, and the ranks together hold less. (Not eigen_adam: Adam's first step scales each eigen-direction's
// gradient to lr whatever its size, so rounding noise in a null direction becomes a step there; one process
// compares it bit for bit.)
TEST(SharedInput, EveryStrategyEqualsSeparateFactors) {
  const Options base = Options().damping(0.01).kl_clip(1e-3).inv_update_steps(2).pad_widths(1);  // memory below
  const std::pair<int, Options> cases[] = {
      {2, Options(base).grad_worker_fraction(0.5).colocate_factors(false)},
      {4, Options(base).grad_worker_fraction(0.0)},
      {4, Options(base).grad_worker_fraction(1.0).symmetric_comm(true)},
      {4, Options(base).grad_worker_fraction(0.5).update_factors_in_hook(false)
              .compute_method(ComputeMethod::kInverse)},
      {2, Options(base).strategy(Strategy::kSpd).spd(SpdOptions().redundant_dim(0).profile_steps(1))},
      {4, Options(base).strategy(Strategy::kSpd).spd(SpdOptions().redundant_dim(6).fusion({3, 5, 8}))},
      {2, Options(base).strategy(Strategy::kDp)},
      {4, Options(base).strategy(Strategy::kDp).inv_update_steps(1)}};
  for (const auto& [world, options] : cases) {
    const std::string what = std::to_string(world) + " ranks, " + to_string(options.strategy()) + ", fraction " +
                             std::to_string(options.grad_worker_fraction());
    const auto run = [&, world = world](const Options& o) {
      std::vector<std::vector<std::vector<torch::Tensor>>> got(world);
      std::vector<int64_t> memory(world);
      testing::run_ranks(world, [&](int rank, std::shared_ptr<comm::Communicator> communicator) {
        auto net = make_net();
        Preconditioner kfac(net, o, communicator);
        torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
        for (int64_t step = 0; step < 5; ++step) {
          sgd.zero_grad();
          loss(*net, step, rank).backward();
          testing::average_gradients(*communicator, *net);
          kfac.step();
          got[rank].push_back(grads_of(*net));
          sgd.step();
        }
        memory[rank] = kfac.memory_bytes();
      });
      return std::pair{got, memory};
    };
    auto [expected, separate_memory] = run(options);
    // DP-KFAC's factors come from each owner's batch, and a group's placement may give a layer another owner than
    // it has alone: its reference is the owners' batches of the sharing run's placement.
    if (options.strategy() == Strategy::kDp) expected = dp_reference(world, options, 5);
    const auto [got, shared_memory] = run(Options(options).shared_input_layers(kShared));
    int64_t total_separate = 0, total_shared = 0;
    for (int rank = 0; rank < world; ++rank) {
      for (size_t step = 0; step < got[rank].size(); ++step) {
        for (size_t p = 0; p < got[rank][step].size(); ++p) {
          EXPECT_TENSOR_NEAR(got[rank][step][p], expected[rank][step][p], 1e-10)
              << what << " rank " << rank << " step " << step << " parameter " << p;
        }
      }
      total_separate += separate_memory[rank];
      total_shared += shared_memory[rank];
    }
    EXPECT_LT(total_shared, total_separate) << what;
  }
}

}  // namespace
}  // namespace dkfac
