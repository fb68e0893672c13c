#include "dkfac/strategy/data_parallel.h"

namespace dkfac::strategy {

DataParallel::DataParallel(std::vector<torch::Tensor> parameters, std::shared_ptr<comm::Communicator> communicator,
                           int64_t bucket_bytes)
    : parameters_(std::move(parameters)), communicator_(std::move(communicator)) {
  TORCH_CHECK(communicator_ != nullptr, "DataParallel needs a communicator");
  TORCH_CHECK(bucket_bytes > 0, "bucket_bytes must be > 0, got ", bucket_bytes);
  where_.resize(parameters_.size());
  Bucket current;
  int64_t bytes = 0;
  for (size_t k = parameters_.size(); k-- > 0;) {
    const auto& p = parameters_[k];
    if (!p.requires_grad()) continue;
    TORCH_CHECK(p.scalar_type() == parameters_.front().scalar_type(), "DataParallel needs one dtype for all parameters");
    const int64_t offset = current.offsets.empty() ? 0 : current.offsets.back() + parameters_[current.parameters.back()].numel();
    where_[k] = {buckets_.size(), current.parameters.size()};
    current.parameters.push_back(k);
    current.offsets.push_back(offset);
    bytes += p.numel() * static_cast<int64_t>(p.element_size());
    if (bytes >= bucket_bytes) {
      buckets_.push_back(std::move(current));
      current = Bucket();
      bytes = 0;
    }
  }
  if (!current.parameters.empty()) buckets_.push_back(std::move(current));
  for (auto& b : buckets_) {
    const auto last = b.parameters.back();
    b.flat = torch::zeros({b.offsets.back() + parameters_[last].numel()}, parameters_[last].options().requires_grad(false));
  }
  for (size_t k = 0; k < parameters_.size(); ++k) {
    if (!parameters_[k].requires_grad()) continue;
    hooks_.push_back(parameters_[k].register_hook([this, k](const torch::Tensor& grad) { on_gradient(k, grad); }));
  }
}

DataParallel::~DataParallel() {
  size_t h = 0;
  for (auto& p : parameters_) {
    if (p.requires_grad() && h < hooks_.size()) p.remove_hook(hooks_[h++]);
  }
}

void DataParallel::on_gradient(size_t parameter, const torch::Tensor& grad) {
  const auto [b, slot] = where_[parameter];
  auto& bucket = buckets_[b];
  const int64_t offset = bucket.offsets[slot];
  bucket.flat.slice(0, offset, offset + grad.numel()).copy_(grad.reshape({-1}));
  if (++bucket.ready == bucket.parameters.size()) start(bucket);
}

void DataParallel::start(Bucket& bucket) {
  bucket.handle = communicator_->allreduce_mean(bucket.flat, comm::kWorld, "data_parallel");
  bucket.started = true;
}

void DataParallel::synchronize() {
  // Buckets with parameters that got no gradient (unused this step) start now, in bucket order.
  for (auto& bucket : buckets_) {
    if (!bucket.started) start(bucket);
  }
  torch::NoGradGuard no_grad;
  for (auto& bucket : buckets_) {
    bucket.handle.wait();
    for (size_t slot = 0; slot < bucket.parameters.size(); ++slot) {
      auto& p = parameters_[bucket.parameters[slot]];
      auto averaged = bucket.flat.slice(0, bucket.offsets[slot], bucket.offsets[slot] + p.numel()).view_as(p);
      if (p.grad().defined()) {
        p.mutable_grad().copy_(averaged);
      } else {
        p.mutable_grad() = averaged.clone();
      }
    }
    bucket.flat.zero_();
    bucket.ready = 0;
    bucket.started = false;
  }
}

}  // namespace dkfac::strategy
