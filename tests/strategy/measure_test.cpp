// One measurement path (strategy/measure.h): the link fit, and SPD-KFAC's threshold taken alike by
// `strategy spd` and by strategy auto's SPD-KFAC candidate.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "dkfac/nn/linear.h"
#include "dkfac/preconditioner.h"
#include "dkfac/strategy/measure.h"
#include "dkfac/strategy/time_model.h"
#include "tests/multi_rank.h"
#include "tests/strategy/uniform_rates.h"

namespace dkfac::strategy {
namespace {

using dkfac::testing::run_ranks;

TEST(Measure, FitLinkRecoversALineAndKeepsItNonNegative) {
  std::vector<double> seconds;
  for (double bytes : link_bytes()) seconds.push_back(20e-6 + 0.5e-9 * bytes);
  const auto link = fit_link(seconds);
  EXPECT_NEAR(link.alpha, 20e-6, 1e-12);
  EXPECT_NEAR(link.beta, 0.5e-9, 1e-16);
  // Start-up noise that makes larger messages look faster has no non-negative slope: a start-up alone.
  const auto flat = fit_link({4e-4, 3e-4, 2e-4, 1e-4});
  EXPECT_EQ(flat.beta, 0.0);
  EXPECT_GT(flat.alpha, 0.0);
  EXPECT_THROW(fit_link({1e-5, 2e-5}), c10::Error);
}

// `strategy spd` measures its link and decomposition probe when it is built; strategy auto predicts an SPD-KFAC
// candidate from Rates. Rates that hold that same measurement (the allreduce link, the decomposition table at the
// probe dimension) give auto's candidate the threshold the running job measured, so the two never plan one job
// two ways.
TEST(Measure, SpdAndAutosSpdCandidateTakeTheSameThresholdFromOneMeasurement) {
  run_ranks(2, [](int, std::shared_ptr<comm::Communicator> communicator) {
    torch::manual_seed(0);
    auto net = torch::nn::Sequential(nn::Linear(96, 48), nn::Linear(48, 8));
    Preconditioner spd(net.ptr(), Options().strategy(Strategy::kSpd), communicator);
    const auto& m = spd.executor()->spd_measurement();
    ASSERT_TRUE(m.measured);
    ASSERT_GT(m.probe_seconds, 0.0);
    ASSERT_GE(m.redundant_dim, 0);
    EXPECT_EQ(spd.plan().redundant_dim, m.redundant_dim);
    EXPECT_EQ(m.redundant_dim, spd_redundant_dim(m.probe_seconds, m.link, c10::kFloat, ComputeMethod::kEigen));

    auto rates = dkfac::testing::uniform_rates(1e-11, m.link.alpha, m.link.beta, 2, ComputeMethod::kEigen, c10::kFloat);
    rates.decomposition = DecompositionRate{{kSpdProbeDim}, {m.probe_seconds}};
    EXPECT_EQ(rates.spd_redundant_dim(2), m.redundant_dim);
    const auto choice = choose_strategy(layer_shapes(spd.layers()), 2, Options(), rates, kNoMemoryBudget, 32, {1, 1});
    bool found = false;
    for (const auto& c : choice.candidates) {
      if (c.options.strategy() != Strategy::kSpd) continue;
      found = true;
      EXPECT_EQ(c.plan.redundant_dim, m.redundant_dim) << c.name;
    }
    EXPECT_TRUE(found) << "strategy auto offered no SPD-KFAC candidate";
  });
}

}  // namespace
}  // namespace dkfac::strategy
