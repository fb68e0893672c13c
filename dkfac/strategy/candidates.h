#pragma once

#include <string>
#include <vector>

#include "dkfac/options.h"

/// The strategies a job could run, each with its one name: what strategy auto chooses among (choose_strategy,
/// time_model.h) and what `dkfac plan` prints.
namespace dkfac::strategy {

/// One strategy a job could run.
struct NamedOptions {
  std::string name;  ///< "kaisa f=1/2 (W=2)", "kaisa f=1 (W=4) triangles", "spd", "dp", "owner (kaisa, W=2)", ...
  Options options;   ///< the base options with this strategy, grad_worker_fraction, symmetric_comm and placement
};

/// Which strategies candidates() lists.
struct CandidateSpace {
  /// KAISA's numbers of grad workers W, each dividing the world size, in this order (repeats listed once);
  /// empty: every divisor, largest first.
  std::vector<int> grad_workers;
  /// Each KAISA W with full matrices and with upper triangles (symmetric_comm), as strategy auto searches;
  /// false: the base options' symmetric_comm only.
  bool both_layouts = true;
  /// Every layer sharded by rows over groups of this many ranks (FSDP: the world; HSDP: world / replicas): the
  /// strategies above in the replicated placement (named ", replicated"), then the owner placements, KAISA with
  /// one grad worker per replica and, on a 1-D mesh, DP-KFAC. 0: not sharded (DDP).
  int shard_ranks = 0;
};

/// The candidates for a job of `world_size` ranks, each `base` with its strategy set: KAISA at each W of `space`
/// (f = W / P), SPD-KFAC (not under unused_layer_policy skip: it reduces factors from the capture hooks, which
/// ranks that skip a layer never call alike), DP-KFAC, then `space`'s owner placements. Names say what runs:
/// "kaisa f=1/2 (W=2)" plus " triangles" with symmetric_comm, "spd" (SPD-KFAC with its threshold measured) or
/// "spd (redundant dim <= 64)", "dp". Throws c10::Error for a W that does not divide the world size.
std::vector<NamedOptions> candidates(int world_size, const Options& base, const CandidateSpace& space = {});

}  // namespace dkfac::strategy
