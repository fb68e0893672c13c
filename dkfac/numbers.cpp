#include "dkfac/numbers.h"

#include <algorithm>
#include <cstdio>
#include <iomanip>
#include <sstream>

#include <c10/util/Exception.h>

namespace dkfac {
namespace {

// `value` in the largest of `units` it reaches (each `base` times the one before): "%.0f" in the first
// unit, "%.2f" in the others.
std::string in_units(double value, double base, const std::vector<const char*>& units) {
  size_t u = 0;
  while (value >= base && u + 1 < units.size()) {
    value /= base;
    ++u;
  }
  char buf[40];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", value, units[u]);
  return buf;
}

}  // namespace

double median(std::vector<double> samples) {
  TORCH_CHECK(!samples.empty(), "the median of no samples is undefined");
  const size_t n = samples.size();
  std::nth_element(samples.begin(), samples.begin() + static_cast<std::ptrdiff_t>(n / 2), samples.end());
  const double upper = samples[n / 2];
  if (n % 2 == 1) return upper;
  const double lower = *std::max_element(samples.begin(), samples.begin() + static_cast<std::ptrdiff_t>(n / 2));
  return (lower + upper) / 2.0;
}

std::string human_bytes(double bytes) { return in_units(bytes, 1024.0, {"B", "KiB", "MiB", "GiB", "TiB", "PiB"}); }

std::string human_flops(double flops) {
  return in_units(flops, 1000.0, {"FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP", "EFLOP"});
}

std::string milliseconds(double seconds) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(seconds < 0.01 ? 3 : seconds < 1 ? 2 : 1) << 1e3 * seconds;
  return out.str();
}

}  // namespace dkfac
