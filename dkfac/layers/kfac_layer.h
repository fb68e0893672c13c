#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "dkfac/math/eigen_adam.h"
#include "dkfac/math/second_order.h"
#include "dkfac/layers/factor_capture.h"
#include "dkfac/options.h"

namespace dkfac {

/// Second-order state of one layer: eigendecompositions (eigen method) or damped inverses.
struct SecondOrderState {
  ComputeMethod method = ComputeMethod::kEigen;
  math::EigenFactor a_eigen;  // Q_A [a, a], d_A [a]
  math::EigenFactor g_eigen;  // Q_G [g, g], d_G [g]
  torch::Tensor denominator;  // 1 / (d_G d_A^T + damping), [g, a]; not held with Options::eigen_adam (unused)
  torch::Tensor a_inverse;    // (A + damping_A I)^-1, [a, a]
  torch::Tensor g_inverse;    // (G + damping_G I)^-1, [g, g]

  /// True once computed: the eigen method's two sides (where the denominator is built from both), the inverse's A.
  bool defined() const {
    return method == ComputeMethod::kEigen ? a_eigen.eigenvalues.defined() && g_eigen.eigenvalues.defined()
                                           : a_inverse.defined();
  }
  /// Every part, held or not, in one order: Q_A, d_A, Q_G, d_G, the denominator, the A and G inverses.
  std::array<torch::Tensor*, 7> parts() {
    return {&a_eigen.eigenvectors, &a_eigen.eigenvalues, &g_eigen.eigenvectors, &g_eigen.eigenvalues, &denominator,
            &a_inverse, &g_inverse};
  }
  std::array<const torch::Tensor*, 7> parts() const {
    auto all = const_cast<SecondOrderState*>(this)->parts();
    return {all[0], all[1], all[2], all[3], all[4], all[5], all[6]};
  }
  /// Whether part `p` of parts() belongs to the A side (Q_A, d_A, the A inverse): the parts a shared-input group's
  /// followers hold of their leader (Options::shared_input_layers).
  static bool a_side(size_t p) { return p == 0 || p == 1 || p == 5; }
  /// V for `grad` [g, a], computed in the state's dtype and returned in the gradient's.
  torch::Tensor precondition(const torch::Tensor& grad) const;
  /// Bytes held; without the A side's where `with_a_side` is false.
  int64_t memory_bytes(bool with_a_side = true) const;
};

/// A second-order state computed but not yet checked: `ok` (0-dim bool, on the device) is true when every
/// part is finite and, for inverses, the Cholesky factorisation succeeded. Reading it waits for the device,
/// so the preconditioner installs each layer's state as it is computed (KfacLayer::install_second_order)
/// and reads every layer's check at once.
struct PendingSecondOrder {
  SecondOrderState state;
  torch::Tensor ok;
};

/// Whether `a` and `b` are one tensor's memory: the same handle, or two handles of one view (a slot of a group's
/// stack, LayerGroups, handed out again since): the same data, shape, strides, dtype and device.
bool same_memory(const torch::Tensor& a, const torch::Tensor& b);
/// `t` as an archive should write it: itself where it is its whole storage, else a contiguous copy (an archive writes
/// a view's whole storage: a stack's slot would bring its stack, and a padded slot its pad; Options::stack_layers).
torch::Tensor written_alone(const torch::Tensor& t);

/// One layer as the core sees it, whichever front end registered it: the C++ API binds each
/// dkfac::nn module of a model, the Python package each torch.nn.Linear / Conv2d it hooks.
struct LayerBinding {
  std::string name;    ///< path in the model, e.g. "layer1.0.conv1"
  /// Linear [g, in_features], Conv2d [g, C_in, kh, kw]; shares the model's parameter. Where the capture's
  /// geometry says `transposed`: [in_features, g] (transformers' Conv1D) or [vocabulary, g] (Embedding).
  torch::Tensor weight;
  torch::Tensor bias;    ///< [g], or undefined
  std::shared_ptr<FactorCapture> capture;  ///< fed by the front end's hooks; knows the layer kind
  /// The front end shards this layer's gradient by output rows over each row of ranks (FSDP2, HSDP) and moves
  /// the rows itself; `weight` and `bias` are full-shaped stand-ins (Options::sharded_placement).
  bool sharded = false;
  /// A sharded layer's shard group: the ranks its rows are split over (HSDP: world / replicas); 0: the world.
  int shard_ranks = 0;
};

/// One entry of KfacLayer::state(): the one list of a layer's state that checkpoints, the collective gather
/// (StepExecutor::gather_states), placement on load and the Python package (dkfac._C.layer_state_entries) read.
struct LayerStateEntry {
  const char* key;   ///< "a_factor", "a_eigenvectors", ...
  bool factor;       ///< a Kronecker factor; else second-order state
  char side;         ///< 'a' or 'g': the factor it belongs to (the eigenvalue denominator [g, a] counts as G's)
  const char* what;  ///< as messages name it: "A factor", "Q_A", ...
  /// How it is shaped, for a side of dimension d: 'f' d x d, or [d] where that factor is diagonal (factors,
  /// inverses); 'q' d x d, never held for a diagonal factor (eigenvectors); 'v' [d] (eigenvalues); 'r' [g, a];
  /// 'm' [g, a] (Adam's moments in the eigenbasis, Options::eigen_adam); 's' [1] float32 (their step count).
  char form;
  /// Adam's state (forms 'm' and 's'): held where the layer is preconditioned, kept by factors-only checkpoints.
  bool moment() const { return form == 'm' || form == 's'; }
};
/// Every entry KfacLayer::state() may hold, in save order.
const std::array<LayerStateEntry, 12>& layer_state_entries();
/// The entry named `key`, or nullptr when there is none.
const LayerStateEntry* layer_state_entry(const std::string& key);

/// K-FAC state and operations of one layer: running factors, second-order state, and the layer
/// gradient seen as a [g, a] matrix. Holds no communication; strategies sequence its phases.
class KfacLayer {
 public:
  /// Checks the binding (weight and capture present, shapes consistent with the layer kind).
  explicit KfacLayer(LayerBinding binding);

