#include "dkfac/comm/agreement.h"

#include <algorithm>
#include <cstdint>

namespace dkfac::comm {
namespace {

/// FNV-1a over the lines, each ended by a newline.
uint64_t hash_of(const std::vector<std::string>& lines) {
  uint64_t h = 14695981039346656037ull;
  for (const auto& line : lines) {
    for (const char c : line + "\n") {
      h ^= static_cast<unsigned char>(c);
      h *= 1099511628211ull;
    }
  }
  return h;
}

/// The hash as four 16-bit parts, each exact in a double.
std::vector<double> parts_of(uint64_t h) {
  std::vector<double> parts;
  for (int i = 0; i < 4; ++i) parts.push_back(static_cast<double>((h >> (16 * i)) & 0xffff));
  return parts;
}

std::string joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& line : lines) out += line + "\n";
  return out;
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> lines;
  size_t begin = 0;
  while (begin < text.size()) {
    const size_t end = text.find('\n', begin);
    lines.push_back(text.substr(begin, end - begin));
    begin = end + 1;
  }
  return lines;
}

}  // namespace

std::string broadcast_text(Communicator& communicator, GroupId group, int root, const std::string& text,
                           Purpose phase) {
  const auto device = communicator.control_device();
  auto length = torch::tensor({static_cast<int64_t>(text.size())}, torch::kInt64).to(device);
  communicator.broadcast(length, root, group, phase).wait();
  const int64_t n = length.cpu().item<int64_t>();
  auto bytes = torch::zeros({n}, torch::kUInt8);
  if (communicator.rank() == root) std::copy(text.begin(), text.end(), bytes.data_ptr<uint8_t>());
  bytes = bytes.to(device);
  if (n > 0) communicator.broadcast(bytes, root, group, phase).wait();
  bytes = bytes.cpu();
  return std::string(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), static_cast<size_t>(n));
}

std::string first_refusal(Communicator& communicator, const std::string& refusal, Purpose phase) {
  if (communicator.size() < 2) return refusal.empty() ? "" : "rank 0: " + refusal;
  const auto refused = gather_over(communicator, kWorld, {refusal.empty() ? 0.0 : 1.0}, phase);
  for (size_t r = 0; r < refused.size(); ++r) {
    if (refused[r][0] == 0.0) continue;
    const int rank = communicator.members(kWorld).at(r);
    return "rank " + std::to_string(rank) + ": " + broadcast_text(communicator, kWorld, rank, refusal, phase);
  }
  return "";
}

std::string first_difference(Communicator& communicator, GroupId group, const std::vector<std::string>& lines,
                             Purpose phase) {
  const auto& members = communicator.members(group);
  if (members.size() < 2) return "";
  const auto hashes = gather_over(communicator, group, parts_of(hash_of(lines)), phase);
  size_t differing = 0;
  for (size_t r = 1; r < hashes.size() && differing == 0; ++r) {
    if (hashes[r] != hashes[0]) differing = r;
  }
  if (differing == 0) return "";
  // Every rank saw the same table, so every rank takes the same collectives from here on.
  const int first = members.front();
  const int named = members[differing];
  const auto reference = split(broadcast_text(communicator, group, first, joined(lines), phase));
  std::string message;
  if (communicator.rank() == named) {
    const size_t common = std::min(lines.size(), reference.size());
    size_t i = 0;
    while (i < common && lines[i] == reference[i]) ++i;
    const std::string own = "rank " + std::to_string(named);
    const std::string theirs = "rank " + std::to_string(first);
    if (i < common) {
      message = own + " has '" + lines[i] + "' where " + theirs + " has '" + reference[i] + "'";
    } else if (lines.size() > reference.size()) {
      message = own + " has '" + lines[i] + "' where " + theirs + " has nothing more";
    } else if (lines.size() < reference.size()) {
      message = own + " has nothing more where " + theirs + " has '" + reference[i] + "'";
    } else {
      message = own + " and " + theirs + " differ in a way their descriptions do not show";  // a hash collision
    }
  }
  return broadcast_text(communicator, group, named, message, phase);
}

bool all_true(Communicator& communicator, bool flag, Purpose phase) {
  // How many ranks say no.
  auto no = torch::full({1}, flag ? 0.0 : 1.0,
                        torch::TensorOptions().dtype(torch::kFloat64).device(communicator.control_device()));
  communicator.allreduce_sum(no, kWorld, phase).wait();
  return no.item<double>() == 0.0;
}

}  // namespace dkfac::comm
