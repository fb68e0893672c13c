// Options::fold_in_hooks (docs/MATH.md section 1.8): each layer's factor batches folded into its running factors in
// its backward hook, where nothing is averaged across ranks. Exact: equal bit for bit to folding at step(), and no
// batch is held from the hook to step(); the layers and runs it leaves to step() fold there.

#include <gtest/gtest.h>

#include <functional>
#include <limits>

#include "dkfac/dkfac.h"
#include "dkfac/strategy/prediction.h"
#include "tests/multi_rank.h"
#include "tests/test_util.h"

namespace dkfac {
namespace {

// A convolution, two Linear layers, and two heads given one input (head and side): `reuse` runs `mid` twice in
// one forward; `side_first` runs side before head, `skip_side` leaves it out, `side_copy` gives it a copy of the input,
// `side_inf` makes side's output gradient NaN (its output enters the loss as sqrt(0 x), whose derivative is inf x 0).
struct Net : torch::nn::Module {
  Net() {
    conv = register_module("conv", nn::Conv2d(torch::nn::Conv2dOptions(2, 3, 3).padding(1)));
    fc = register_module("fc", nn::Linear(3 * 4 * 4, 8));
    mid = register_module("mid", nn::Linear(8, 8));
    head = register_module("head", nn::Linear(8, 3));
    side = register_module("side", nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(conv->forward(x)).flatten(1);
    h = torch::tanh(mid->forward(torch::tanh(fc->forward(h))));
    if (reuse) h = torch::tanh(mid->forward(h));
    if (skip_side) return head->forward(h);
    if (side_inf) return head->forward(h) + torch::sqrt(side->forward(h) * 0.0);
    if (side_first) {
      const auto s = torch::tanh(side->forward(side_copy ? h.clone() : h));
      return head->forward(h) + s;
    }
    return head->forward(h) + torch::tanh(side->forward(side_copy ? h.clone() : h));
  }
  nn::Conv2d conv{nullptr};
  nn::Linear fc{nullptr}, mid{nullptr}, head{nullptr}, side{nullptr};
  bool reuse = false, side_first = false, skip_side = false, side_copy = false, side_inf = false;
};

std::shared_ptr<Net> make_net() { return testing::seeded_float64<Net>(21); }

// One pass of micro-batch `micro` of `step` (rank `rank`'s data), its loss divided by `passes`.
void pass(Net& net, int64_t step, int64_t micro, int64_t passes, int rank = 0) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(900 + 17 * step + micro + 1000 * rank);
  const auto x = torch::randn({6, 2, 4, 4}, g, torch::kFloat64);
  const auto y = torch::randn({6, 3}, g, torch::kFloat64);
  ((net.forward(x) - y).pow(2).mean() / static_cast<double>(passes)).backward();
}

std::vector<torch::Tensor> grads_of(Net& net) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : net.parameters()) grads.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return grads;
}

void expect_same(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t p = 0; p < got.size(); ++p) {
    ASSERT_EQ(got[p].defined(), want[p].defined()) << what << ", tensor " << p;
    if (got[p].defined()) {
      EXPECT_TRUE(torch::allclose(got[p], want[p], 0.0, 0.0, /*equal_nan=*/true)) << what << ", tensor " << p;
    }
  }
}

std::vector<torch::Tensor> factors_of(const Preconditioner& kfac) {
  std::vector<torch::Tensor> factors;
  for (const auto& layer : kfac.layers()) {
    for (const auto* factor : {&layer.a_factor(), &layer.g_factor()}) {
      factors.push_back(factor->defined() ? factor->clone() : torch::Tensor());
    }
  }
  return factors;
}

// Bytes of captured batches the preconditioner's layers hold (what folding in the hook frees at once).
int64_t pending_bytes(const Preconditioner& kfac) {
  int64_t bytes = 0;
  for (const auto& layer : kfac.layers()) {
    const auto [a, g] = layer.capture().pending_bytes();
    bytes += a + g;
  }
  return bytes;
}

