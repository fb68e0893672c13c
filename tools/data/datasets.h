#pragma once

#include <string>
#include <vector>

#include <torch/torch.h>

#include "tools/data/idx.h"

/// The datasets of `dkfac train`, loaded fully into memory.
namespace dkfac::data {

/// Names accepted by load_dataset(): fashion-mnist, mnist, cifar10, synthetic.
const std::vector<std::string>& dataset_names();

/// A train/test pair and its geometry.
struct Dataset {
  std::string name;
  ImageSet train;
  ImageSet test;
  int64_t channels = 1;
  int64_t height = 28;
  int64_t width = 28;
  int64_t classes = 10;
  bool augment = false;  ///< random crop (pad 4) and horizontal flip during training (CIFAR)
};

/// Loads `name` from `dir` (empty: the Debian package path for fashion-mnist; required for mnist and
/// cifar10). `raw_pixels` keeps pixels in [0, 1] instead of normalising them (autoencoder targets).
/// Errors name the file and what is wrong with it.
Dataset load_dataset(const std::string& name, const std::string& dir, bool raw_pixels);

/// CIFAR-10 binary batch files (each record: 1 label byte + 3072 pixel bytes) -> raw uint8 images
/// [N, 3, 32, 32] and labels [N]. Checks lengths and label range.
ImageSet read_cifar10(const std::vector<std::string>& files);
/// One CIFAR-10 file's bytes -> raw uint8 images [N, 3, 32, 32] and labels; `name` appears in the messages.
ImageSet parse_cifar10(const std::vector<uint8_t>& bytes, const std::string& name);

/// A learnable synthetic set: Gaussian images, labels from a fixed random linear teacher.
Dataset synthetic_dataset(int64_t train_size, int64_t test_size, int64_t seed);

/// Random crop of a zero-padded (4 pixels) image and horizontal flip, per example, from `generator`.
torch::Tensor augment_crop_flip(const torch::Tensor& images, at::Generator& generator);

}  // namespace dkfac::data
