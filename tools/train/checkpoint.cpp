#include "tools/train/checkpoint.h"

#include "tools/common/files.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace dkfac::train {
namespace {

constexpr char kMagic[8] = {'D', 'K', 'F', 'A', 'C', 'C', 'K', 'P'};

void put_le(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

uint64_t get_le(const std::string& in, size_t offset, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= static_cast<uint64_t>(static_cast<unsigned char>(in[offset + i])) << (8 * i);
  return value;
}

void fsync_path(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags);
  TORCH_CHECK(fd >= 0, "cannot open '", path, "' to sync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  TORCH_CHECK(rc == 0, "fsync of '", path, "' failed: ", std::strerror(err));
}

}  // namespace

uint32_t crc32_of(const void* data, size_t size, uint32_t crc) {
  auto bytes = static_cast<const Bytef*>(data);
  uLong value = crc;
  while (size > 0) {  // zlib takes uInt lengths
    const auto chunk = static_cast<uInt>(std::min<size_t>(size, 1u << 30));
    value = ::crc32(value, bytes, chunk);
    bytes += chunk;
    size -= chunk;
  }
  return static_cast<uint32_t>(value);
}

std::string envelope_header(const std::string& payload) {
  std::string header(kMagic, sizeof(kMagic));
  put_le(header, kEnvelopeVersion, 4);
  put_le(header, payload.size(), 8);
  put_le(header, crc32_of(payload.data(), payload.size()), 4);
  return header;
}

void save_atomically(const std::string& path, const std::function<void(torch::serialize::OutputArchive&)>& write) {
  const auto target = std::filesystem::path(path);
  const auto dir = target.parent_path().empty() ? std::filesystem::path(".") : target.parent_path();
  const auto tmp = dir / ("." + target.filename().string() + ".tmp." + std::to_string(::getpid()));
  int fd = -1;
  try {
    torch::serialize::OutputArchive archive;
    write(archive);
    std::ostringstream payload_stream;
    archive.save_to(payload_stream);
    const std::string payload = payload_stream.str();
    const std::string header = envelope_header(payload);

    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    TORCH_CHECK(fd >= 0, "cannot create '", tmp.string(), "': ", std::strerror(errno));
    tools::write_all(fd, header, "'" + tmp.string() + "'");
    tools::write_all(fd, payload, "'" + tmp.string() + "'");
    TORCH_CHECK(::fsync(fd) == 0, "fsync of '", tmp.string(), "' failed: ", std::strerror(errno));
    const int rc = ::close(fd);
    fd = -1;
    TORCH_CHECK(rc == 0, "closing '", tmp.string(), "' failed: ", std::strerror(errno));
    std::filesystem::rename(tmp, target);
    fsync_path(dir.string(), O_RDONLY | O_DIRECTORY);
  } catch (const std::exception& e) {
    if (fd >= 0) ::close(fd);
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    TORCH_CHECK(false, "could not write checkpoint '", path, "' (the previous one, if any, is intact): ",
                c10_error ? c10_error->what_without_backtrace() : e.what());
  }
}

torch::serialize::InputArchive parse_checkpoint(const std::string& bytes, const std::string& name,
                                                c10::Device device) {
  TORCH_CHECK(bytes.size() >= kEnvelopeBytes && std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) == 0,
              "'", name, "' is not a dkfac checkpoint (no DKFACCKP header)");
  const auto version = get_le(bytes, 8, 4);
  TORCH_CHECK(version == kEnvelopeVersion, "checkpoint '", name, "' has envelope version ", version,
              ", this build reads ", kEnvelopeVersion);
  const uint64_t size = get_le(bytes, 12, 8);
  const uint64_t available = bytes.size() - kEnvelopeBytes;
  TORCH_CHECK(size <= available, "checkpoint '", name, "' is truncated: ", available, " of ", size,
              " payload bytes");
  TORCH_CHECK(size == available, "checkpoint '", name, "' has ", available - size, " bytes after its payload");
  const auto expected = static_cast<uint32_t>(get_le(bytes, 20, 4));
  const auto actual = crc32_of(bytes.data() + kEnvelopeBytes, size);
  TORCH_CHECK(actual == expected, "checkpoint '", name, "' is damaged: checksum mismatch");
  torch::serialize::InputArchive archive;
  std::istringstream payload(bytes.substr(kEnvelopeBytes));
  try {
    archive.load_from(payload, device);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "checkpoint '", name, "' passed its checksum but its archive does not load: ",
                e.what_without_backtrace());
  } catch (const std::exception& e) {  // LibTorch's archive reader also throws torch::jit::ErrorReport (found by fuzzing)
    TORCH_CHECK(false, "checkpoint '", name, "' passed its checksum but its archive does not load: ", e.what());
  }
  return archive;
}

torch::serialize::InputArchive load_verified(const std::string& path, c10::Device device) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "cannot open checkpoint '", path, "': ", std::strerror(errno));
  std::ostringstream bytes;
  bytes << in.rdbuf();
  TORCH_CHECK(!in.bad(), "reading checkpoint '", path, "' failed: ", std::strerror(errno));
  return parse_checkpoint(bytes.str(), path, device);
}

}  // namespace dkfac::train
