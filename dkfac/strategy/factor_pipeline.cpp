#include "dkfac/strategy/factor_pipeline.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <sstream>

#include "dkfac/comm/packing.h"
#include "dkfac/numbers.h"

namespace dkfac::strategy {

FactorPipeline::FactorPipeline(std::shared_ptr<comm::Communicator> communicator, std::vector<KfacLayer>& layers,
                               const StepPlan& plan, const Options& options, assign::AlphaBeta link)
    : communicator_(std::move(communicator)),
      fusion_(plan.reduction == FactorReduction::kSpdPipeline),
      triangles_(plan.factor_triangles),
      num_layers_(layers.size()),
      link_(link),
      profile_steps_(plan.profile_steps) {
  TORCH_INTERNAL_ASSERT(fusion_ || plan.reduction == FactorReduction::kHookBuckets);
  std::vector<int> everyone(communicator_->size());
  std::iota(everyone.begin(), everyone.end(), 0);
  group_id_ = communicator_->new_group(everyone);
  for (auto& layer : layers) captures_.push_back(&layer.capture());
  const int64_t element = layers.empty() ? 4 : static_cast<int64_t>(c10::elementSize(layers[0].factor_dtype()));
  for (size_t slot = 0; slot < 2 * num_layers_; ++slot) {
    const auto& layer = layers[layer_of(slot)];
    const int64_t n = is_a(slot) ? layer.a_dim() : layer.g_dim();
    const bool diagonal = is_a(slot) ? layer.a_diagonal() : layer.g_diagonal();
    const bool absent = is_a(slot) && layer.follows_a();
    slot_dims_.push_back(n);
    slot_diagonal_.push_back(diagonal);
    slot_absent_.push_back(absent);
    slot_bytes_.push_back(absent ? 0 : element * comm::packed_length(n, triangles_, diagonal));
    slot_column_.push_back(plan.factor_destination(layer_of(slot)));
  }
  // Owner placement's groups: every rank makes every row's and column's group, in order (Communicator::new_group).
  row_group_ = group_id_;
  row_size_ = plan.world_size() / plan.grad_workers();
  if (std::any_of(slot_column_.begin(), slot_column_.end(), [](int c) { return c >= 0; }) && plan.grad_workers() > 1) {
    const int rank = communicator_->rank();
    for (const auto& row : plan.placement.rows()) {
      const auto id = communicator_->new_group(row);
      if (plan.placement.row_of(rank) == plan.placement.row_of(row.front())) row_group_ = id;
    }
    for (const auto& column : plan.placement.columns()) column_groups_.push_back(communicator_->new_group(column));
  }
  const auto& fusion = plan.fusion;
  if (!fusion_) {
    set_buckets(static_cast<int64_t>(plan.bucket_cap_mb * 1024 * 1024));
  } else if (!fusion.empty()) {
    const int64_t total = std::accumulate(fusion.begin(), fusion.end(), int64_t{0});
    TORCH_CHECK(total == static_cast<int64_t>(2 * num_layers_), "SpdOptions::fusion group sizes sum to ", total,
                " but the model has ", 2 * num_layers_, " factors (2 per K-FAC layer)");
    set_grouping(fusion);
  } else {
    set_grouping(std::vector<int64_t>(2 * num_layers_, 1));
  }
  for (size_t i = 0; i < captures_.size(); ++i) {
    captures_[i]->set_listener([this, i](bool a, int64_t count) {
      on_ready(a ? i : 2 * num_layers_ - 1 - i, count);
    });
  }
  arm(options.accumulation_steps());
}

FactorPipeline::~FactorPipeline() {
  for (auto* capture : captures_) capture->set_listener(nullptr);
}

void FactorPipeline::set_grouping(const std::vector<int64_t>& sizes) { set_groups(consecutive_groups(sizes)); }

void FactorPipeline::set_buckets(int64_t cap_bytes) {
  set_groups(factor_buckets(slot_bytes_, slot_column_, cap_bytes));
}

void FactorPipeline::set_groups(std::vector<std::vector<size_t>> groups) {
  group_slots_ = std::move(groups);
  grouping_.clear();
  group_of_slot_.assign(2 * num_layers_, 0);
  for (size_t g = 0; g < group_slots_.size(); ++g) {
    grouping_.push_back(static_cast<int64_t>(group_slots_[g].size()));
    for (const size_t s : group_slots_[g]) group_of_slot_[s] = g;
  }
}

void FactorPipeline::arm(int64_t micro_batches) {
  std::lock_guard<std::mutex> lock(mutex_);
  micro_batches_ = micro_batches;
  groups_.clear();
  groups_.resize(group_slots_.size());
  for (size_t g = 0; g < group_slots_.size(); ++g) {
    groups_[g].slots = group_slots_[g];
    groups_[g].column = slot_column_[group_slots_[g].front()];
  }
  ready_tensor_.assign(2 * num_layers_, torch::Tensor());
  ready_marks_.assign(2 * num_layers_, std::nullopt);
}

void FactorPipeline::on_ready(size_t slot, int64_t count) {
  std::lock_guard<std::mutex> lock(mutex_);  // the capture's own lock is never held while this runs
  if (count != micro_batches_) return;
  auto* capture = captures_[layer_of(slot)];
  auto packed = comm::pack_symmetric(is_a(slot) ? capture->mean_a() : capture->mean_g(), triangles_);
  if (profiling()) ready_marks_[slot] = device::Mark::now(packed.device());
  ready_tensor_[slot] = std::move(packed);
  auto& group = groups_[group_of_slot_[slot]];
  if (group.started) return;
  std::vector<torch::Tensor> tensors;
  for (size_t s : group.slots) {
    if (slot_absent_[s]) continue;
    if (!ready_tensor_[s].defined()) return;  // the group waits for its last member
    tensors.push_back(ready_tensor_[s]);
  }
  start(group, tensors);
}

void FactorPipeline::start(Group& group, const std::vector<torch::Tensor>& tensors) {
  group.started = true;
  if (tensors.empty()) return;
  group.buffer = comm::fuse(tensors);
  group.handle = group.column < 0
                     ? communicator_->allreduce_mean(group.buffer, group_id_, comm::Purpose::kFactors)
                     : communicator_->reduce_sum(group.buffer, root_of(group.column), row_group_,
                                                 comm::Purpose::kFactors);
}

void FactorPipeline::collect(std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches) {
  TORCH_INTERNAL_ASSERT(batches.size() == num_layers_);
  auto local = [&](size_t slot) -> torch::Tensor& {
    auto& pair = batches[layer_of(slot)];
    return is_a(slot) ? pair.first : pair.second;
  };
  std::lock_guard<std::mutex> lock(mutex_);
  // Groups whose slots did not all fire (a layer that did not run, fewer micro-batches than expected)
  // start now with the members that exist; every rank runs the same model, so they agree on which.
  for (auto& group : groups_) {
    if (group.started) continue;
    std::vector<torch::Tensor> tensors;
    std::vector<size_t> present;
    for (size_t s : group.slots) {
      if (!local(s).defined()) continue;
      tensors.push_back(comm::pack_symmetric(local(s), triangles_));
      present.push_back(s);
    }
    group.slots = present;
    start(group, tensors);
  }
  for (auto& group : groups_) {
    if (group.buffer.defined()) group.handle.wait();
  }
  // Owner placement: the sums of this rank's row are its own where it is the owner; they are summed over the owners
  // of the column (W > 1), then divided by the world size. The other ranks keep no factor of these layers.
  const auto mine = [this](const Group& group) {
    return group.buffer.defined() && (group.column < 0 || root_of(group.column) == communicator_->rank());
  };
  std::vector<comm::Handle> columns;
  for (auto& group : groups_) {
    if (group.column < 0 || !mine(group) || column_groups_.empty()) continue;
    columns.push_back(communicator_->allreduce_sum(group.buffer, column_groups_.at(static_cast<size_t>(group.column)),
                                                   comm::Purpose::kFactors));
  }
  comm::wait_all(columns);
  for (auto& group : groups_) {
    if (!mine(group)) continue;
    if (group.column >= 0) group.buffer.div_(communicator_->size());
    int64_t offset = 0;
    for (size_t s : group.slots) {
      if (slot_absent_[s]) continue;  // not in the buffer
      const int64_t n = slot_dims_[s];
      const bool diagonal = slot_diagonal_[s];
      const int64_t length = comm::packed_length(n, triangles_, diagonal);
      // A layer the preconditioner set aside this step (no gradient) took no batch: its average is dropped.
      if (local(s).defined()) {
        local(s) = comm::unpack_symmetric(group.buffer.narrow(0, offset, length), n, triangles_, diagonal);
      }
      offset += length;
    }
  }
  if (profiling()) {
    ready_history_.push_back(ready_seconds());
    if (++profiled_steps_ == profile_steps_) choose_grouping();
  }
}

std::vector<double> FactorPipeline::ready_seconds() const {
  // Seconds since the step's first ready slot; NaN for a slot that did not fire. Waits for the device.
  std::vector<double> seconds(ready_marks_.size(), std::numeric_limits<double>::quiet_NaN());
  const device::Mark* first = nullptr;
  for (const auto& mark : ready_marks_) {
    if (mark && (first == nullptr || device::Mark::seconds_between(*first, *mark) < 0.0)) first = &*mark;
  }
  for (size_t s = 0; s < ready_marks_.size(); ++s) {
    if (ready_marks_[s]) seconds[s] = device::Mark::seconds_between(*first, *ready_marks_[s]);
  }
  return seconds;
}

void FactorPipeline::choose_grouping() {
  // Median ready time per slot over the profiled steps; a slot that never fired counts as last.
  std::vector<double> ready(2 * num_layers_, 0.0);
  for (size_t s = 0; s < ready.size(); ++s) {
    std::vector<double> seen;
    for (const auto& step : ready_history_) {
      if (!std::isnan(step[s])) seen.push_back(step[s]);
    }
    ready[s] = seen.empty() ? std::numeric_limits<double>::infinity() : median(seen);
    // A follower's A never fires: ready when its predecessor is (it adds nothing), not last.
    if (slot_absent_[s]) ready[s] = s > 0 ? ready[s - 1] : 0.0;
  }
  const double last = std::accumulate(ready.begin(), ready.end(), 0.0, [](double m, double v) {
    return std::isfinite(v) ? std::max(m, v) : m;
  });
  for (auto& r : ready) r = std::isfinite(r) ? r : last;
  comm::average_over(*communicator_, group_id_, ready);  // every rank decides from the same numbers
  for (size_t s = 1; s < ready.size(); ++s) ready[s] = std::max(ready[s], ready[s - 1]);  // listeners fire in order
  set_grouping(assign::fuse_groups(ready, slot_bytes_, link_));
  ready_history_.clear();
}

std::string FactorPipeline::describe() const {
  std::ostringstream out;
  if (!fusion_) {
    const bool owners = std::any_of(slot_column_.begin(), slot_column_.end(), [](int c) { return c >= 0; });
    out << (owners ? "factors summed into their owners (reduce over each row" +
                         std::string(column_groups_.empty() ? "" : ", then allreduce over the owners' column") +
                         ") from the capture hooks in "
                   : "factor allreduce from the capture hooks in ")
        << grouping_.size() << " bucket(s) for " << slot_bytes_.size() << " factors ("
        << (triangles_ ? "upper triangles" : "full matrices") << "), bytes per bucket [";
  } else {
    out << "SPD-KFAC factor fusion (alpha " << link_.alpha * 1e6 << " us, beta " << link_.beta * 1e9 << " ns/B): ";
  }
  if (profiling()) {
    out << "profiling step " << profiled_steps_ + 1 << " of " << profile_steps_ << ", each factor sent alone";
    return out.str();
  }
  if (fusion_) {
    out << grouping_.size() << " collectives for " << slot_bytes_.size() << " factors, bytes per group [";
  }
  for (size_t g = 0; g < group_slots_.size(); ++g) {
    int64_t bytes = 0;
    for (const size_t s : group_slots_[g]) bytes += slot_bytes_[s];
    out << (g ? ", " : "") << bytes;
  }
  out << "]";
  return out.str();
}

}  // namespace dkfac::strategy