  const std::string& name() const { return binding_.name; }
  LayerKind kind() const { return binding_.capture->geometry().kind; }
  const torch::Tensor& weight() const { return binding_.weight; }
  const torch::Tensor& bias() const { return binding_.bias; }
  /// Neither its weight nor its bias is frozen (requires_grad=False): else its preconditioned gradient, which mixes
  /// the two, would move the frozen one.
  bool trainable() const { return weight().requires_grad() && (!bias().defined() || bias().requires_grad()); }
  /// Follows the module's parameters when they were replaced by others of the same shape, dtype and device (a
  /// Hugging Face or meta-device load: `load_state_dict(assign=True)`, or `layer.weight = Parameter(...)`);
  /// throws naming the layer and both tensors otherwise. Factors and second-order state are kept.
  void rebind(torch::Tensor weight, torch::Tensor bias);
  FactorCapture& capture() { return *binding_.capture; }
  const std::shared_ptr<FactorCapture>& shared_capture() const { return binding_.capture; }
  const FactorCapture& capture() const { return *binding_.capture; }
  /// a = inputs per output (+1 with bias), g = outputs: weight columns and rows, swapped where transposed.
  int64_t a_dim() const { return a_dim_; }
  int64_t g_dim() const { return g_dim_; }
  /// Whether the A / G factor is kept as its diagonal (math/factors.h): an Embedding's A, or a factor wider
  /// than Options::diagonal_factor_dim.
  bool a_diagonal() const { return binding_.capture->geometry().a_diagonal; }
  /// LayerBinding::sharded and shard_ranks.
  bool sharded() const { return binding_.sharded; }
  int shard_ranks() const { return binding_.shard_ranks; }
  bool g_diagonal() const { return binding_.capture->geometry().g_diagonal; }
  /// Keeps the factors wider than `limit` diagonal (0: none); before any capture (the preconditioner's
  /// construction).
  void set_diagonal_limit(int64_t limit);
  /// The shape `entry` has in this layer's state; empty where this layer never holds it (the eigenvectors
  /// of a diagonal factor).
  std::vector<int64_t> state_shape(const LayerStateEntry& entry) const;

