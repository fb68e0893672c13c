#pragma once
// Debian 12's libtorch-dev (1.13.1) ships torch/csrc/distributed/c10d/reducer.hpp but not the
// distributed-autograd header it includes. c10d::Reducer only names two things from it: the type of a
// gradient callback (checked by a static_assert) and a shared pointer to the RPC autograd context, which
// it holds but dkfac never sets (no distributed autograd). These declarations give reducer.hpp those two
// names with the same layout (a std::shared_ptr and a raw pointer); the context's definition stays in
// libtorch_cpu. Used only by dkfac/parallel/data_parallel.cpp; never installed.
#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>

namespace torch::distributed::autograd {

class DistAutogradContext {
 public:
  using GradCallback = std::function<bool(at::Tensor&)>;
};

using ContextPtr = std::shared_ptr<DistAutogradContext>;

}  // namespace torch::distributed::autograd
