// comm::first_difference and the Preconditioner's agreement check at construction: ranks (threads of this
// process over real Gloo groups) that built their preconditioners differently all fail, naming the difference,
// instead of hanging in collectives that differ or aborting in Gloo.
#include "dkfac/comm/agreement.h"

#include <gtest/gtest.h>

#include <chrono>
#include <mutex>
#include <set>

#include "dkfac/dkfac.h"
#include "tests/multi_rank.h"

namespace dkfac::comm {
namespace {

using testing::run_ranks;

// Each rank's result of first_difference over `lines_of(rank)`, and the setup traffic it cost.
std::vector<std::pair<std::string, Traffic>> run(int world, const std::function<std::vector<std::string>(int)>& lines_of) {
  std::vector<std::pair<std::string, Traffic>> out(world);
  run_ranks(world, [&](int rank, std::shared_ptr<Communicator> communicator) {
    out[rank].first = first_difference(*communicator, kWorld, lines_of(rank));
    out[rank].second = communicator->traffic()["setup"];
  });
  return out;
}

TEST(FirstDifference, AgreeingRanksCostOneAllreduce) {
  const auto got = run(3, [](int) { return std::vector<std::string>{"2 layers", "damping=0.001"}; });
  for (const auto& [difference, traffic] : got) {
    EXPECT_EQ(difference, "");
    EXPECT_EQ(traffic.calls, 1);
    EXPECT_EQ(traffic.bytes, 3 * 4 * 8);  // 3 ranks x 4 parts of the hash, float64
  }
}

TEST(FirstDifference, EveryRankNamesTheLowestDifferingRankAndItsLine) {
  const auto got = run(4, [](int rank) {
    return std::vector<std::string>{"2 layers", rank >= 2 ? "damping=0.01" : "damping=0.001", "lr=0.1"};
  });
  for (const auto& [difference, traffic] : got) {
    EXPECT_EQ(difference, "rank 2 has 'damping=0.01' where rank 0 has 'damping=0.001'");
  }
}

// Every rank learns the lowest refusing rank's refusal (ranks 1 and 3 refuse here), or "" where none refused.
TEST(FirstRefusal, EveryRankNamesTheLowestRefusingRankAndItsReason) {
  std::vector<std::string> refusals(4), none(4);
  run_ranks(4, [&](int rank, std::shared_ptr<Communicator> communicator) {
    refusals[rank] = first_refusal(*communicator, rank % 2 == 1 ? "no entry for layer 'fc" + std::to_string(rank) +
                                                                      "'" : "");
    none[rank] = first_refusal(*communicator, "");
  });
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(refusals[rank], "rank 1: no entry for layer 'fc1'") << rank;
    EXPECT_EQ(none[rank], "") << rank;
  }
}

TEST(FirstDifference, NamesAnExtraOrMissingLine) {
  auto extra = run(2, [](int rank) {
    std::vector<std::string> lines{"a", "b"};
    if (rank == 1) lines.push_back("c");
    return lines;
  });
  EXPECT_EQ(extra[0].first, "rank 1 has 'c' where rank 0 has nothing more");
  EXPECT_EQ(extra[1].first, extra[0].first);
  auto missing = run(2, [](int rank) { return rank == 1 ? std::vector<std::string>{"a"} : std::vector<std::string>{"a", "b"}; });
  EXPECT_EQ(missing[1].first, "rank 1 has nothing more where rank 0 has 'b'");
}

// A small model whose layers and options the ranks may change.
std::shared_ptr<torch::nn::Sequential> model(int64_t hidden) {
  static std::mutex mutex;  // ranks are threads: seeding and drawing must not interleave
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(0);
  return std::make_shared<torch::nn::Sequential>(nn::Linear(4, hidden), torch::nn::Tanh(), nn::Linear(hidden, 2));
}

// Builds a preconditioner on each of 2 ranks with `options_of(rank)` and `hidden_of(rank)`; returns each
// rank's error ("" if it built), within a bound that a hang would break.
std::vector<std::string> build(const std::function<Options(int)>& options_of,
                               const std::function<int64_t(int)>& hidden_of = [](int) { return 8; }) {
  std::vector<std::string> errors(2);
  const auto start = std::chrono::steady_clock::now();
  run_ranks(2, [&](int rank, std::shared_ptr<Communicator> communicator) {
    try {
      const auto net = model(hidden_of(rank));
      Preconditioner kfac(net->ptr(), options_of(rank), communicator);
    } catch (const c10::Error& e) {
      errors[rank] = e.what_without_backtrace();
    }
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20)) << "no hang";
  return errors;
}

TEST(RanksAgree, SameOptionsAndLayersBuild) {
  const auto errors = build([](int) { return Options().damping(0.003).grad_worker_fraction(0.5); });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

TEST(RanksAgree, DifferentDampingFailsOnEveryRankNamingIt) {
  const auto errors = build([](int rank) { return Options().damping(rank == 0 ? 1e-3 : 1e-2); });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("the ranks built their preconditioners differently: rank 1 has 'damping=0.01' where rank 0 "
                     "has 'damping=0.001'"), std::string::npos) << e;
  }
}

