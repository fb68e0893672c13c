#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "dkfac/comm/communicator.h"

namespace dkfac::strategy {

/// Averages parameter gradients over all ranks, overlapped with backward. Parameters are grouped
/// into buckets of about `bucket_bytes` in reverse registration order (roughly the order backward
/// produces them); a hook on each parameter copies its gradient into its bucket as soon as autograd
/// produces it, and a full bucket's allreduce starts at once while backward goes on.
/// `synchronize()` waits for the buckets and writes the averages into `.grad`.
/// Assumes each parameter gets one gradient per backward and `.grad` was zero or undefined before it
/// (no accumulation across backward passes). Every rank must own the same parameters in the same order.
class DataParallel {
 public:
  DataParallel(std::vector<torch::Tensor> parameters, std::shared_ptr<comm::Communicator> communicator,
               int64_t bucket_bytes = int64_t{1} << 20);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  /// Call after loss.backward() and before the preconditioner / optimizer step.
  void synchronize();

  /// Number of buckets (for tests and logs).
  size_t buckets() const { return buckets_.size(); }

 private:
  struct Bucket {
    std::vector<size_t> parameters;  // indices into parameters_
    std::vector<int64_t> offsets;    // element offset of each parameter in `flat`
    torch::Tensor flat;              // [sum of numel]
    size_t ready = 0;
    comm::Handle handle;
    bool started = false;
  };
  void on_gradient(size_t parameter, const torch::Tensor& grad);
  void start(Bucket& bucket);

  std::vector<torch::Tensor> parameters_;
  std::shared_ptr<comm::Communicator> communicator_;
  std::vector<Bucket> buckets_;
  std::vector<std::pair<size_t, size_t>> where_;  // parameter -> (bucket, slot)
  std::vector<unsigned> hooks_;
};

}  // namespace dkfac::strategy
