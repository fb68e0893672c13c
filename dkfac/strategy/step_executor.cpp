#include "dkfac/strategy/step_executor.h"

#include <array>
#include <sstream>

#include "dkfac/comm/packing.h"

namespace dkfac::strategy {

std::vector<assign::LayerShape> layer_shapes(const std::vector<KfacLayer>& layers) {
  std::vector<assign::LayerShape> shapes;
  for (const auto& layer : layers) {
    assign::LayerShape shape{layer.name(), layer.a_dim(), layer.g_dim(), layer.capture().rows_per_sample()};
    shape.a_diagonal = layer.a_diagonal();
    shape.g_diagonal = layer.g_diagonal();
    shape.sharded = layer.sharded();
    shape.a_shared_with = layer.a_leader();
    const auto& geometry = layer.capture().geometry();
    if (geometry.kind == LayerKind::kConv2d) {
      const int64_t in_channels = layer.weight().size(1);  // [out, in, kh, kw]
      shape.a_kernel = math::conv2d_a_kernel(in_channels, geometry.conv.kernel_size[0], geometry.conv.stride[0]);
      shape.g_kernel = math::FactorKernel::kConvGradient;
    }
    shapes.push_back(std::move(shape));
  }
  return shapes;
}

StepExecutor::StepExecutor(std::shared_ptr<comm::Communicator> communicator, std::vector<KfacLayer>& layers,
                           const Options& options)
    : communicator_(std::move(communicator)), rank_(communicator_ ? communicator_->rank() : 0) {
  const auto shapes = layer_shapes(layers);
  const int world = communicator_ ? communicator_->size() : 1;
  int64_t redundant = options.spd().redundant_dim();
  if (world > 1 && options.strategy() == Strategy::kSpd && (redundant < 0 || options.spd().fusion().empty())) {
    // The plan's inputs, not decisions of their own: SPD-KFAC's link speed (for its fusion) and threshold are
    // measured before the plan is made, and only where options leave a choice to make (both are collectives),
    // by the same measurement and rule as strategy auto's rates (measure.h).
    const auto& weight = layers.front().weight();
    spd_measurement_ = measure_spd(*communicator_, weight.device(), weight.scalar_type(), options.compute_method(),
                                   /*threshold=*/redundant < 0);
    if (redundant < 0) redundant = spd_measurement_.redundant_dim;
  }
  // Replicated placement all-gathers a sharded layer's rows over its shard group (HSDP: world / replicas).
  int shard_ranks = 0;
  for (const auto& layer : layers) {
    if (layer.sharded()) shard_ranks = std::max(shard_ranks, layer.shard_ranks());
  }
  plan_ = make_step_plan(shapes, world, options, redundant, shard_ranks);
  if (world == 1) return;
  // Same order on every rank: columns, then rows (then the pipeline's group); the world is reused
  // where a group is everyone.
  for (const auto& column : plan_.placement.columns()) {
    column_groups_.push_back(static_cast<int>(column.size()) == world ? comm::kWorld
                                                                       : communicator_->new_group(column));
  }
  for (const auto& row : plan_.placement.rows()) {
    row_groups_.push_back(static_cast<int>(row.size()) == world ? comm::kWorld : communicator_->new_group(row));
  }
  if (plan_.reduction == FactorReduction::kSpdPipeline || plan_.reduction == FactorReduction::kHookBuckets) {
    pipeline_ = std::make_unique<FactorPipeline>(communicator_, layers, plan_, options, spd_measurement_.link);
  }
}

std::string StepExecutor::describe(bool per_layer) const {
  std::string out = plan_.describe(per_layer);
  if (spd_measurement_.measured) out += "  " + strategy::describe(spd_measurement_) + "\n";
  if (pipeline_) out += "  " + pipeline_->describe() + "\n";
  return out;
}

std::string StepExecutor::take_plan_change() {
  if (!pipeline_ || plan_.profile_steps == 0 || grouping_announced_ || pipeline_->profiling()) return "";
  grouping_announced_ = true;
  return pipeline_->describe();
}

void StepExecutor::arm_factor_step(int64_t micro_batches) {
  if (pipeline_) pipeline_->arm(micro_batches);
}

comm::Handle StepExecutor::start(torch::Tensor& tensor, bool triangle,
                                const std::function<comm::Handle(torch::Tensor)>& op,
                                std::vector<std::function<void()>>& finish) {
  if (!triangle || tensor.dim() == 1) return op(tensor);  // a diagonal factor or inverse is sent as it is
  auto packed = comm::pack_upper(tensor);
  const int64_t n = tensor.size(0);
  finish.push_back([&tensor, packed, n] { tensor = comm::unpack_upper(packed, n); });
  return op(packed);
}

void StepExecutor::reduce_factors(std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches) {
  if (plan_.reduction == FactorReduction::kNone) return;  // each builder keeps the factors of its own batch
  if (pipeline_) {
    pipeline_->collect(batches);
    return;
  }
  std::vector<comm::Handle> handles;
  std::vector<std::function<void()>> finish;
  const auto allreduce = [this](torch::Tensor t) { return communicator_->allreduce_mean(t, comm::kWorld, comm::Purpose::kFactors); };
  // Owner placement (StepPlan::factor_destination): summed into the layer's owner in each row, then over its
  // column's owners (a group of one where W = 1), then divided by the world size, as FactorPipeline does from the
  // hooks. The other ranks keep no factor of the layer (StepPlan::keeps_factors): their batches are left as they were.
  struct Owned {
    torch::Tensor* factor;
    torch::Tensor sum;  // packed where factors travel as triangles
  };
  std::vector<Owned> owned;
  const auto row = row_groups_[plan_.placement.row_of(rank_)];
  for (size_t i = 0; i < batches.size(); ++i) {
    for (torch::Tensor* t : {&batches[i].first, &batches[i].second}) {
      if (!t->defined()) continue;
      *t = t->contiguous();
      if (plan_.factor_destination(i) < 0) {
        handles.push_back(start(*t, plan_.factor_triangles, allreduce, finish));
        continue;
      }
      const int owner = plan_.gradient_source(i, rank_);
      auto sum = plan_.factor_triangles && t->dim() == 2 ? comm::pack_upper(*t) : *t;
      handles.push_back(communicator_->reduce_sum(sum, owner, row, comm::Purpose::kFactors));
      if (owner == rank_) owned.push_back({t, sum});
    }
  }
  comm::wait_all(handles);
  for (auto& f : finish) f();
  // Every owner of the column has the same layers' sums, in the same order.
  const auto column = column_groups_[plan_.placement.column_of(rank_)];
  for (auto& o : owned) handles.push_back(communicator_->allreduce_sum(o.sum, column, comm::Purpose::kFactors));
  comm::wait_all(handles);
  for (auto& o : owned) {
    o.sum.div_(plan_.world_size());
    if (!o.sum.is_same(*o.factor)) *o.factor = comm::unpack_upper(o.sum, o.factor->size(0));
  }
}

void StepExecutor::share_second_order(std::vector<KfacLayer>& layers, double damping) {
  if (!plan_.shares_second_order()) return;  // every part was computed where it is used
  const ComputeMethod method = plan_.method;
  std::vector<comm::Handle> handles;
  std::vector<std::function<void()>> finish;
  std::vector<size_t> shared;
  const auto group = column_groups_[plan_.placement.column_of(rank_)];
  const auto from = [this, group](int root) {
    return [this, group, root](torch::Tensor t) { return communicator_->broadcast(t, root, group, comm::Purpose::kSecondOrder); };
  };
  for (size_t i = 0; i < layers.size(); ++i) {
    if (!preconditions(i) || !layers[i].has_factors()) continue;
    const auto& placed = plan_.placement.layers[i];
    const bool send_a = plan_.flows[i].broadcast_a;
    const bool send_g = plan_.flows[i].broadcast_g;
    if (!send_a && !send_g) continue;
    auto& state = layers[i].prepare_second_order(method, send_a, send_g);
    if (method == ComputeMethod::kEigen) {
      // A diagonal factor has no eigenvectors to send (the identity): its eigenvalues alone.
      if (send_a && !layers[i].a_diagonal()) {
        handles.push_back(start(state.a_eigen.eigenvectors, false, from(placed.a_worker), finish));
      }
      if (send_a) handles.push_back(start(state.a_eigen.eigenvalues, false, from(placed.a_worker), finish));
      if (send_g && !layers[i].g_diagonal()) {
        handles.push_back(start(state.g_eigen.eigenvectors, false, from(placed.g_worker), finish));
      }
      if (send_g) handles.push_back(start(state.g_eigen.eigenvalues, false, from(placed.g_worker), finish));
    } else {
      const bool triangle = plan_.inverse_triangles;
      if (send_a) handles.push_back(start(state.a_inverse, triangle, from(placed.a_worker), finish));
      if (send_g) handles.push_back(start(state.g_inverse, triangle, from(placed.g_worker), finish));
    }
    shared.push_back(i);
  }
  comm::wait_all(handles);
  for (auto& f : finish) f();
  // A follower of a shared-input group is finished once the preconditioner links its leader's A (link_a).
  for (size_t i : shared) {
    if (!layers[i].follows_a()) layers[i].finish_second_order(damping);
  }
}

void StepExecutor::share_gradients(std::vector<torch::Tensor>& preconditioned) {
  if (!plan_.broadcast_gradients) return;  // every rank preconditioned every layer
  std::vector<comm::Handle> handles;
  const auto group = row_groups_[plan_.placement.row_of(rank_)];
  for (size_t i = 0; i < preconditioned.size(); ++i) {
    if (!preconditioned[i].defined() || plan_.flows[i].owner_rows) continue;
    preconditioned[i] = preconditioned[i].contiguous();
    handles.push_back(communicator_->broadcast(preconditioned[i], plan_.gradient_source(i, rank_), group,
                                               comm::Purpose::kGradients));
  }
  comm::wait_all(handles);
}

void StepExecutor::agree_on_reports(torch::Tensor& rows, const std::vector<size_t>& layers) {
  std::vector<int64_t> owned;  // rows of owner-placed layers
  std::vector<double> owners;
  for (size_t k = 0; k < layers.size(); ++k) {
    if (!owner_rows(layers[k])) continue;
    owned.push_back(static_cast<int64_t>(k));
    owners.push_back(static_cast<double>(this->owners(layers[k])));
  }
  if (owned.empty()) return;
  const auto index = torch::tensor(owned, torch::kInt64).to(rows.device());
  auto reports = rows.index_select(0, index);
  if (communicator_ && plan_.world_size() > 1) {
    auto wire = reports.to(communicator_->control_device());
    communicator_->allreduce_sum(wire, comm::kWorld, comm::Purpose::kControl).wait();
    reports = wire.to(rows.device());
  }
  // Each owner's V is the same: its sum(V * grad) once, and a flag 1 only where every owner's is.
  reports.div_(torch::tensor(owners, rows.options()).unsqueeze(1));
  rows.index_copy_(0, index, reports);
}

std::vector<std::map<std::string, torch::Tensor>> StepExecutor::gather_states(
    const std::vector<KfacLayer>& layers) const {
  TORCH_INTERNAL_ASSERT(layers.size() == plan_.flows.size(), "gather_states got ", layers.size(),
                        " layers for a plan of ", plan_.flows.size());
  std::vector<std::map<std::string, torch::Tensor>> states;
  for (const auto& layer : layers) states.push_back(layer.state());
  const int world = plan_.world_size();
  if (world == 1) return states;
  // Per layer and entry, the rank that holds it, or -1 when every rank holds its own (identical) copy.
  const auto source = [&](size_t i, bool factor) {
    if (factor && plan_.flows[i].owner_rows) return plan_.placement.layers[i].a_worker;  // kept where decomposed
    if (factor) return plan_.flows[i].factor_builder == assign::kEveryRank ? -1 : plan_.flows[i].factor_builder;
    return plan_.grad_workers() == world ? -1 : plan_.placement.grad_source_for(i, 0);
  };
  // What each source holds, as dtype + 1 (0: nothing), so that the receivers can shape their buffers.
  const auto& all = layer_state_entries();
  const auto entries = static_cast<int64_t>(all.size());
  auto held = torch::zeros({static_cast<int64_t>(layers.size()), entries}, torch::kInt64);
  auto* table = held.data_ptr<int64_t>();
  for (size_t i = 0; i < layers.size(); ++i) {
    for (int64_t k = 0; k < entries; ++k) {
      const auto it = states[i].find(all[k].key);
      if (source(i, all[k].factor) == rank_ && it != states[i].end()) {
        table[i * entries + k] = static_cast<int64_t>(it->second.scalar_type()) + 1;
      }
    }
  }
  auto summed = held.to(communicator_->control_device());  // an NCCL-only group carries CUDA tensors alone
  communicator_->allreduce_sum(summed, comm::kWorld, comm::Purpose::kSetup).wait();
  held = summed.cpu();
  table = held.data_ptr<int64_t>();
  std::vector<comm::Handle> handles;
  for (size_t i = 0; i < layers.size(); ++i) {
    for (int64_t k = 0; k < entries; ++k) {
      const auto& entry = all[k];
      const int root = source(i, entry.factor);
      if (root < 0) continue;  // this rank's own copy is the state
      const int64_t dtype = table[i * entries + k];
      if (dtype == 0) {  // the holder has none: neither has anyone else
        states[i].erase(entry.key);
        continue;
      }
      auto& tensor = states[i][entry.key];
      if (root == rank_) {
        tensor = tensor.contiguous();
      } else {
        const auto options = layers[i].weight().options().dtype(static_cast<torch::ScalarType>(dtype - 1));
        tensor = torch::empty(layers[i].state_shape(entry), options);
      }
      handles.push_back(communicator_->broadcast(tensor, root, comm::kWorld, comm::Purpose::kSetup));
    }
  }
  comm::wait_all(handles);
  return states;
}

}  // namespace dkfac::strategy