TEST(RanksAgree, DifferentStrategiesFailInsteadOfStartingDifferentCollectives) {
  // SPD-KFAC measures the link and the decomposition speed at construction, KAISA does not: without the
  // check, the ranks would wait for each other in different collectives.
  const auto errors = build([](int rank) { return Options().strategy(rank == 0 ? Strategy::kKaisa : Strategy::kSpd); });
  for (const auto& e : errors) EXPECT_NE(e.find("rank 1 has 'strategy=spd' where rank 0 has 'strategy=kaisa'"), std::string::npos) << e;
}

TEST(RanksAgree, DifferentLayerShapesFailNamingTheFirstLayer) {
  const auto errors = build([](int) { return Options(); }, [](int rank) { return rank == 0 ? 8 : 6; });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("rank 1 has 'layer 0 '0': Linear, weight [6, 4] Float, bias' where rank 0 has 'layer 0 '0': "
                     "Linear, weight [8, 4] Float, bias'"), std::string::npos) << e;
  }
}

// Schedules (functions of the step, as every Python hyper-parameter is) cannot be compared when built: their
// values are, at the start of every step. `damping_of(rank, step)` and `interval_of(rank, step)` per rank;
// returns each rank's error and the step it came at (-1: none in 4 steps).
std::vector<std::pair<std::string, int64_t>> train(const std::function<double(int, int64_t)>& damping_of,
                                                   const std::function<int64_t(int, int64_t)>& interval_of) {
  std::vector<std::pair<std::string, int64_t>> out(2, {"", -1});
  run_ranks(2, [&](int rank, std::shared_ptr<Communicator> communicator) {
    const auto net = model(8);
    Options options;
    options.damping(std::function<double(int64_t)>([&, rank](int64_t step) { return damping_of(rank, step); }));
    options.factor_update_steps(std::function<int64_t(int64_t)>([&, rank](int64_t step) { return interval_of(rank, step); }));
    Preconditioner kfac(net->ptr(), options, communicator);
    for (int64_t step = 0; step < 4; ++step) {
      (*net)->zero_grad();
      (*net)->forward(torch::randn({5, 4})).pow(2).sum().backward();
      for (auto& p : (*net)->parameters()) communicator->allreduce_mean(p.mutable_grad(), kWorld, Purpose::kDataParallel).wait();
      try {
        kfac.step();
      } catch (const c10::Error& e) {
        out[rank] = {e.what_without_backtrace(), step};
        return;
      }
    }
  });
  return out;
}

TEST(RanksAgree, SchedulesAreComparedByTheirValuesEachStep) {
  const auto same = train([](int, int64_t) { return 0.003; }, [](int, int64_t) { return 1; });
  EXPECT_EQ(same[0], std::make_pair(std::string(), int64_t{-1}));
  EXPECT_EQ(same[1], same[0]);
  const auto damping = train([](int rank, int64_t step) { return rank == 1 && step >= 2 ? 0.01 : 0.003; },
                             [](int, int64_t) { return 1; });
  for (const auto& [error, step] : damping) {
    EXPECT_EQ(step, 2);
    EXPECT_NE(error.find("the ranks' hyper-parameters differ at K-FAC step 2: rank 1 has damping=0.01 where rank 0 "
                         "has damping=0.003"), std::string::npos) << error;
  }
  // Intervals that differ would make the ranks' factor collectives differ: refused before any of them.
  const auto interval = train([](int, int64_t) { return 0.003; }, [](int rank, int64_t) { return rank + 1; });
  for (const auto& [error, step] : interval) {
    EXPECT_EQ(step, 0);
    EXPECT_NE(error.find("rank 1 has factor_update_steps=2 where rank 0 has factor_update_steps=1"), std::string::npos) << error;
  }
  // An interval that changes on one rank from step 3: the end of step 2 arms step 3's captures (rank 0 captures,
  // rank 1 does not, and the capture hooks start factor collectives), so step 2 refuses it already.
  const auto later = train([](int, int64_t) { return 0.003; }, [](int rank, int64_t step) { return rank == 1 && step >= 3 ? 2 : 1; });
  for (const auto& [error, step] : later) {
    EXPECT_EQ(step, 2);
    EXPECT_NE(error.find("rank 1 has factor_update_steps at step 3=2 where rank 0 has factor_update_steps at step 3=1"),
              std::string::npos) << error;
  }
}