// The default (folded in the hooks) and fold_in_hooks off, each on a net from make_net(), stepped in lockstep.
struct Lockstep {
  explicit Lockstep(const Options& options)
      : hooked_net(make_net()),
        plain_net(make_net()),
        hooked(hooked_net, options),
        plain(plain_net, Options(options).fold_in_hooks(false)) {}
  std::vector<Net*> nets() { return {hooked_net.get(), plain_net.get()}; }
  /// Both step(); their factors, and unless `grads` is false their gradients, are the same bit for bit.
  void step(const std::string& what, bool grads = true) {
    hooked.step();
    plain.step();
    if (grads) expect_same(grads_of(*hooked_net), grads_of(*plain_net), what);
    expect_same(factors_of(hooked), factors_of(plain), what + " factors");
  }
  std::shared_ptr<Net> hooked_net, plain_net;
  Preconditioner hooked, plain;
};

// Net's layers in model order (Preconditioner::layers()).
enum LayerIndex : size_t { kConv, kFc, kMid, kHead, kSide };

struct Case {
  std::string name;
  Options options;
  int64_t passes;  // micro-batches per step (accumulation_steps)
};

class FoldInHooks : public ::testing::TestWithParam<Case> {};

// The default (folded in the hooks) against fold_in_hooks off, in lockstep: every step's gradients, KL clipping's
// scale and factors are the same bit for bit; from the second factor update on the batches are gone when the backward
// pass ends (held until step() with the option off), and the hooks' folds are timed as factor work.
TEST_P(FoldInHooks, EqualFoldingAtStepBitForBit) {
  const auto& param = GetParam();
  const auto options = Options(param.options).accumulation_steps(param.passes).kl_clip(1e-4);
  Lockstep runs(options);
  auto& hooked = runs.hooked;
  auto& plain = runs.plain;
  const int64_t factor_every = options.factor_update_steps_at(0);
  for (int64_t step = 0; step < 7; ++step) {
    for (auto* net : runs.nets()) {
      net->zero_grad();
      for (int64_t k = 0; k < param.passes; ++k) pass(*net, step, k, param.passes);
    }
    const std::string what = param.name + ", step " + std::to_string(step);
    if (step % factor_every == 0) {
      EXPECT_GT(pending_bytes(plain), 0) << what;
      // The first factor update folds at step(); every later one in the hooks.
      if (step == 0) EXPECT_GT(pending_bytes(hooked), 0) << what;
      if (step > 0) EXPECT_EQ(pending_bytes(hooked), 0) << what;
    }
    runs.step(what);
    EXPECT_EQ(hooked.last_kl_scale(), plain.last_kl_scale()) << what;
    if (step % factor_every == 0) EXPECT_GT(hooked.last_step_times()[KfacPhase::kFactors], 0.0) << what;
  }
  EXPECT_LT(hooked.last_kl_scale(), 1.0) << "KL clipping is exercised";
}

INSTANTIATE_TEST_SUITE_P(
    MethodsAndAccumulation, FoldInHooks,
    ::testing::Values(Case{"eigen", Options().inv_update_steps(2), 1},
                      Case{"inverse", Options().compute_method(ComputeMethod::kInverse).inv_update_steps(3), 1},
                      Case{"accumulation3", Options().inv_update_steps(2), 3},
                      Case{"factorEvery2", Options().factor_update_steps(2).inv_update_steps(4), 2},
                      // the decay the hook reads is its step's
                      Case{"decaySchedule",
                           Options().stack_layers(false).factor_decay([](int64_t s) { return 0.9 - 0.2 * (s % 3); }),
                           1}),
    [](const auto& info) { return info.param.name; });

