#include "dkfac/strategy/distributed.h"

#include <sstream>

#include "dkfac/comm/packing.h"

namespace dkfac::strategy {

Distributed::Distributed(std::shared_ptr<comm::Communicator> communicator, std::vector<KfacLayer>& layers,
                         const Options& options)
    : communicator_(std::move(communicator)), strategy_(options.strategy()), rank_(communicator_->rank()),
      symmetric_comm_(options.symmetric_comm() || options.strategy() == Strategy::kSpd) {
  std::vector<assign::LayerShape> shapes;
  for (const auto& layer : layers) shapes.push_back({layer.name(), layer.a_dim(), layer.g_dim()});
  const int world = communicator_->size();
  assign::AlphaBeta link;
  switch (strategy_) {
    case Strategy::kKaisa:
      assignment_ = assign::assign_kaisa(shapes, world, options.grad_worker_fraction(),
                                         options.balance_memory() ? assign::Balance::kMemory : assign::Balance::kCompute,
                                         options.colocate_factors());
      break;
    case Strategy::kDp:
      assignment_ = assign::assign_dp(shapes, world);
      break;
    case Strategy::kSpd: {
      // Measured only where options leave a choice to make: both measurements are collectives.
      const bool measure = options.spd_redundant_dim() < 0 || options.spd_fusion().empty();
      if (measure) link = measure_link(*communicator_, comm::kWorld);
      int64_t redundant = options.spd_redundant_dim();
      std::ostringstream m;
      if (measure) m << "link alpha " << link.alpha * 1e6 << " us, beta " << link.beta * 1e9 << " ns/B; ";
      if (redundant < 0) {
        const auto dtype = layers.front().weight().scalar_type();
        const double per_cubed = measure_decomposition(*communicator_, options.compute_method(), dtype);
        // What a broadcast carries per d^2: eigenvectors (d^2, plus d eigenvalues), or an upper triangle.
        const double element = static_cast<double>(c10::elementSize(dtype));
        const double per_entry = options.compute_method() == ComputeMethod::kEigen ? element : element / 2;
        redundant = assign::redundant_dim_threshold(per_cubed, link, per_entry);
        m << "decomposition " << per_cubed * 1e9 << " ns/d^3 -> ";
      }
      m << "factors of dim <= " << redundant << " decomposed on every rank";
      measurements_ = m.str();
      assignment_ = assign::assign_spd(shapes, world, redundant);
      break;
    }
  }
  // Same order on every rank: columns, then rows (then the pipeline's group); the world is reused
  // where a group is everyone.
  for (const auto& column : assignment_.columns()) {
    column_groups_.push_back(static_cast<int>(column.size()) == world ? comm::kWorld
                                                                       : communicator_->new_group(column));
  }
  for (const auto& row : assignment_.rows()) {
    row_groups_.push_back(static_cast<int>(row.size()) == world ? comm::kWorld : communicator_->new_group(row));
  }
  if (strategy_ == Strategy::kSpd) {
    pipeline_ = std::make_unique<FactorPipeline>(communicator_, layers, options, link);
  } else if (strategy_ == Strategy::kKaisa && options.update_factors_in_hook()) {
    pipeline_ = std::make_unique<FactorPipeline>(communicator_, layers, options, link,
                                                 FactorPipeline::Mode::kKaisaBuckets);
  }
}

std::string Distributed::describe(const std::vector<KfacLayer>& layers) const {
  std::vector<assign::LayerShape> shapes;
  for (const auto& layer : layers) shapes.push_back({layer.name(), layer.a_dim(), layer.g_dim()});
  std::string out = assignment_.to_string(shapes);
  if (!measurements_.empty()) out += "  " + measurements_ + "\n";
  if (pipeline_) out += "  " + pipeline_->describe() + "\n";
  return out;
}

bool Distributed::builds_factors(size_t layer) const {
  return strategy_ != Strategy::kDp || assignment_.layers[layer].a_worker == rank_;
}

bool Distributed::computes_a(size_t layer) const {
  const int worker = assignment_.layers[layer].a_worker;
  return worker == rank_ || worker == assign::kEveryRank;
}

bool Distributed::computes_g(size_t layer) const {
  const int worker = assignment_.layers[layer].g_worker;
  return worker == rank_ || worker == assign::kEveryRank;
}

void Distributed::arm_factor_step(int64_t micro_batches) {
  if (pipeline_) pipeline_->arm(micro_batches);
}

comm::Handle Distributed::start(torch::Tensor& tensor, bool symmetric,
                                const std::function<comm::Handle(torch::Tensor)>& op,
                                std::vector<std::function<void()>>& finish) {
  if (!symmetric || !symmetric_comm_) return op(tensor);
  auto packed = comm::pack_upper(tensor);
  const int64_t n = tensor.size(0);
  finish.push_back([&tensor, packed, n] { tensor = comm::unpack_upper(packed, n); });
  return op(packed);
}

void Distributed::reduce_factors(std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches) {
  if (strategy_ == Strategy::kDp) return;  // each owner keeps the factors of its own batch
  if (pipeline_) {
    pipeline_->collect(batches);
    return;
  }
  std::vector<comm::Handle> handles;
  std::vector<std::function<void()>> finish;
  const auto allreduce = [this](torch::Tensor t) { return communicator_->allreduce_mean(t, comm::kWorld, comm::Phase::kFactors); };
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

void Distributed::share_second_order(std::vector<KfacLayer>& layers, ComputeMethod method, double damping) {
  if (assignment_.grad_workers == 1) return;  // MEM-OPT, DP-KFAC: the only holder computed everything
  std::vector<comm::Handle> handles;
  std::vector<std::function<void()>> finish;
  std::vector<size_t> shared;
  const auto group = column_groups_[assignment_.column_of(rank_)];
  const auto from = [this, group](int root) {
    return [this, group, root](torch::Tensor t) { return communicator_->broadcast(t, root, group, comm::Phase::kSecondOrder); };
  };
  for (size_t i = 0; i < layers.size(); ++i) {
    if (!preconditions(i) || !layers[i].a_factor().defined()) continue;
    const auto& plan = assignment_.layers[i];
    const bool send_a = plan.a_worker != assign::kEveryRank;
    const bool send_g = plan.g_worker != assign::kEveryRank;
    if (!send_a && !send_g) continue;  // computed whole on every rank
    auto& state = layers[i].prepare_second_order(method);
    if (method == ComputeMethod::kEigen) {
      if (send_a) handles.push_back(start(state.a_eigen.eigenvectors, false, from(plan.a_worker), finish));
      if (send_a) handles.push_back(start(state.a_eigen.eigenvalues, false, from(plan.a_worker), finish));
      if (send_g) handles.push_back(start(state.g_eigen.eigenvectors, false, from(plan.g_worker), finish));
      if (send_g) handles.push_back(start(state.g_eigen.eigenvalues, false, from(plan.g_worker), finish));
    } else {
      if (send_a) handles.push_back(start(state.a_inverse, true, from(plan.a_worker), finish));
      if (send_g) handles.push_back(start(state.g_inverse, true, from(plan.g_worker), finish));
    }
    shared.push_back(i);
  }
  comm::wait_all(handles);
  for (auto& f : finish) f();
  for (size_t i : shared) layers[i].finish_second_order(damping);
}

void Distributed::share_gradients(std::vector<torch::Tensor>& preconditioned) {
  if (assignment_.grad_workers == assignment_.world_size) return;  // COMM-OPT, SPD-KFAC: everyone preconditioned
  std::vector<comm::Handle> handles;
  const auto group = row_groups_[assignment_.row_of(rank_)];
  for (size_t i = 0; i < preconditioned.size(); ++i) {
    if (!preconditioned[i].defined()) continue;
    preconditioned[i] = preconditioned[i].contiguous();
    handles.push_back(communicator_->broadcast(preconditioned[i], assignment_.grad_source_for(i, rank_), group,
                                               comm::Phase::kGradients));
  }
  comm::wait_all(handles);
}

}  // namespace dkfac::strategy
