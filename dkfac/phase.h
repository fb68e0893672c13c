#pragma once

#include <array>
#include <cstddef>
#include <map>
#include <string>

/// The phases of a K-FAC step: what the Preconditioner times (PhaseClock), what strategy auto profiles and
/// calibrates (strategy::ProfiledSteps, strategy::RateScales), and what the front ends report (`dkfac train`'s
/// kfac_time_s, Python's phase_times()). Adding a phase: a line in DKFAC_PHASES, and its use.
namespace dkfac {

// X(enumerator, name, words, what it counts): `name` is what JSON and Python report, `words` what messages say.
#define DKFAC_PHASES(X)                                                                                      \
  X(kFactors, "factors", "factors", "building factors in forward/backward and folding them into running averages") \
  X(kSecondOrder, "second_order", "second order", "eigendecompositions or inverses")                          \
  X(kPrecondition, "precondition", "preconditioning", "V = preconditioned gradients")                         \
  X(kApply, "apply", "applying", "the NaN guard, KL clipping and writing gradients back")                     \
  X(kCommunication, "communication", "communication",                                                         \
    "waiting for K-FAC collectives (factors, second order, V); not in the others")

enum class KfacPhase : size_t {
#define DKFAC_PHASE_ENUMERATOR(id, name, words, doc) id,
  DKFAC_PHASES(DKFAC_PHASE_ENUMERATOR)
#undef DKFAC_PHASE_ENUMERATOR
};

/// How many phases there are.
inline constexpr size_t kPhaseCount = 0
#define DKFAC_PHASE_ONE(id, name, words, doc) +1
    DKFAC_PHASES(DKFAC_PHASE_ONE)
#undef DKFAC_PHASE_ONE
    ;

/// Every phase, in declaration order.
inline constexpr std::array<KfacPhase, kPhaseCount> kAllPhases = {
#define DKFAC_PHASE_LISTED(id, name, words, doc) KfacPhase::id,
    DKFAC_PHASES(DKFAC_PHASE_LISTED)
#undef DKFAC_PHASE_LISTED
};

/// A phase's names: in reports ("factors", "second_order", ...) and in messages ("second order", ...).
struct PhaseNames {
  const char* name;
  const char* words;
};
inline constexpr std::array<PhaseNames, kPhaseCount> kPhaseNames = {{
#define DKFAC_PHASE_NAMES(id, name, words, doc) {name, words},
    DKFAC_PHASES(DKFAC_PHASE_NAMES)
#undef DKFAC_PHASE_NAMES
}};

/// The phase's name in reports: "factors", "second_order", "precondition", "apply", "communication".
constexpr const char* to_string(KfacPhase phase) { return kPhaseNames[static_cast<size_t>(phase)].name; }

/// The phase in messages' words: "second order", "preconditioning", ...
constexpr const char* words(KfacPhase phase) { return kPhaseNames[static_cast<size_t>(phase)].words; }

/// One value per phase, indexed by the phase.
template <typename T>
struct PhaseArray {
  std::array<T, kPhaseCount> values{};

  T& operator[](KfacPhase phase) { return values[static_cast<size_t>(phase)]; }
  const T& operator[](KfacPhase phase) const { return values[static_cast<size_t>(phase)]; }
};

/// Seconds spent in each K-FAC phase. On a CUDA device they are the device's time between CUDA events
/// recorded on the current stream at the phase boundaries (never host time around asynchronous kernels).
struct PhaseTimes : PhaseArray<double> {
  double total() const {
    double sum = 0.0;
    for (const double seconds : values) sum += seconds;
    return sum;
  }
  PhaseTimes& operator+=(const PhaseTimes& other) {
    for (size_t k = 0; k < kPhaseCount; ++k) values[k] += other.values[k];
    return *this;
  }
  /// Seconds by phase name (to_string), every phase: what Python's phase_times() and the metrics print.
  std::map<std::string, double> by_name() const {
    std::map<std::string, double> out;
    for (const auto phase : kAllPhases) out[to_string(phase)] = (*this)[phase];
    return out;
  }
};

}  // namespace dkfac