// A model whose middle layer some ranks skip at some steps (stochastic depth; DDP's find_unused_parameters).
struct Skippy : torch::nn::Module {
  Skippy() {
    a = register_module("a", nn::Linear(4, 6));
    b = register_module("b", nn::Linear(6, 6));
    c = register_module("c", nn::Linear(6, 2));
  }
  torch::Tensor forward(const torch::Tensor& x, bool skip_b) {
    auto h = torch::tanh(a->forward(x));
    if (!skip_b) h = h + torch::tanh(b->forward(h));
    return c->forward(h);
  }
  nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};

class SkippedOnOneRank : public ::testing::TestWithParam<Options> {};

// With unused_layer_policy skip, a layer that one rank skipped used to abort the job (the factor allreduce
// sizes differed between ranks). Now the ranks agree at every step: such a layer keeps its plain gradient on
// every rank that step, the others are preconditioned, and the ranks stay identical. (DP-KFAC builds a layer's
// factors from its owner's batch alone: there the layer is left plain only where its owner skipped it.)
TEST_P(SkippedOnOneRank, EveryRankKeepsThatLayersPlainGradientAndTrainsOn) {
  const std::set<int64_t> skipped_steps = {1, 2};
  std::vector<std::vector<std::vector<torch::Tensor>>> got(2), plain(2);
  bool skipping_rank_needs_b = true;  // whether rank 1's capture of b counts (every strategy but DP: yes)
  run_ranks(2, [&](int rank, std::shared_ptr<Communicator> communicator) {
    std::shared_ptr<Skippy> net;
    {
      static std::mutex mutex;
      std::lock_guard<std::mutex> lock(mutex);
      torch::manual_seed(0);
      net = std::make_shared<Skippy>();
    }
    Preconditioner kfac(net, Options(GetParam()).unused_layer_policy(UnusedLayerPolicy::kSkip), communicator);
    if (rank == 1) skipping_rank_needs_b = kfac.executor()->builds_factors(1);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    for (int64_t step = 0; step < 4; ++step) {
      sgd.zero_grad();
      auto g = at::make_generator<at::CPUGeneratorImpl>(100 * step + rank);
      const bool skip = rank == 1 && skipped_steps.count(step) > 0;
      net->forward(torch::randn({5, 4}, g), skip).pow(2).sum().backward();
      for (auto& p : net->parameters()) {  // as DDP: an unused parameter's gradient is zero
        if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
        communicator->allreduce_mean(p.mutable_grad(), kWorld, Purpose::kDataParallel).wait();
      }
      std::vector<torch::Tensor> before;
      for (const auto& p : net->parameters()) before.push_back(p.grad().clone());
      kfac.step();
      std::vector<torch::Tensor> after;
      for (const auto& p : net->parameters()) after.push_back(p.grad().clone());
      plain[rank].push_back(before);
      got[rank].push_back(after);
      sgd.step();
    }
  });
  // Parameters in registration order: a.weight, a.bias, b.weight, b.bias, c.weight, c.bias.
  for (int64_t step = 0; step < 4; ++step) {
    for (size_t p = 0; p < got[0][step].size(); ++p) {
      EXPECT_TRUE(torch::equal(got[0][step][p], got[1][step][p])) << "ranks differ: step " << step << " param " << p;
      const bool of_b = p == 2 || p == 3;
      const bool left_plain = of_b && skipped_steps.count(step) > 0 && skipping_rank_needs_b;
      EXPECT_EQ(torch::equal(got[0][step][p], plain[0][step][p]), left_plain) << "step " << step << " param " << p;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, SkippedOnOneRank,
                         ::testing::Values(Options().grad_worker_fraction(0.5), Options(),
                                           Options().strategy(Strategy::kDp)));

}  // namespace
}  // namespace dkfac::comm
