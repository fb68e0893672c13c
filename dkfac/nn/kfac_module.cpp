#include "dkfac/nn/kfac_module.h"

namespace dkfac::nn {

void FactorCapture::add(torch::Tensor& sum, int64_t& count, const torch::Tensor& batch) {
  if (count == 0) {
    sum = batch;
  } else {
    TORCH_INTERNAL_ASSERT(sum.sizes() == batch.sizes(), "captured factor changed shape from ", sum.sizes(),
                          " to ", batch.sizes());
    sum = sum + batch;  // not in place: the first batch may be referenced elsewhere
  }
  ++count;
}

torch::Tensor FactorCapture::take(torch::Tensor& sum, int64_t& count) {
  if (count == 0) return {};
  auto mean = count == 1 ? sum : sum / static_cast<double>(count);
  sum = torch::Tensor();
  count = 0;
  return mean;
}

void FactorCapture::add_a(const torch::Tensor& a_batch, double seconds) {
  Listener listener;
  int64_t count = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    add(a_sum_, a_count_, a_batch);
    seconds_ += seconds;
    listener = listener_;
    count = a_count_;
  }
  if (listener) listener(/*is_a=*/true, count);
}

void FactorCapture::add_g(const torch::Tensor& g_batch, double seconds) {
  Listener listener;
  int64_t count = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    add(g_sum_, g_count_, g_batch);
    seconds_ += seconds;
    listener = listener_;
    count = g_count_;
  }
  if (listener) listener(/*is_a=*/false, count);
}

torch::Tensor FactorCapture::mean_a() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return a_count_ == 0 ? torch::Tensor() : a_sum_ / static_cast<double>(a_count_);
}

torch::Tensor FactorCapture::mean_g() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return g_count_ == 0 ? torch::Tensor() : g_sum_ / static_cast<double>(g_count_);
}

void FactorCapture::set_listener(Listener listener) {
  std::lock_guard<std::mutex> lock(mutex_);
  listener_ = std::move(listener);
}

int64_t FactorCapture::a_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return a_count_;
}

int64_t FactorCapture::g_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return g_count_;
}

torch::Tensor FactorCapture::take_a() {
  std::lock_guard<std::mutex> lock(mutex_);
  return take(a_sum_, a_count_);
}

torch::Tensor FactorCapture::take_g() {
  std::lock_guard<std::mutex> lock(mutex_);
  return take(g_sum_, g_count_);
}

void FactorCapture::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  a_sum_ = torch::Tensor();
  g_sum_ = torch::Tensor();
  a_count_ = 0;
  g_count_ = 0;
}

double FactorCapture::seconds() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return seconds_;
}

}  // namespace dkfac::nn
