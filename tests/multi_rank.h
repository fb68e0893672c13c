#pragma once
// Ranks as threads of one test process, joined by an in-process store over real Gloo groups (Gloo for CUDA
// tensors too: NCCL refuses several ranks on one GPU).

#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "dkfac/comm/communicator.h"

namespace dkfac::testing {

/// Runs `body(rank, communicator)` on `world` threads; rethrows the first rank's exception.
inline void run_ranks(int world, const std::function<void(int, std::shared_ptr<comm::Communicator>)>& body) {
  auto store = std::make_shared<comm::InProcessStore>();
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(world);
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
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
