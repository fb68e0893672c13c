#pragma once

#include <string>
#include <vector>

#include <torch/torch.h>

/// Reference models of the dkfac command line, built from dkfac::nn layers.
namespace dkfac::models {

/// Names accepted by make_model().
const std::vector<std::string>& model_names();

/// Builds `name` for inputs of `channels` x `height` x `width` and `classes` outputs:
/// - "mlp": flatten -> 512 -> 256 -> classes, ReLU;
/// - "cnn": conv(C->32, 3, pad 1)-relu-maxpool-conv(32->32, 3, pad 1)-relu-maxpool-fc(->256)-relu-fc(256->classes).
/// Throws c10::Error listing the valid names for an unknown one.
torch::nn::Sequential make_model(const std::string& name, int64_t channels, int64_t height, int64_t width,
                                 int64_t classes);

}  // namespace dkfac::models
