// The heartbeat watchdog of a Communicator; talks to the rendezvous store through c10d::Store.
#include "dkfac/comm/heartbeat.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <condition_variable>
#include <iomanip>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

namespace dkfac::comm {

// Heartbeats through the store. The thread owns its own store client where the store is a TCPStore, so
// that a blocking store call of the main thread (group creation) never delays a heartbeat; only this
// thread touches that client.
//
// A store call can block for good: torch 2.x's TCPStore client waits for an answer without a timeout
// (check() did not return within 60 s once the store's host stopped answering). So each round with the
// store runs on a thread of its own, and the watchdog waits for it at most the timeout: a round that does
// not return is left behind (it holds the state alive) and counts as the store having stopped answering.
//
// The first rank to diagnose a loss publishes it under kLostKey, and every other rank reports that
// diagnosis instead of its own: when rank 3 dies and rank 0 stops because of it, rank 1 must still say
// "lost rank 3", not "lost rank 0". Rank 0 hosts the store, so after a loss it lingers until the other
// ranks have stopped beating (they have read the diagnosis) or a few intervals have passed.
struct Heartbeat::State : std::enable_shared_from_this<Heartbeat::State> {
  using Clock = std::chrono::steady_clock;
  static constexpr const char* kLostKey = "dkfac/lost";
  c10::intrusive_ptr<c10d::Store> store;
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds interval{1000};
  std::chrono::milliseconds timeout{60000};
  std::string store_address;  // for messages

  std::mutex mutex;
  std::condition_variable wake;
  bool stopping = false;
  std::vector<std::string> last_value;
  std::vector<Clock::time_point> last_change;
  std::vector<int64_t> change_round;  // the store round that last saw each rank's heartbeat change
  int64_t rounds_done = 0;
  Clock::time_point round_start;      // of the last round that returned
  Clock::duration round_time{0};      // how long it took
  // A diagnosis under way (diagnose()): the first round that started after the failure, and when it ended.
  std::optional<Clock::time_point> failure_time;
  int64_t failure_round = 0;
  Clock::time_point failure_round_end;
  std::string store_error;
  std::string remote_lost;  // another rank's published diagnosis, "rank 3 (...) (reported by rank 0)"
  std::string to_publish;   // this rank's diagnosis, written to the store by the thread
  bool published = false;
  bool failure_seen = false;
  std::function<void(const std::string&)> on_lost;
  bool reported = false;
  bool round_running = false;  // a store round has not returned yet
  bool store_stuck = false;    // one never returned within the timeout: no further store calls
  std::thread thread;

  static std::string key(int r) { return "dkfac/heartbeat/" + std::to_string(r); }
  static std::vector<uint8_t> bytes(const std::string& text) { return {text.begin(), text.end()}; }

  void start() {
    last_value.assign(size, "");
    last_change.assign(size, Clock::now());
    change_round.assign(size, 0);
    thread = std::thread([this] { run(); });
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stopping = true;
    }
    wake.notify_all();
    if (thread.joinable()) thread.join();
  }

