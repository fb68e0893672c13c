#pragma once
// Ranks as threads of one test process, joined by an in-process store over real Gloo groups (Gloo for CUDA
// tensors too: NCCL refuses several ranks on one GPU).

#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "dkfac/comm/communicator.h"
#include "tests/test_util.h"

namespace dkfac::testing {

/// Averages every gradient of `model` over the world, as DDP does before kfac.step().
inline void average_gradients(comm::Communicator& communicator, torch::nn::Module& model) {
  std::vector<comm::Handle> handles;
  for (auto& p : model.parameters()) {
    handles.push_back(communicator.allreduce_mean(p.mutable_grad(), comm::kWorld, comm::Purpose::kDataParallel));
  }
  comm::wait_all(handles);
}

/// Runs `body(rank, communicator)` on `world` threads; rethrows the first rank's exception.
inline void run_ranks(int world, const std::function<void(int, std::shared_ptr<comm::Communicator>)>& body) {
  auto store = std::make_shared<comm::InProcessStore>();
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(world);
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        // DKFAC_TEST_DIAG=rank_stream: each rank works on its own CUDA stream, as separate processes do
        // (threads otherwise share the device's default stream).
        std::optional<c10::StreamGuard> own_stream;
        if (diagnostic("rank_stream") && test_device().is_cuda()) {
          c10::impl::VirtualGuardImpl cuda(c10::kCUDA);
          own_stream.emplace(cuda.getStreamFromGlobalPool(test_device(), /*isHighPriority=*/false));
        }
        body(rank, comm::Communicator::connect_in_process(store, rank, world, std::chrono::seconds(30),
                                                         comm::CudaBackend::kGloo));
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace dkfac::testing
