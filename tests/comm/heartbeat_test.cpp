// The heartbeat watchdog's diagnosis after a failed collective, on an in-memory store.
#include "dkfac/comm/heartbeat.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <string>
#include <thread>

#include <gtest/gtest.h>

namespace dkfac::comm {
namespace {

// A rank's view of a shared store: every call takes `delay` first (a rank whose rounds with the store run
// late, as on a loaded machine), and writes to `dropped` are lost (a rank whose diagnosis never arrives).
class StoreView : public c10d::Store {
 public:
  StoreView(c10::intrusive_ptr<c10d::Store> inner, std::chrono::milliseconds delay, std::string dropped = "")
      : inner_(std::move(inner)), delay_(delay), dropped_(std::move(dropped)) {}
  c10::intrusive_ptr<c10d::Store> clone() override { return c10::make_intrusive<StoreView>(inner_, delay_, dropped_); }
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    pause();
    if (key != dropped_) inner_->set(key, value);
  }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    pause();
    return inner_->compareSet(key, expected, desired);
  }
  std::vector<uint8_t> get(const std::string& key) override { return pause(), inner_->get(key); }
  int64_t add(const std::string& key, int64_t value) override { return pause(), inner_->add(key, value); }
  bool deleteKey(const std::string& key) override { return pause(), inner_->deleteKey(key); }
  bool check(const std::vector<std::string>& keys) override { return pause(), inner_->check(keys); }
  int64_t getNumKeys() override { return pause(), inner_->getNumKeys(); }
  void wait(const std::vector<std::string>& keys) override { pause(), inner_->wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    pause(), inner_->wait(keys, timeout);
  }

 private:
  void pause() const { std::this_thread::sleep_for(delay_); }
  c10::intrusive_ptr<c10d::Store> inner_;
  std::chrono::milliseconds delay_;
  std::string dropped_;
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

}  // namespace
}  // namespace dkfac::comm
