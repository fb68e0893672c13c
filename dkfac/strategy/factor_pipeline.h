#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "dkfac/assign/assignment.h"
#include "dkfac/comm/communicator.h"
#include "dkfac/device.h"
#include "dkfac/layers/kfac_layer.h"
#include "dkfac/options.h"
#include "dkfac/strategy/step_plan.h"

namespace dkfac::strategy {

/// Factor allreduce started as soon as each factor exists. Factors are "slots" in ready order: A of
/// every layer in model order (forward), then G in reverse model order (backward); a shared-input
/// follower's A slot is absent (empty, never waited for: its leader's slot carries the group's A). A listener on
/// each layer's FactorCapture fires when a factor holds its last micro-batch; once every slot of a
/// fusion group has fired, the group's upper triangles are concatenated and one allreduce starts on
/// the pipeline's own process group (so its order never interleaves with data-parallel buckets).
/// The first StepPlan::profile_steps factor steps send each factor alone and record when each
/// became ready; the grouping is then chosen by assign::fuse_groups from the ready times (averaged
/// over ranks) and the measured alpha-beta model, and kept. Grouping changes speed, never results.
///
/// KAISA (FactorReduction::kHookBuckets) runs the same pipeline with kfac_pytorch's grouping instead:
/// fixed buckets of at most StepPlan::bucket_cap_mb in ready order, no profiling. Triangles or full
/// matrices as StepPlan::factor_triangles says.
///
/// Owner placement (StepPlan::factor_destination: rows of 3 ranks or more): only a layer's owners keep its factors,
/// one in each row of ranks (its KAISA column). Its factors are summed into the owner of each row (a reduce over the
/// row, on the pipeline's own row group: N bytes per rank on a ring, against an allreduce's 2 (P - 1) / P N), then
/// over the column's owners (an allreduce among W ranks, at collect(); none where W = 1), and divided by the world
/// size: the world's mean, on the owners alone. KAISA's buckets are formed per owner column, so that one collective
/// has one root.
class FactorPipeline {
 public:
  /// `plan.reduction` is kSpdPipeline or kHookBuckets; `options` gives accumulation_steps.
  FactorPipeline(std::shared_ptr<comm::Communicator> communicator, std::vector<KfacLayer>& layers,
                 const StepPlan& plan, const Options& options, assign::AlphaBeta link);
  ~FactorPipeline();
  FactorPipeline(const FactorPipeline&) = delete;
  FactorPipeline& operator=(const FactorPipeline&) = delete;

  /// Starts a factor step in which each factor is complete after `micro_batches` captures.
  void arm(int64_t micro_batches);
  /// Waits for this step's collectives (starting, in group order, those whose slots did not all fire)
  /// and replaces each defined batch in `batches` (the local means, indexed by layer) by its average
  /// over ranks.
  void collect(std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches);

  /// Current grouping (slots per group: consecutive groups, but under owner placement, where each owner column's
  /// slots are bucketed apart) and whether it is still being profiled.
  const std::vector<int64_t>& grouping() const { return grouping_; }
  bool profiling() const { return profiled_steps_ < profile_steps_; }
  /// Seconds from the step's first ready slot to each slot's (NaN: did not fire); waits for the device.
  std::vector<double> ready_seconds() const;
  /// One line: the grouping, with bytes per group, and the model it came from.
  std::string describe() const;

 private:
  struct Group {
    std::vector<size_t> slots;
    int column = -1;       // owner placement: the column of its layers' owners; -1: averaged over the world
    torch::Tensor buffer;  // concatenated packed triangles, reduced in place
    comm::Handle handle;
    bool started = false;
  };

  void on_ready(size_t slot, int64_t count);
  /// Groups of consecutive slots of these sizes (SPD-KFAC's fusion; slots averaged over the world).
  void set_grouping(const std::vector<int64_t>& sizes);
  /// KAISA's buckets of at most `cap_bytes` (strategy::factor_buckets: apart for each owner column).
  void set_buckets(int64_t cap_bytes);
  void set_groups(std::vector<std::vector<size_t>> groups);
  /// This row's owner of `column` (the root of its groups' reduce).
  int root_of(int column) const { return communicator_->rank() / row_size_ * row_size_ + column; }
  /// Packs the listed slots' tensors into one buffer and starts its allreduce. Caller holds mutex_.
  void start(Group& group, const std::vector<torch::Tensor>& tensors);
  void choose_grouping();
  size_t layer_of(size_t slot) const { return slot < num_layers_ ? slot : 2 * num_layers_ - 1 - slot; }
  bool is_a(size_t slot) const { return slot < num_layers_; }

  std::shared_ptr<comm::Communicator> communicator_;
  bool fusion_;     // SPD-KFAC's measured fusion (else KAISA's fixed buckets)
  bool triangles_;  // factors travel as upper triangles (comm/packing.h), else flat
  comm::GroupId group_id_;
  std::vector<FactorCapture*> captures_;  // per layer; shared with the front end's hooks
  size_t num_layers_;
  std::vector<int64_t> slot_dims_;   // factor dimension per slot
  std::vector<bool> slot_diagonal_;  // the factor is kept diagonal (sent as [n])
  std::vector<int64_t> slot_bytes_;  // bytes sent per slot
  std::vector<bool> slot_absent_;    // never fires: a shared-input follower's A (its leader's slot carries it)
  std::vector<int> slot_column_;     // owner placement: the column of the slot's layer's owners, else -1
  int row_size_ = 1;                 // P / W: ranks per row of KAISA's grid
  comm::GroupId row_group_ = comm::kWorld;   // this rank's row (the pipeline's group where it is the world)
  std::vector<comm::GroupId> column_groups_;  // per column, where W > 1 and some layer is owner-placed
  assign::AlphaBeta link_;
  const int64_t profile_steps_;  // StepPlan::profile_steps: 0 unless SPD-KFAC fuses by measurement
  int64_t profiled_steps_ = 0;
  std::vector<std::vector<double>> ready_history_;  // per profiled step, seconds per slot

  std::mutex mutex_;  // listeners run on the forward and autograd threads
  int64_t micro_batches_ = 1;
  std::vector<int64_t> grouping_;                 // slots per group
  std::vector<std::vector<size_t>> group_slots_;  // each group's slots, ascending
  std::vector<size_t> group_of_slot_;
  std::vector<Group> groups_;
  std::vector<torch::Tensor> ready_tensor_;  // packed local mean per slot, this step
  // Profiled steps: a device mark when each slot became ready (CUDA events on a GPU, so the time the
  // factor was computed, not the time its kernels were queued), resolved into seconds when collected.
  std::vector<std::optional<device::Mark>> ready_marks_;
};

}  // namespace dkfac::strategy
