#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

/// Readers for the IDX files of MNIST and Fashion-MNIST (gzip-compressed or plain).
namespace dkfac::data {

/// Images of an IDX3 file (magic 0x00000803) as uint8 [N, rows, cols]. Throws c10::Error naming the
/// file and the defect: wrong magic, zero or absurd dimensions, truncated data, trailing bytes.
torch::Tensor read_idx_images(const std::string& path);

/// Labels of an IDX1 file (magic 0x00000801) as int64 [N]; every label must be < `num_classes`.
torch::Tensor read_idx_labels(const std::string& path, int64_t num_classes = 10);

/// What the readers do with a file's (decompressed) bytes; `name` appears in the messages.
torch::Tensor parse_idx_images(const std::vector<uint8_t>& bytes, const std::string& name);
torch::Tensor parse_idx_labels(const std::vector<uint8_t>& bytes, const std::string& name, int64_t num_classes = 10);

/// A labelled image set: images [N, C, H, W] (uint8 as read, or float32 normalised), labels int64 [N].
struct ImageSet {
  torch::Tensor images;
  torch::Tensor labels;
  std::string source;  ///< the files read ("'dir/train-images-idx3-ubyte.gz', '...labels...'"); empty: generated
  int64_t size() const { return labels.size(0); }
};

/// Reads `train` or `t10k` images (uint8 [N, 1, H, W]) and labels of an MNIST-style directory (files with
/// or without .gz); checks that both files hold the same number of examples and, when `rows` and `cols`
/// are > 0, that the images are rows x cols (the message names the file, both sizes and `dataset`).
ImageSet read_mnist_style(const std::string& dir, bool train, int64_t rows = 0, int64_t cols = 0,
                          const std::string& dataset = "");
/// read_mnist_style() with the images as float32 (x/255 - mean) / stddev.
ImageSet load_mnist_style(const std::string& dir, bool train, double mean, double stddev);
/// The float32 (x/255 - mean) / stddev of uint8 MNIST-style `images`, as load_mnist_style() computes it.
torch::Tensor normalise_mnist_style(const torch::Tensor& images, double mean, double stddev);

/// Default directory of Debian's dataset-fashion-mnist package.
constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";
/// Normalisation constants of Fashion-MNIST's training set.
constexpr double kFashionMnistMean = 0.2860;
constexpr double kFashionMnistStd = 0.3530;

}  // namespace dkfac::data
