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

comm::Handle Kaisa::start(torch::Tensor& tensor, bool symmetric, const std::function<comm::Handle(torch::Tensor)>& op,
                          std::vector<std::function<void()>>& finish) {
  if (!symmetric || !symmetric_comm_) return op(tensor);
  auto packed = pack_upper(tensor);
  const int64_t n = tensor.size(0);
  finish.push_back([&tensor, packed, n] { tensor = unpack_upper(packed, n); });
  return op(packed);
}

void Kaisa::reduce_factors(std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches) {
  std::vector<comm::Handle> handles;
  std::vector<std::function<void()>> finish;
  const auto allreduce = [this](torch::Tensor t) { return communicator_->allreduce_mean(t, comm::kWorld, "factors"); };
  for (auto& [a, g] : batches) {
    for (torch::Tensor* t : {&a, &g}) {
      if (!t->defined()) continue;
      *t = t->contiguous();
      handles.push_back(start(*t, /*symmetric=*/true, allreduce, finish));
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
    const auto from = [this, group](int root) {
      return [this, group, root](torch::Tensor t) { return communicator_->broadcast(t, root, group, "second_order"); };
    };
    if (method == ComputeMethod::kEigen) {
      handles.push_back(start(state.a_eigen.eigenvectors, false, from(plan.a_worker), finish));
      handles.push_back(start(state.a_eigen.eigenvalues, false, from(plan.a_worker), finish));
      handles.push_back(start(state.g_eigen.eigenvectors, false, from(plan.g_worker), finish));
      handles.push_back(start(state.g_eigen.eigenvalues, false, from(plan.g_worker), finish));
    } else {
      handles.push_back(start(state.a_inverse, true, from(plan.a_worker), finish));
      handles.push_back(start(state.g_inverse, true, from(plan.g_worker), finish));
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
