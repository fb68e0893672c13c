#include <dkfac/dkfac.h>
#include <dkfac/strategy/prediction.h>

#include <iostream>

struct Net : torch::nn::Module {
  Net() {
    conv = register_module("conv", dkfac::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)));
    fc = register_module("fc", dkfac::nn::Linear(torch::nn::LinearOptions(4 * 8 * 8, 3)));
  }
  torch::Tensor forward(torch::Tensor x) { return fc->forward(torch::relu(conv->forward(x)).flatten(1)); }
  dkfac::nn::Conv2d conv{nullptr};
  dkfac::nn::Linear fc{nullptr};
};

int main() {
  torch::manual_seed(0);
  auto net = std::make_shared<Net>();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  dkfac::Preconditioner kfac(net, dkfac::Options().damping(3e-3));
  auto x = torch::randn({8, 1, 8, 8});
  auto y = torch::arange(8) % 3;
  double first = 0, last = 0;
  for (int step = 0; step < 5; ++step) {
    sgd.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
    loss.backward();
    kfac.step();
    sgd.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  std::cout << "dkfac " << DKFAC_VERSION_STRING << " consumer: loss " << first << " -> " << last << "\n";
  // The same loop through dkfac::optim::KFAC (its lr, SGD's 0.1, is the Options' default): the same losses.
  torch::manual_seed(0);
  auto again = std::make_shared<Net>();
  dkfac::optim::KFAC opt(again, std::make_shared<torch::optim::SGD>(again->parameters(), torch::optim::SGDOptions(0.1)),
                         dkfac::Options().damping(3e-3));
  double opt_last = 0;
  for (int step = 0; step < 5; ++step) {
    opt_last = opt.step([&] {
                    opt.zero_grad();
                    auto loss = torch::nn::functional::cross_entropy(again->forward(x), y);
                    loss.backward();
                    return loss;
                  }).item<double>();
  }
  // The same model's plan on 4 ranks under DP-KFAC, and its predicted cost, without running it.
  std::vector<dkfac::assign::LayerShape> shapes;
  for (const auto& layer : kfac.layers()) shapes.push_back({layer.name(), layer.a_dim(), layer.g_dim()});
  const auto plan = dkfac::strategy::make_step_plan(shapes, 4, dkfac::Options().strategy(dkfac::Strategy::kDp));
  const auto cost = dkfac::strategy::predict(plan, 4, 8);
  std::cout << kfac.plan().describe(false) << plan.describe();
  std::cout << "through dkfac::optim::KFAC: loss " << opt_last << " at step 5\n";
  return last < first && cost.size() == 4 && cost[0].factor_bytes == 0 && opt_last == last ? 0 : 1;
}
