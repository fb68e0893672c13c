// The Communicator's failure reporting on real Gloo process groups (ranks as threads of this process).
#include "dkfac/comm/communicator.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "tests/multi_rank.h"

namespace dkfac::comm {
namespace {

// reduce_sum puts the sum of every member's tensor into the root's, over the world and over a subgroup whose root is
// not its first member, and counts the bytes each rank hands to it under its purpose.
TEST(Communicator, ReduceSumsIntoTheRootAlone) {
  constexpr int kRanks = 3;
  std::vector<torch::Tensor> world_sums(kRanks), group_sums(kRanks);
  std::vector<Traffic> traffic(kRanks);
  dkfac::testing::run_ranks(kRanks, [&](int rank, std::shared_ptr<Communicator> c) {
    const auto group = c->new_group({0, 2});
    const auto options = torch::TensorOptions(torch::kFloat64).device(dkfac::testing::test_device());
    auto t = torch::arange(5, options) * (rank + 1);
    c->reduce_sum(t, /*root=*/1, kWorld, Purpose::kFactors).wait();
    world_sums[rank] = t.cpu();
    if (rank != 1) {
      auto u = torch::full({3}, rank + 1.0, options);
      c->reduce_sum(u, /*root=*/2, group, Purpose::kFactors).wait();
      group_sums[rank] = u.cpu();
    }
    traffic[rank] = c->traffic().at("factors");
  });
  EXPECT_TRUE(torch::equal(world_sums[1], torch::arange(5, torch::kFloat64) * 6)) << world_sums[1];
  EXPECT_TRUE(torch::equal(group_sums[2], torch::full({3}, 4.0, torch::kFloat64))) << group_sums[2];
  for (int rank = 0; rank < kRanks; ++rank) {
    EXPECT_EQ(traffic[rank].calls, rank == 1 ? 1 : 2) << rank;
    EXPECT_EQ(traffic[rank].bytes, 8 * (5 + (rank == 1 ? 0 : 3))) << rank;
  }
}

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
      auto h = c->allreduce_mean(t, kWorld, Purpose::kFactors);
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

// Writes one byte into a socket whose other end is closed, as a rank does to a peer that has died; exits 0 where
// the write fails with EPIPE (the process lives on to say what happened).
[[noreturn]] void write_to_a_closed_socket() {
  sigset_t pipe;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  ::sigprocmask(SIG_UNBLOCK, &pipe, nullptr);  // delivered, whatever mask the test process inherited
  int ends[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, ends) != 0) std::_Exit(2);
  ::close(ends[1]);
  const char byte = 0;
  const bool epipe = ::write(ends[0], &byte, 1) < 0 && errno == EPIPE;
  std::_Exit(epipe ? 0 : 3);
}

// Once a communicator exists, a write to a dead peer's socket is an error (EPIPE), not SIGPIPE's end of the process
// (which left a torchrun worker's error unsaid). Without one, the same write ends the process: the check can fail.
// A SIGPIPE handler the program installed is kept.
TEST(CommunicatorDeathTest, ABrokenPipeIsAnErrorNotTheEndOfTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        std::signal(SIGPIPE, SIG_DFL);
        write_to_a_closed_socket();
      },
      ::testing::KilledBySignal(SIGPIPE), "");
  EXPECT_EXIT(
      {
        std::signal(SIGPIPE, SIG_DFL);
        auto c = Communicator::connect_in_process(std::make_shared<InProcessStore>(), 0, 1, std::chrono::seconds(2));
        write_to_a_closed_socket();
      },
      ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(
      {
        std::signal(SIGPIPE, [](int) { std::_Exit(7); });
        auto c = Communicator::connect_in_process(std::make_shared<InProcessStore>(), 0, 1, std::chrono::seconds(2));
        write_to_a_closed_socket();
      },
      ::testing::ExitedWithCode(7), "");
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
    c->allreduce_mean(t, kWorld, Purpose::kFactors).wait();
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

// Control tensors (flags, timings, state tables) go where the world group can carry them: the CPU when it has a
// CPU backend, else the layers' own GPU, not the thread's current device (a rank that never called set_device
// would put every rank's flags on cuda:0); no device that fits is an error naming the problem.
TEST(Communicator, ControlDeviceFollowsTheLayersInAnNcclOnlyWorld) {
  const c10::Device cuda1(c10::kCUDA, 1);
  EXPECT_EQ(control_device_for(true, cuda1), c10::Device(c10::kCPU));
  EXPECT_EQ(control_device_for(true, std::nullopt), c10::Device(c10::kCPU));
  EXPECT_EQ(control_device_for(false, cuda1), cuda1);
  EXPECT_EQ(control_device_for(false, c10::Device(c10::kCUDA, 3)), c10::Device(c10::kCUDA, 3));
  try {
    control_device_for(false, c10::Device(c10::kCPU));
    ADD_FAILURE() << "CPU layers in an NCCL-only world were accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no CPU backend (an NCCL-only group), but the layers are on cpu"),
              std::string::npos) << e.what();
  }
  try {
    control_device_for(false, std::nullopt);
    ADD_FAILURE() << "no device in an NCCL-only world was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no device was given for dkfac's control tensors"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace dkfac::comm