  /// Options::shared_input_layers: the index of the layer whose A factor this one shares (its group's first
  /// layer), or -1 where it holds its own. A follower holds none of the A side's state: link_a aliases the
  /// leader's, state() and memory_bytes() leave it out, state_shape() gives it no shape, and load_state ignores
  /// it. Before any capture (the preconditioner's construction, which also sets up the members' captures:
  /// FactorCapture::set_shared_input).
  void set_a_leader(int leader);
  int a_leader() const { return a_leader_; }
  bool follows_a() const { return a_leader_ >= 0; }
  /// Aliases the leader's running A factor and the A side of its second-order state (Q_A and d_A, or the A
  /// inverse); the denominator is this layer's own (finish_second_order rebuilds it).
  void link_a(const KfacLayer& leader);

  /// Storage dtype of the second-order state (Options::inv_dtype); nullopt: the factors' dtype.
  void set_inv_dtype(std::optional<torch::ScalarType> inv_dtype);
  /// dtype of the running factors (the capture's factor dtype, else the weight's) and of the second-order state.
  torch::ScalarType factor_dtype() const {
    return binding_.capture->factor_dtype().value_or(binding_.weight.scalar_type());
  }
  torch::ScalarType second_order_dtype() const { return inv_dtype_.value_or(factor_dtype()); }

  /// Turns activation/gradient capture on for the coming forward/backward (factor steps only).
  void set_capture(bool enabled) { binding_.capture->set_enabled(enabled); }
  /// Micro-batches captured since the last factor update: those its hooks folded (Options::fold_in_hooks), and the
  /// min of the A and G counts.
  int64_t captured_batches() const;

  /// The mean captured factors {A_batch [a, a], G_batch [g, g]} (undefined if none); resets the capture.
  std::pair<torch::Tensor, torch::Tensor> take_factor_batches();
  /// F = alpha F + (1 - alpha) F_batch for both factors where both batches are finite. Decided on the
  /// device: returns a 0-dim bool tensor, true when updated, false when a batch held NaN/Inf and the factors
  /// were left unchanged. Only the first update (no previous factor to keep) waits for the device.
  torch::Tensor fold_factors(const torch::Tensor& a_batch, const torch::Tensor& g_batch, double alpha);
  /// One factor's fold (a shared-input group's: A once for the group, each member's G): F = alpha F +
  /// (1 - alpha) F_batch where the batch is finite and `also` (a 0-dim bool, where given) holds, decided on the
  /// device; the 0-dim bool says whether it was. A first update (no previous factor) that is not folded leaves the
  /// factor undefined.
  torch::Tensor fold_factor(bool a, const torch::Tensor& batch, double alpha, const torch::Tensor& also = {});
  /// Both running factors exist (a first factor update succeeded).
  bool has_factors() const { return a_factor_.defined() && g_factor_.defined(); }
  /// Running factors: A [a, a] and G [g, g] ([a] / [g] where diagonal); undefined before the first update.
  const torch::Tensor& a_factor() const { return a_factor_; }
  const torch::Tensor& g_factor() const { return g_factor_; }