  // One round with the store, without the lock: publish a pending diagnosis, beat, read the others'
  // heartbeats and any published diagnosis; then record what was seen.
  void poll(int64_t beat) {
    const auto started = Clock::now();
    std::string publish_now;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (!to_publish.empty() && !published) publish_now = to_publish;
      published = published || !publish_now.empty();
    }
    std::string error, lost_value;
    std::vector<std::string> seen(size);
    try {
      if (!publish_now.empty() && !store->check({kLostKey})) {
        store->set(kLostKey, bytes(std::to_string(rank) + "|" + publish_now));
      }
      store->set(key(rank), bytes(std::to_string(beat)));
      for (int r = 0; r < size; ++r) {
        if (r == rank || !store->check({key(r)})) continue;
        const auto value = store->get(key(r));
        seen[r] = std::string(value.begin(), value.end());
      }
      if (store->check({kLostKey})) {
        const auto value = store->get(kLostKey);
        lost_value.assign(value.begin(), value.end());
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
    std::lock_guard<std::mutex> lock(mutex);
    const auto now = Clock::now();
    if (!error.empty() && store_error.empty()) store_error = error;
    ++rounds_done;
    round_start = started;
    round_time = now - started;
    if (failure_time && failure_round == 0 && started >= *failure_time) {
      failure_round = rounds_done;
      failure_round_end = now;
    }
    for (int r = 0; r < size; ++r) {
      if (r == rank || seen[r].empty() || seen[r] == last_value[r]) continue;
      last_value[r] = seen[r];
      last_change[r] = now;
      change_round[r] = rounds_done;
    }
    const auto bar = lost_value.find('|');
    if (bar != std::string::npos && remote_lost.empty() && lost_value.substr(0, bar) != std::to_string(rank)) {
      remote_lost = lost_value.substr(bar + 1) + " (reported by rank " + lost_value.substr(0, bar) + ")";
      failure_seen = true;
    }
    wake.notify_all();
  }

  // How long rank 0 keeps the store up for the others, after a loss or at a clean end.
  Clock::time_point grace_deadline() const {
    return Clock::now() + std::max<Clock::duration>(std::chrono::seconds(2), 5 * interval);
  }

  // Rank 0 after a loss: keeps the store up until every other rank has stopped beating or a few intervals
  // (at least 2 s) have passed, so that the others can read the published diagnosis.
  void linger(int64_t& beat) {
    const auto deadline = grace_deadline();
    while (Clock::now() < deadline) {
      poll(++beat);
      {
        std::lock_guard<std::mutex> lock(mutex);
        const auto now = Clock::now();
        bool all_quiet = true;
        for (int r = 0; r < size; ++r) all_quiet = all_quiet && (r == rank || now - last_change[r] >= 2 * interval);
        if (all_quiet) return;
      }
      std::this_thread::sleep_for(interval / 2);
    }
  }

  // How long stop() waits for a store round in flight: a round that answers takes milliseconds.
  std::chrono::milliseconds stop_grace() const {
    return std::min(timeout, std::max<std::chrono::milliseconds>(std::chrono::seconds(2), 5 * interval));
  }

  // poll(beat) on its own thread, waited for at most the timeout (with `lock` held on entry and return).
  // A round that does not return sets store_error, and no round is started after it.
  //
  // stop() also waits for the round in flight (at most stop_grace()): a round left behind at a clean end
  // would still be calling the store client while the process exits and tears down what that client uses
  // (a worker aborted with "malloc(): unaligned tcache chunk detected" at its exit in CI), and would skip
  // finish(), so that the other ranks could take the end for a lost rank 0.
  void bounded_poll(int64_t beat, std::unique_lock<std::mutex>& lock) {
    if (store_stuck) return;
    round_running = true;
    std::thread round([self = shared_from_this(), beat] {
      self->poll(beat);
      std::lock_guard<std::mutex> guard(self->mutex);
      self->round_running = false;
      self->wake.notify_all();
    });
    const auto deadline = Clock::now() + timeout;
    wake.wait_until(lock, deadline, [this] { return !round_running || stopping; });
    if (round_running && stopping) {
      wake.wait_until(lock, std::min(deadline, Clock::now() + stop_grace()), [this] { return !round_running; });
    }
    if (!round_running) {
      lock.unlock();  // the round's last step takes the lock
      round.join();
      lock.lock();
      return;
    }
    round.detach();
    store_stuck = true;  // the round did not return in time: it is left behind (it holds the state alive)
    if (!stopping && store_error.empty()) {
      std::ostringstream out;
      out << "no answer for " << std::fixed << std::setprecision(1)
          << std::chrono::duration<double>(timeout).count() << " s";
      store_error = out.str();
    }
  }

  void run() {
    int64_t beat = 0;
    std::unique_lock<std::mutex> lock(mutex);
    while (!stopping) {
      bounded_poll(++beat, lock);
      std::string lost;
      if (!remote_lost.empty()) {
        lost = remote_lost;
      } else if (!store_error.empty() && rank != 0) {
        lost = "rank 0 (the rendezvous store it hosts at " + store_address + " stopped answering: " + store_error + ")";
      } else {
        lost = silent_locked(timeout, Clock::now());
        if (!lost.empty() && to_publish.empty()) to_publish = lost;
      }
      if (!lost.empty() && !reported && on_lost && !stopping) {
        reported = true;
        failure_seen = true;
        auto callback = on_lost;
        // Publish this rank's own diagnosis before the callback ends the process; not through a store that
        // already failed, whose every call waits for the timeout again.
        const bool publish = !to_publish.empty() && !published && store_error.empty();
        if (publish) bounded_poll(++beat, lock);
        lock.unlock();
        if (rank == 0) linger(beat);
        callback("rank " + std::to_string(rank) + " lost " + lost);
        lock.lock();
      }
      wake.wait_for(lock, interval, [this] { return stopping; });
    }
    // Stopping after a failed collective: publish the diagnosis and, on rank 0, keep the store up a little.
    const bool after_failure = failure_seen && !reported;
    const bool publish = after_failure && !to_publish.empty() && !published && store_error.empty();
    if (publish) bounded_poll(++beat, lock);
    const bool store_usable = !store_stuck;
    lock.unlock();
    if (after_failure && rank == 0) linger(beat);
    if (!after_failure && !reported && store_usable) finish();
  }

  // A clean shutdown: every rank marks itself done, and rank 0, which hosts the store, keeps it up until
  // all have (at most max(2 s, 5 intervals)), so that no rank's last heartbeat finds the store gone and
  // takes a finished job for a lost rank 0.
  void finish() {
    try {
      store->set("dkfac/done/" + std::to_string(rank), bytes("1"));
      if (rank != 0) return;
      const auto deadline = grace_deadline();
      for (int r = 1; r < size; ++r) {
        while (!store->check({"dkfac/done/" + std::to_string(r)})) {
          if (Clock::now() >= deadline) return;
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      }
    } catch (const std::exception&) {
      // The store is gone or unreachable: nothing left to coordinate.
    }
  }

  // "rank 2 (no heartbeat for 5.8 s), rank 1 (...)": the longest silent first, which is the rank that was
  // lost first when the others stopped because of it.
  std::string describe(std::vector<int> ranks, Clock::time_point now) const {
    std::stable_sort(ranks.begin(), ranks.end(), [this](int a, int b) { return last_change[a] < last_change[b]; });
    std::ostringstream out;
    for (int r : ranks) {
      out << (out.tellp() > 0 ? ", " : "") << "rank " << r << " (no heartbeat for " << std::fixed
          << std::setprecision(1) << std::chrono::duration<double>(now - last_change[r]).count() << " s)";
    }
    return out.str();
  }

  std::string silent_locked(std::chrono::milliseconds silent_for, Clock::time_point now) const {
    std::vector<int> silent;
    for (int r = 0; r < size; ++r) {
      if (r != rank && now - last_change[r] >= silent_for) silent.push_back(r);
    }
    return describe(silent, now);
  }

  // After a failed collective: names the ranks whose heartbeat did not change between the first store
  // round that started after the failure and a round that started long enough after it, or the diagnosis
  // another rank published first. The result is published for the other ranks.
  //
  // Long enough: a live rank beats at most an interval plus its own round with the store apart. The span
  // allows its rounds to take twice as long as this rank's, and half an interval of scheduling delay. The
  // span is counted between this rank's own reads, not on the clock: a fixed window of three intervals did
  // not hold on a loaded machine, where this rank's rounds ran late, no read fell into the window, and a
  // live rank was named lost with the dead one. Each round is bounded by the timeout (a round that does not
  // return sets store_error), so the wait is too; past 4 timeouts the rule falls back to the clock.
  std::string diagnose() {
    const auto since = Clock::now();
    const auto deadline = since + 3 * interval + 4 * timeout;
    std::unique_lock<std::mutex> lock(mutex);
    failure_seen = true;
    if (!failure_time) failure_time = since;
    const auto decided = [&] {
      if (stopping || !remote_lost.empty() || !store_error.empty()) return true;
      const auto span = interval + interval / 2 + 2 * round_time;
      return failure_round != 0 && round_start >= failure_round_end + span;
    };
    while (!decided() && Clock::now() < deadline) wake.wait_until(lock, std::min(deadline, Clock::now() + interval));
    if (!remote_lost.empty()) return remote_lost;
    if (!store_error.empty() && rank != 0) return "rank 0 (its rendezvous store stopped answering)";
    std::vector<int> silent;
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      const bool beat = failure_round != 0 ? change_round[r] > failure_round : last_change[r] > since + interval;
      if (!beat) silent.push_back(r);
    }
    auto found = describe(silent, Clock::now());
    if (!found.empty() && to_publish.empty()) to_publish = found;
    wake.notify_all();
    return found;
  }
};

Heartbeat::Heartbeat(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::chrono::milliseconds timeout,
                     std::string store_address)
    : state_(std::make_shared<State>()) {
  state_->store = std::move(store);
  state_->rank = rank;
  state_->size = size;
  state_->timeout = timeout;
  state_->interval = interval_for(timeout);
  state_->store_address = std::move(store_address);
  state_->start();
}

Heartbeat::~Heartbeat() { stop(); }

void Heartbeat::stop() { state_->stop(); }

std::chrono::milliseconds Heartbeat::interval_for(std::chrono::milliseconds timeout) {
  return std::max(std::chrono::milliseconds(50), std::min(std::chrono::milliseconds(1000), timeout / 10));
}

std::string Heartbeat::silent_ranks(std::chrono::milliseconds silent_for) const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->silent_locked(silent_for, State::Clock::now());
}

void Heartbeat::on_lost_rank(std::function<void(const std::string&)> callback) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->on_lost = std::move(callback);
}

std::string Heartbeat::diagnose() { return state_->diagnose(); }

}  // namespace dkfac::comm
