#pragma once

#include <cstdint>

/// Which kernel of math/factors.h builds a layer's factor. Pure: no tensors, so that the layer shapes of the
/// time model (assign::LayerShape) and the kernels themselves read the one rule.
namespace dkfac::math {

/// A Conv2d input with fewer channels than this builds its patches with unfold: a channels-last copy would
/// move runs of fewer than this many floats.
constexpr int64_t kChannelsLastMin = 8;

enum class FactorKernel {
  kCovariance,    ///< X^T X of a contiguous [rows, d] matrix: both factors of a Linear layer
  kConvRowShift,  ///< a Conv2d A with stride 1 in height, kernel height > 1 and >= kChannelsLastMin channels:
                  ///< products of kernel-row shifts of the input, no patch matrix
  kConvPatches,   ///< any other Conv2d A with >= kChannelsLastMin channels (strided or 1 x 1): a channels-last
                  ///< copy of the patches, then their covariance
  kConvUnfold,    ///< a Conv2d A with fewer channels: unfold's patches, then their covariance
  kConvGradient,  ///< a Conv2d G, from its [B, C, H, W] output gradient
};

/// Every FactorKernel, in declaration order.
constexpr FactorKernel kFactorKernels[] = {FactorKernel::kCovariance, FactorKernel::kConvRowShift,
                                           FactorKernel::kConvPatches, FactorKernel::kConvUnfold,
                                           FactorKernel::kConvGradient};

/// The kernel math::conv2d_a_factor runs for `in_channels` input channels, a kernel `kernel_h` high and
/// stride `stride_h` in height.
constexpr FactorKernel conv2d_a_kernel(int64_t in_channels, int64_t kernel_h, int64_t stride_h) {
  if (in_channels < kChannelsLastMin) return FactorKernel::kConvUnfold;
  return stride_h == 1 && kernel_h > 1 ? FactorKernel::kConvRowShift : FactorKernel::kConvPatches;
}

/// "covariance", "conv_row_shift", "conv_patches", "conv_unfold", "conv_gradient".
constexpr const char* to_string(FactorKernel kernel) {
  switch (kernel) {
    case FactorKernel::kCovariance: return "covariance";
    case FactorKernel::kConvRowShift: return "conv_row_shift";
    case FactorKernel::kConvPatches: return "conv_patches";
    case FactorKernel::kConvUnfold: return "conv_unfold";
    case FactorKernel::kConvGradient: return "conv_gradient";
  }
  return "?";
}

}  // namespace dkfac::math
