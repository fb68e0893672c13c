// Every reference model runs forward/backward with K-FAC on inputs of each dataset's shape.
#include <gtest/gtest.h>

#include "dkfac/dkfac.h"
#include "tools/models/models.h"

namespace dkfac::models {
namespace {

// One intra-op thread: the step is small, and two OpenMP threads beside another test on a 2-core machine spun
// against it (all 8 models took over 300 s in a suite run beside a benchmark, 16 s alone).
class Models : public ::testing::TestWithParam<std::tuple<std::string, int64_t>> {
 protected:
  void SetUp() override {
    threads_ = at::get_num_threads();
    at::set_num_threads(1);
  }
  void TearDown() override { at::set_num_threads(threads_); }

 private:
  int threads_ = 1;
};

TEST_P(Models, TrainStepWithKfac) {
  const auto [name, channels] = GetParam();
  const int64_t side = channels == 3 ? 32 : 28;
  torch::manual_seed(0);
  auto model = make_model(name, channels, side, side, 10);
  Preconditioner kfac(model.ptr(), Options().damping(0.1));
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01));
  auto x = torch::rand({4, channels, side, side});
  auto y = torch::tensor({0, 1, 2, 3}, torch::kInt64);
  auto before = torch::cat({model->parameters()[0].detach().flatten().clone()});
  sgd.zero_grad();
  auto out = model->forward(x);
  torch::Tensor loss;
  if (model_task(name) == Task::kReconstruction) {
    ASSERT_EQ(out.sizes(), (std::vector<int64_t>{4, channels * side * side}));
    loss = torch::nn::functional::binary_cross_entropy_with_logits(out, x.flatten(1));
  } else {
    ASSERT_EQ(out.sizes(), (std::vector<int64_t>{4, 10}));
    loss = torch::nn::functional::cross_entropy(out, y);
  }
  loss.backward();
  kfac.step();
  sgd.step();
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
  EXPECT_FALSE(torch::equal(before, model->parameters()[0].detach().flatten()));
  for (const auto& p : model->parameters()) EXPECT_TRUE(torch::isfinite(p).all().item<bool>());
}

INSTANTIATE_TEST_SUITE_P(All, Models,
                         ::testing::Combine(::testing::Values("mlp", "cnn", "resnet20", "autoencoder"),
                                            ::testing::Values(1, 3)));

TEST(ModelsShape, LayerCounts) {
  auto count = [](const std::string& name) {
    auto m = make_model(name, 1, 28, 28, 10);
    Preconditioner p(m.ptr(), Options());
    return p.layers().size();
  };
  EXPECT_EQ(count("mlp"), 3u);
  EXPECT_EQ(count("cnn"), 4u);
  EXPECT_EQ(count("resnet20"), 1u + 18u + 2u + 1u);  // stem, 9 blocks x 2 convs, 2 projections, fc
  EXPECT_EQ(count("autoencoder"), 8u);
  EXPECT_THROW(make_model("vgg", 1, 28, 28, 10), c10::Error);
}

}  // namespace
}  // namespace dkfac::models
