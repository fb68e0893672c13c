#include "tools/models/models.h"

#include "dkfac/dkfac.h"

namespace dkfac::models {

const std::vector<std::string>& model_names() {
  static const std::vector<std::string> names = {"mlp", "cnn"};
  return names;
}

torch::nn::Sequential make_model(const std::string& name, int64_t channels, int64_t height, int64_t width,
                                 int64_t classes) {
  if (name == "mlp") {
    return torch::nn::Sequential(torch::nn::Flatten(), nn::Linear(channels * height * width, 512), torch::nn::ReLU(),
                                 nn::Linear(512, 256), torch::nn::ReLU(), nn::Linear(256, classes));
  }
  if (name == "cnn") {
    const int64_t h = height / 4;
    const int64_t w = width / 4;
    return torch::nn::Sequential(
        nn::Conv2d(torch::nn::Conv2dOptions(channels, 32, 3).padding(1)), torch::nn::ReLU(),
        torch::nn::MaxPool2d(2), nn::Conv2d(torch::nn::Conv2dOptions(32, 32, 3).padding(1)), torch::nn::ReLU(),
        torch::nn::MaxPool2d(2), torch::nn::Flatten(), nn::Linear(32 * h * w, 256), torch::nn::ReLU(),
        nn::Linear(256, classes));
  }
  std::string valid;
  for (const auto& n : model_names()) valid += (valid.empty() ? "" : ", ") + n;
  TORCH_CHECK(false, "unknown model '", name, "'; valid models: ", valid);
}

}  // namespace dkfac::models
