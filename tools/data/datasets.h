#pragma once

#include <string>
#include <vector>

#include <torch/torch.h>

#include "tools/data/idx.h"

/// The datasets of `dkfac train`, loaded fully into memory.
namespace dkfac::data {

/// Names accepted by load_dataset(): fashion-mnist, mnist, cifar10, synthetic.
const std::vector<std::string>& dataset_names();

/// How stored uint8 pixels become model input: x = (pixels / 255 - mean[c]) / stddev[c], computed per batch
/// in float32 with the same operations, in the same order, as normalising the whole set once would.
struct Normalisation {
  std::vector<double> mean;    ///< per channel; empty: pixels / 255 only (autoencoder targets in [0, 1])
  std::vector<double> stddev;  ///< per channel
  bool per_channel = false;    ///< (x - mean tensor) / stddev tensor (CIFAR-10); else in-place scalar operations
};

/// A train/test pair and its geometry. Images are stored as they are in the files, uint8 [N, C, H, W]
/// (a quarter of float32), and converted to float model input one batch at a time by train_batch() and
/// test_batch(); the synthetic set is stored as float32 model input.
struct Dataset {
  std::string name;
  ImageSet train;
  ImageSet test;
  Normalisation normalisation;
  int64_t channels = 1;
  int64_t height = 28;
  int64_t width = 28;
  int64_t classes = 10;
  bool augment = false;  ///< random crop (pad 4) and horizontal flip during training (CIFAR)

  /// Float32 model input [n, C, H, W] of the training examples `indices` (int64 [n]), normalised.
  torch::Tensor train_batch(const torch::Tensor& indices) const;
  /// Float32 model input of the test examples [begin, end), normalised.
  torch::Tensor test_batch(int64_t begin, int64_t end) const;
  /// The model input of stored `images` (uint8 or already float).
  torch::Tensor to_input(const torch::Tensor& images) const;
};

/// Loads `name` from `dir` (empty: the Debian package path for fashion-mnist; required for mnist and
/// cifar10). `raw_pixels` keeps pixels in [0, 1] instead of normalising them (autoencoder targets).
/// Errors name the file and what is wrong with it, including images of other dimensions than the
/// dataset's (28 x 28 for mnist and fashion-mnist), which the models are built for.
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
