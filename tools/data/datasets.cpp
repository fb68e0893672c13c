#include "tools/data/datasets.h"

#include <filesystem>
#include <fstream>
#include <iterator>

#include <c10/util/StringUtil.h>

namespace dkfac::data {
namespace {

constexpr int64_t kCifarRecord = 1 + 3 * 32 * 32;

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "dataset file '", path, "' cannot be opened");
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

torch::Tensor Dataset::to_input(const torch::Tensor& images) const {
  if (images.scalar_type() != torch::kUInt8) return images;  // stored as model input (synthetic)
  const auto& n = normalisation;
  if (!n.per_channel) {
    // MNIST-style: the scalar operations of normalise_mnist_style (mean 0, std 1 when raw).
    return normalise_mnist_style(images, n.mean.empty() ? 0.0 : n.mean[0], n.stddev.empty() ? 1.0 : n.stddev[0]);
  }
  auto x = images.to(torch::kFloat32).div_(255.0);
  if (!n.mean.empty()) {
    auto m = torch::tensor(n.mean, torch::kFloat32).view({1, -1, 1, 1});
    auto s = torch::tensor(n.stddev, torch::kFloat32).view({1, -1, 1, 1});
    x = (x - m) / s;
  }
  return x.contiguous();
}

torch::Tensor Dataset::train_batch(const torch::Tensor& indices) const {
  return to_input(train.images.index_select(0, indices));
}

torch::Tensor Dataset::test_batch(int64_t begin, int64_t end) const {
  return to_input(test.images.slice(0, begin, end));
}

const std::vector<std::string>& dataset_names() {
  static const std::vector<std::string> names = {"fashion-mnist", "mnist", "cifar10", "synthetic"};
  return names;
}

ImageSet parse_cifar10(const std::vector<uint8_t>& bytes, const std::string& name) {
  const auto n = static_cast<int64_t>(bytes.size());
  TORCH_CHECK(n > 0 && n % kCifarRecord == 0, "CIFAR-10 file '", name, "' has ", n,
              " bytes, not a positive multiple of the ", kCifarRecord, "-byte record");
  auto records = torch::from_blob(const_cast<uint8_t*>(bytes.data()), {n / kCifarRecord, kCifarRecord}, torch::kUInt8)
                     .clone();
  auto label = records.select(1, 0).to(torch::kInt64);
  const int64_t max_label = label.max().item<int64_t>();
  TORCH_CHECK(max_label < 10, "CIFAR-10 file '", name, "': label ", max_label, " at record ",
              label.argmax().item<int64_t>(), " is out of range [0, 10)");
  return {records.slice(1, 1).reshape({-1, 3, 32, 32}), label};
}

ImageSet read_cifar10(const std::vector<std::string>& files) {
  std::vector<torch::Tensor> images, labels;
  for (const auto& path : files) {
    TORCH_CHECK(std::filesystem::exists(path), "CIFAR-10 file '", path, "' does not exist");
    auto set = parse_cifar10(read_bytes(path), path);
    images.push_back(set.images);
    labels.push_back(set.labels);
  }
  return {torch::cat(images), torch::cat(labels)};
}

Dataset synthetic_dataset(int64_t train_size, int64_t test_size, int64_t seed) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed) + 12345);
  auto teacher = torch::randn({28 * 28, 10}, generator);
  auto make = [&](int64_t n) {
    auto x = torch::randn({n, 1, 28, 28}, generator);
    auto y = torch::mm(x.reshape({n, -1}), teacher).argmax(1);
    return ImageSet{x, y};
  };
  Dataset d;
  d.name = "synthetic";
  d.train = make(train_size);
  d.test = make(test_size);
  return d;
}

Dataset load_dataset(const std::string& name, const std::string& dir, bool raw_pixels) {
  Dataset d;
  d.name = name;
  if (name == "fashion-mnist" || name == "mnist") {
    TORCH_CHECK(name == "fashion-mnist" || !dir.empty(), "--data-dir is required for mnist");
    const std::string path = dir.empty() ? kFashionMnistDir : dir;
    const double mean = name == "mnist" ? 0.1307 : kFashionMnistMean;
    const double stddev = name == "mnist" ? 0.3081 : kFashionMnistStd;
    // Mean 0 and std 1 leave the pixels in [0, 1] (autoencoder targets).
    d.normalisation = {{raw_pixels ? 0.0 : mean}, {raw_pixels ? 1.0 : stddev}, false};
    d.train = read_mnist_style(path, true, d.height, d.width, name);
    d.test = read_mnist_style(path, false, d.height, d.width, name);
    return d;
  }
  if (name == "cifar10") {
    TORCH_CHECK(!dir.empty(), "--data-dir is required for cifar10 (the directory with data_batch_1.bin ...)");
    std::vector<std::string> train_files;
    for (int i = 1; i <= 5; ++i) train_files.push_back(dir + "/data_batch_" + std::to_string(i) + ".bin");
    const std::vector<double> mean = {0.4914, 0.4822, 0.4465};
    const std::vector<double> stddev = {0.2470, 0.2435, 0.2616};
    d.normalisation = {raw_pixels ? std::vector<double>{} : mean, raw_pixels ? std::vector<double>{} : stddev, true};
    d.train = read_cifar10(train_files);
    d.test = read_cifar10({dir + "/test_batch.bin"});
    d.channels = 3;
    d.height = 32;
    d.width = 32;
    d.augment = true;
    return d;
  }
  if (name == "synthetic") return synthetic_dataset(8192, 1024, 0);
  TORCH_CHECK(false, "unknown dataset '", name, "'; valid datasets: ", c10::Join(", ", dataset_names()));
}

torch::Tensor augment_crop_flip(const torch::Tensor& images, at::Generator& generator) {
  const int64_t n = images.size(0), h = images.size(2), w = images.size(3);
  auto padded = torch::constant_pad_nd(images, {4, 4, 4, 4}, 0.0);
  auto offsets = torch::randint(0, 9, {n, 2}, generator, torch::kInt64);
  auto flips = torch::randint(0, 2, {n}, generator, torch::kInt64);
  auto out = torch::empty_like(images);
  auto o = offsets.accessor<int64_t, 2>();
  auto f = flips.accessor<int64_t, 1>();
  for (int64_t i = 0; i < n; ++i) {
    auto crop = padded[i].slice(1, o[i][0], o[i][0] + h).slice(2, o[i][1], o[i][1] + w);
    out[i].copy_(f[i] ? crop.flip({2}) : crop);
  }
  return out;
}

}  // namespace dkfac::data
