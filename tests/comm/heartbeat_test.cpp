// The heartbeat watchdog's diagnosis after a failed collective, on an in-memory store.
#include "dkfac/comm/heartbeat.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include <gtest/gtest.h>

namespace dkfac::comm {
namespace {

// What a StoreView saw: calls started, and calls under way.
struct StoreCalls {
  std::atomic<int> started{0};
  std::atomic<int> in_flight{0};
};

// A rank's view of a shared store: every call takes `delay` first (a rank whose rounds with the store run
// late, as on a loaded machine), and writes to `dropped` are lost (a rank whose diagnosis never arrives).
// Calls are counted in `calls`.
class StoreView : public c10d::Store {
 public:
  StoreView(c10::intrusive_ptr<c10d::Store> inner, std::chrono::milliseconds delay, std::string dropped = "",
            std::shared_ptr<StoreCalls> calls = std::make_shared<StoreCalls>())
      : inner_(std::move(inner)), delay_(delay), dropped_(std::move(dropped)), calls_(std::move(calls)) {}
  c10::intrusive_ptr<c10d::Store> clone() override {
    return c10::make_intrusive<StoreView>(inner_, delay_, dropped_, calls_);
  }
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    Call call(*this);
    if (key != dropped_) inner_->set(key, value);
  }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    Call call(*this);
    return inner_->compareSet(key, expected, desired);
  }
  std::vector<uint8_t> get(const std::string& key) override { return Call(*this), inner_->get(key); }
  int64_t add(const std::string& key, int64_t value) override { return Call(*this), inner_->add(key, value); }
  bool deleteKey(const std::string& key) override { return Call(*this), inner_->deleteKey(key); }
  bool check(const std::vector<std::string>& keys) override { return Call(*this), inner_->check(keys); }
  int64_t getNumKeys() override { return Call(*this), inner_->getNumKeys(); }
  void wait(const std::vector<std::string>& keys) override { Call(*this), inner_->wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    Call(*this), inner_->wait(keys, timeout);
  }

 private:
  // One call: counted in flight from its pause to its end (the temporary lives to the end of the full expression).
  struct Call {
    explicit Call(const StoreView& view) : calls(*view.calls_) {
      ++calls.started;
      ++calls.in_flight;
      std::this_thread::sleep_for(view.delay_);
    }
    ~Call() { --calls.in_flight; }
    StoreCalls& calls;
  };
  c10::intrusive_ptr<c10d::Store> inner_;
  std::chrono::milliseconds delay_;
  std::string dropped_;
  std::shared_ptr<StoreCalls> calls_;
};

// Rank 2 of 3 stops beating; rank 0's rounds with the store take longer than three beat intervals (6 store
// calls of 80 ms against a 100 ms interval). Rank 0 must still name rank 2 alone: rank 1 beats all along.
// A diagnosis that waited a fixed three intervals often saw no round finish in that window and named
// rank 1 too. Rank 1's own diagnosis (its watchdog sees rank 2 silent for the timeout) is not published,
// so that rank 0 decides by itself.
TEST(Heartbeat, DiagnosisOnASlowStoreNamesOnlyTheSilentRank) {
  const auto timeout = std::chrono::milliseconds(1000);  // beats every 100 ms
  auto shared = c10::make_intrusive<c10d::HashStore>();
  Heartbeat rank0(c10::make_intrusive<StoreView>(shared, std::chrono::milliseconds(80)), 0, 3, timeout, "memory");
  Heartbeat rank1(c10::make_intrusive<StoreView>(shared, std::chrono::milliseconds(0), "dkfac/lost"), 1, 3, timeout,
                  "memory");
  {
    Heartbeat rank2(shared, 2, 3, timeout, "memory");
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // every rank has beaten in rank 0's rounds
  }  // rank 2 stops here
  const auto start = std::chrono::steady_clock::now();
  const std::string found = rank0.diagnose();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(found.rfind("rank 2 (no heartbeat for", 0), 0u) << found;
  EXPECT_EQ(found.find("rank 1"), std::string::npos) << found;
  EXPECT_LT(seconds, 3 * 0.1 + 4 * 1.0) << "decided by the rounds, before the deadline";
}

// On a store that answers at once, the diagnosis takes about two beat intervals and names the silent rank.
TEST(Heartbeat, DiagnosisNamesTheSilentRankWithinAFewIntervals) {
  const auto timeout = std::chrono::milliseconds(1000);
  auto shared = c10::make_intrusive<c10d::HashStore>();
  Heartbeat rank0(shared, 0, 3, timeout, "memory");
  Heartbeat rank2(shared, 2, 3, timeout, "memory");
  {
    Heartbeat rank1(shared, 1, 3, timeout, "memory");
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  const auto start = std::chrono::steady_clock::now();
  const std::string found = rank0.diagnose();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(found.rfind("rank 1 (no heartbeat for", 0), 0u) << found;
  EXPECT_EQ(found.find("rank 2"), std::string::npos) << found;
  EXPECT_LT(seconds, 0.6);
}

// Waits (at most 5 s) until a store call is under way.
bool under_way(const StoreCalls& calls) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (calls.in_flight.load() == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return calls.in_flight.load() > 0;
}

// stop() returns only once the store round in flight has returned: a round left behind at a clean end kept
// calling the store client while the process exited (a Python worker aborted in CI with "malloc(): unaligned
// tcache chunk detected"), and skipped the clean end's "done" mark. Each call takes 150 ms.
TEST(Heartbeat, StopWaitsForTheStoreRoundInFlight) {
  const auto timeout = std::chrono::milliseconds(3000);
  auto shared = c10::make_intrusive<c10d::HashStore>();
  auto calls = std::make_shared<StoreCalls>();
  Heartbeat rank1(c10::make_intrusive<StoreView>(shared, std::chrono::milliseconds(150), "", calls), 1, 2, timeout,
                  "memory");
  ASSERT_TRUE(under_way(*calls)) << "the first round is under way";
  rank1.stop();
  EXPECT_EQ(calls->in_flight.load(), 0) << "stop() returned with a store call under way";
  const int started = calls->started.load();
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  EXPECT_EQ(calls->started.load(), started) << "a store call started after stop() returned";
  EXPECT_TRUE(shared->check({"dkfac/done/1"})) << "the clean end marks this rank done";
}

// A store that does not answer holds stop() for at most a few beat intervals (the round is left behind).
TEST(Heartbeat, StopLeavesAStuckRoundBehindWithinItsGrace) {
  const auto timeout = std::chrono::milliseconds(4000);  // beats every 400 ms; stop's grace 2 s
  auto shared = c10::make_intrusive<c10d::HashStore>();
  auto calls = std::make_shared<StoreCalls>();
  Heartbeat rank1(c10::make_intrusive<StoreView>(shared, std::chrono::milliseconds(8000), "", calls), 1, 2, timeout,
                  "memory");
  ASSERT_TRUE(under_way(*calls));
  const auto start = std::chrono::steady_clock::now();
  rank1.stop();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(seconds, 1.9);
  EXPECT_LT(seconds, 3.9) << "within the grace, before the round's own timeout";
  EXPECT_EQ(calls->in_flight.load(), 1) << "the stuck call is left behind";
}

}  // namespace
}  // namespace dkfac::comm
