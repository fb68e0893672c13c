#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "dkfac/comm/communicator.h"
#include "tools/common/file_lock.h"

/// The checkpoint files of one rank of a `dkfac train` job in --checkpoint-dir, and the rules around
/// them: one job per directory (a lock), nothing replaced without --resume or --overwrite, the previous
/// checkpoint kept as `.prev`, resume from the newest checkpoint that verifies on every rank. A directory
/// of a job of another number of ranks resumes from that job's rank 0 file, which holds the whole state
/// (the model, the optimizer and every layer's K-FAC state, whatever the world size), on every rank.
namespace dkfac::train {

class Checkpointer {
 public:
  /// A checkpoint chosen for resuming, read and verified.
  struct Found {
    std::string path;
    torch::serialize::InputArchive archive;
    std::string note;  ///< non-empty when a damaged newer file was passed over (say so)
    /// True when it is the rank 0 file of a job of another number of ranks, read by every rank of this one.
    bool other_world = false;
  };

  /// Rank `rank` of `world`; `communicator` (null in a single process) lets the ranks agree on a step.
  Checkpointer(std::string dir, int rank, int world, std::shared_ptr<comm::Communicator> communicator);

  /// Locks this rank's files against a second job. A fresh run (not `resume`) refuses a directory that
  /// holds checkpoints unless `overwrite`, which removes them (every rank its own). Returns a line to
  /// log, or "".
  std::string open(bool resume, bool overwrite);

  /// This rank's checkpoint file.
  std::string path() const;

  /// Writes a checkpoint atomically; the one it replaces stays as `.prev`.
  void save(const std::function<void(torch::serialize::OutputArchive&)>& write);

  /// The checkpoint to resume from: with several ranks, the newest step for which every rank has a
  /// checkpoint that verifies (its newest or `.prev`). When the directory's files are another world size's
  /// (their names say so), every rank takes the newest rank 0 file that verifies, `checkpoint.pt` or
  /// `checkpoint-rank0.pt` (or their `.prev`), with other_world set: the directory must be shared by this
  /// job's ranks. nullopt: the directory holds no checkpoint (a first run). Throws c10::Error when no file
  /// verifies (naming each file's defect), or when the ranks have no step in common. The archive's tensors
  /// are on `device`, whatever device wrote them.
  std::optional<Found> find(c10::Device device = c10::kCPU);

  /// Removes the files of another world size's job (names this job's ranks do not write: `checkpoint.pt`
  /// in a job of several ranks, `checkpoint-rank<R>.pt` for R >= world otherwise, with their `.prev`),
  /// once this job's ranks have all written theirs after resuming from them (rank 0 alone calls it), so
  /// that a later resume cannot mix the two jobs' files. Returns how many were removed.
  int remove_other_worlds();

 private:
  /// The checkpoint files (not .prev) in the directory, by the world size their names say.
  std::vector<std::string> existing_files() const;
  /// find() on a directory of another world size's checkpoints: the newest verified rank 0 file.
  std::optional<Found> find_other_world(int found_world, c10::Device device);

  std::string dir_;
  int rank_;
  int world_;
  std::shared_ptr<comm::Communicator> communicator_;
  tools::FileLock lock_;
};

}  // namespace dkfac::train
