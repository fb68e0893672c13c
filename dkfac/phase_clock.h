#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include <c10/core/Device.h>

#include "dkfac/device.h"
#include "dkfac/phase.h"

namespace dkfac {

/// The clock of the Preconditioner's phases: spans between device marks (CUDA events on the current stream, or
/// the host clock on the CPU), resolved into PhaseTimes only when read, so that a step never waits for the device
/// to be timed. A collective's time counts as communication and is taken out of the phase that ran it.
class PhaseClock {
 public:
  explicit PhaseClock(c10::Device device = c10::kCPU) : device_(device) {}

  /// Records the time from its construction to its end as `phase` of this step.
  class Span {
   public:
    Span(PhaseClock& clock, KfacPhase phase) : clock_(clock), phase_(phase), start_(device::Mark::now(clock.device_)) {}
    ~Span() { clock_.add(phase_, std::move(start_), device::Mark::now(clock_.device_)); }
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;

   private:
    PhaseClock& clock_;
    KfacPhase phase_;
    device::Mark start_;
  };

  /// While it lives, the clock's marks are the host's and what it records is dropped at its end: a CUDA graph's
  /// capture (device::Graph), in which nothing runs and no event can be timed.
  class Paused {
   public:
    explicit Paused(PhaseClock& clock)
        : clock_(clock), device_(clock.device_), spans_(clock.spans_.size()), seconds_(clock.seconds_) {
      clock.device_ = c10::Device(c10::kCPU);
    }
    ~Paused() {
      clock_.device_ = device_;
      clock_.spans_.erase(clock_.spans_.begin() + static_cast<std::ptrdiff_t>(spans_), clock_.spans_.end());
      clock_.seconds_ = seconds_;
    }
    Paused(const Paused&) = delete;
    Paused& operator=(const Paused&) = delete;

   private:
    PhaseClock& clock_;
    c10::Device device_;
    size_t spans_;
    PhaseTimes seconds_;
  };
  /// Runs `collective` inside `phase`, counting its time as communication and not as `phase`.
  template <typename F>
  void collective(KfacPhase phase, F&& run) {
    auto start = device::Mark::now(device_);
    std::forward<F>(run)();
    auto end = device::Mark::now(device_);
    spans_.push_back({KfacPhase::kCommunication, 1.0, start, end});
    spans_.push_back({phase, -1.0, std::move(start), std::move(end)});
  }
  /// Runs `run` outside every phase and returns what it returns, counting its time as communication (a front
  /// end's collectives around the step).
  template <typename F>
  auto communication(F&& run) {
    auto start = device::Mark::now(device_);
    auto result = std::forward<F>(run)();
    spans_.push_back({KfacPhase::kCommunication, 1.0, std::move(start), device::Mark::now(device_)});
    return result;
  }
  /// `phase` of this step ran from `start` to `end` (e.g. a capture's device marks).
  void add(KfacPhase phase, device::Mark start, device::Mark end) {
    spans_.push_back({phase, 1.0, std::move(start), std::move(end)});
  }
  /// `seconds` of `phase` this step, measured as such (host-timed captures).
  void add_seconds(KfacPhase phase, double seconds) { seconds_[phase] += seconds; }

  /// Ends the step: its spans become the last step's; the step before joins the total once the device reached it.
  void close_step();
  /// The last closed step's times (waits for its marks on a device).
  PhaseTimes last_step() const;
  /// Every closed step's times.
  PhaseTimes total() const;

 private:
  struct Timed {
    KfacPhase phase;
    double sign;  // -1 takes a collective's time out of its enclosing phase
    device::Mark start;
    device::Mark end;
  };
  static PhaseTimes resolve(std::vector<Timed>::const_iterator begin, std::vector<Timed>::const_iterator end);

  c10::Device device_;
  std::vector<Timed> spans_;          // this step's
  PhaseTimes seconds_;                // this step's time given as seconds
  std::vector<Timed> last_spans_;     // the last step's, resolved when read
  PhaseTimes last_seconds_;
  mutable std::vector<Timed> older_;  // earlier steps' not yet resolved into total_
  mutable PhaseTimes total_;          // resolved spans of the steps before the last
};

}  // namespace dkfac
