// Dataset parsers on good and damaged files: every defect gets a message naming the file and the problem.
#include <gtest/gtest.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>

#include "tests/test_util.h"
#include "tools/data/datasets.h"
#include "tools/data/idx.h"

namespace dkfac::data {
namespace {

namespace fs = std::filesystem;
using dkfac::testing::expect_error;

class DataFiles : public ::testing::Test {
 protected:

  static std::vector<uint8_t> be32(uint32_t v) {
    return {uint8_t(v >> 24), uint8_t(v >> 16), uint8_t(v >> 8), uint8_t(v)};
  }
  static std::vector<uint8_t> idx_images(uint32_t magic, uint32_t n, uint32_t rows, uint32_t cols, size_t payload) {
    std::vector<uint8_t> b;
    for (auto v : {magic, n, rows, cols}) {
      auto x = be32(v);
      b.insert(b.end(), x.begin(), x.end());
    }
    for (size_t i = 0; i < payload; ++i) b.push_back(uint8_t(i % 251));
    return b;
  }
  static std::vector<uint8_t> idx_labels(uint32_t magic, uint32_t n, std::vector<uint8_t> labels) {
    std::vector<uint8_t> b;
    for (auto v : {magic, n}) {
      auto x = be32(v);
      b.insert(b.end(), x.begin(), x.end());
    }
    b.insert(b.end(), labels.begin(), labels.end());
    return b;
  }
  std::string write(const std::string& name, const std::vector<uint8_t>& bytes, bool gzip = false) {
    const auto path = (dir_ / name).string();
    if (gzip) {
      gzFile f = gzopen(path.c_str(), "wb");
      gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
      gzclose(f);
    } else {
      std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    }
    return path;
  }
  dkfac::testing::ScratchDir scratch_{"dkfac-data-test"};
  const fs::path& dir_ = scratch_.path();
};

TEST_F(DataFiles, ReadsPlainAndGzipIdx) {
  for (bool gz : {false, true}) {
    auto images = read_idx_images(write(gz ? "i.gz" : "i", idx_images(0x803, 3, 2, 4, 24), gz));
    EXPECT_EQ(images.sizes(), (std::vector<int64_t>{3, 2, 4}));
    EXPECT_EQ(images[2][1][3].item<int64_t>(), 23);
    auto labels = read_idx_labels(write(gz ? "l.gz" : "l", idx_labels(0x801, 3, {0, 9, 4}), gz));
    EXPECT_TRUE(torch::equal(labels, torch::tensor({0, 9, 4}, torch::kInt64)));
  }
}

TEST_F(DataFiles, DamagedIdxFilesNameTheDefect) {
  auto truncated = write("trunc", idx_images(0x803, 3, 2, 4, 20));
  expect_error([&] { read_idx_images(truncated); }, {truncated, "requires 40", "truncated"});
  auto trailing = write("trail", idx_images(0x803, 3, 2, 4, 30));
  expect_error([&] { read_idx_images(trailing); }, {trailing, "trailing data"});
  auto magic = write("magic", idx_images(0x801, 3, 2, 4, 24));
  expect_error([&] { read_idx_images(magic); }, {magic, "magic number 0x801, expected 0x803"});
  auto header = write("header", {0, 0, 8});
  expect_error([&] { read_idx_images(header); }, {header, "shorter than its 16-byte header"});
  auto zero = write("zero", idx_images(0x803, 0, 2, 4, 0));
  expect_error([&] { read_idx_images(zero); }, {zero, "dimension 0 = 0"});
  auto label = write("label", idx_labels(0x801, 3, {0, 10, 4}));
  expect_error([&] { read_idx_labels(label); }, {label, "label 10 at index 1 is out of range [0, 10)"});
  auto count = write("count", idx_labels(0x801, 4, {0, 1, 4}));
  expect_error([&] { read_idx_labels(count); }, {count, "truncated"});
  expect_error([&] { read_idx_images((dir_ / "missing").string()); }, {"missing", "does not exist"});
  auto corrupt_gz = write("bad.gz", {0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3, 1, 2, 3, 4, 5});
  EXPECT_THROW(read_idx_images(corrupt_gz), c10::Error);
}

TEST_F(DataFiles, MismatchedImageAndLabelCounts) {
  write("train-images-idx3-ubyte", idx_images(0x803, 3, 2, 2, 12));
  write("train-labels-idx1-ubyte.gz", idx_labels(0x801, 2, {1, 2}), true);
  expect_error([&] { load_mnist_style(dir_.string(), true, 0.0, 1.0); }, {"holds 3 images", "holds 2 labels"});
  expect_error([&] { load_mnist_style(dir_.string(), false, 0.0, 1.0); }, {"has neither t10k-images-idx3-ubyte"});
}

// An uncompressed file beside its .gz: read when both hold the same data, refused naming both when they differ
// (a stale copy used to be read without a word).
TEST_F(DataFiles, PlainAndGzipCopiesMustAgree) {
  write("train-images-idx3-ubyte", idx_images(0x803, 2, 2, 2, 8));
  write("train-images-idx3-ubyte.gz", idx_images(0x803, 2, 2, 2, 8), true);
  write("train-labels-idx1-ubyte", idx_labels(0x801, 2, {1, 2}));
  const auto read = load_mnist_style(dir_.string(), true, 0.0, 1.0);
  EXPECT_EQ(read.size(), 2);
  EXPECT_EQ(read.source, "'" + dir_.string() + "/train-images-idx3-ubyte', '" + dir_.string() + "/train-labels-idx1-ubyte'")
      << "the files read are named";
  write("train-labels-idx1-ubyte.gz", idx_labels(0x801, 2, {2, 1}), true);
  expect_error([&] { load_mnist_style(dir_.string(), true, 0.0, 1.0); },
               {"has both train-labels-idx1-ubyte and train-labels-idx1-ubyte.gz, and they hold different data",
                "remove the stale one"});
}

TEST_F(DataFiles, ImagesOfOtherDimensionsThanTheModelsAreNamedWithBothSizes) {
  // A mnist-named directory with 32 x 32 images used to end in "mat1 and mat2 shapes cannot be multiplied".
  const auto images = write("train-images-idx3-ubyte", idx_images(0x803, 2, 32, 32, 2 * 32 * 32));
  write("train-labels-idx1-ubyte", idx_labels(0x801, 2, {1, 2}));
  expect_error([&] { load_dataset("mnist", dir_.string(), false); },
               {"dataset file '" + images + "' holds 32 x 32 images, but --dataset mnist has 28 x 28 images",
                "the models are built for that size"});
  // 28 x 28 train images but 20 x 28 test images: the test file is named.
  write("train-images-idx3-ubyte", idx_images(0x803, 2, 28, 28, 2 * 28 * 28));
  const auto test_images = write("t10k-images-idx3-ubyte", idx_images(0x803, 1, 20, 28, 20 * 28));
  write("t10k-labels-idx1-ubyte", idx_labels(0x801, 1, {3}));
  expect_error([&] { load_dataset("fashion-mnist", dir_.string(), false); },
               {"'" + test_images + "' holds 20 x 28 images, but --dataset fashion-mnist has 28 x 28"});
}

TEST_F(DataFiles, BatchesAreTheNormalisedFloatImagesOfTheStoredBytes) {
  write("train-images-idx3-ubyte", idx_images(0x803, 3, 28, 28, 3 * 28 * 28));
  write("train-labels-idx1-ubyte", idx_labels(0x801, 3, {1, 2, 3}));
  write("t10k-images-idx3-ubyte", idx_images(0x803, 2, 28, 28, 2 * 28 * 28));
  write("t10k-labels-idx1-ubyte", idx_labels(0x801, 2, {4, 5}));
  for (bool raw : {false, true}) {
    const auto d = load_dataset("mnist", dir_.string(), raw);
    EXPECT_EQ(d.train.images.scalar_type(), torch::kUInt8) << "stored as read: a quarter of float32";
    EXPECT_EQ(d.train.images.sizes(), (std::vector<int64_t>{3, 1, 28, 28}));
    // Bit for bit what normalising the whole set at load time gave.
    const auto whole = load_mnist_style(dir_.string(), true, raw ? 0.0 : 0.1307, raw ? 1.0 : 0.3081);
    const auto idx = torch::tensor({2, 0}, torch::kInt64);
    const auto batch = d.train_batch(idx);
    EXPECT_EQ(batch.scalar_type(), torch::kFloat32);
    EXPECT_EQ(batch.sizes(), (std::vector<int64_t>{2, 1, 28, 28}));
    EXPECT_TRUE(torch::equal(batch, whole.images.index_select(0, idx)));
    const auto test_whole = load_mnist_style(dir_.string(), false, raw ? 0.0 : 0.1307, raw ? 1.0 : 0.3081);
    EXPECT_TRUE(torch::equal(d.test_batch(1, 2), test_whole.images.slice(0, 1, 2)));
  }
}

TEST_F(DataFiles, Cifar10Records) {
  std::vector<uint8_t> good;
  for (int r = 0; r < 2; ++r) {
    good.push_back(uint8_t(r + 3));
    for (int i = 0; i < 3072; ++i) good.push_back(uint8_t((i + r) % 256));
  }
  auto set = read_cifar10({write("data.bin", good)});
  EXPECT_EQ(set.images.sizes(), (std::vector<int64_t>{2, 3, 32, 32}));
  EXPECT_TRUE(torch::equal(set.labels, torch::tensor({3, 4}, torch::kInt64)));
  EXPECT_EQ(set.images[1][0][0][1].item<int64_t>(), 2);

  auto short_file = write("short.bin", std::vector<uint8_t>(good.begin(), good.end() - 5));
  expect_error([&] { read_cifar10({short_file}); }, {short_file, "not a positive multiple of the 3073-byte record"});
  auto bad_label = good;
  bad_label[3073] = 12;
  auto bad = write("label.bin", bad_label);
  expect_error([&] { read_cifar10({bad}); }, {bad, "label 12 at record 1"});
}

TEST(Datasets, UnknownNameListsValidOnes) {
  try {
    load_dataset("imagenet", "", false);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("valid datasets: fashion-mnist, mnist, cifar10, synthetic"), std::string::npos);
  }
}

TEST(Datasets, AugmentationKeepsShapeAndIsSeeded) {
  auto x = torch::arange(2 * 3 * 8 * 8, torch::kFloat32).reshape({2, 3, 8, 8});
  auto g1 = at::make_generator<at::CPUGeneratorImpl>(5);
  auto g2 = at::make_generator<at::CPUGeneratorImpl>(5);
  auto a = augment_crop_flip(x, g1);
  auto b = augment_crop_flip(x, g2);
  EXPECT_EQ(a.sizes(), x.sizes());
  EXPECT_TRUE(torch::equal(a, b));
}

}  // namespace
}  // namespace dkfac::data
