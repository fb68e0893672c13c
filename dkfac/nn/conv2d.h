#pragma once

#include <torch/torch.h>

#include "dkfac/math/factors.h"
#include "dkfac/nn/kfac_module.h"

namespace dkfac::nn {

/// Drop-in replacement for torch::nn::Conv2dImpl: same options, parameters, initialisation and
/// forward. Stride, dilation, every padding (numbers, kValid, kSame) and padding mode are
/// supported; groups > 1 is refused at construction (its Fisher blocks are per group).
/// While capture is enabled, forward builds the A factor from im2col patches and hooks the
/// output gradient to build G.
class Conv2dImpl : public torch::nn::Conv2dImpl, public KfacModule {
 public:
  Conv2dImpl(int64_t input_channels, int64_t output_channels, torch::ExpandingArray<2> kernel_size)
      : Conv2dImpl(torch::nn::Conv2dOptions(input_channels, output_channels, kernel_size)) {}
  explicit Conv2dImpl(const torch::nn::Conv2dOptions& options);

  /// Same as torch::nn::Conv2d; input [B, C_in, H, W] -> [B, C_out, H_out, W_out].
  torch::Tensor forward(const torch::Tensor& input);

  void pretty_print(std::ostream& stream) const override;
  /// A deep copy of the same dkfac class, with a capture of its own (clone_kfac_module).
  std::shared_ptr<torch::nn::Module> clone(const std::optional<torch::Device>& device = std::nullopt) const override;

  /// The patch layout this layer's forward uses (kernel, stride, dilation, explicit padding).
  math::Conv2dGeometry geometry() const;

  torch::Tensor kfac_weight() const override { return weight; }
  torch::Tensor kfac_bias() const override { return bias; }
  int64_t a_dim() const override;
  int64_t g_dim() const override;
};

/// Module holder for Conv2dImpl, used like torch::nn::Conv2d.
TORCH_MODULE(Conv2d);

}  // namespace dkfac::nn
