#include "tools/data/idx.h"

#include <zlib.h>

#include <filesystem>
#include <memory>
#include <vector>

namespace dkfac::data {
namespace {

// Whole content of a gzip or plain file (zlib reads both).
std::vector<uint8_t> read_file(const std::string& path) {
  TORCH_CHECK(std::filesystem::exists(path), "dataset file '", path, "' does not exist");
  std::unique_ptr<gzFile_s, int (*)(gzFile)> file(gzopen(path.c_str(), "rb"), gzclose);
  TORCH_CHECK(file != nullptr, "cannot open dataset file '", path, "'");
  std::vector<uint8_t> bytes;
  std::vector<uint8_t> chunk(1 << 20);
  while (true) {
    const int n = gzread(file.get(), chunk.data(), static_cast<unsigned>(chunk.size()));
    if (n < 0) {
      int err = 0;
      const char* msg = gzerror(file.get(), &err);
      TORCH_CHECK(false, "dataset file '", path, "' is damaged: ", msg);
    }
    if (n == 0) break;
    bytes.insert(bytes.end(), chunk.begin(), chunk.begin() + n);
  }
  return bytes;
}

uint32_t big_endian(const std::vector<uint8_t>& b, size_t offset) {
  return (uint32_t{b[offset]} << 24) | (uint32_t{b[offset + 1]} << 16) | (uint32_t{b[offset + 2]} << 8) |
         uint32_t{b[offset + 3]};
}

// Checks magic and header, returns the dimensions.
std::vector<int64_t> parse_header(const std::vector<uint8_t>& bytes, const std::string& path, uint32_t magic,
                                  size_t dims) {
  const size_t header = 4 + 4 * dims;
  TORCH_CHECK(bytes.size() >= header, "dataset file '", path, "' is truncated: ", bytes.size(),
              " bytes, shorter than its ", header, "-byte header");
  const uint32_t found = big_endian(bytes, 0);
  TORCH_CHECK(found == magic, "dataset file '", path, "' has magic number 0x", std::hex, found, ", expected 0x", magic,
              std::dec, " (", dims == 3 ? "IDX3 images" : "IDX1 labels", ")");
  std::vector<int64_t> shape;
  int64_t total = 1;
  for (size_t i = 0; i < dims; ++i) {
    const int64_t d = big_endian(bytes, 4 + 4 * i);
    TORCH_CHECK(d > 0 && d <= (int64_t{1} << 28), "dataset file '", path, "' declares dimension ", i, " = ", d);
    shape.push_back(d);
    total *= d;
    TORCH_CHECK(total <= (int64_t{1} << 34), "dataset file '", path, "' declares an absurd size");
  }
  const int64_t expected = static_cast<int64_t>(header) + total;
  TORCH_CHECK(static_cast<int64_t>(bytes.size()) == expected, "dataset file '", path, "' has ", bytes.size(),
              " bytes, its header (", c10::IntArrayRef(shape), ") requires ", expected,
              static_cast<int64_t>(bytes.size()) < expected ? " (truncated)" : " (trailing data)");
  return shape;
}

// `stem` or `stem.gz` in `dir`. With both, they must hold the same bytes: a stale uncompressed copy beside a
// newer .gz used to be read without a word.
std::string find_file(const std::string& dir, const std::string& stem) {
  const auto plain = dir + "/" + stem;
  const auto gz = plain + ".gz";
  const bool has_plain = std::filesystem::exists(plain);
  const bool has_gz = std::filesystem::exists(gz);
  TORCH_CHECK(has_plain || has_gz, "dataset directory '", dir, "' has neither ", stem, " nor ", stem, ".gz");
  TORCH_CHECK(!has_plain || !has_gz || read_file(plain) == read_file(gz), "dataset directory '", dir, "' has both ",
              stem, " and ", stem, ".gz, and they hold different data: remove the stale one");
  return has_plain ? plain : gz;
}

}  // namespace

torch::Tensor parse_idx_images(const std::vector<uint8_t>& bytes, const std::string& name) {
  auto shape = parse_header(bytes, name, 0x00000803, 3);
  auto images = torch::empty(shape, torch::kUInt8);
  std::memcpy(images.data_ptr<uint8_t>(), bytes.data() + 16, static_cast<size_t>(images.numel()));
  return images;
}

torch::Tensor parse_idx_labels(const std::vector<uint8_t>& bytes, const std::string& name, int64_t num_classes) {
  auto shape = parse_header(bytes, name, 0x00000801, 1);
  auto labels = torch::empty(shape, torch::kInt64);
  auto* out = labels.data_ptr<int64_t>();
  for (int64_t i = 0; i < shape[0]; ++i) {
    const int64_t label = bytes[8 + static_cast<size_t>(i)];
    TORCH_CHECK(label < num_classes, "dataset file '", name, "': label ", label, " at index ", i,
                " is out of range [0, ", num_classes, ")");
    out[i] = label;
  }
  return labels;
}

torch::Tensor read_idx_images(const std::string& path) { return parse_idx_images(read_file(path), path); }

torch::Tensor read_idx_labels(const std::string& path, int64_t num_classes) {
  return parse_idx_labels(read_file(path), path, num_classes);
}

ImageSet read_mnist_style(const std::string& dir, bool train, int64_t rows, int64_t cols, const std::string& dataset) {
  const std::string prefix = train ? "train" : "t10k";
  const auto images_path = find_file(dir, prefix + "-images-idx3-ubyte");
  const auto labels_path = find_file(dir, prefix + "-labels-idx1-ubyte");
  auto images = read_idx_images(images_path);
  TORCH_CHECK(rows <= 0 || cols <= 0 || (images.size(1) == rows && images.size(2) == cols), "dataset file '",
              images_path, "' holds ", images.size(1), " x ", images.size(2), " images, but ",
              dataset.empty() ? std::string("the dataset") : "--dataset " + dataset, " has ", rows, " x ", cols,
              " images and the models are built for that size; point --data-dir at a directory of ", rows, " x ",
              cols, " images");
  auto labels = read_idx_labels(labels_path);
  TORCH_CHECK(images.size(0) == labels.size(0), "'", images_path, "' holds ", images.size(0), " images but '",
              labels_path, "' holds ", labels.size(0), " labels");
  return {images.unsqueeze(1), labels, "'" + images_path + "', '" + labels_path + "'"};
}

torch::Tensor normalise_mnist_style(const torch::Tensor& images, double mean, double stddev) {
  return images.to(torch::kFloat32).div_(255.0).sub_(mean).div_(stddev);
}

ImageSet load_mnist_style(const std::string& dir, bool train, double mean, double stddev) {
  auto set = read_mnist_style(dir, train);
  set.images = normalise_mnist_style(set.images, mean, stddev);
  return set;
}

}  // namespace dkfac::data
