#pragma once

#include <torch/torch.h>

#include "dkfac/nn/kfac_module.h"

namespace dkfac::nn {

/// Drop-in replacement for torch::nn::LinearImpl: same options, parameters, initialisation and
/// forward. While the preconditioner has capture enabled (factor steps only), forward also builds
/// the A factor of its input and hooks the output gradient to build G. Inputs may have any number
/// of leading dimensions.
class LinearImpl : public torch::nn::LinearImpl, public KfacModule {
 public:
  LinearImpl(int64_t in_features, int64_t out_features)
      : LinearImpl(torch::nn::LinearOptions(in_features, out_features)) {}
  explicit LinearImpl(const torch::nn::LinearOptions& options);

  /// y = x W^T + b; input [..., in_features] -> [..., out_features].
  torch::Tensor forward(const torch::Tensor& input);

  void pretty_print(std::ostream& stream) const override;
  /// A deep copy of the same dkfac class, with a capture of its own (clone_kfac_module).
  std::shared_ptr<torch::nn::Module> clone(const std::optional<torch::Device>& device = std::nullopt) const override {
    return clone_kfac_module<LinearImpl>(*this, options, device);
  }

  torch::Tensor kfac_weight() const override { return weight; }
  torch::Tensor kfac_bias() const override { return bias; }
  int64_t a_dim() const override;
  int64_t g_dim() const override;
};

/// Module holder for LinearImpl, used like torch::nn::Linear.
TORCH_MODULE(Linear);

}  // namespace dkfac::nn
