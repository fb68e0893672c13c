#include "dkfac/strategy/kaisa.h"

namespace dkfac::strategy {

torch::Tensor pack_upper(const torch::Tensor& matrix) {
  const int64_t n = matrix.size(0);
  auto idx = torch::triu_indices(n, n, 0, torch::TensorOptions().dtype(torch::kLong).device(matrix.device()));
  return matrix.index({idx[0], idx[1]}).contiguous();
}

torch::Tensor unpack_upper(const torch::Tensor& packed, int64_t n) {
  auto idx = torch::triu_indices(n, n, 0, torch::TensorOptions().dtype(torch::kLong).device(packed.device()));
  auto out = torch::zeros({n, n}, packed.options());
  out.index_put_({idx[0], idx[1]}, packed);
  out.index_put_({idx[1], idx[0]}, packed);
  return out;
}

Kaisa::Kaisa(std::shared_ptr<comm::Communicator> communicator, const std::vector<KfacLayer>& layers,
             const Options& options)
    : communicator_(std::move(communicator)), rank_(communicator_->rank()), symmetric_comm_(options.symmetric_comm()) {
  std::vector<assign::LayerShape> shapes;
  for (const auto& layer : layers) shapes.push_back({layer.name(), layer.a_dim(), layer.g_dim()});
  assignment_ = assign::assign_kaisa(shapes, communicator_->size(), options.grad_worker_fraction(),
                                     options.balance_memory() ? assign::Balance::kMemory : assign::Balance::kCompute,
                                     options.colocate_factors());
  // Same order on every rank: columns, then rows; the world is reused where a group is everyone.
  const int world = communicator_->size();
  for (const auto& column : assignment_.columns()) {
    column_groups_.push_back(static_cast<int>(column.size()) == world ? comm::kWorld
                                                                       : communicator_->new_group(column));
  }
  for (const auto& row : assignment_.rows()) {
    row_groups_.push_back(static_cast<int>(row.size()) == world ? comm::kWorld : communicator_->new_group(row));
  }
}

comm::Handle Kaisa::share(torch::Tensor& tensor, bool symmetric, int root, comm::GroupId group, const char* phase,
                          std::vector<std::function<void()>>& finish) {
  if (!symmetric || !symmetric_comm_) return communicator_->broadcast(tensor, root, group, phase);
  auto packed = pack_upper(tensor);
  const int64_t n = tensor.size(0);
  finish.push_back([&tensor, packed, n] { tensor = unpack_upper(packed, n); });
  return communicator_->broadcast(packed, root, group, phase);
}

void Kaisa::reduce_factors(std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches) {
  std::vector<comm::Handle> handles;
  std::vector<std::function<void()>> finish;
  for (auto& [a, g] : batches) {
    for (torch::Tensor* t : {&a, &g}) {
      if (!t->defined()) continue;
      *t = t->contiguous();
      if (!symmetric_comm_) {
        handles.push_back(communicator_->allreduce_mean(*t, comm::kWorld, "factors"));
        continue;
      }
      auto packed = pack_upper(*t);
      const int64_t n = t->size(0);
      handles.push_back(communicator_->allreduce_mean(packed, comm::kWorld, "factors"));
      finish.push_back([t, packed, n] { *t = unpack_upper(packed, n); });
    }
  }
  comm::wait_all(handles);
  for (auto& f : finish) f();
}

void Kaisa::share_second_order(std::vector<KfacLayer>& layers, ComputeMethod method, double damping) {
  if (assignment_.grad_workers == 1) return;  // MEM-OPT: the only holder computed everything
  std::vector<comm::Handle> handles;
  std::vector<std::function<void()>> finish;
  std::vector<size_t> shared;
  for (size_t i = 0; i < layers.size(); ++i) {
    if (!preconditions(i) || !layers[i].a_factor().defined()) continue;
    const auto& plan = assignment_.layers[i];
    const auto group = column_groups_[assignment_.column_of(plan.a_worker)];
    auto& state = layers[i].prepare_second_order(method);
    if (method == ComputeMethod::kEigen) {
      handles.push_back(share(state.a_eigen.eigenvectors, false, plan.a_worker, group, "second_order", finish));
      handles.push_back(share(state.a_eigen.eigenvalues, false, plan.a_worker, group, "second_order", finish));
      handles.push_back(share(state.g_eigen.eigenvectors, false, plan.g_worker, group, "second_order", finish));
      handles.push_back(share(state.g_eigen.eigenvalues, false, plan.g_worker, group, "second_order", finish));
    } else {
      handles.push_back(share(state.a_inverse, true, plan.a_worker, group, "second_order", finish));
      handles.push_back(share(state.g_inverse, true, plan.g_worker, group, "second_order", finish));
    }
    shared.push_back(i);
  }
  comm::wait_all(handles);
  for (auto& f : finish) f();
  for (size_t i : shared) layers[i].finish_second_order(damping);
}

void Kaisa::share_gradients(std::vector<torch::Tensor>& preconditioned) {
  if (assignment_.grad_workers == assignment_.world_size) return;  // COMM-OPT: everyone preconditioned
  std::vector<comm::Handle> handles;
  const auto group = row_groups_[assignment_.row_of(rank_)];
  for (size_t i = 0; i < preconditioned.size(); ++i) {
    if (!preconditioned[i].defined()) continue;
    preconditioned[i] = preconditioned[i].contiguous();
    handles.push_back(communicator_->broadcast(preconditioned[i], assignment_.grad_source_for(i, rank_), group,
                                               "gradients"));
  }
  comm::wait_all(handles);
}

}  // namespace dkfac::strategy
