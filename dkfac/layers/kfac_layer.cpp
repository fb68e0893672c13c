#include "dkfac/layers/kfac_layer.h"

#include <limits>

namespace dkfac {
namespace {

bool all_finite(const torch::Tensor& t) { return torch::isfinite(t).all().item<bool>(); }

int64_t bytes_of(const torch::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; }

// F = alpha F + (1 - alpha) F_batch with F = I before the first update.
torch::Tensor running_average(const torch::Tensor& running, const torch::Tensor& batch, double alpha) {
  auto base = running.defined() ? running : torch::eye(batch.size(0), batch.options());
  return base.mul(alpha).add_(batch, 1.0 - alpha);
}

void check_shape(const std::string& layer, const char* what, const torch::Tensor& t, at::IntArrayRef expected) {
  TORCH_CHECK(!t.defined() || t.sizes() == expected, "checkpoint for layer '", layer, "': ", what, " has shape ",
              t.sizes(), ", the model expects ", expected);
}

}  // namespace

torch::Tensor SecondOrderState::precondition(const torch::Tensor& grad) const {
  TORCH_INTERNAL_ASSERT(defined(), "precondition() before the second-order state was computed");
  if (method == ComputeMethod::kEigen) return math::precondition_eigen(a_eigen, g_eigen, denominator, grad);
  return math::precondition_inverse(a_inverse, g_inverse, grad);
}

int64_t SecondOrderState::memory_bytes() const {
  return bytes_of(a_eigen.eigenvectors) + bytes_of(a_eigen.eigenvalues) + bytes_of(g_eigen.eigenvectors) +
         bytes_of(g_eigen.eigenvalues) + bytes_of(denominator) + bytes_of(a_inverse) + bytes_of(g_inverse);
}

KfacLayer::KfacLayer(std::string name, std::shared_ptr<torch::nn::Module> module)
    : name_(std::move(name)), module_(std::move(module)) {
  kfac_module_ = dynamic_cast<nn::KfacModule*>(module_.get());
  TORCH_CHECK(kfac_module_ != nullptr, "layer '", name_, "' (", module_->name(),
              ") is not a dkfac::nn module; use dkfac::nn::Linear or dkfac::nn::Conv2d");
}

int64_t KfacLayer::captured_batches() const {
  const auto& capture = kfac_module_->factor_capture();
  return std::min(capture.a_count(), capture.g_count());
}

std::pair<torch::Tensor, torch::Tensor> KfacLayer::take_factor_batches() {
  auto& capture = kfac_module_->factor_capture();
  auto a_batch = capture.take_a();
  auto g_batch = capture.take_g();
  return {a_batch, g_batch};
}

FactorUpdate KfacLayer::update_factors(double alpha) {
  auto [a_batch, g_batch] = take_factor_batches();
  if (!a_batch.defined() || !g_batch.defined()) return FactorUpdate::kMissing;
  return fold_factors(a_batch, g_batch, alpha);
}

FactorUpdate KfacLayer::fold_factors(const torch::Tensor& a_batch, const torch::Tensor& g_batch, double alpha) {
  if (!all_finite(a_batch) || !all_finite(g_batch)) return FactorUpdate::kNonFinite;
  a_factor_ = running_average(a_factor_, a_batch, alpha);
  g_factor_ = running_average(g_factor_, g_batch, alpha);
  return FactorUpdate::kUpdated;
}

void KfacLayer::set_factors(torch::Tensor a_factor, torch::Tensor g_factor) {
  TORCH_INTERNAL_ASSERT(a_factor.size(0) == a_dim() && g_factor.size(0) == g_dim());
  a_factor_ = std::move(a_factor);
  g_factor_ = std::move(g_factor);
}

void KfacLayer::compute_second_order(ComputeMethod method, double damping, bool pi_damping, bool a_part,
                                     bool g_part) {
  TORCH_INTERNAL_ASSERT(a_factor_.defined() && g_factor_.defined(), "layer '", name_,
                        "': second order requested before any factor update");
  SecondOrderState next = second_order_.method == method ? second_order_ : SecondOrderState();
  next.method = method;
  if (method == ComputeMethod::kEigen) {
    if (a_part) next.a_eigen = math::eigen_decompose(a_factor_);
    if (g_part) next.g_eigen = math::eigen_decompose(g_factor_);
    if (a_part && g_part) next.denominator = math::eigen_denominator(next.a_eigen, next.g_eigen, damping);
  } else {
    double a_damping = damping;
    double g_damping = damping;
    if (pi_damping) std::tie(a_damping, g_damping) = math::pi_damping(a_factor_, g_factor_, damping);
    if (a_part) next.a_inverse = math::damped_inverse(a_factor_, a_damping);
    if (g_part) next.g_inverse = math::damped_inverse(g_factor_, g_damping);
  }
  second_order_ = std::move(next);  // only replaced once everything succeeded
}

SecondOrderState& KfacLayer::prepare_second_order(ComputeMethod method) {
  auto& s = second_order_;
  if (s.method != method) s = SecondOrderState();
  s.method = method;
  const auto options = kfac_module_->kfac_weight().options();
  const int64_t a = a_dim();
  const int64_t g = g_dim();
  auto ensure = [&](torch::Tensor& t, at::IntArrayRef shape) {
    // NaN, not garbage: if the computing rank has nothing to send, receivers fall back cleanly.
    if (!t.defined() || t.sizes() != shape) t = torch::full(shape, std::numeric_limits<double>::quiet_NaN(), options);
    t = t.contiguous();  // LAPACK results are column-major; collectives need contiguous buffers
  };
  if (method == ComputeMethod::kEigen) {
    ensure(s.a_eigen.eigenvectors, {a, a});
    ensure(s.a_eigen.eigenvalues, {a});
    ensure(s.g_eigen.eigenvectors, {g, g});
    ensure(s.g_eigen.eigenvalues, {g});
  } else {
    ensure(s.a_inverse, {a, a});
    ensure(s.g_inverse, {g, g});
  }
  return s;
}

void KfacLayer::finish_second_order(double damping) {
  auto& s = second_order_;
  if (s.method == ComputeMethod::kEigen) s.denominator = math::eigen_denominator(s.a_eigen, s.g_eigen, damping);
}

bool KfacLayer::has_gradient() const {
  auto bias = kfac_module_->kfac_bias();
  return kfac_module_->kfac_weight().grad().defined() && (!bias.defined() || bias.grad().defined());
}

torch::Tensor KfacLayer::gradient() const {
  auto weight_grad = kfac_module_->kfac_weight().grad();
  auto matrix = weight_grad.reshape({weight_grad.size(0), -1});
  auto bias = kfac_module_->kfac_bias();
  if (!bias.defined()) return matrix;
  return torch::cat({matrix, bias.grad().reshape({-1, 1})}, 1);
}

void KfacLayer::set_gradient(const torch::Tensor& matrix) {
  auto weight_grad = kfac_module_->kfac_weight().mutable_grad();
  auto bias = kfac_module_->kfac_bias();
  const int64_t columns = weight_grad.numel() / weight_grad.size(0);
  torch::NoGradGuard no_grad;
  weight_grad.copy_(matrix.slice(1, 0, columns).reshape(weight_grad.sizes()));
  if (bias.defined()) bias.mutable_grad().copy_(matrix.select(1, columns));
}

int64_t KfacLayer::memory_bytes() const {
  return bytes_of(a_factor_) + bytes_of(g_factor_) + second_order_.memory_bytes();
}

void KfacLayer::save(torch::serialize::OutputArchive& archive) const {
  archive.write("name", c10::IValue(name_));
  archive.write("method", c10::IValue(static_cast<int64_t>(second_order_.method)));
  auto write = [&](const char* key, const torch::Tensor& t) {
    if (t.defined()) archive.write(key, t, /*is_buffer=*/true);
  };
  write("a_factor", a_factor_);
  write("g_factor", g_factor_);
  write("a_eigenvectors", second_order_.a_eigen.eigenvectors);
  write("a_eigenvalues", second_order_.a_eigen.eigenvalues);
  write("g_eigenvectors", second_order_.g_eigen.eigenvectors);
  write("g_eigenvalues", second_order_.g_eigen.eigenvalues);
  write("denominator", second_order_.denominator);
  write("a_inverse", second_order_.a_inverse);
  write("g_inverse", second_order_.g_inverse);
}

void KfacLayer::load(torch::serialize::InputArchive& archive) {
  c10::IValue name;
  archive.read("name", name);
  TORCH_CHECK(name.isString() && name.toStringRef() == name_, "checkpoint holds K-FAC layer '",
              name.isString() ? name.toStringRef() : std::string("?"), "' where the model has '", name_, "'");
  c10::IValue method;
  archive.read("method", method);
  auto read = [&](const char* key) {
    torch::Tensor t;
    if (!archive.try_read(key, t, /*is_buffer=*/true)) return torch::Tensor();
    return t.to(kfac_module_->kfac_weight().device());
  };
  const int64_t a = a_dim();
  const int64_t g = g_dim();
  torch::Tensor a_factor = read("a_factor");
  torch::Tensor g_factor = read("g_factor");
  check_shape(name_, "A factor", a_factor, {a, a});
  check_shape(name_, "G factor", g_factor, {g, g});
  SecondOrderState state;
  state.method = static_cast<ComputeMethod>(method.toInt());
  state.a_eigen = {read("a_eigenvectors"), read("a_eigenvalues")};
  state.g_eigen = {read("g_eigenvectors"), read("g_eigenvalues")};
  state.denominator = read("denominator");
  state.a_inverse = read("a_inverse");
  state.g_inverse = read("g_inverse");
  check_shape(name_, "Q_A", state.a_eigen.eigenvectors, {a, a});
  check_shape(name_, "Q_G", state.g_eigen.eigenvectors, {g, g});
  check_shape(name_, "eigenvalue denominator", state.denominator, {g, a});
  check_shape(name_, "A inverse", state.a_inverse, {a, a});
  check_shape(name_, "G inverse", state.g_inverse, {g, g});
  a_factor_ = a_factor;
  g_factor_ = g_factor;
  second_order_ = std::move(state);
}

}  // namespace dkfac
