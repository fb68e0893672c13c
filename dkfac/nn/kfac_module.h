#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include <torch/torch.h>

namespace dkfac::nn {

/// Per-layer accumulator of mini-batch Kronecker factors. The layer's forward adds A factors and
/// a hook on its output adds G factors while capture is active; the preconditioner takes their
/// means at each factor update. Shared by the module and by autograd hooks that may outlive it.
class FactorCapture {
 public:
  /// True when the next forward should capture: enabled, module in training mode, grad mode on.
  bool active(bool training) const { return enabled_ && training && torch::GradMode::is_enabled(); }
  /// Turned on by the preconditioner before each factor step, off after it.
  void set_enabled(bool enabled) { enabled_ = enabled; }
  bool enabled() const { return enabled_; }

  /// Adds one micro-batch factor ([a, a] or [g, g]) and the seconds spent building it.
  void add_a(const torch::Tensor& a_batch, double seconds);
  void add_g(const torch::Tensor& g_batch, double seconds);

  /// Micro-batches captured since the last take.
  int64_t a_count() const;
  int64_t g_count() const;

  /// Mean of the captured factors (sum / count), or an undefined tensor if none; resets the sum.
  torch::Tensor take_a();
  torch::Tensor take_g();

  /// Mean of the captured factors without resetting (undefined if none).
  torch::Tensor mean_a() const;
  torch::Tensor mean_g() const;

  /// Drops anything captured.
  void clear();

  /// Called after each add (on the thread that added, outside the capture's lock) with whether it was
  /// A and how many micro-batches that factor now holds. SPD-KFAC starts allreduces from it.
  using Listener = std::function<void(bool is_a, int64_t count)>;
  void set_listener(Listener listener);

  /// Seconds spent building factors since construction (forward and backward).
  double seconds() const;

 private:
  static void add(torch::Tensor& sum, int64_t& count, const torch::Tensor& batch);
  static torch::Tensor mean(const torch::Tensor& sum, int64_t count);
  static torch::Tensor take(torch::Tensor& sum, int64_t& count);
  /// Adds under the lock, then calls the listener outside it.
  void add_and_notify(bool is_a, const torch::Tensor& batch, double seconds);

  mutable std::mutex mutex_;  // forward and autograd threads may both touch the sums
  bool enabled_ = false;
  torch::Tensor a_sum_;  // [a, a]
  torch::Tensor g_sum_;  // [g, g]
  int64_t a_count_ = 0;
  int64_t g_count_ = 0;
  double seconds_ = 0.0;
  Listener listener_;
};

/// Interface of modules whose Kronecker factors dkfac can build (dkfac::nn::Linear, Conv2d).
/// The preconditioner finds such modules in a model by dynamic_cast.
class KfacModule {
 public:
  virtual ~KfacModule() = default;

  /// "Linear" or "Conv2d".
  virtual std::string kfac_kind() const = 0;
  /// The weight; its gradient is viewed as [g, a - has_bias].
  virtual torch::Tensor kfac_weight() const = 0;
  /// The bias, or an undefined tensor.
  virtual torch::Tensor kfac_bias() const = 0;
  /// Factor dimensions: a (input side, +1 with bias) and g (output side).
  virtual int64_t a_dim() const = 0;
  virtual int64_t g_dim() const = 0;

  /// Rows each sample adds to the factor's input matrix in the last forward: output positions
  /// H_out * W_out for Conv2d, the middle dimensions' size for Linear (1 for [B, in] inputs).
  int64_t rows_per_sample() const { return rows_per_sample_; }

  FactorCapture& factor_capture() { return *capture_; }
  const FactorCapture& factor_capture() const { return *capture_; }

 protected:
  std::shared_ptr<FactorCapture> capture_ = std::make_shared<FactorCapture>();
  int64_t rows_per_sample_ = 1;
};

}  // namespace dkfac::nn