// A step whose batches are not finite (a NaN input, step 3): factors kept and plain gradients on both runs, and the
// runs agree bit for bit before, at and after it.
TEST(FoldInHooksGuard, NonFiniteBatchKeepsTheFactors) {
  testing::CapturedWarnings warnings;
  Lockstep runs{Options()};
  std::vector<torch::Tensor> before;
  for (int64_t step = 0; step < 6; ++step) {
    if (step == 3) before = factors_of(runs.hooked);  // before the hooks fold
    for (auto* net : runs.nets()) {
      net->zero_grad();
      if (step == 3) {
        auto x = torch::randn({6, 2, 4, 4}, torch::kFloat64);
        x[0][0][0][0] = std::numeric_limits<double>::quiet_NaN();
        net->forward(x).pow(2).mean().backward();
      } else {
        pass(*net, step, 0, 1);
      }
    }
    runs.step("step " + std::to_string(step));
    if (step == 3) expect_same(factors_of(runs.hooked), before, "the non-finite step keeps the factors");
  }
  EXPECT_EQ(runs.hooked.events().fallbacks, runs.plain.events().fallbacks);
  EXPECT_GT(runs.hooked.events().fallbacks, 0);
}

// `mid` run twice in one forward (forward, forward, backward, backward) with accumulation_steps 2: its passes match
// the count, but a forward came before the last one's backward, so it folds at step() (as do the other layers, whose
// one pass does not match), and the run equals folding at step().
TEST(FoldInHooksAtStep, InterleavedPassesFoldAtStep) {
  testing::CapturedWarnings warnings;  // the other layers: "ran forward and backward 1 times" (both runs)
  Lockstep runs(Options().accumulation_steps(2));
  runs.hooked_net->reuse = runs.plain_net->reuse = true;
  const auto& mid = runs.hooked.layers()[kMid];
  ASSERT_EQ(mid.name(), "mid");
  for (int64_t step = 0; step < 4; ++step) {
    for (auto* net : runs.nets()) {
      net->zero_grad();
      pass(*net, step, 0, 1);
    }
    EXPECT_EQ(mid.captured_batches(), 2) << "step " << step;
    EXPECT_GT(mid.capture().pending_bytes().first, 0) << "step " << step;
    runs.step("step " + std::to_string(step));
  }
}

// An armed layer given more passes than accumulation_steps (steps 0-2 one pass, step 3 two) keeps the pass its hook
// folded, drops the later one with a warning naming the counts, and folds at step() from then on: its factors are
// those of a run that had only the first pass at step 3, and the later steps equal folding at step().
TEST(FoldInHooksAtStep, LatePassesAreDroppedAndNamed) {
  testing::CapturedWarnings warnings;
  Lockstep runs{Options()};
  for (int64_t step = 0; step < 6; ++step) {
    for (auto* net : runs.nets()) {
      net->zero_grad();
      pass(*net, step, 0, 1);
    }
    if (step == 3) pass(*runs.hooked_net, step, 1, 1);
    if (step > 3) EXPECT_GT(pending_bytes(runs.hooked), 0) << "step " << step << ": folds at step() again";
    runs.step("step " + std::to_string(step), /*grads=*/step != 3);  // step 3's second pass is the hooked run's
  }
  size_t named = 0;
  for (const auto& m : warnings.messages) {
    if (m.find("ran 1 forward and 1 backward passes after the 1 (accumulation_steps) its backward hook had folded "
               "into its factors this step; they are dropped") != std::string::npos) {
      ++named;
    }
  }
  EXPECT_EQ(named, runs.hooked.layers().size()) << warnings.all();
}

// Two backward passes of one forward (retain_graph: two G batches to one A) never arm a layer: its A and G counts
// differ, and step() averages the two G batches as with the option off.
TEST(FoldInHooksAtStep, TwoBackwardPassesOfOneForwardFoldAtStep) {
  testing::CapturedWarnings warnings;
  Lockstep runs{Options()};
  for (int64_t step = 0; step < 4; ++step) {
    for (auto* net : runs.nets()) {
      net->zero_grad();
      auto g = at::make_generator<at::CPUGeneratorImpl>(40 + step);
      const auto out = net->forward(torch::randn({6, 2, 4, 4}, g, torch::kFloat64));
      out.pow(2).mean().backward({}, /*retain_graph=*/true);
      out.sin().mean().backward();
    }
    EXPECT_GT(pending_bytes(runs.hooked), 0) << "step " << step;
    runs.step("step " + std::to_string(step));
  }
}

