// The C++ API's run of the Python tests' "cnn" scenario, for test_cpp_api.py: reads the initial weights,
// the batches and the K-FAC settings that Python wrote with torch.save, trains with dkfac::nn modules and
// dkfac::Preconditioner, and writes every step's preconditioned gradients with torch::pickle_save; or, for the
// "optim_*" methods, with dkfac::optim::KFAC, and writes the parameters after every step.
#include <fstream>
#include <iostream>
#include <iterator>

#include <torch/torch.h>

#include "dkfac/dkfac.h"

namespace {

struct Cnn : torch::nn::Module {
  Cnn() {
    conv0 = register_module("0", dkfac::nn::Conv2d(torch::nn::Conv2dOptions(2, 4, 3).padding(1)));
    conv2 = register_module("2", dkfac::nn::Conv2d(torch::nn::Conv2dOptions(4, 4, 3).stride(2).bias(false)));
    fc = register_module("5", dkfac::nn::Linear(4 * 3 * 3, 5));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(conv2->forward(torch::relu(conv0->forward(x))));
    return fc->forward(h.flatten(1));
  }
  dkfac::nn::Conv2d conv0{nullptr}, conv2{nullptr};
  dkfac::nn::Linear fc{nullptr};
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: cpp_reference INPUT.pt OUTPUT.pt\n";
    return 2;
  }
  std::ifstream in(argv[1], std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto spec = torch::pickle_load(bytes).toGenericDict();
  // "eigen", "inverse", "eigen_adam", "eigen_refresh" (eigen with eigh_interval 2: step 3 refreshes) or "eigen_lag"
  // (second_order_lag 1: step 3's update is installed at step 4)
  const auto& name = spec.at("method").toStringRef();
  const auto method = name == "inverse" ? dkfac::ComputeMethod::kInverse : dkfac::ComputeMethod::kEigen;
  const bool eigen_adam = name == "eigen_adam";
  auto model = std::make_shared<Cnn>();
  {
    torch::NoGradGuard no_grad;
    auto weights = spec.at("weights").toList();
    auto params = model->parameters();
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(weights.get(i).toTensor());
  }
  auto inputs = spec.at("inputs").toList();
  auto targets = spec.at("targets").toList();
  auto loss_at = [&](size_t step) {
    return torch::nn::functional::cross_entropy(model->forward(inputs.get(step).toTensor()),
                                                targets.get(step).toTensor());
  };
  c10::List<torch::Tensor> out_tensors;
  auto write = [&] {
    auto out = torch::pickle_save(c10::IValue(out_tensors));
    std::ofstream(argv[2], std::ios::binary).write(out.data(), static_cast<std::streamsize>(out.size()));
  };
  if (name == "optim_sgd" || name == "optim_eigen_adam" || name == "optim_graft") {
    // dkfac::optim::KFAC against Python's dkfac.optim.KFAC: SGD with momentum and an lr set before each step (as a
    // scheduler sets it; KL clipping follows it), the same SGD grafted (LibTorch's SGD and torch's take the same
    // steps; their AdamWs differ by rounding), or AdamW with eigen_adam (Adam's betas from the base, AdamW stepping
    // no parameter of this model); the parameters after each step.
    const bool adam = name == "optim_eigen_adam";
    const bool graft = name == "optim_graft";  // AdamW's step length along K-FAC's direction
    std::shared_ptr<torch::optim::Optimizer> base;
    if (adam) {
      base = std::make_shared<torch::optim::AdamW>(
          model->parameters(), torch::optim::AdamWOptions(3e-3).betas({0.8, 0.95}).weight_decay(0.1));
    } else {
      base = std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    }
    dkfac::optim::KFAC opt(model, base, dkfac::Options()
                                            .factor_update_steps(spec.at("factor_update_steps").toInt())
                                            .inv_update_steps(spec.at("inv_update_steps").toInt())
                                            .damping(spec.at("damping").toDouble())
                                            .kl_clip(adam ? 0.0 : 0.001)
                                            .eigen_adam(adam)
                                            .inv_dtype(torch::kFloat32),
                           nullptr, dkfac::optim::KFACOptions().graft(graft));
    const auto lrs = spec.at("lrs").toTensor();  // float64, one per step
    for (size_t step = 0; step < inputs.size(); ++step) {
      opt.base().param_groups()[0].options().set_lr(lrs[static_cast<int64_t>(step)].item<double>());
      opt.zero_grad();
      loss_at(step).backward();
      opt.step();
      for (const auto& p : model->parameters()) out_tensors.push_back(p.detach().clone());
    }
    write();
    return 0;
  }
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  dkfac::Preconditioner kfac(model, dkfac::Options()
                                        .factor_update_steps(spec.at("factor_update_steps").toInt())
                                        .inv_update_steps(spec.at("inv_update_steps").toInt())
                                        .damping(spec.at("damping").toDouble())
                                        .lr(0.1)
                                        .kl_clip(eigen_adam ? 0.0 : 0.001)
                                        .compute_method(method)
                                        .eigen_adam(eigen_adam)
                                        .eigh_interval(name == "eigen_refresh" ? 2 : 1)
                                        .second_order_lag(name == "eigen_lag" ? 1 : 0)
                                        .inv_dtype(torch::kFloat32));
  for (size_t step = 0; step < inputs.size(); ++step) {
    sgd.zero_grad();
    loss_at(step).backward();
    kfac.step();
    for (const auto& p : model->parameters()) out_tensors.push_back(p.grad().clone());
    sgd.step();
  }
  write();
  return 0;
}
