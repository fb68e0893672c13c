#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include <torch/torch.h>

/// The file a dkfac checkpoint lives in. A torch::serialize archive is wrapped in an envelope that is
/// verified before the archive is parsed, so a damaged or foreign file is refused with a message
/// instead of reaching the archive reader:
///
///   bytes 0-7    "DKFACCKP"
///   bytes 8-11   envelope version, uint32 little-endian (kEnvelopeVersion)
///   bytes 12-19  payload size in bytes, uint64 little-endian
///   bytes 20-23  CRC-32 (zlib) of the payload, uint32 little-endian
///   bytes 24-    payload: the archive
namespace dkfac::train {

constexpr uint32_t kEnvelopeVersion = 1;
constexpr size_t kEnvelopeBytes = 24;

/// zlib's CRC-32 of `size` bytes, continuing from `crc` (0 to start), for any size.
uint32_t crc32_of(const void* data, size_t size, uint32_t crc = 0);

/// The 24 envelope bytes that go before `payload`.
std::string envelope_header(const std::string& payload);

/// Writes `write(archive)` to `path` atomically: a temporary file in the same directory, fsync, rename,
/// fsync of the directory. On any failure (a full disk included) the previous file at `path` is untouched,
/// the temporary file is removed and c10::Error is thrown.
void save_atomically(const std::string& path, const std::function<void(torch::serialize::OutputArchive&)>& write);

/// Reads `path`, verifies its envelope and returns the archive, its tensors on `device` whatever device
/// wrote them (a GPU run's checkpoint resumes on the CPU and the other way round). Throws c10::Error naming
/// the file and the defect: missing, not a dkfac checkpoint, another envelope version, truncated, trailing
/// bytes, checksum mismatch, or an archive that does not parse.
torch::serialize::InputArchive load_verified(const std::string& path, c10::Device device = c10::kCPU);

/// What load_verified() does with the file's bytes; `name` appears in the messages.
torch::serialize::InputArchive parse_checkpoint(const std::string& bytes, const std::string& name,
                                                c10::Device device = c10::kCPU);

}  // namespace dkfac::train