// A factor interval changed after the captures were armed for a factor step (a callable whose value changes by
// itself after step()): the step stays the factor step it was armed as, with the option on or off alike (it used to
// keep the hooks' fold while step() skipped the update, and the option off to carry the batch to the next factor
// step), and says so once. Preconditioner::rearm_capture (what an assignment of the interval calls in Python) arms
// the captures again before the forward pass: then the change applies to that step, without a warning.
TEST(FoldInHooksAtStep, IntervalChangedAfterArmingStandsAsArmed) {
  for (const bool rearm : {false, true}) {
    testing::CapturedWarnings warnings;
    std::vector<std::vector<torch::Tensor>> runs[2];
    for (const bool fold : {true, false}) {
      int64_t interval = 1;
      auto net = make_net();
      Preconditioner kfac(net, Options().fold_in_hooks(fold).factor_update_steps([&interval](int64_t) {
        return interval;
      }));
      for (int64_t step = 0; step < 6; ++step) {
        net->zero_grad();
        pass(*net, step, 0, 1);
        kfac.step();
        runs[fold].push_back(factors_of(kfac));
        if (step == 2) {
          interval = 2;  // step 3 was armed as a factor step
          if (rearm) EXPECT_TRUE(kfac.rearm_capture());
        }
      }
      EXPECT_EQ(pending_bytes(kfac), 0);
      const bool updated_at_3 = !torch::equal(runs[fold][2][0], runs[fold][3][0]);
      EXPECT_EQ(updated_at_3, !rearm) << (fold ? "fold" : "at step()");
    }
    for (size_t step = 0; step < runs[0].size(); ++step) {
      expect_same(runs[1][step], runs[0][step], "step " + std::to_string(step) + (rearm ? ", re-armed" : ""));
    }
    size_t changed = 0;  // besides the suggestion to share head's and side's input
    for (const auto& m : warnings.messages) {
      const bool ours = m.find("step 3 is a factor step, as the end of the last step() armed the captures") !=
                        std::string::npos;
      changed += ours;
      EXPECT_TRUE(ours || m.find("shared_input_layers") != std::string::npos) << m;
    }
    EXPECT_EQ(changed, rearm ? 0u : 2u) << warnings.all();  // once per preconditioner
  }
}

// rearm_capture changes nothing once a pass was captured for the step.
TEST(FoldInHooksAtStep, RearmAfterAPassChangesNothing) {
  int64_t interval = 1;
  auto net = make_net();
  Preconditioner kfac(net, Options().factor_update_steps([&interval](int64_t) { return interval; }));
  net->zero_grad();
  pass(*net, 0, 0, 1);
  interval = 2;
  EXPECT_FALSE(kfac.rearm_capture());
  kfac.step();
  EXPECT_TRUE(kfac.layers()[0].a_factor().defined()) << "step 0 stays a factor step";
}

// A shared-input group (head and side) folds as one, in the hook of whichever member's backward comes last, with
// either forward order and accumulation 1 or 3: equal bit for bit to folding at step(), no batch held from the
// second factor update on, and side's A still head's (the group's one factor).
TEST(FoldInHooksSharedInput, GroupFoldsAsOneBitForBit) {
  for (const bool side_first : {false, true}) {
    for (const int64_t passes : {1, 3}) {
      const auto options = Options().shared_input_layers({"(head|side)$"}).accumulation_steps(passes);
      Lockstep runs(options);
      runs.hooked_net->side_first = runs.plain_net->side_first = side_first;
      const std::string name = std::string(side_first ? "side first" : "head first") + ", " +
                               std::to_string(passes) + " passes";
      for (int64_t step = 0; step < 5; ++step) {
        for (auto* net : runs.nets()) {
          net->zero_grad();
          for (int64_t k = 0; k < passes; ++k) pass(*net, step, k, passes);
        }
        const auto& layers = runs.hooked.layers();
        if (step > 0) EXPECT_EQ(pending_bytes(runs.hooked), 0) << name << ", step " << step;
        runs.step(name + ", step " + std::to_string(step));
        ASSERT_TRUE(layers[kSide].follows_a());
        EXPECT_TRUE(layers[kSide].a_factor().is_same(layers[kHead].a_factor())) << name << ", step " << step;
      }
    }
  }
}

