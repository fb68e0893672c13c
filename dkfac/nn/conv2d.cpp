#include "dkfac/nn/conv2d.h"

#include <variant>

namespace dkfac::nn {
namespace {

// LibTorch 1.x options hold c10::variant, 2.x std::variant. With std::get_if visible, an unqualified
// get_if<T>(&v) also finds c10::get_if by argument-dependent lookup, so one spelling serves both.
using std::get_if;

torch::nn::functional::PadFuncOptions::mode_t to_pad_mode(const torch::nn::detail::conv_padding_mode_t& mode) {
  if (get_if<torch::enumtype::kReflect>(&mode)) return torch::kReflect;
  if (get_if<torch::enumtype::kReplicate>(&mode)) return torch::kReplicate;
  if (get_if<torch::enumtype::kCircular>(&mode)) return torch::kCircular;
  return torch::kConstant;
}

}  // namespace

Conv2dImpl::Conv2dImpl(const torch::nn::Conv2dOptions& options) : torch::nn::Conv2dImpl(options) {
  TORCH_CHECK(options.groups() == 1, "dkfac::nn::Conv2d supports groups=1 only, got groups=", options.groups(),
              " (use torch::nn::Conv2d for grouped convolutions; they keep their plain gradient)");
  capture_ = std::make_shared<FactorCapture>(LayerGeometry{LayerKind::kConv2d, options.bias(), geometry()});
}

math::Conv2dGeometry Conv2dImpl::geometry() const {
  math::Conv2dGeometry g;
  const auto& k = *options.kernel_size();
  const auto& s = *options.stride();
  const auto& d = *options.dilation();
  g.kernel_size = {k[0], k[1]};
  g.stride = {s[0], s[1]};
  g.dilation = {d[0], d[1]};
  g.padding_mode = to_pad_mode(options.padding_mode());
  if (!get_if<torch::enumtype::kZeros>(&options.padding_mode())) {
    // Non-zero modes: forward pads with exactly this vector, then convolves without padding.
    const auto& r = _reversed_padding_repeated_twice;
    g.padding = {r[0], r[1], r[2], r[3]};
    return g;
  }
  const auto& padding = options.padding();
  if (get_if<torch::enumtype::kValid>(&padding) != nullptr) {
    g.padding = {0, 0, 0, 0};
  } else if (get_if<torch::enumtype::kSame>(&padding) != nullptr) {
    g.padding = math::conv2d_same_padding(g.kernel_size, g.dilation);
  } else {
    const auto& pad = **get_if<torch::ExpandingArray<2>>(&padding);
    g.padding = {pad[1], pad[1], pad[0], pad[0]};
  }
  return g;
}

torch::Tensor Conv2dImpl::forward(const torch::Tensor& input) {
  auto output = torch::nn::Conv2dImpl::forward(input);
  capture_module_pass(capture_, input, output, is_training());
  return output;
}

std::shared_ptr<torch::nn::Module> Conv2dImpl::clone(const std::optional<torch::Device>& device) const {
  // torch keeps the options as ConvNdOptions<2>; the constructor takes Conv2dOptions.
  const auto given = torch::nn::Conv2dOptions(options.in_channels(), options.out_channels(), options.kernel_size())
                         .stride(options.stride())
                         .padding(options.padding())
                         .dilation(options.dilation())
                         .groups(options.groups())
                         .bias(options.bias())
                         .padding_mode(options.padding_mode());
  return clone_kfac_module<Conv2dImpl>(*this, given, device);
}

void Conv2dImpl::pretty_print(std::ostream& stream) const {
  stream << "dkfac::nn::";
  torch::nn::Conv2dImpl::pretty_print(stream);
}

int64_t Conv2dImpl::a_dim() const {
  const auto& k = *options.kernel_size();
  return options.in_channels() * k[0] * k[1] + (bias.defined() ? 1 : 0);
}

int64_t Conv2dImpl::g_dim() const { return options.out_channels(); }

}  // namespace dkfac::nn
