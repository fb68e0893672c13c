#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include <c10/util/intrusive_ptr.h>

namespace c10d {
class Store;
}  // namespace c10d

namespace dkfac::comm {

/// The lost-rank watchdog of a Communicator: every rank publishes a heartbeat in the rendezvous store from
/// a thread (every min(1 s, timeout / 10), at least 50 ms) and watches the others'. A rank silent for the
/// timeout, or a store (hosted by rank 0) that stopped answering, is reported once through the
/// `on_lost_rank` callback; a failed collective asks `diagnose()` which ranks went silent. The first rank
/// to diagnose a loss publishes it in the store and the others report that diagnosis, so that every rank
/// names the rank lost first.
///
/// Internal: users reach it through Communicator (on_lost_rank, silent_ranks, diagnose_failure).
class Heartbeat {
 public:
  /// Starts the thread. `store` is used by that thread alone (a TCPStore client of its own, so that a
  /// blocking store call of the main thread never delays a beat); keys are "dkfac/heartbeat/<rank>",
  /// "dkfac/lost" and "dkfac/done/<rank>" within it. `store_address` names the store in messages.
  Heartbeat(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::chrono::milliseconds timeout,
            std::string store_address);
  /// Stops the thread (see stop()).
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  /// Stops and joins the thread; idempotent. After a failed collective it first publishes this rank's
  /// diagnosis (and rank 0 keeps the store up a little for the others); after a clean run every rank marks
  /// itself done and rank 0 waits (bounded) for the others before the store goes away.
  void stop();

  /// The ranks whose heartbeat has not moved for `silent_for`, as "rank 2 (no heartbeat for 3.1 s)",
  /// the longest silent first, comma-separated; empty when every rank is alive.
  std::string silent_ranks(std::chrono::milliseconds silent_for) const;

  /// Called once, from the heartbeat thread, with "rank R lost <diagnosis>" when a loss is seen.
  void on_lost_rank(std::function<void(const std::string&)> callback);

  /// After a failed collective: names the ranks that did not beat in the store rounds after it (about
  /// two beat intervals, longer when the rounds run slow), or the diagnosis another rank published first;
  /// empty when none went silent.
  std::string diagnose();

  /// The beat interval for a collective timeout: min(1 s, timeout / 10), at least 50 ms.
  static std::chrono::milliseconds interval_for(std::chrono::milliseconds timeout);

 private:
  struct State;
  std::shared_ptr<State> state_;  // shared with a store round that never returned (see heartbeat.cpp)
};

}  // namespace dkfac::comm
