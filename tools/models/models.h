#pragma once

#include <string>
#include <vector>

#include <torch/torch.h>

/// Reference models of the dkfac command line, built from dkfac::nn layers (batch norm, pooling
/// and activations are plain torch modules).
namespace dkfac::models {

/// What a model is trained for.
enum class Task {
  kClassification,  ///< logits [B, classes], cross-entropy against int64 labels
  kReconstruction,  ///< logits [B, C*H*W], binary cross-entropy against the input pixels in [0, 1]
};

/// Names accepted by make_model(): mlp, cnn, resnet20, autoencoder.
const std::vector<std::string>& model_names();

/// The task of model `name`.
Task model_task(const std::string& name);

/// Builds `name` for inputs [B, channels, height, width] and `classes` outputs:
/// - "mlp": flatten -> 512 -> 256 -> classes, ReLU;
/// - "cnn": conv(C->32, 3, pad 1)-relu-maxpool-conv(32->32, 3, pad 1)-relu-maxpool-fc(->256)-relu-fc(256->classes);
/// - "resnet20": CIFAR ResNet-20 (He et al. 2016), 16/32/64 channels, batch norm, 1x1 projection shortcuts;
/// - "autoencoder": 784-1000-500-250-30 encoder and its mirror (sigmoid units, linear code), the deep
///   autoencoder of the original K-FAC paper; outputs pixel logits.
/// Throws c10::Error listing the valid names for an unknown one.
torch::nn::Sequential make_model(const std::string& name, int64_t channels, int64_t height, int64_t width,
                                 int64_t classes);

}  // namespace dkfac::models
