#include "dkfac/layers/layer_group.h"

#include <string>

#include "dkfac/strategy/step_plan.h"

namespace dkfac {

bool LayerGroups::Binding::in_place() const {
  return part->defined() && stack->defined() && same_memory(*part, view());
}

void LayerGroups::plan(const std::vector<KfacLayer>& layers, const std::function<bool(size_t)>& held,
                       ComputeMethod method, int64_t pad_widths, bool eigen_adam) {
  TORCH_CHECK(pad_widths >= 1, "pad_widths must be >= 1, got ", pad_widths);
  TORCH_INTERNAL_ASSERT(groups_.empty(), "LayerGroups::plan over groups that were not cleared");
  seats_.assign(layers.size(), Seat{});
  std::vector<strategy::StackCandidate> candidates(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& layer = layers[i];
    // What else a group's layers must have alike: the second-order dtype, the gradient's dtype, the device.
    const std::string kind = std::string(c10::toString(layer.second_order_dtype())) + "," +
                             c10::toString(layer.weight().scalar_type()) + "," + layer.weight().device().str();
    candidates[i] = {held(i), layer.g_dim(), layer.a_dim(), layer.a_diagonal() || layer.g_diagonal(),
                     layer.a_leader(), kind};
  }
  for (auto& stacked : strategy::stack_groups(candidates)) {
    groups_.emplace_back();
    auto& group = groups_.back();
    group.method = method;
    group.adam = eigen_adam && method == ComputeMethod::kEigen;
    group.share = stacked.share;
    group.units = std::move(stacked.units);
    group.members = std::move(stacked.members);
    const auto& first = layers[group.units.front()];
    group.g_dim = first.g_dim();
    group.a_dim = first.a_dim();
    group.padded_g = strategy::padded_width(group.g_dim, pad_widths);
    group.padded_a = strategy::padded_width(group.a_dim, pad_widths);
  }
  for (size_t k = 0; k < groups_.size(); ++k) {
    const auto& group = groups_[k];
    for (size_t m = 0; m < group.members.size(); ++m) {
      seats_[group.members[m]] = {static_cast<int>(k), static_cast<int64_t>(m),
                                  m % static_cast<size_t>(group.share) == 0};
    }
  }
}

std::vector<LayerGroups::Binding> LayerGroups::bindings(Group& group, const Seat& seat, SecondOrderState& state) {
  const auto units = static_cast<int64_t>(group.units.size());
  const auto members = static_cast<int64_t>(group.members.size());
  const int64_t unit = seat.member / group.share;
  const int64_t a = group.a_dim, g = group.g_dim, pa = group.padded_a, pg = group.padded_g;
  if (group.method == ComputeMethod::kEigen) {
    std::vector<Binding> parts = {{&group.a, units, unit, &state.a_eigen.eigenvectors, a, a, pa, pa},
                                  {&group.g, members, seat.member, &state.g_eigen.eigenvectors, g, g, pg, pg}};
    if (!group.adam) parts.push_back({&group.denominator, members, seat.member, &state.denominator, g, a, pg, pa});
    return parts;
  }
  return {{&group.a, units, unit, &state.a_inverse, a, a, pa, pa},
          {&group.g, members, seat.member, &state.g_inverse, g, g, pg, pg}};
}

void LayerGroups::absorb(std::vector<KfacLayer>& layers, size_t i) {
  if (i >= seats_.size() || seats_[i].group < 0) return;
  const auto& seat = seats_[i];
  auto& group = groups_[static_cast<size_t>(seat.group)];
  auto& layer = layers[i];
  if (layer.second_order().method != group.method || !layer.second_order().defined()) return;
  SecondOrderState state = layer.second_order();
  bool moved = false;
  for (const auto& b : bindings(group, seat, state)) {
    auto& part = *b.part;
    if (b.stack == &group.a && !seat.holds_a) continue;  // a follower's A side is its unit's
    if (!part.defined() || b.in_place()) continue;
    torch::NoGradGuard no_grad;
    if (!b.stack->defined()) {
      const auto options = part.options().memory_format(at::MemoryFormat::Contiguous);
      const bool padded = b.padded_rows != b.rows || b.padded_cols != b.cols;
      *b.stack = padded ? torch::zeros({b.count, b.padded_rows, b.padded_cols}, options)
                        : torch::empty({b.count, b.rows, b.cols}, options);
      // A square part's pad is the identity's (a denominator's stays 0): a padded product is the unpadded one.
      if (padded && b.rows == b.cols) b.stack->diagonal(0, 1, 2).narrow(1, b.rows, b.padded_rows - b.rows).fill_(1);
    }
    auto slot = b.view();
    if (slot.sizes() != part.sizes() || slot.scalar_type() != part.scalar_type() || slot.device() != part.device()) {
      continue;  // not the group's shape: this layer keeps its own tensor (and the group its layer-by-layer path)
    }
    const auto sharing = holders(group, seat, b, i);
    for (size_t j : sharing) layers[j].keep_adam_basis_from(slot);  // Options::eigen_adam: the moments' basis
    slot.copy_(part);
    for (size_t j : sharing) layers[j].adam_basis_moved(part, slot);
    part = slot;
    moved = true;
  }
  if (!moved) return;
  layer.set_second_order(std::move(state));
  if (seat.holds_a) relink_followers(layers, group, seat);
}

void LayerGroups::relink_followers(std::vector<KfacLayer>& layers, const Group& group, const Seat& seat) {
  const auto& leader = layers[group.members[static_cast<size_t>(seat.member)]];
  for (int64_t m = seat.member + 1; m < seat.member + group.share; ++m) {
    auto& follower = layers[group.members[static_cast<size_t>(m)]];
    if (follower.second_order().method == group.method) follower.link_a(leader);
  }
}

std::vector<size_t> LayerGroups::holders(const Group& group, const Seat& seat, const Binding& b, size_t i) {
  if (b.stack != &group.a) return {i};
  std::vector<size_t> unit;
  for (int64_t m = seat.member; m < seat.member + group.share; ++m) {
    unit.push_back(group.members[static_cast<size_t>(m)]);
  }
  return unit;
}

void LayerGroups::absorb_all(std::vector<KfacLayer>& layers) {
  for (const auto& group : groups_) {
    for (size_t i : group.members) absorb(layers, i);
  }
}

bool LayerGroups::in_slots(std::vector<KfacLayer>& layers, size_t i) {
  const auto& seat = seats_[i];
  auto& group = groups_[static_cast<size_t>(seat.group)];
  SecondOrderState state = layers[i].second_order();
  if (state.method != group.method || !state.defined()) return false;
  for (const auto& b : bindings(group, seat, state)) {
    if (!b.in_place()) return false;
  }
  return true;
}

int64_t LayerGroups::padding_bytes() const {
  int64_t total = 0;
  for (const auto& group : groups_) {
    const auto units = static_cast<int64_t>(group.units.size());
    const auto members = static_cast<int64_t>(group.members.size());
    const int64_t a = group.a_dim, g = group.g_dim;
    const std::pair<const torch::Tensor*, int64_t> unpadded[] = {
        {&group.a, units * a * a}, {&group.g, members * g * g}, {&group.denominator, members * g * a}};
    for (const auto& [stack, entries] : unpadded) {
      if (stack->defined()) total += static_cast<int64_t>(stack->nbytes()) - entries * stack->element_size();
    }
  }
  return total;
}

bool LayerGroups::ready(std::vector<KfacLayer>& layers, size_t k) {
  bool all = true;
  for (size_t i : groups_[k].members) {
    if (!in_slots(layers, i)) {
      absorb(layers, i);
      all = all && in_slots(layers, i);
    }
  }
  return all;
}

void LayerGroups::clear(std::vector<KfacLayer>& layers) {
  for (auto& group : groups_) {
    for (auto* stack : {&group.a, &group.g, &group.denominator}) {
      if (!stack->defined()) continue;
      for (size_t i : group.members) {
        if (i >= layers.size()) continue;
        const auto& seat = seats_[i];
        SecondOrderState state = layers[i].second_order();
        bool copied = false;
        for (const auto& b : bindings(group, seat, state)) {
          if (b.stack != stack || (stack == &group.a && !seat.holds_a)) continue;
          if (!b.in_place()) continue;
          const auto slot = *b.part;
          *b.part = b.part->clone(at::MemoryFormat::Contiguous);
          for (size_t j : holders(group, seat, b, i)) layers[j].adam_basis_moved(slot, *b.part);
          copied = true;
        }
        if (!copied) continue;
        layers[i].set_second_order(std::move(state));
        if (seat.holds_a) relink_followers(layers, group, seat);
      }
      *stack = torch::Tensor();
    }
  }
  groups_.clear();
  seats_.clear();
}

}  // namespace dkfac
