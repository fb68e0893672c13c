#include "dkfac/phase_clock.h"

#include <algorithm>
#include <iterator>

namespace dkfac {

PhaseTimes PhaseClock::resolve(std::vector<Timed>::const_iterator begin, std::vector<Timed>::const_iterator end) {
  PhaseTimes times;
  for (auto s = begin; s != end; ++s) times[s->phase] += s->sign * device::Mark::seconds_between(s->start, s->end);
  return times;
}

void PhaseClock::close_step() {
  // The step before the last joins the total once the device has reached it (CPU: at once); waiting only
  // when too many are left (a loop that never synchronises).
  older_.insert(older_.end(), std::make_move_iterator(last_spans_.begin()), std::make_move_iterator(last_spans_.end()));
  total_ += last_seconds_;
  last_spans_ = std::exchange(spans_, {});
  last_seconds_ = std::exchange(seconds_, {});
  constexpr size_t kMostUnresolved = 4096;
  const auto unreached = older_.size() > kMostUnresolved
                             ? older_.end()
                             : std::find_if(older_.begin(), older_.end(), [](const Timed& t) { return !t.end.reached(); });
  total_ += resolve(older_.begin(), unreached);
  older_.erase(older_.begin(), unreached);
}

PhaseTimes PhaseClock::last_step() const {
  PhaseTimes times = resolve(last_spans_.begin(), last_spans_.end());
  times += last_seconds_;
  return times;
}

PhaseTimes PhaseClock::total() const {
  total_ += resolve(older_.begin(), older_.end());
  older_.clear();
  PhaseTimes times = total_;
  times += last_step();
  return times;
}

}  // namespace dkfac
