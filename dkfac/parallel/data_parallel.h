#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "dkfac/comm/communicator.h"

namespace c10d {
class Reducer;
}  // namespace c10d

/// Data parallelism as torch's DistributedDataParallel does it, for LibTorch training loops: the same
/// engine (c10d::Reducer: bucketed gradient allreduce overlapped with backward), with the calls DDP's
/// forward makes spelled out, because LibTorch modules have no forward hooks. Not a K-FAC strategy:
/// K-FAC preconditions the averaged gradients after it.
///
/// One difference from DDP's defaults: the buckets keep their first layout (parameters in reverse
/// registration order) instead of being rebuilt after the first step in the order gradients arrived.
/// With more than two ranks Gloo's ring sums an element in an order that depends on its place in the
/// bucket, so a rebuilt layout would make a resumed job (whose first step uses the first layout again)
/// drift from the uninterrupted one at round-off level; with a fixed layout it continues bit for bit.
/// The reducer skips the rebuild when it searches the loss's graph for parameters without a gradient
/// (DDP's find_unused_parameters=True), which is therefore on: a parameter a step does not use gets a
/// zero average instead of an error, as in DDP with that flag.
namespace dkfac::parallel {

struct DataParallelOptions {
  /// Gradient bucket size; DDP's default (the first bucket is 1 MiB, as in DDP).
  double bucket_cap_mb = 25.0;
  /// Rank 0's buffers (BatchNorm running statistics) go to every rank at the start of each step, as
  /// DDP's broadcast_buffers=True does.
  bool broadcast_buffers = true;
};

/// One step with gradient accumulation over K micro-batches:
///
///     for (k = 0; k < K; ++k) {
///       if (k == 0) dp.broadcast_buffers();         // DDP: in the first forward after an averaged step
///       auto loss = loss_fn(model->forward(x[k])) / K;
///       dp.backward(loss, /*average=*/k + 1 == K);  // DDP: no_sync() for all but the last
///     }
///     preconditioner.step(); optimizer.step();
///
/// Every rank must build the same model (checked at construction: same parameter count, shapes and dtypes).
/// Load checkpoints before building it: LibTorch's `Module::load` can give a parameter a new gradient
/// accumulator, which the reducer would no longer see (`backward` refuses to go on when that happened).
class DataParallel {
 public:
  /// Broadcasts `model`'s parameters and buffers from rank 0, so ranks start identical whatever their
  /// seeds, and builds the reducer over its parameters that require gradients.
  DataParallel(torch::nn::Module& model, std::shared_ptr<comm::Communicator> communicator,
               DataParallelOptions options = {});
  /// The same over explicit parameters and buffers.
  DataParallel(std::vector<torch::Tensor> parameters, std::vector<torch::Tensor> buffers,
               std::shared_ptr<comm::Communicator> communicator, DataParallelOptions options = {});
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  /// Rank 0's buffers to every rank (no-op without buffers or with broadcast_buffers off). Call before
  /// the first forward of each step, and before evaluating.
  void broadcast_buffers();

  /// `loss.backward()`. With `average`, each parameter's `.grad` (everything accumulated since the last
  /// averaged backward, this one included) ends as its mean over the ranks; the buckets' allreduces run
  /// while backward goes on and are complete when this returns. Without, gradients accumulate locally
  /// and nothing is communicated (DDP's no_sync()). A failed allreduce is an error naming the silent ranks.
  void backward(const torch::Tensor& loss, bool average = true);

  /// Gradient buckets (a fixed layout: see above).
  size_t buckets() const { return buckets_; }

 private:
  std::vector<torch::Tensor> parameters_;
  std::vector<torch::Tensor> buffers_;
  std::shared_ptr<comm::Communicator> communicator_;
  DataParallelOptions options_;
  std::shared_ptr<c10d::Reducer> reducer_;
  std::vector<const void*> accumulators_;  // each parameter's gradient accumulator the reducer hooks into
  size_t buckets_ = 0;
  int64_t gradient_bytes_ = 0;  // of the parameters, counted per averaged backward
  int64_t buffer_bytes_ = 0;    // of the buffers, counted per broadcast_buffers()
};

}  // namespace dkfac::parallel
