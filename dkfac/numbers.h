#pragma once

#include <string>
#include <vector>

/// Numbers as the library, its tools and their messages print and summarise them, written once.
namespace dkfac {

/// The median of `samples` (the mean of the two middle ones for an even count); throws c10::Error when empty.
double median(std::vector<double> samples);

/// `bytes` in the largest binary unit it reaches: "512 B", "1.50 KiB", "150.12 MiB", "2.00 GiB".
std::string human_bytes(double bytes);

/// `flops` in the largest decimal unit it reaches: "900 FLOP", "3.20 GFLOP", "2.21 TFLOP".
std::string human_flops(double flops);

/// `seconds` as milliseconds, without the unit: "0.125" under 10 ms, "12.50" under 1 s, "1234.5" beyond.
std::string milliseconds(double seconds);

}  // namespace dkfac
