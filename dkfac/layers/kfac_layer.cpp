#include "dkfac/layers/kfac_layer.h"

#include <algorithm>
#include <array>
#include <limits>
#include <utility>

namespace dkfac {
namespace {


int64_t bytes_of(const torch::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; }

}  // namespace

const std::array<LayerStateEntry, 12>& layer_state_entries() {
  static const std::array<LayerStateEntry, 12> entries = {{
      {"a_factor", true, 'a', "A factor", 'f'},
      {"g_factor", true, 'g', "G factor", 'f'},
      {"a_eigenvectors", false, 'a', "Q_A", 'q'},
      {"a_eigenvalues", false, 'a', "d_A", 'v'},
      {"g_eigenvectors", false, 'g', "Q_G", 'q'},
      {"g_eigenvalues", false, 'g', "d_G", 'v'},
      {"denominator", false, 'g', "eigenvalue denominator", 'r'},
      {"a_inverse", false, 'a', "A inverse", 'f'},
      {"g_inverse", false, 'g', "G inverse", 'f'},
      {"exp_avg", false, 'g', "Adam's first moment", 'm'},
      {"exp_avg_sq", false, 'g', "Adam's second moment", 'm'},
      {"adam_steps", false, 'g', "Adam's step count", 's'},
  }};
  return entries;
}

std::vector<int64_t> KfacLayer::state_shape(const LayerStateEntry& entry) const {
  const bool a = entry.side == 'a';
  if (a && follows_a()) return {};  // its group's first layer holds it
  const int64_t d = a ? a_dim() : g_dim();
  const bool diagonal = a ? a_diagonal() : g_diagonal();
  switch (entry.form) {
    case 'f': return diagonal ? std::vector<int64_t>{d} : std::vector<int64_t>{d, d};
    case 'q': return diagonal ? std::vector<int64_t>{} : std::vector<int64_t>{d, d};
    case 'v': return {d};
    case 's': return {1};
    case 'r': return eigen_adam_ ? std::vector<int64_t>{} : std::vector<int64_t>{g_dim(), a_dim()};  // unused there
    default: return {g_dim(), a_dim()};
  }
}

const LayerStateEntry* layer_state_entry(const std::string& key) {
  for (const auto& entry : layer_state_entries()) {
    if (key == entry.key) return &entry;
  }
  return nullptr;
}

torch::Tensor SecondOrderState::precondition(const torch::Tensor& grad) const {
  TORCH_INTERNAL_ASSERT(defined(), "precondition() before the second-order state was computed");
  const auto dtype = method == ComputeMethod::kEigen ? a_eigen.eigenvalues.scalar_type() : a_inverse.scalar_type();
  const auto g = grad.scalar_type() == dtype ? grad : grad.to(dtype);
  auto v = method == ComputeMethod::kEigen ? math::precondition_eigen(a_eigen, g_eigen, denominator, g)
                                           : math::precondition_inverse(a_inverse, g_inverse, g);
  return v.scalar_type() == grad.scalar_type() ? v : v.to(grad.scalar_type());
}

int64_t SecondOrderState::memory_bytes(bool with_a_side) const {
  int64_t total = 0;
  const auto all = parts();
  for (size_t p = 0; p < all.size(); ++p) {
    if (with_a_side || !a_side(p)) total += bytes_of(*all[p]);
  }
  return total;
}

KfacLayer::KfacLayer(LayerBinding binding) : binding_(std::move(binding)) {
  const auto& b = binding_;
  TORCH_CHECK(b.weight.defined() && b.capture != nullptr, "layer '", b.name, "' needs a weight and a factor capture");
  const auto& geometry = b.capture->geometry();
  const int64_t expected_dim = geometry.kind == LayerKind::kConv2d ? 4 : 2;
  // A Conv1d (the Python front end's) is the Conv2d of kernel height 1: its weight [C_out, C_in, k] is that one's
  // without the height, laid out alike, and its capture sees its inputs and output gradients with a height of 1.
  const bool conv1d = geometry.kind == LayerKind::kConv2d && geometry.conv.kernel_size[0] == 1 && b.weight.dim() == 3;
  TORCH_CHECK(b.weight.dim() == expected_dim || conv1d, "layer '", b.name, "' (", to_string(geometry.kind),
              "): weight has shape ",
              b.weight.sizes(), ", expected ", expected_dim, " dimensions");
  TORCH_CHECK(!geometry.transposed || geometry.kind != LayerKind::kConv2d, "layer '", b.name,
              "': a Conv2d weight is never stored transposed");
  // A transposed weight is [in, out]: transformers' Conv1D, an Embedding's [vocabulary, dim].
  const int64_t outputs = geometry.transposed ? b.weight.size(1) : b.weight.size(0);
  TORCH_CHECK(b.weight.numel() > 0, "layer '", b.name, "' (", to_string(geometry.kind), "): weight has shape ",
              b.weight.sizes(), ", with no element: there is nothing to precondition (leave the layer out with "
              "skip_layers)");
  TORCH_CHECK(geometry.kind != LayerKind::kEmbedding || b.weight.size(0) == geometry.vocabulary, "layer '", b.name,
              "' (Embedding): weight has shape ", b.weight.sizes(), ", expected ", geometry.vocabulary, " rows (num_embeddings)");
  TORCH_CHECK(b.bias.defined() == geometry.has_bias && (!b.bias.defined() || b.bias.numel() == outputs),
              "layer '", b.name, "': bias does not match the weight's ", outputs, " outputs");
  g_dim_ = outputs;
  a_dim_ = b.weight.numel() / outputs + (b.bias.defined() ? 1 : 0);
  b.capture->set_weight_dtype(b.weight.scalar_type());
  b.capture->watch_weight(b.weight);
}

void KfacLayer::set_diagonal_limit(int64_t limit) {
  binding_.capture->set_diagonal(limit > 0 && a_dim() > limit, limit > 0 && g_dim() > limit);
}

void KfacLayer::set_a_leader(int leader) { a_leader_ = leader; }

void KfacLayer::link_a(const KfacLayer& leader) {
  TORCH_INTERNAL_ASSERT(follows_a() && !leader.follows_a(), "layer '", name(), "' linked to '", leader.name(), "'");
  a_factor_ = leader.a_factor_;
  const auto& from = leader.second_order_;
  if (second_order_.method != from.method) second_order_ = SecondOrderState{from.method};
  second_order_.a_eigen = from.a_eigen;
  second_order_.a_inverse = from.a_inverse;
}

void KfacLayer::set_inv_dtype(std::optional<torch::ScalarType> inv_dtype) { inv_dtype_ = inv_dtype; }

void KfacLayer::rebind(torch::Tensor weight, torch::Tensor bias) {
  const auto& old = binding_.weight;
  TORCH_CHECK(weight.defined() && weight.sizes() == old.sizes() && weight.scalar_type() == old.scalar_type() &&
                  weight.device() == old.device(),
              "layer '", name(), "': its weight was replaced by ",
              weight.defined() ? c10::str("a tensor of shape ", weight.sizes(), ", ", weight.scalar_type(), " on ",
                                          weight.device())
                               : std::string("nothing"),
              "; K-FAC registered one of shape ", old.sizes(), ", ", old.scalar_type(), " on ", old.device(),
              ". A replacement must match (load weights of the same model); for another shape build a new "
              "preconditioner");
  TORCH_CHECK(bias.defined() == binding_.bias.defined() &&
                  (!bias.defined() || (bias.sizes() == binding_.bias.sizes() && bias.device() == old.device())),
              "layer '", name(), "': its bias was replaced by ", bias.defined() ? c10::str("one of shape ", bias.sizes())
                                                                                : std::string("none"),
              " (K-FAC registered ", binding_.bias.defined() ? c10::str("one of shape ", binding_.bias.sizes()) : "none",
              ")");
  binding_.weight = std::move(weight);
  binding_.bias = std::move(bias);
  binding_.capture->set_weight_dtype(binding_.weight.scalar_type());
  binding_.capture->watch_weight(binding_.weight);
}

int64_t KfacLayer::captured_batches() const {
  const auto& capture = *binding_.capture;
  return capture.folded_passes() + std::min(capture.a_count(), capture.g_count());
}

std::pair<torch::Tensor, torch::Tensor> KfacLayer::take_factor_batches() {
  auto& capture = *binding_.capture;
  auto a_batch = capture.take_a();
  auto g_batch = capture.take_g();
  return {a_batch, g_batch};
}

torch::Tensor KfacLayer::fold_factors(const torch::Tensor& a_batch, const torch::Tensor& g_batch, double alpha) {
  if (!a_factor_.defined() || !g_factor_.defined()) {
    // Nothing to keep if the batch is not finite: decide here (the first update only).
    auto finite = math::all_finite(a_batch, g_batch);
    if (!finite.item<bool>()) return finite;
    a_factor_ = math::running_average(a_factor_, a_batch, alpha);
    g_factor_ = math::running_average(g_factor_, g_batch, alpha);
    return finite;
  }
  auto folded = math::fold_factors(a_factor_, g_factor_, a_batch, g_batch, alpha);
  a_factor_ = std::move(folded.a);
  g_factor_ = std::move(folded.g);
  return folded.finite;
}

torch::Tensor KfacLayer::fold_factor(bool a, const torch::Tensor& batch, double alpha, const torch::Tensor& also) {
  TORCH_INTERNAL_ASSERT(!a || !follows_a(), "layer '", name(), "' folds the A factor its group's first layer holds");
  auto& factor = a ? a_factor_ : g_factor_;
  auto finite = also.defined() ? torch::isfinite(batch).all().logical_and(also) : torch::isfinite(batch).all();
  if (!factor.defined()) {  // nothing to keep if the batch is not finite: decided here (the first update only)
    if (finite.item<bool>()) factor = math::running_average(factor, batch, alpha);
    return finite;
  }
  factor = torch::where(finite, math::running_average(factor, batch, alpha), factor);
  return finite;
}

void KfacLayer::compute_second_order(ComputeMethod method, double damping, bool pi_damping, bool a_part,
                                     bool g_part) {
  auto pending = start_second_order(method, damping, pi_damping, a_part, g_part);
  if (!pending.ok.item<bool>()) {
    TORCH_CHECK(method == ComputeMethod::kInverse, "eigendecomposition of layer '", name(), "' (A ", a_dim(),
                " x ", a_dim(), ", G ", g_dim(), " x ", g_dim(), ") produced NaN or Inf");
    invert_without_cholesky(pending.state, damping, pi_damping, a_part, g_part);
  }
  second_order_ = std::move(pending.state);  // only replaced once everything succeeded
}

void KfacLayer::invert_without_cholesky(SecondOrderState& state, double damping, bool pi_damping, bool a_part,
                                        bool g_part) const {
  const auto store = second_order_dtype();
  const auto work = decomposition_dtype(a_factor_.scalar_type(), store);
  double a_damping = damping;
  double g_damping = damping;
  if (pi_damping) std::tie(a_damping, g_damping) = math::pi_damping(a_factor_, g_factor_, damping);
  // damped_inverse falls back to a general inverse and throws if the result is still not finite.
  if (a_part) state.a_inverse = math::damped_inverse(a_factor_.to(work), a_damping).to(store).contiguous();
  if (g_part) state.g_inverse = math::damped_inverse(g_factor_.to(work), g_damping).to(store).contiguous();
}

bool same_memory(const torch::Tensor& a, const torch::Tensor& b) {
  return a.is_same(b) || (a.defined() && b.defined() && a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes() &&
                          a.strides() == b.strides() && a.scalar_type() == b.scalar_type() && a.device() == b.device());
}

torch::Tensor written_alone(const torch::Tensor& t) {
  if (!t.defined()) return t;
  const bool whole = t.storage_offset() == 0 && static_cast<size_t>(t.nbytes()) == t.storage().nbytes();
  return whole ? t : t.clone(at::MemoryFormat::Contiguous);
}

std::optional<SecondOrderState> KfacLayer::install_second_order(SecondOrderState next, const torch::Tensor& ok) {
  auto& now = second_order_;
  const auto old_parts = now.parts();
  const auto new_parts = next.parts();
  bool selectable = now.method == next.method;
  for (size_t k = 0; k < old_parts.size() && selectable; ++k) {
    const auto& was = *old_parts[k];
    const auto& is = *new_parts[k];
    if (!is.defined() || same_memory(is, was)) continue;  // not recomputed: shared with the current state
    selectable = was.defined() && was.sizes() == is.sizes() && was.scalar_type() == is.scalar_type() &&
                 was.device() == is.device();
  }
  if (!selectable) return std::exchange(now, std::move(next));
  for (size_t k = 0; k < old_parts.size(); ++k) {
    auto& is = *new_parts[k];
    if (!is.defined() || same_memory(is, *old_parts[k])) continue;
    is = torch::where(ok.to(is.device()), is, *old_parts[k]);  // exactly `is` where ok holds
  }
  now = std::move(next);
  return std::nullopt;
}

PendingSecondOrder KfacLayer::start_second_order(ComputeMethod method, double damping, bool pi_damping, bool a_part,
                                                 bool g_part, bool refresh) const {
  TORCH_INTERNAL_ASSERT(a_factor_.defined() && g_factor_.defined(), "layer '", name(),
                        "': second order requested before any factor update");
  PendingSecondOrder pending{second_order_.method == method ? second_order_ : SecondOrderState(), {}};
  auto& next = pending.state;
  next.method = method;
  // The same operations as compute_second_order, in the same order, without the checks that wait.
  const auto store = second_order_dtype();
  const auto work = decomposition_dtype(a_factor_.scalar_type(), store);
  auto in = [work](const torch::Tensor& t) { return t.scalar_type() == work ? t : t.to(work); };
  auto out = [store](const torch::Tensor& t) { return t.scalar_type() == store ? t : t.to(store); };
  std::vector<torch::Tensor> checks;  // 0-dim bools, all must hold
  auto finite = [&](const torch::Tensor& t) { checks.push_back(torch::isfinite(t).all()); };
  if (method == ComputeMethod::kEigen) {
    auto stored = [&](const math::EigenFactor& e) {  // a diagonal factor has no eigenvectors (the identity)
      // Row-major, as every other source of an eigenbasis (a stack's slot, a collective's buffer, a loaded
      // checkpoint) holds it: LAPACK's column-major results would make the products round otherwise, and a
      // resumed run differ from the uninterrupted one. The inverses below likewise.
      math::EigenFactor kept{e.eigenvectors.defined() ? out(e.eigenvectors).contiguous() : torch::Tensor(),
                             out(e.eigenvalues)};
      if (kept.eigenvectors.defined()) finite(kept.eigenvectors);
      finite(kept.eigenvalues);
      return kept;
    };
    // `next` starts as a copy of the current state: its eigenbasis is the one a refresh starts from.
    auto decompose = [&](const torch::Tensor& factor, const math::EigenFactor& held) {
      const bool from_held = refresh && held.eigenvectors.defined() && held.eigenvectors.sizes() == factor.sizes();
      return from_held ? math::refresh_eigenbasis(in(factor), {in(held.eigenvectors), in(held.eigenvalues)})
                       : math::eigen_decompose_unchecked(in(factor));
    };
    if (a_part) next.a_eigen = stored(decompose(a_factor_, next.a_eigen));
    if (g_part) next.g_eigen = stored(decompose(g_factor_, next.g_eigen));
    // Adam in the eigenbasis steps without the eigenvalues: no denominator to hold.
    if (a_part && g_part && !eigen_adam_) next.denominator = math::eigen_denominator(next.a_eigen, next.g_eigen, damping);
  } else {
    auto a_damping = torch::scalar_tensor(damping, torch::kFloat64);
    auto g_damping = a_damping;
    if (pi_damping) std::tie(a_damping, g_damping) = math::pi_damping_on_device(a_factor_, g_factor_, damping);
    auto inverse = [&](const torch::Tensor& factor, const torch::Tensor& d) {
      auto result = math::damped_inverse_unchecked(in(factor), d);
      checks.push_back(result.cholesky_ok);
      auto kept = out(result.inverse).contiguous();  // row-major, as the eigenbases above
      finite(kept);
      return kept;
    };
    if (a_part) next.a_inverse = inverse(a_factor_, a_damping);
    if (g_part) next.g_inverse = inverse(g_factor_, g_damping);
  }
  pending.ok = checks.empty() ? torch::ones({}, torch::kBool) : torch::stack(checks).all();
  return pending;
}

SecondOrderState& KfacLayer::prepare_second_order(ComputeMethod method, bool a_side, bool g_side) {
  auto& s = second_order_;
  if (s.method != method) s = SecondOrderState();
  s.method = method;
  const auto options = binding_.weight.options().dtype(second_order_dtype());
  auto ensure = [&](torch::Tensor& t, const char* key, bool sent) {
    const auto shape = state_shape(*layer_state_entry(key));
    if (shape.empty()) {  // never held (the identity eigenvectors of a diagonal factor)
      t = torch::Tensor();
      return;
    }
    // NaN, not garbage: if the computing rank has nothing to send, receivers fall back cleanly.
    if (!t.defined() || t.sizes() != at::IntArrayRef(shape)) {
      t = torch::full(shape, std::numeric_limits<double>::quiet_NaN(), options);
    }
    if (sent) t = t.contiguous();  // LAPACK results are column-major; collectives need contiguous buffers
  };
  if (method == ComputeMethod::kEigen) {
    if (eigen_adam_) {  // broadcast into copies: the basis the moments are in (adam_basis_) keeps the old tensors
      for (auto* q : {&s.a_eigen.eigenvectors, &s.g_eigen.eigenvectors}) {
        const bool leaders = q == &s.a_eigen.eigenvectors && follows_a();  // relinked after the broadcast
        if (q->defined() && !leaders) *q = q->clone(at::MemoryFormat::Contiguous);
      }
    }
    ensure(s.a_eigen.eigenvectors, "a_eigenvectors", a_side);
    ensure(s.a_eigen.eigenvalues, "a_eigenvalues", a_side);
    ensure(s.g_eigen.eigenvectors, "g_eigenvectors", g_side);
    ensure(s.g_eigen.eigenvalues, "g_eigenvalues", g_side);
  } else {
    ensure(s.a_inverse, "a_inverse", a_side);
    ensure(s.g_inverse, "g_inverse", g_side);
  }
  return s;
}

void KfacLayer::finish_second_order(double damping) {
  auto& s = second_order_;
  if (s.method == ComputeMethod::kEigen && !eigen_adam_) {
    s.denominator = math::eigen_denominator(s.a_eigen, s.g_eigen, damping);
  }
}

bool KfacLayer::has_gradient() const {
  const auto& bias = binding_.bias;
  return binding_.weight.grad().defined() && (!bias.defined() || bias.grad().defined());
}

torch::Tensor KfacLayer::weight_gradient_matrix() const {
  auto weight_grad = binding_.weight.grad();
  TORCH_CHECK(!weight_grad.is_sparse(), "layer '", name(), "' has a sparse gradient (an Embedding with sparse=True); "
              "K-FAC preconditions dense gradients only: build the Embedding with sparse=False, or skip it with skip_layers");
  return binding_.capture->geometry().transposed ? weight_grad.t() : weight_grad.reshape({weight_grad.size(0), -1});
}

torch::Tensor KfacLayer::gradient() const {
  auto matrix = weight_gradient_matrix();
  const auto& bias = binding_.bias;
  if (!bias.defined()) return matrix;
  return torch::cat({matrix, bias.grad().reshape({-1, 1})}, 1);
}

void KfacLayer::copy_gradient_to(torch::Tensor out) const {
  TORCH_INTERNAL_ASSERT(out.dim() == 2 && out.size(0) == g_dim() && out.size(1) == a_dim(), "layer '", name(),
                        "': gradient slot of shape ", out.sizes());
  const auto matrix = weight_gradient_matrix();
  const auto& bias = binding_.bias;
  if (!bias.defined()) {
    out.copy_(matrix);
    return;
  }
  out.narrow(1, 0, a_dim() - 1).copy_(matrix);
  out.select(1, a_dim() - 1).copy_(bias.grad().reshape({-1}));
}

void KfacLayer::set_gradient(const torch::Tensor& matrix) {
  auto weight_grad = binding_.weight.mutable_grad();
  const auto& bias = binding_.bias;
  const int64_t columns = weight_grad.numel() / g_dim();
  torch::NoGradGuard no_grad;
  if (binding_.capture->geometry().transposed) {
    weight_grad.copy_(matrix.slice(1, 0, columns).t());
  } else {
    weight_grad.copy_(matrix.slice(1, 0, columns).reshape(weight_grad.sizes()));
  }
  if (bias.defined()) bias.mutable_grad().copy_(matrix.select(1, columns));
}

void KfacLayer::set_gradient_where(const torch::Tensor& use, const torch::Tensor& matrix) {
  auto weight_grad = binding_.weight.mutable_grad();
  const auto& bias = binding_.bias;
  const int64_t columns = weight_grad.numel() / g_dim();
  torch::NoGradGuard no_grad;
  const auto weight_part = binding_.capture->geometry().transposed
                               ? matrix.slice(1, 0, columns).t()
                               : matrix.slice(1, 0, columns).reshape(weight_grad.sizes());
  weight_grad.copy_(torch::where(use, weight_part, weight_grad));
  if (bias.defined()) {
    auto bias_grad = bias.mutable_grad();
    bias_grad.copy_(torch::where(use, matrix.select(1, columns), bias_grad));
  }
}

int64_t KfacLayer::memory_bytes() const {
  int64_t total = 0;
  for (const auto& [key, tensor] : state()) total += bytes_of(tensor);  // a follower's A side is its leader's
  return total;
}

bool KfacLayer::adam_basis_is_current() const {
  // By memory, not handle: a stack's slot is handed out in new views (LayerGroups), and a slot about to be
  // overwritten in place keeps the moments' basis apart first (keep_adam_basis_from).
  const auto& s = second_order_;
  return adam_basis_ && same_memory(adam_basis_->first.eigenvectors, s.a_eigen.eigenvectors) &&
         same_memory(adam_basis_->second.eigenvectors, s.g_eigen.eigenvectors);
}

void KfacLayer::take_current_basis_for_adam() {
  const auto& s = second_order_;
  adam_basis_.emplace(math::EigenFactor{s.a_eigen.eigenvectors, {}}, math::EigenFactor{s.g_eigen.eigenvectors, {}});
}

void KfacLayer::rotate_adam_moments_if_due() {
  const auto& s = second_order_;
  if (!adam_.defined() || s.method != ComputeMethod::kEigen || !s.defined()) return;
  if (adam_basis_ && !adam_basis_is_current()) {
    // Into the moments' own memory: a CUDA graph that steps them (Options::cuda_graphs) keeps reading them there.
    const auto rotated = math::rotate_moments(adam_, adam_basis_->first, adam_basis_->second, s.a_eigen, s.g_eigen);
    adam_.exp_avg.copy_(rotated.exp_avg);
    adam_.exp_avg_sq.copy_(rotated.exp_avg_sq);
    adam_.steps.copy_(rotated.steps);
    ++adam_rotations_;
  }
  take_current_basis_for_adam();
}

math::EigenAdamMoments& KfacLayer::adam_moments_for_step() {
  const auto& s = second_order_;
  TORCH_INTERNAL_ASSERT(s.method == ComputeMethod::kEigen && s.defined(), "layer '", name(),
                        "': an eigen_adam step before the eigen method's state was computed");
  if (!adam_.defined()) {
    adam_ = math::zero_moments(g_dim(), a_dim(), binding_.weight.options().dtype(second_order_dtype()));
  }
  rotate_adam_moments_if_due();
  return adam_;
}

torch::Tensor KfacLayer::precondition_adam(const torch::Tensor& grad, const math::AdamConstants& constants) {
  auto& moments = adam_moments_for_step();
  const auto& s = second_order_;
  return math::eigen_adam_step(s.a_eigen, s.g_eigen, moments, grad, constants);
}

bool KfacLayer::adam_moments_current() const { return adam_.defined() && adam_basis_is_current(); }

void KfacLayer::adam_basis_moved(const torch::Tensor& from, const torch::Tensor& to) {
  if (!adam_basis_ || !from.defined()) return;
  for (auto* q : {&adam_basis_->first.eigenvectors, &adam_basis_->second.eigenvectors}) {
    if (same_memory(*q, from)) *q = to;
  }
}

void KfacLayer::keep_adam_basis_from(const torch::Tensor& memory) {
  if (!adam_basis_ || !memory.defined()) return;
  for (auto* q : {&adam_basis_->first.eigenvectors, &adam_basis_->second.eigenvectors}) {
    if (q->defined() && q->data_ptr() == memory.data_ptr()) *q = q->clone(at::MemoryFormat::Contiguous);
  }
}

std::map<std::string, torch::Tensor> KfacLayer::state() const {
  std::map<std::string, torch::Tensor> state;
  auto put = [&](const char* key, const torch::Tensor& t) {
    if (t.defined() && !(follows_a() && layer_state_entry(key)->side == 'a')) state[key] = t;  // a leader's
  };
  put("a_factor", a_factor_);
  put("g_factor", g_factor_);
  put("a_eigenvectors", second_order_.a_eigen.eigenvectors);
  put("a_eigenvalues", second_order_.a_eigen.eigenvalues);
  put("g_eigenvectors", second_order_.g_eigen.eigenvectors);
  put("g_eigenvalues", second_order_.g_eigen.eigenvalues);
  put("denominator", second_order_.denominator);
  put("a_inverse", second_order_.a_inverse);
  put("g_inverse", second_order_.g_inverse);
  put("exp_avg", adam_.exp_avg);
  put("exp_avg_sq", adam_.exp_avg_sq);
  put("adam_steps", adam_.steps);
  return state;
}

void KfacLayer::load_state(const std::map<std::string, torch::Tensor>& state, ComputeMethod method) {
  // Loaded state takes the dtypes this layer keeps (its factors', its Options::inv_dtype), whatever the
  // checkpoint's: a float64 checkpoint must not quietly change them.
  const auto factor_type = a_factor_.defined() ? a_factor_.scalar_type() : factor_dtype();
  const auto stored_type = inv_dtype_.value_or(factor_type);
  auto get = [&](const char* key) {
    const auto it = state.find(key);
    if (it == state.end() || !it->second.defined()) return torch::Tensor();
    const auto* entry = layer_state_entry(key);
    if (eigen_adam_ && entry->form == 'r') return torch::Tensor();  // a denominator: not held
    const auto dtype = entry->factor ? factor_type : entry->form == 's' ? torch::kFloat32 : stored_type;
    // A copy even where device and dtype match: the caller's tensors (a state dict it may fill again) are never
    // the live state.
    return it->second.to(binding_.weight.device(), dtype, /*non_blocking=*/false, /*copy=*/true);
  };
  if (follows_a()) {  // its group's first layer holds the A side (a checkpoint without sharing has a copy)
    auto own = state;
    for (auto it = own.begin(); it != own.end();) {
      const auto* entry = layer_state_entry(it->first);
      it = entry != nullptr && entry->side == 'a' ? own.erase(it) : std::next(it);
    }
    if (own.size() < state.size()) return load_state(own, method);
  }
  for (const auto& [key, tensor] : state) {
    const auto* entry = layer_state_entry(key);
    TORCH_CHECK(entry == nullptr || !tensor.defined() || torch::isfinite(tensor).all().item<bool>(),
                "checkpoint for layer '", name(), "': ", entry ? entry->what : key, " holds NaN or Inf; nothing was "
                "loaded (a running average would keep it for good)");
  }
  for (const auto& [key, tensor] : state) {
    TORCH_CHECK(layer_state_entry(key) != nullptr, "state of K-FAC layer '", name(), "' has an unknown entry '", key, "'");
  }
  for (const auto& entry : layer_state_entries()) {
    const auto t = get(entry.key);
    const auto expected = state_shape(entry);
    TORCH_CHECK(!t.defined() || !expected.empty(), "checkpoint for layer '", name(), "' holds ", entry.what,
                " of shape ", t.sizes(), ", but this layer keeps its ", entry.side == 'a' ? "A" : "G",
                " factor diagonal (no eigenvectors): was it saved with another diagonal_factor_dim?");
    TORCH_CHECK(!t.defined() || t.sizes() == at::IntArrayRef(expected), "checkpoint for layer '", name(), "': ",
                entry.what, " has shape ", t.sizes(), ", the model expects ", at::IntArrayRef(expected),
                expected.size() != static_cast<size_t>(t.dim()) ? " (one keeps this factor diagonal, the other dense: "
                                                                  "the same diagonal_factor_dim is needed)" : "");
  }
  // Adam's moments: all three or none; a layer without eigen_adam has no use for them (another run's).
  math::EigenAdamMoments adam;
  // Contiguous (a checkpoint's tensors may have any layout): the fused Adam kernel steps P, m and v in one, and
  // the eigenbases and inverses are row-major as computed, so that the products round as in the uninterrupted run.
  auto dense = [&](const char* key) {
    auto t = get(key);
    return t.defined() ? t.contiguous() : t;
  };
  if (eigen_adam_) adam = {dense("exp_avg"), dense("exp_avg_sq"), dense("adam_steps")};
  const int held = adam.exp_avg.defined() + adam.exp_avg_sq.defined() + adam.steps.defined();
  TORCH_CHECK(held == 0 || held == 3, "checkpoint for layer '", name(), "' holds ", held,
              " of Adam's three entries (exp_avg, exp_avg_sq, adam_steps): the state is incomplete");
  torch::Tensor a_factor = get("a_factor");
  torch::Tensor g_factor = get("g_factor");
  SecondOrderState next;
  next.method = method;
  next.a_eigen = {dense("a_eigenvectors"), get("a_eigenvalues")};  // row-major, as computed (start_second_order)
  next.g_eigen = {dense("g_eigenvectors"), get("g_eigenvalues")};
  next.denominator = get("denominator");
  next.a_inverse = dense("a_inverse");  // row-major, as computed
  next.g_inverse = dense("g_inverse");
  a_factor_ = a_factor;
  g_factor_ = g_factor;
  second_order_ = std::move(next);
  adam_ = std::move(adam);
  adam_basis_.reset();  // until the layers are linked: adam_moments_in_current_basis
}

void KfacLayer::adam_moments_in_current_basis() {
  const auto& s = second_order_;
  if (adam_.defined() && s.method == ComputeMethod::kEigen && s.defined()) {
    take_current_basis_for_adam();
  } else {
    adam_basis_.reset();  // no basis was saved with them: the next one computed is theirs
  }
}

void KfacLayer::save(torch::serialize::OutputArchive& archive) const {
  archive.write("name", c10::IValue(name()));
  archive.write("method", c10::IValue(static_cast<int64_t>(second_order_.method)));
  for (const auto& [key, tensor] : state()) archive.write(key, written_alone(tensor), /*is_buffer=*/true);
}

void KfacLayer::load(torch::serialize::InputArchive& archive) {
  c10::IValue saved_name;
  archive.read("name", saved_name);
  TORCH_CHECK(saved_name.isString() && saved_name.toStringRef() == name(), "checkpoint holds K-FAC layer '",
              saved_name.isString() ? saved_name.toStringRef() : std::string("?"), "' where the model has '", name(),
              "'");
  c10::IValue method;
  archive.read("method", method);
  std::map<std::string, torch::Tensor> state;
  for (const auto& entry : layer_state_entries()) {
    torch::Tensor t;
    if (archive.try_read(entry.key, t, /*is_buffer=*/true)) state[entry.key] = t;
  }
  load_state(state, static_cast<ComputeMethod>(method.toInt()));
}

}  // namespace dkfac
