#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "dkfac/layers/factor_capture.h"

namespace dkfac::nn {

using dkfac::FactorCapture;

/// Interface of the C++ modules whose Kronecker factors dkfac builds (dkfac::nn::Linear, Conv2d, Embedding).
/// The preconditioner finds such modules in a model by dynamic_cast and binds each as a KfacLayer;
/// the module feeds its FactorCapture from its forward and a hook on its output.
class KfacModule {
 public:
  virtual ~KfacModule() = default;

  /// "Linear", "Conv2d" or "Embedding".
  std::string kfac_kind() const { return to_string(capture_->geometry().kind); }
  /// The weight; its gradient is viewed as [g, a - has_bias].
  virtual torch::Tensor kfac_weight() const = 0;
  /// The bias, or an undefined tensor.
  virtual torch::Tensor kfac_bias() const = 0;
  /// Factor dimensions: a (input side, +1 with bias) and g (output side).
  virtual int64_t a_dim() const = 0;
  virtual int64_t g_dim() const = 0;

  /// Rows each sample adds to the factor's input matrix in the last forward: output positions
  /// H_out * W_out for Conv2d, the middle dimensions' size for Linear (1 for [B, in] inputs).
  int64_t rows_per_sample() const { return capture_->rows_per_sample(); }

  FactorCapture& factor_capture() { return *capture_; }
  const FactorCapture& factor_capture() const { return *capture_; }
  /// The capture, shared with the preconditioner's layer and with output-gradient hooks.
  const std::shared_ptr<FactorCapture>& shared_factor_capture() const { return capture_; }

 protected:
  /// Set by the module's constructor, once its geometry is known.
  std::shared_ptr<FactorCapture> capture_;
};

/// clone() of a dkfac module (`Impl`, built from `options`): a module of the same dkfac class with its own, fresh
/// capture (registered with no preconditioner, so the copy trains with its plain gradients until one registers it),
/// and copies of `from`'s parameters and buffers (on `device` if given) and training mode. torch's Cloneable would
/// copy the torch base class alone: a Sequential's clone then held null children (a segfault at its forward), a
/// lone module's clone a torch module.
template <typename Impl, typename Options>
std::shared_ptr<torch::nn::Module> clone_kfac_module(const torch::nn::Module& from, const Options& options,
                                                    const std::optional<torch::Device>& device) {
  torch::NoGradGuard no_grad;
  auto copy = std::make_shared<Impl>(options);
  auto copy_all = [&](const auto& source, auto target) {
    for (const auto& item : source) {
      const auto& tensor = item.value();
      auto* into = target.find(item.key());
      TORCH_CHECK(into != nullptr, "clone of ", from.name(), ": its copy has no '", item.key(), "'");
      into->set_data(device && tensor.device() != *device ? tensor.to(*device) : tensor.clone());
      into->set_requires_grad(tensor.requires_grad());
    }
  };
  copy_all(from.named_parameters(/*recurse=*/false), copy->named_parameters(/*recurse=*/false));
  copy_all(from.named_buffers(/*recurse=*/false), copy->named_buffers(/*recurse=*/false));
  copy->train(from.is_training());
  return copy;
}

}  // namespace dkfac::nn
