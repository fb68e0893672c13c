#include "dkfac/nn/linear.h"

namespace dkfac::nn {

LinearImpl::LinearImpl(const torch::nn::LinearOptions& options) : torch::nn::LinearImpl(options) {
  capture_ = std::make_shared<FactorCapture>(LayerGeometry{LayerKind::kLinear, options.bias(), {}});
}

torch::Tensor LinearImpl::forward(const torch::Tensor& input) {
  auto output = torch::nn::LinearImpl::forward(input);
  capture_module_pass(capture_, input, output, is_training());
  return output;
}

void LinearImpl::pretty_print(std::ostream& stream) const {
  stream << "dkfac::nn::Linear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", bias=" << options.bias() << ")";
}

int64_t LinearImpl::a_dim() const { return options.in_features() + (bias.defined() ? 1 : 0); }

int64_t LinearImpl::g_dim() const { return options.out_features(); }

}  // namespace dkfac::nn
