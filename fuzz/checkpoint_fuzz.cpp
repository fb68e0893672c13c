// libFuzzer target: the checkpoint loader on arbitrary bytes. Every input must end in an archive or a
// c10::Error naming the file, never a crash, a sanitizer report or a leak.
//
// DKFAC_FUZZ_WRITE_SEED=<file> writes a small valid checkpoint (the seed in fuzz/corpus/checkpoint) and exits.
// DKFAC_FUZZ_FIX_ENVELOPE=1 rewrites each input's payload size and checksum before loading it, so that the
// mutations reach LibTorch's archive reader instead of stopping at the checksum.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "tools/train/checkpoint.h"

namespace {

bool fix_envelope = false;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* seed = std::getenv("DKFAC_FUZZ_WRITE_SEED")) {
    dkfac::train::save_atomically(seed, [](torch::serialize::OutputArchive& archive) {
      archive.write("version", torch::tensor(int64_t{2}));
      archive.write("weight", torch::arange(6, torch::kFloat32).reshape({2, 3}));
      archive.write("layout", c10::IValue(std::string("world 1, rank 0")));
    });
    std::exit(0);
  }
  fix_envelope = std::getenv("DKFAC_FUZZ_FIX_ENVELOPE") != nullptr;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  if (fix_envelope && bytes.size() >= dkfac::train::kEnvelopeBytes) {
    // Keep the input's magic and version, give its payload a matching size and checksum.
    const auto payload = bytes.substr(dkfac::train::kEnvelopeBytes);
    bytes = bytes.substr(0, 12) + dkfac::train::envelope_header(payload).substr(12) + payload;
  }
  try {
    auto archive = dkfac::train::parse_checkpoint(bytes, "fuzz.ckpt");
    torch::Tensor weight;
    archive.try_read("weight", weight);
  } catch (const c10::Error& e) {
    if (std::string(e.what_without_backtrace()).find("fuzz.ckpt") == std::string::npos) __builtin_trap();
  }
  return 0;
}
