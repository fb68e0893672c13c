#pragma once

#include <cstddef>
#include <functional>
#include <vector>

#include <torch/torch.h>

#include "dkfac/layers/kfac_layer.h"

namespace dkfac {

/// Options::stack_layers (docs/MATH.md section 2.9): the layers a rank preconditions, grouped by shape, so that a step
/// preconditions each group with four batched products (math::precondition_eigen_stacked) in place of a dozen kernels
/// per layer.
///
/// A group holds one tensor per part that preconditioning reads (Q_A, Q_G and the eigenvalue denominator; or the A
/// and G inverses), and each member's part is a view of its slot in it: the stacked state is the layers' own, not a
/// copy. Its units are the layers that hold an A side, each followed by the layers that share it
/// (Options::shared_input_layers), so that the A side has one slot per unit.
///
/// With Options::pad_widths > 1 a group's stacks hold its widths padded up to a multiple of it: each square part
/// [a', a'] or [g', g'] with the identity in its pad (zeros off the diagonal), each denominator [g', a'] with zeros,
/// and a layer's part is the view of its slot's leading [a, a], [g, g] or [g, a] block. The products take the padded
/// gradients (zeros in the pad), and the pad stays out of every layer's result: rotating [grad 0; 0 0] by
/// diag(Q_G, I) and diag(Q_A, I) gives [Q_G^T grad Q_A 0; 0 0]. The pad is written once, where a stack is allocated.
///
/// Nothing here is taken on trust. A part replaced since it was placed (a second-order update, a broadcast, a load) is
/// no longer its slot's view: `absorb` copies it into its slot and the layer keeps the view (the replaced tensor is
/// freed), and `ready` says whether every member preconditions from its slots, else the preconditioner takes the
/// layer-by-layer path. So a layer's parts are written in place (copies into slots, and the broadcasts into the parts
/// that were already there), and only where an update is installed, shared or loaded: Options::second_order_lag's
/// thread, which reads copies of the layers (views of the slots) while the steps go on, has ended by then, or (an
/// update resumed after a load) reads the loaded tensors that are copied into the slots, not the slots.
class LayerGroups {
 public:
  struct Group {
    ComputeMethod method = ComputeMethod::kEigen;
    int64_t share = 1;            ///< layers per unit (per A side)
    std::vector<size_t> units;    ///< each unit's layer holding its A side
    std::vector<size_t> members;  ///< every layer, unit by unit: the unit's layer, then its followers
    int64_t g_dim = 0, a_dim = 0;        ///< the members' widths
    int64_t padded_g = 0, padded_a = 0;  ///< the stacks' (strategy::padded_width; the members' unpadded)
    torch::Tensor a;              ///< [units, a', a']: Q_A, or the A inverse; undefined until a member is absorbed
    torch::Tensor g;              ///< [members, g', g']: Q_G, or the G inverse
    torch::Tensor denominator;    ///< [members, g', a'] (eigen, not with Options::eigen_adam)
    bool adam = false;            ///< Options::eigen_adam: Adam's moments, per layer, take the denominator's place
    bool padded() const { return padded_g != g_dim || padded_a != a_dim; }
  };

  /// Groups the layers `held(i)` says this rank preconditions with `method` (and has state or factors for: a layer
  /// that never runs takes no slot), by strategy::stack_groups, the rule the time model prices: the layers of one
  /// (g, a, share, second-order dtype, gradient dtype, device), neither factor diagonal, a shared A side's layers all
  /// held here alike, groups of two layers or more, their stacks padded to a multiple of `pad_widths`. Layers keep
  /// their tensors until absorbed. Call clear() first where groups exist.
  /// With `eigen_adam` (Options::eigen_adam, the eigen method) the stacks hold the eigenbases alone: each layer's
  /// Adam moments stay its own, and a slot overwritten with a new basis keeps the one they are in apart first
  /// (KfacLayer::keep_adam_basis_from), so that the next step rotates them as layer by layer.
  void plan(const std::vector<KfacLayer>& layers, const std::function<bool(size_t)>& held, ComputeMethod method,
            int64_t pad_widths = 1, bool eigen_adam = false);
  /// No groups: every part that is a slot's view is copied out, part by part, so that no stack outlives its group
  /// and no more than one part's stack and its copies are alive at once.
  void clear(std::vector<KfacLayer>& layers);
  bool empty() const { return groups_.empty(); }
  const std::vector<Group>& groups() const { return groups_; }
  /// Puts layer i's parts into its slots where they are not there yet and have the slots' shape, dtype and device
  /// (allocating its group's stacks at the first), its unit's followers relinked to the A side's slot. Nothing for
  /// a layer in no group, or without state of its group's method.
  void absorb(std::vector<KfacLayer>& layers, size_t i);
  /// Absorbs every member of every group (after a broadcast or a load).
  void absorb_all(std::vector<KfacLayer>& layers);
  /// Whether every member of group `k` preconditions from its slots, after absorbing the ones that do not.
  bool ready(std::vector<KfacLayer>& layers, size_t k);
  /// Bytes of the stacks allocated that no layer's part is a view of: their pads (Options::pad_widths).
  int64_t padding_bytes() const;

 private:
  /// Where layer i sits: its group, its slot among the members, and whether it holds its unit's A side.
  struct Seat {
    int group = -1;
    int64_t member = 0;
    bool holds_a = false;
  };
  /// One part of a layer's state and its slot: `stack` (count slots of [rows', cols']), its slot `slot`, whose
  /// leading [rows, cols] block the part is.
  struct Binding {
    torch::Tensor* stack;
    int64_t count;
    int64_t slot;
    torch::Tensor* part;
    int64_t rows, cols, padded_rows, padded_cols;
    /// The part's place in its allocated stack.
    torch::Tensor view() const { return stack->select(0, slot).narrow(0, 0, rows).narrow(1, 0, cols); }
    /// Whether the part is its place's view.
    bool in_place() const;
  };
  /// The parts `state` places in its group's stacks; a follower's A side (its unit's) included.
  std::vector<Binding> bindings(Group& group, const Seat& seat, SecondOrderState& state);
  /// The followers of the unit whose A side the layer at `seat` holds, linked to it again (KfacLayer::link_a).
  static void relink_followers(std::vector<KfacLayer>& layers, const Group& group, const Seat& seat);
  /// The layers whose state holds binding `b` of layer i at `seat`: its unit's for the A side, else layer i alone.
  static std::vector<size_t> holders(const Group& group, const Seat& seat, const Binding& b, size_t i);
  /// Whether each of layer i's parts is its slot's view.
  bool in_slots(std::vector<KfacLayer>& layers, size_t i);

  std::vector<Group> groups_;
  std::vector<Seat> seats_;  // per layer
};

}  // namespace dkfac
