#include "tools/models/models.h"

#include "dkfac/dkfac.h"

#include <c10/util/StringUtil.h>

namespace dkfac::models {
namespace {

torch::nn::Conv2dOptions conv3x3(int64_t in, int64_t out, int64_t stride) {
  return torch::nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false);
}

/// ResNet basic block: conv-bn-relu-conv-bn plus shortcut, then relu.
struct BasicBlockImpl : torch::nn::Module {
  BasicBlockImpl(int64_t in, int64_t out, int64_t stride) {
    conv1 = register_module("conv1", nn::Conv2d(conv3x3(in, out, stride)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(out));
    conv2 = register_module("conv2", nn::Conv2d(conv3x3(out, out, 1)));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(out));
    if (stride != 1 || in != out) {
      shortcut = register_module(
          "shortcut", torch::nn::Sequential(nn::Conv2d(torch::nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)),
                                            torch::nn::BatchNorm2d(out)));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = torch::relu(bn1->forward(conv1->forward(x)));
    y = bn2->forward(conv2->forward(y));
    return torch::relu(y + (shortcut.is_empty() ? x : shortcut->forward(x)));
  }
  nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Sequential shortcut{nullptr};
};
TORCH_MODULE(BasicBlock);

torch::nn::Sequential resnet20(int64_t channels, int64_t classes) {
  torch::nn::Sequential net(nn::Conv2d(conv3x3(channels, 16, 1)), torch::nn::BatchNorm2d(16), torch::nn::ReLU());
  int64_t in = 16;
  for (int64_t stage = 0; stage < 3; ++stage) {
    const int64_t out = 16 << stage;
    for (int64_t block = 0; block < 3; ++block) {
      net->push_back(BasicBlock(in, out, stage > 0 && block == 0 ? 2 : 1));
      in = out;
    }
  }
  net->push_back(torch::nn::AdaptiveAvgPool2d(torch::nn::AdaptiveAvgPool2dOptions(1)));
  net->push_back(torch::nn::Flatten());
  net->push_back(nn::Linear(64, classes));
  return net;
}

torch::nn::Sequential autoencoder(int64_t inputs) {
  const std::vector<int64_t> widths = {inputs, 1000, 500, 250, 30, 250, 500, 1000, inputs};
  torch::nn::Sequential net{torch::nn::Flatten()};
  for (size_t i = 0; i + 1 < widths.size(); ++i) {
    net->push_back(nn::Linear(widths[i], widths[i + 1]));
    // Sigmoid units everywhere except the linear code layer and the output logits.
    const bool code = i == 3;
    const bool output = i + 2 == widths.size();
    if (!code && !output) net->push_back(torch::nn::Sigmoid());
  }
  return net;
}

}  // namespace

const std::vector<std::string>& model_names() {
  static const std::vector<std::string> names = {"mlp", "cnn", "resnet20", "autoencoder"};
  return names;
}

Task model_task(const std::string& name) {
  return name == "autoencoder" ? Task::kReconstruction : Task::kClassification;
}

torch::nn::Sequential make_model(const std::string& name, int64_t channels, int64_t height, int64_t width,
                                 int64_t classes) {
  if (name == "mlp") {
    return torch::nn::Sequential(torch::nn::Flatten(), nn::Linear(channels * height * width, 512), torch::nn::ReLU(),
                                 nn::Linear(512, 256), torch::nn::ReLU(), nn::Linear(256, classes));
  }
  if (name == "cnn") {
    return torch::nn::Sequential(
        nn::Conv2d(torch::nn::Conv2dOptions(channels, 32, 3).padding(1)), torch::nn::ReLU(),
        torch::nn::MaxPool2d(2), nn::Conv2d(torch::nn::Conv2dOptions(32, 32, 3).padding(1)), torch::nn::ReLU(),
        torch::nn::MaxPool2d(2), torch::nn::Flatten(), nn::Linear(32 * (height / 4) * (width / 4), 256),
        torch::nn::ReLU(), nn::Linear(256, classes));
  }
  if (name == "resnet20") return resnet20(channels, classes);
  if (name == "autoencoder") return autoencoder(channels * height * width);
  TORCH_CHECK(false, "unknown model '", name, "'; valid models: ", c10::Join(", ", model_names()));
}

}  // namespace dkfac::models