// A member left out of one step (side, under unused_layer_policy skip): its group has no complete set of passes, so
// nothing of it is folded in the hooks and step() gives both members their plain gradients, as with the option off;
// the next steps fold in the hooks again, equal bit for bit throughout.
TEST(FoldInHooksSharedInput, MemberLeftOutFoldsNothing) {
  testing::CapturedWarnings warnings;
  Lockstep runs(Options().shared_input_layers({"(head|side)$"}).unused_layer_policy(UnusedLayerPolicy::kSkip));
  for (int64_t step = 0; step < 6; ++step) {
    for (auto* net : runs.nets()) {
      net->skip_side = step == 3;
      net->zero_grad();
      pass(*net, step, 0, 1);
    }
    if (step == 3) EXPECT_GT(runs.hooked.layers()[kHead].capture().pending_bytes().first, 0);
    if (step == 4) EXPECT_EQ(pending_bytes(runs.hooked), 0);
    runs.step("step " + std::to_string(step));
  }
  EXPECT_EQ(runs.hooked.events().skipped_unused, runs.plain.events().skipped_unused);
  EXPECT_GT(runs.hooked.events().skipped_unused, 0);
}

// A member whose first G batch is not finite (side, step 0) has no factors after the first update, so it is not armed
// while its leader would be: the group is armed whole or not at all, so both are armed at the next update and fold in
// their hooks from step 2 on, equal bit for bit to folding at step().
TEST(FoldInHooksSharedInput, MemberWithoutFactorsLeavesTheGroupUnarmed) {
  testing::CapturedWarnings warnings;
  Lockstep runs(Options().shared_input_layers({"(head|side)$"}));
  for (int64_t step = 0; step < 5; ++step) {
    for (auto* net : runs.nets()) {
      net->side_inf = step == 0;
      net->zero_grad();
      pass(*net, step, 0, 1);
    }
    if (step == 0) {
      EXPECT_FALSE(runs.hooked.layers()[kSide].has_factors());
    } else if (step >= 2) {
      EXPECT_EQ(pending_bytes(runs.hooked), 0) << "step " << step;
    }
    runs.step("step " + std::to_string(step));
  }
}

// second_order_lag with a shared-input group: the update in flight holds the group's old A once (its leader's copy
// and its follower's alias it), as strategy::predict's in_flight_bytes counts it.
TEST(FoldInHooksSharedInput, LaggedUpdateHoldsTheGroupsOldAOnce) {
  auto net = make_net();
  Preconditioner kfac(net, Options().shared_input_layers({"(head|side)$"}).inv_update_steps(3).second_order_lag(2));
  for (int64_t step = 0; step < 5; ++step) {
    net->zero_grad();
    pass(*net, step, 0, 1);
    kfac.step();
    const auto predicted = strategy::predict(kfac.plan(), /*element_bytes=*/8, /*batch_size=*/1).at(0);
    if (step == 4) {  // step 3's update in flight, after step 4's factor update
      EXPECT_EQ(kfac.second_order_in_flight_bytes(), predicted.in_flight_bytes);
    } else if (step < 3) {
      EXPECT_EQ(kfac.second_order_in_flight_bytes(), 0) << "step " << step;
    }
  }
}

