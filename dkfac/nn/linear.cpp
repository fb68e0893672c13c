#include "dkfac/nn/linear.h"

#include <chrono>

#include "dkfac/math/factors.h"

namespace dkfac::nn {
namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

LinearImpl::LinearImpl(const torch::nn::LinearOptions& options) : torch::nn::LinearImpl(options) {}

torch::Tensor LinearImpl::forward(const torch::Tensor& input) {
  auto output = torch::nn::LinearImpl::forward(input);
  rows_per_sample_ = input.dim() > 2 ? input.numel() / (input.size(0) * input.size(-1)) : 1;
  if (!capture_->active(is_training())) return output;

  const auto start = std::chrono::steady_clock::now();
  {
    torch::NoGradGuard no_grad;
    // Built before timing stops: argument evaluation order is unspecified.
    auto a_batch = math::linear_a_factor(input.detach(), bias.defined());
    capture_->add_a(a_batch, seconds_since(start));
  }
  if (output.requires_grad()) {
    // The hook holds the capture, not the module: it stays valid if the module goes first.
    output.register_hook([capture = capture_](const torch::Tensor& grad) {
      const auto hook_start = std::chrono::steady_clock::now();
      torch::NoGradGuard no_grad;
      auto g_batch = math::linear_g_factor(grad);
      capture->add_g(g_batch, seconds_since(hook_start));
    });
  }
  return output;
}

void LinearImpl::pretty_print(std::ostream& stream) const {
  stream << "dkfac::nn::Linear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", bias=" << options.bias() << ")";
}

int64_t LinearImpl::a_dim() const { return options.in_features() + (bias.defined() ? 1 : 0); }

int64_t LinearImpl::g_dim() const { return options.out_features(); }

}  // namespace dkfac::nn
