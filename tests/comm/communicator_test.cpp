// The Communicator's failure reporting on real Gloo process groups (ranks as threads of this process).
#include "dkfac/comm/communicator.h"

#include <chrono>
#include <mutex>
#include <string>
#include <thread>

#include <gtest/gtest.h>

namespace dkfac::comm {
namespace {

// A rank that stops answering turns into an error on the others within the configured timeout.
TEST(Communicator, LostPeerIsAnErrorWithinTheTimeout) {
  auto store = std::make_shared<InProcessStore>();
  std::string message;
  double seconds = 0;
  std::thread silent([&] {
    auto c = Communicator::connect_in_process(store, 1, 2, std::chrono::seconds(2));
    (void)c;  // joins the world, then never takes part in a collective
    std::this_thread::sleep_for(std::chrono::seconds(4));
  });
  {
    auto c = Communicator::connect_in_process(store, 0, 2, std::chrono::seconds(2));
    auto t = torch::ones({4});
    const auto start = std::chrono::steady_clock::now();
    try {
      auto h = c->allreduce_mean(t, kWorld, Phase::kFactors);
      h.wait();
    } catch (const c10::Error& e) {
      message = e.what_without_backtrace();
    }
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  silent.join();
  EXPECT_NE(message.find("allreduce of 4 elements (factors) over 2 ranks failed"), std::string::npos) << message;
  EXPECT_LT(seconds, 10.0);
}

// A rank that goes away is named: in the error of the collective it fails, and to the lost-rank callback
// once it has been silent for the timeout.
TEST(Communicator, LostRankIsNamed) {
  auto store = std::make_shared<InProcessStore>();
  std::thread leaving([&] {
    auto c = Communicator::connect_in_process(store, 1, 2, std::chrono::seconds(2));
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  });  // its communicator, and with it its heartbeat, ends here
  auto c = Communicator::connect_in_process(store, 0, 2, std::chrono::seconds(2));
  std::mutex mutex;
  std::string lost;
  c->on_lost_rank([&](const std::string& m) {
    std::lock_guard<std::mutex> lock(mutex);
    lost = m;
  });
  leaving.join();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_NE(c->silent_ranks(std::chrono::milliseconds(300)).find("rank 1 (no heartbeat for"), std::string::npos);
  EXPECT_EQ(c->silent_ranks(std::chrono::seconds(30)), "");
  std::string message;
  try {
    auto t = torch::ones({4});
    c->allreduce_mean(t, kWorld, Phase::kFactors).wait();
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  }
  EXPECT_NE(message.find("allreduce of 4 elements (factors) over 2 ranks failed (lost rank 1 (no heartbeat for"),
            std::string::npos)
      << message;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < deadline) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (!lost.empty()) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::lock_guard<std::mutex> lock(mutex);
  EXPECT_NE(lost.find("rank 0 lost rank 1 (no heartbeat for"), std::string::npos) << lost;
}

}  // namespace
}  // namespace dkfac::comm
