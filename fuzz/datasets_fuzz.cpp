// libFuzzer target: the dataset readers on arbitrary bytes. The first byte picks the reader; every input
// must end in a tensor or a c10::Error, never a crash, a sanitizer report or a leak.
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "tools/data/datasets.h"
#include "tools/data/idx.h"

namespace {

// The file readers (plain or gzip through zlib) on the bytes written to a file.
void read_as_files(const std::vector<uint8_t>& bytes) {
  static const std::string path = "/tmp/dkfac-fuzz-datasets-" + std::to_string(::getpid()) + ".idx";
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  try {
    dkfac::data::read_idx_images(path);
  } catch (const c10::Error&) {
  }
  try {
    dkfac::data::read_idx_labels(path);
  } catch (const c10::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::vector<uint8_t> bytes(data + 1, data + size);
  try {
    switch (data[0] % 4) {
      case 0: {
        auto images = dkfac::data::parse_idx_images(bytes, "fuzz");
        TORCH_CHECK(images.dim() == 3 && images.numel() + 16 == static_cast<int64_t>(bytes.size()));
        break;
      }
      case 1: {
        auto labels = dkfac::data::parse_idx_labels(bytes, "fuzz");
        TORCH_CHECK(labels.numel() == 0 || labels.max().item<int64_t>() < 10);
        break;
      }
      case 2: {
        auto set = dkfac::data::parse_cifar10(bytes, "fuzz");
        TORCH_CHECK(set.images.size(0) == set.labels.size(0));
        break;
      }
      default:
        read_as_files(bytes);
    }
  } catch (const c10::Error& e) {
    // A refusal must name the file; an accepted input must satisfy the checks above (a failed
    // TORCH_CHECK without a message is a bug and aborts).
    if (std::string(e.what_without_backtrace()).find("fuzz") == std::string::npos) __builtin_trap();
  }
  return 0;
}