  /// Recomputes the second-order state from the running factors. On failure (non-convergence,
  /// NaN) the previous state is kept and the error is rethrown for the caller to report.
  /// With `a_part`/`g_part` false, that factor's part is left for a broadcast to fill in (distributed).
  /// Waits for the device to check the result; start_second_order and set_second_order split it for
  /// callers that check many layers at once.
  void compute_second_order(ComputeMethod method, double damping, bool pi_damping, bool a_part = true,
                            bool g_part = true);
  /// The new second-order state and its check, computed without waiting for the device (only a
  /// decomposition that fails to converge throws). Inverses come from Cholesky alone: where `ok` is false,
  /// compute_second_order (with its general-inverse fallback) is the way on.
  /// With `refresh` (Options::eigh_interval), the eigen method refreshes the eigenbasis this layer holds
  /// (math::refresh_eigenbasis) where it holds one of the factor's shape, and decomposes in full elsewhere; a
  /// refresh from a basis that is not finite fails the check, and compute_second_order decomposes in full.
  PendingSecondOrder start_second_order(ComputeMethod method, double damping, bool pi_damping, bool a_part = true,
                                        bool g_part = true, bool refresh = false) const;
  /// Installs a state from start_second_order before its check is read, so that no layer's old and new state
  /// outlive the layer's own update (one layer's two copies at a time, not every layer's). Each part is chosen
  /// on the device, the new one where `ok` holds and the current one elsewhere: nothing waits, and a layer whose
  /// check fails keeps the state it had. Where the current state has no part of the new one's shape to fall
  /// back on (the first update, another method), the new state is installed as it is and the current one
  /// returned: the caller reinstalls it (set_second_order) when `ok` turns out false.
  std::optional<SecondOrderState> install_second_order(SecondOrderState next, const torch::Tensor& ok);
  /// Installs a state: a checked one, or the one install_second_order returned.
  void set_second_order(SecondOrderState state) { second_order_ = std::move(state); }
  const SecondOrderState& second_order() const { return second_order_; }
  /// For strategies that receive parts by broadcast: shapes them for `method` (NaN-filled where missing), the
  /// parts of the sides broadcast (`a_side`, `g_side`) contiguous, then, after the broadcast, `finish_second_order`
  /// rebuilds the denominator. A part that is a padded stack's view (Options::pad_widths) is not contiguous: it is
  /// broadcast through a contiguous copy, which LayerGroups::absorb copies back into its slot.
  SecondOrderState& prepare_second_order(ComputeMethod method, bool a_side = true, bool g_side = true);
  void finish_second_order(double damping);

  /// Adam in the eigenbasis (Options::eigen_adam), set before any step: the layer keeps Adam's moments, and
  /// prepare_second_order gives each broadcast a copy of the eigenvectors to fill (the basis the moments are in
  /// must outlive a refresh: precondition_adam rotates them out of it).
  void set_eigen_adam(bool on) { eigen_adam_ = on; }
  bool eigen_adam() const { return eigen_adam_; }
  /// Adam's step in the current eigenbasis for `grad`, this layer's gradient ([g, a], gradient(); the result in its
  /// dtype; NaN where it is not finite), updating the moments (math::eigen_adam_step); the moments are first
  /// re-expressed in the current basis where it was refreshed since they were last updated (math::rotate_moments),
  /// and start at zero. Needs the eigen method's state; nothing waits for the device.
  torch::Tensor precondition_adam(const torch::Tensor& grad, const math::AdamConstants& constants);
  /// The moments precondition_adam steps, made ready for a step in the current basis (zero, or rotated into it),
  /// which they are then taken to be in: for a step taken elsewhere (math::eigen_adam_step_stacked, Options::
  /// stack_layers). The same conditions as precondition_adam.
  math::EigenAdamMoments& adam_moments_for_step();
  /// Where the moments and the eigen method's state exist: the moments rotated now into the current basis if it
  /// changed since their last step, as their next step would, and taken to be in it (before they are gathered with
  /// that basis: strategy auto's re-placement). Nothing otherwise.
  void rotate_adam_moments_if_due();
  /// After a load (and the layers' linking, Options::shared_input_layers): the loaded moments are in the loaded
  /// basis, so that an update installed next (one in flight when the state was saved, Options::second_order_lag, or a
  /// recomputation) rotates them out of it; where no basis was loaded, the next one computed is theirs.
  void adam_moments_in_current_basis();
  /// Options::stack_layers: `from`, a part of this layer's eigenbasis, now lives in `to`, which holds its values (a
  /// copy into a stack's slot, or out of it): where the moments are expressed in `from`, they are in `to`, and need
  /// no rotation. Nothing without eigen_adam.
  void adam_basis_moved(const torch::Tensor& from, const torch::Tensor& to);
  /// Options::stack_layers: `memory` (a stack's slot) is about to be overwritten in place: where the moments are
  /// expressed in a basis held there, that basis is kept as a copy, so that the next step rotates them out of it.
  void keep_adam_basis_from(const torch::Tensor& memory);
  /// Adam's moments (undefined before the first precondition_adam).
  const math::EigenAdamMoments& adam_moments() const { return adam_; }
  /// Whether the moments exist and are in the current eigenbasis, so that a step needs no host decision about them
  /// (a CUDA graph's replay takes none: Options::cuda_graphs).
  bool adam_moments_current() const;
  /// How many times the moments were rotated into a new eigenbasis: once per basis they were stepped in after the
  /// first, none for a basis that only moved (into a stack's slot or out of it).
  int64_t adam_rotations() const { return adam_rotations_; }

