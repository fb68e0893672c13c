// DDP's engine (c10d::Reducer) on the world's process group; with comm/, the only part of dkfac that
// includes c10d headers.
#include "dkfac/parallel/data_parallel.h"

#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>

namespace dkfac::parallel {

namespace {

std::vector<torch::Tensor> trainable(const std::vector<torch::Tensor>& parameters) {
  std::vector<torch::Tensor> out;
  for (const auto& p : parameters) {
    if (p.requires_grad()) out.push_back(p);
  }
  return out;
}

constexpr size_t kBroadcastBucketBytes = size_t{250} << 20;  // DDP's broadcast_bucket_size

}  // namespace

DataParallel::DataParallel(torch::nn::Module& model, std::shared_ptr<comm::Communicator> communicator,
                           DataParallelOptions options)
    : DataParallel(model.parameters(), model.buffers(), std::move(communicator), options) {}

DataParallel::DataParallel(std::vector<torch::Tensor> parameters, std::vector<torch::Tensor> buffers,
                           std::shared_ptr<comm::Communicator> communicator, DataParallelOptions options)
    : parameters_(trainable(parameters)),
      buffers_(std::move(buffers)),
      communicator_(std::move(communicator)),
      options_(options) {
  TORCH_CHECK(communicator_ != nullptr, "DataParallel needs a communicator");
  TORCH_CHECK(options_.bucket_cap_mb > 0, "DataParallel: bucket_cap_mb must be > 0, got ", options_.bucket_cap_mb);
  TORCH_CHECK(!parameters_.empty(), "DataParallel: the model has no parameter that requires a gradient");
  auto group = communicator_->process_group(comm::kWorld);
  // Same parameter count, shapes and dtypes on every rank, or an error naming the first difference.
  c10d::verify_params_across_processes(group, parameters_, std::nullopt);
  {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> state = parameters;
    for (const auto& b : buffers_) state.push_back(b);
    c10d::broadcast_coalesced(group, state, kBroadcastBucketBytes, 0);
  }
  const auto cap = static_cast<int64_t>(options_.bucket_cap_mb * 1024 * 1024);
  const int64_t first_cap = std::min<int64_t>(c10d::kDefaultFirstBucketBytes, cap);
  // As DDP: buckets assigned in registration order with a small first bucket, then reversed, so that
  // the parameters backward reaches first (the last layers) fill the first bucket.
  auto indices = std::get<0>(c10d::compute_bucket_assignment_by_size(
      parameters_, {static_cast<size_t>(first_cap), static_cast<size_t>(cap)},
      std::vector<bool>(parameters_.size(), false)));
  std::reverse(indices.begin(), indices.end());
  buckets_ = indices.size();
  for (const auto& p : parameters_) gradient_bytes_ += static_cast<int64_t>(p.nbytes());
  for (const auto& b : buffers_) buffer_bytes_ += static_cast<int64_t>(b.nbytes());
  // The constructor as torch 2.11 to 2.15 declare it (2.15 adds two defaulted flags); older 2.x releases
  // differ, which is one reason dkfac needs torch 2.11 or newer (cmake/torch.cmake).
  reducer_ = std::make_shared<c10d::Reducer>(parameters_, std::move(indices), group,
                                             std::vector<bool>(parameters_.size(), false), cap,
                                             /*find_unused_parameters=*/true, /*gradient_as_bucket_view=*/false,
                                             std::unordered_map<size_t, std::string>(), first_cap,
                                             /*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false,
                                             /*bucket_bytes_cap_list=*/std::vector<int64_t>());  // rebuilt: first_cap, then cap
  for (const auto& p : parameters_) accumulators_.push_back(torch::autograd::impl::grad_accumulator(p).get());
}

DataParallel::~DataParallel() = default;

void DataParallel::broadcast_buffers() {
  if (!options_.broadcast_buffers || buffers_.empty()) return;
  torch::NoGradGuard no_grad;
  c10d::broadcast_coalesced(communicator_->process_group(comm::kWorld), buffers_, kBroadcastBucketBytes, 0);
  communicator_->add_traffic(comm::Purpose::kDataParallel, 1, buffer_bytes_);
}

void DataParallel::backward(const torch::Tensor& loss, bool average) {
  if (!average) {
    loss.backward();  // the reducer's hooks stay idle: gradients accumulate in .grad
    return;
  }
  for (size_t k = 0; k < parameters_.size(); ++k) {
    // A parameter whose accumulator changed (Module::load after construction) would silently stay local.
    TORCH_CHECK(torch::autograd::impl::grad_accumulator(parameters_[k]).get() == accumulators_[k],
                "DataParallel: parameter ", k, " was replaced after DataParallel was built (e.g. by Module::load); "
                "its gradient would not be averaged. Build DataParallel after loading the model");
  }
  try {
    reducer_->prepare_for_forward();
    reducer_->prepare_for_backward({loss});  // finds parameters outside the loss's graph (see the header)
    loss.backward();  // the reducer waits for its last bucket in autograd's final callback
  } catch (const c10::OutOfMemoryError&) {
    throw;  // the backward pass ran out of memory: not a communication failure
  } catch (const std::exception& e) {
    const std::string silent = communicator_->diagnose_failure();
    TORCH_CHECK(false, "dkfac: gradient allreduce (data_parallel) over ", communicator_->size(), " ranks failed (",
                silent.empty() ? "a peer died, stopped answering or the timeout passed" : "lost " + silent,
                "): ", e.what());
  }
  communicator_->add_traffic(comm::Purpose::kDataParallel, static_cast<int64_t>(buckets_), gradient_bytes_);
}

}  // namespace dkfac::parallel
