// DataParallel (DDP's reducer under dkfac's communicator) against single-process references: averaged
// gradients, rank 0's start, BatchNorm buffers, and accumulation equal to the large batch.
#include "dkfac/parallel/data_parallel.h"

#include <gtest/gtest.h>

#include <mutex>

#include "tests/multi_rank.h"
#include "tests/test_util.h"

namespace dkfac::parallel {
namespace {

using testing::run_ranks;

struct Net : torch::nn::Module {
  explicit Net(bool batch_norm) {
    fc1 = register_module("fc1", torch::nn::Linear(5, 7));
    if (batch_norm) bn = register_module("bn", torch::nn::BatchNorm1d(7));
    fc2 = register_module("fc2", torch::nn::Linear(7, 3));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = fc1->forward(x);
    if (bn) x = bn->forward(x);
    return fc2->forward(torch::tanh(x));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};

std::shared_ptr<Net> make_net(uint64_t seed, bool batch_norm = false) {
  static std::mutex mutex;  // ranks are threads: seeding and drawing must not interleave
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(seed);
  auto net = std::make_shared<Net>(batch_norm);
  net->to(torch::kFloat64);
  return net;
}

// Examples [begin, end) of a fixed data set of 24.
std::pair<torch::Tensor, torch::Tensor> batch(int64_t begin, int64_t end) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(7);
  auto x = torch::randn({24, 5}, g, torch::kFloat64);
  auto y = torch::randn({24, 3}, g, torch::kFloat64);
  return {x.slice(0, begin, end), y.slice(0, begin, end)};
}

torch::Tensor loss_of(Net& net, int64_t begin, int64_t end) {
  auto [x, y] = batch(begin, end);
  return (net.forward(x) - y).pow(2).mean();
}

std::vector<torch::Tensor> grads_of(Net& net) {
  std::vector<torch::Tensor> out;
  for (const auto& p : net.parameters()) out.push_back(p.grad().clone());
  return out;
}

std::vector<torch::Tensor> state_of(Net& net) {
  std::vector<torch::Tensor> out;
  for (const auto& p : net.parameters()) out.push_back(p.detach().clone());
  for (const auto& b : net.buffers()) out.push_back(b.clone());
  return out;
}

class DataParallelTest : public ::testing::TestWithParam<std::tuple<int, double>> {};

// Each rank's gradient of its own examples, averaged: equal to the gradient of all examples on one
// process (equal shards, mean loss), whatever the bucket size; the buffers are reused across steps.
TEST_P(DataParallelTest, AveragesGradientsOverRanks) {
  const auto [world, bucket_mb] = GetParam();
  const int64_t shard = 24 / world;
  auto reference = make_net(1);
  loss_of(*reference, 0, 24).backward();
  const auto expected = grads_of(*reference);
  std::vector<std::vector<torch::Tensor>> got(world);
  std::vector<int64_t> traffic(world);
  run_ranks(world, [&](int rank, std::shared_ptr<comm::Communicator> communicator) {
    auto net = make_net(1);
    DataParallel dp(*net, communicator, DataParallelOptions{bucket_mb});
    for (int repeat = 0; repeat < 3; ++repeat) {
      net->zero_grad();
      dp.backward(loss_of(*net, rank * shard, (rank + 1) * shard));
    }
    got[rank] = grads_of(*net);
    traffic[rank] = communicator->traffic()["data_parallel"].bytes;
  });
  for (int rank = 0; rank < world; ++rank) {
    for (size_t p = 0; p < expected.size(); ++p) EXPECT_TENSOR_NEAR(got[rank][p], expected[p], 1e-12) << "param " << p;
    EXPECT_EQ(traffic[rank], 3 * 8 * (5 * 7 + 7 + 7 * 3 + 3)) << "3 steps of every float64 gradient";
  }
}

INSTANTIATE_TEST_SUITE_P(Buckets, DataParallelTest, ::testing::Combine(::testing::Values(2, 4),
                                                                       ::testing::Values(0.0001, 25.0)));

// Ranks seeded differently start from rank 0's parameters and buffers, as under DDP.
TEST(DataParallel, RanksStartFromRankZero) {
  const int world = 3;
  std::vector<std::vector<torch::Tensor>> states(world);
  run_ranks(world, [&](int rank, std::shared_ptr<comm::Communicator> communicator) {
    auto net = make_net(100 + rank, /*batch_norm=*/true);
    {
      torch::NoGradGuard no_grad;
      net->bn->running_mean.fill_(static_cast<double>(rank));
    }
    DataParallel dp(*net, communicator);
    states[rank] = state_of(*net);
  });
  const auto rank0 = state_of(*make_net(100, true));
  for (int rank = 0; rank < world; ++rank) {
    ASSERT_EQ(states[rank].size(), rank0.size());
    for (size_t k = 0; k < rank0.size(); ++k) {
      if (k == 6) {  // running_mean (after 6 parameters): rank 0 filled it with zeros
        EXPECT_TRUE(states[rank][k].eq(0).all().item<bool>()) << "rank " << rank;
      } else {
        EXPECT_TRUE(states[rank][k].equal(rank0[k])) << "rank " << rank << " tensor " << k;
      }
    }
  }
}

// BatchNorm statistics drift apart in training (each rank sees its own examples); broadcast_buffers
// gives every rank rank 0's before the next forward.
TEST(DataParallel, BroadcastBuffersKeepsBatchNormStatisticsConsistent) {
  const int world = 2;
  std::vector<std::vector<torch::Tensor>> before(world), after(world);
  run_ranks(world, [&](int rank, std::shared_ptr<comm::Communicator> communicator) {
    auto net = make_net(3, true);
    DataParallel dp(*net, communicator);
    dp.backward(loss_of(*net, rank * 12, (rank + 1) * 12));
    before[rank] = {net->bn->running_mean.clone(), net->bn->running_var.clone()};
    dp.broadcast_buffers();
    after[rank] = {net->bn->running_mean.clone(), net->bn->running_var.clone()};
  });
  EXPECT_FALSE(before[0][0].equal(before[1][0])) << "the ranks' statistics should differ before the broadcast";
  for (int k = 0; k < 2; ++k) {
    EXPECT_TRUE(after[1][k].equal(before[0][k]));
    EXPECT_TRUE(after[0][k].equal(before[0][k]));
  }
}

// K micro-batches of B/K with loss / K, averaged with the last only, equal one batch of B: gradients and
// the parameters after SGD steps. Nothing is communicated for the first K-1 micro-batches.
TEST(DataParallel, AccumulationEqualsTheLargeBatch) {
  const int world = 2;
  const int64_t k_steps = 3;
  const int64_t per_rank = 12, micro = per_rank / k_steps;
  std::vector<std::vector<torch::Tensor>> large(world), accumulated(world);
  std::vector<int64_t> calls(world);
  for (bool accumulate : {false, true}) {
    run_ranks(world, [&](int rank, std::shared_ptr<comm::Communicator> communicator) {
      auto net = make_net(5);
      DataParallel dp(*net, communicator);
      torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      for (int step = 0; step < 3; ++step) {
        sgd.zero_grad();
        const int64_t begin = rank * per_rank;
        if (!accumulate) {
          dp.backward(loss_of(*net, begin, begin + per_rank));
        } else {
          for (int64_t k = 0; k < k_steps; ++k) {
            auto loss = loss_of(*net, begin + k * micro, begin + (k + 1) * micro) / static_cast<double>(k_steps);
            dp.backward(loss, /*average=*/k + 1 == k_steps);
          }
        }
        sgd.step();
      }
      (accumulate ? accumulated : large)[rank] = state_of(*net);
      if (accumulate) calls[rank] = communicator->traffic()["data_parallel"].calls;
    });
  }
  for (int rank = 0; rank < world; ++rank) {
    for (size_t p = 0; p < large[rank].size(); ++p) {
      EXPECT_TENSOR_NEAR(accumulated[rank][p], large[rank][p], 1e-12) << "rank " << rank << " tensor " << p;
    }
    EXPECT_EQ(calls[rank], 3) << "one bucket per step, none for the micro-batches before the last";
  }
}

// A parameter a step does not use (fc2 skipped on every rank): its gradient averages to zero, the
// others to the single-process reference, as DDP with find_unused_parameters.
TEST(DataParallel, UnusedParameterGetsZero) {
  const int world = 2;
  auto reference = make_net(9);
  auto [x_all, y_all] = batch(0, 24);
  (reference->fc1->forward(x_all).sum(1, true) - y_all.slice(1, 0, 1)).pow(2).mean().backward();
  std::vector<std::vector<torch::Tensor>> got(world);
  run_ranks(world, [&](int rank, std::shared_ptr<comm::Communicator> communicator) {
    auto net = make_net(9);
    DataParallel dp(*net, communicator);
    for (int step = 0; step < 2; ++step) {
      net->zero_grad();
      auto [x, y] = batch(rank * 12, (rank + 1) * 12);
      dp.backward((net->fc1->forward(x).sum(1, true) - y.slice(1, 0, 1)).pow(2).mean());
    }
    got[rank] = {net->fc1->weight.grad().clone(), net->fc1->bias.grad().clone(),
                 net->fc2->weight.grad().defined() ? net->fc2->weight.grad().clone() : torch::Tensor()};
  });
  for (int rank = 0; rank < world; ++rank) {
    EXPECT_TENSOR_NEAR(got[rank][0], reference->fc1->weight.grad(), 1e-12);
    EXPECT_TENSOR_NEAR(got[rank][1], reference->fc1->bias.grad(), 1e-12);
    EXPECT_TRUE(!got[rank][2].defined() || got[rank][2].eq(0).all().item<bool>());
  }
}

// Module::load after construction gives the parameters new gradient accumulators: refused, not a
// silently local gradient.
TEST(DataParallel, ModelLoadedAfterConstructionIsRefused) {
  std::vector<std::string> errors(2);
  run_ranks(2, [&](int rank, std::shared_ptr<comm::Communicator> communicator) {
    auto net = make_net(4);
    DataParallel dp(*net, communicator);
    dp.backward(loss_of(*net, rank * 12, (rank + 1) * 12));
    torch::serialize::OutputArchive out;
    net->save(out);
    std::ostringstream bytes;
    out.save_to(bytes);
    torch::serialize::InputArchive in;
    std::istringstream input(bytes.str());
    in.load_from(input);
    net->load(in);
    try {
      dp.backward(loss_of(*net, rank * 12, (rank + 1) * 12));
    } catch (const c10::Error& e) {
      errors[rank] = e.what_without_backtrace();
    }
  });
  for (const auto& e : errors) EXPECT_NE(e.find("was replaced after DataParallel was built"), std::string::npos) << e;
}

// Ranks with different models: an error at construction, not a hang or a wrong average.
TEST(DataParallel, DifferentModelsAreAnError) {
  std::vector<std::string> errors(2);
  run_ranks(2, [&](int rank, std::shared_ptr<comm::Communicator> communicator) {
    auto net = make_net(1, /*batch_norm=*/false);
    std::vector<torch::Tensor> parameters = net->parameters();
    if (rank == 1) parameters.pop_back();
    try {
      DataParallel dp(parameters, {}, communicator);
    } catch (const c10::Error& e) {
      errors[rank] = e.what_without_backtrace();
    }
  });
  EXPECT_FALSE(errors[0].empty() && errors[1].empty());
}

}  // namespace
}  // namespace dkfac::parallel