// A member given a copy of the group's input after the group was armed: its hook folds nothing, and the step is
// refused naming the layers, as with the option off, with both members' factors as they were.
TEST(FoldInHooksSharedInput, InputCopyAfterArmingFoldsNothing) {
  testing::CapturedWarnings warnings;
  Lockstep runs(Options().shared_input_layers({"(head|side)$"}));
  for (int64_t step = 0; step < 2; ++step) {
    for (auto* net : runs.nets()) {
      net->zero_grad();
      pass(*net, step, 0, 1);
    }
    runs.step("step " + std::to_string(step));
  }
  const auto before = factors_of(runs.hooked);
  for (auto* net : runs.nets()) {
    net->side_copy = true;
    net->zero_grad();
    pass(*net, 2, 0, 1);
  }
  for (auto* kfac : {&runs.hooked, &runs.plain}) {
    testing::expect_error([&] { kfac->step(); }, {"shares its A factor with", "side", "head"});
  }
  const auto after = factors_of(runs.hooked);
  for (const auto index : {kHead, kSide}) {
    for (const size_t part : {0, 1}) {
      EXPECT_TRUE(torch::equal(after[2 * index + part], before[2 * index + part])) << index << " " << part;
    }
  }
}

// Never folded in the hooks: a grad scaler, factors averaged across ranks (KAISA at 2 ranks).
TEST(FoldInHooksAtStep, WhereStepMustDecide) {
  const auto held_after_backward = [](const Options& options, LayerIndex layer) {
    auto net = make_net();
    Preconditioner kfac(net, options);
    int64_t held = 0;
    for (int64_t step = 0; step < 3; ++step) {
      net->zero_grad();
      pass(*net, step, 0, 1);
      held = kfac.layers()[layer].capture().pending_bytes().first;
      kfac.step();
    }
    return held;
  };
  EXPECT_EQ(held_after_backward(Options(), kFc), 0);
  EXPECT_GT(held_after_backward(Options().grad_scaler([] { return torch::ones({}, torch::kFloat64); }), kFc), 0);
  std::vector<int64_t> held(2);
  testing::run_ranks(2, [&](int rank, std::shared_ptr<comm::Communicator> communicator) {
    auto net = make_net();
    Preconditioner kfac(net, Options(), communicator);
    for (int64_t step = 0; step < 3; ++step) {
      net->zero_grad();
      pass(*net, step, 0, 1, rank);
      held[rank] = pending_bytes(kfac);
      testing::average_gradients(*communicator, *net);
      kfac.step();
    }
  });
  EXPECT_GT(held[0], 0);
  EXPECT_GT(held[1], 0);
}

// DP-KFAC at 2 ranks (each layer's owner keeps the factors of its own batch): folded in the owners' hooks, equal bit
// for bit to folding at step() on every rank.
TEST(FoldInHooksDistributed, DpKfacEqualsFoldingAtStep) {
  const auto run = [](const Options& options, std::vector<int64_t>* held) {
    std::vector<std::vector<std::vector<torch::Tensor>>> got(2);
    testing::run_ranks(2, [&](int rank, std::shared_ptr<comm::Communicator> communicator) {
      auto net = make_net();
      Preconditioner kfac(net, options, communicator);
      for (int64_t step = 0; step < 5; ++step) {
        net->zero_grad();
        pass(*net, step, 0, 1, rank);
        if (held && step > 0) (*held)[rank] += pending_bytes(kfac);
        testing::average_gradients(*communicator, *net);
        kfac.step();
        got[rank].push_back(grads_of(*net));
      }
    });
    return got;
  };
  const auto options = Options().strategy(Strategy::kDp).inv_update_steps(2).kl_clip(1e-4);
  std::vector<int64_t> held(2, 0), held_plain(2, 0);
  const auto hooked = run(options, &held);
  const auto plain = run(Options(options).fold_in_hooks(false), &held_plain);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(held[rank], 0) << "rank " << rank;
    EXPECT_GT(held_plain[rank], 0) << "rank " << rank << ": each rank owns some layer";
    for (size_t step = 0; step < hooked[rank].size(); ++step) {
      const auto what = "rank " + std::to_string(rank) + " step " + std::to_string(step);
      expect_same(hooked[rank][step], plain[rank][step], what);
    }
  }
}

}  // namespace
}  // namespace dkfac
