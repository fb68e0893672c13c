#pragma once

#include <string>
#include <vector>

#include "dkfac/comm/communicator.h"

/// Whether every rank of a group holds the same description of something (options, layers), checked without
/// any collective that could differ between ranks: a hash of every rank's lines first (one allreduce), the
/// lines themselves only when the hashes differ.
namespace dkfac::comm {

/// `text` (as rank `root` of `group` holds it) on every rank of the group: its length, then its bytes, in two
/// broadcasts (counted under `phase`). Collective over `group`; `root` is a world rank in it.
std::string broadcast_text(Communicator& communicator, GroupId group, int root, const std::string& text,
                           Purpose phase = Purpose::kSetup);

/// The first difference between this rank's `lines` and those of the other ranks of `group`, as every rank
/// sees it ("rank 1 has 'damping=0.01' where rank 0 has 'damping=0.001'"), or "" when all agree. Every rank
/// returns the same text. The lowest rank that differs from the group's first rank is the one named. Costs one
/// allreduce of group size x 4 numbers when the ranks agree; when they differ, a few broadcasts more.
/// Collective over `group` (counted under `phase`).
std::string first_difference(Communicator& communicator, GroupId group, const std::vector<std::string>& lines,
                             Purpose phase = Purpose::kSetup);

/// The lowest rank of the world whose `refusal` is not empty, and that refusal, as "rank 2: <refusal>", on every
/// rank; "" where no rank refused. For a check that one rank may fail before a collective every rank takes (a state
/// dict's validation before its restore): every rank stops together, naming the cause, where the others would wait
/// for the refusing rank in that collective until it was named lost. One allreduce of world size numbers, and two
/// broadcasts where some rank refused. Collective over the world (counted under `phase`).
std::string first_refusal(Communicator& communicator, const std::string& refusal, Purpose phase = Purpose::kControl);

/// True when `flag` is true on every rank of the world: one tiny allreduce (counted under `phase`), so that every
/// rank takes the same branch. Collective over the world.
bool all_true(Communicator& communicator, bool flag, Purpose phase = Purpose::kControl);

}  // namespace dkfac::comm