  /// True when the weight (and bias) have gradients.
  bool has_gradient() const;
  /// The gradient as a matrix [g, a]: weight gradient viewed [g, -1], bias gradient as last column.
  torch::Tensor gradient() const;
  /// gradient(), written into `out` [g, a] (a slot of a group's stacked gradients, LayerGroups) without a copy of its
  /// own.
  void copy_gradient_to(torch::Tensor out) const;
  /// Writes a [g, a] matrix back into the weight (and bias) gradients.
  void set_gradient(const torch::Tensor& matrix);
  /// Where `use` (a 0-dim bool, on the device) is true, writes `matrix` [g, a] into the weight (and bias) gradients;
  /// where it is false, they keep what they hold. Part by part: the gradient is not gathered into a matrix for it.
  void set_gradient_where(const torch::Tensor& use, const torch::Tensor& matrix);

  /// Bytes of factors, second-order state and Adam's moments held by this layer.
  int64_t memory_bytes() const;

  /// Factors and second-order state by name (layer_state_entries()' keys); only those held.
  std::map<std::string, torch::Tensor> state() const;
  /// Restores what state() returned (moved to the weight's device); checks every shape and refuses
  /// unknown entries, leaving the layer unchanged on error.
  void load_state(const std::map<std::string, torch::Tensor>& state, ComputeMethod method);

  /// Serialises factors and second-order state.
  void save(torch::serialize::OutputArchive& archive) const;
  /// Restores what save() wrote; checks the name and shapes.
  void load(torch::serialize::InputArchive& archive);

 private:
  /// Whether adam_basis_ is the current eigenbasis (by memory).
  bool adam_basis_is_current() const;
  /// adam_basis_ := the current eigenbasis.
  void take_current_basis_for_adam();
  /// The weight's gradient as a matrix [g, a - 1 with a bias] (a view where the weight's layout allows).
  torch::Tensor weight_gradient_matrix() const;
  /// Inverses through damped_inverse (Cholesky, else a general inverse; checked): where Cholesky failed.
  void invert_without_cholesky(SecondOrderState& state, double damping, bool pi_damping, bool a_part,
                               bool g_part) const;

  LayerBinding binding_;
  int64_t a_dim_;
  int64_t g_dim_;
  std::optional<torch::ScalarType> inv_dtype_;
  torch::Tensor a_factor_;                     // A, [a, a]
  torch::Tensor g_factor_;                     // G, [g, g]
  SecondOrderState second_order_;
  bool eigen_adam_ = false;
  int a_leader_ = -1;  // Options::shared_input_layers: the layer whose A side this one aliases
  math::EigenAdamMoments adam_;
  int64_t adam_rotations_ = 0;
  /// The eigenbasis adam_ is expressed in ({Q_A, Q_G}: the tensors of the state it was last updated with, compared
  /// with the current ones by memory; an update installs new ones, or new values into a stack's slot after
  /// keep_adam_basis_from); nullopt: whichever is current (new moments, or moments loaded without a basis).
  std::optional<std::pair<math::EigenFactor, math::EigenFactor>> adam_basis_;
};

}  // namespace dkfac
