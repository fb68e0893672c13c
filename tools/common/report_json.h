#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "dkfac/phase.h"
#include "dkfac/strategy/prediction.h"
#include "dkfac/strategy/rates.h"
#include "dkfac/strategy/time_model.h"

/// The JSON of the core's reports, one function per type, as nlohmann's to_json / from_json (so that
/// `nlohmann::json j = rates;` and `j.get<strategy::Rates>()` work). The core has no JSON dependency; the
/// command line, its metrics and `dkfac plan` write these and nothing else writes them.
namespace dkfac {

/// Seconds per K-FAC phase by name, and "total": metrics format 3's kfac_time_s (tools/train/metrics.h).
void to_json(nlohmann::json& json, const PhaseTimes& times);

namespace strategy {

/// Every field of Rates ("format": "dkfac rates 1"; seconds, bytes, FLOPs). from_json requires every field and
/// throws c10::Error naming a missing or invalid one, then Rates::validate()s.
void to_json(nlohmann::json& json, const Rates& rates);
void from_json(const nlohmann::json& json, Rates& rates);

/// One rank's predicted bytes, memory and FLOPs (strategy::predict), under RankCost's field names.
void to_json(nlohmann::json& json, const RankCost& cost);

/// Seconds per phase of the rank slowest at it, under PhaseSeconds' field names.
void to_json(nlohmann::json& json, const PhaseSeconds& seconds);

/// A candidate of strategy auto: name, strategy, grad_worker_fraction, grad_workers, symmetric_comm,
/// redundant_dim, step_seconds, max_over_ranks_seconds (PhaseSeconds), memory_bytes, fits.
void to_json(nlohmann::json& json, const Candidate& candidate);

}  // namespace strategy

/// The Rates in the JSON file at `path`; errors name `flag` (the flag that gave the path) and the file.
strategy::Rates read_rates(const std::string& path, const std::string& flag);

}  // namespace dkfac
