#include "tools/train/checkpointer.h"

#include <algorithm>
#include <filesystem>
#include <regex>
#include <sstream>

#include <c10/util/StringUtil.h>

#include "tools/train/checkpoint.h"

namespace dkfac::train {
namespace {

namespace fs = std::filesystem;

// checkpoint.pt (a 1-rank job) or checkpoint-rank<R>.pt; .prev files go with them.
const std::regex kCheckpointName(R"(checkpoint(-rank([0-9]+))?\.pt(\.prev)?)");

// The rank that wrote a checkpoint file of `name` (checkpoint.pt: rank 0 of a 1-rank job; callers pass
// names that match kCheckpointName).
int writer_of(const std::string& name) {
  std::smatch m;
  std::regex_match(name, m, kCheckpointName);
  return m[1].matched ? std::stoi(m[2].str()) : 0;
}

// The world size a set of checkpoint names implies: 1 for checkpoint.pt, else the highest rank + 1.
int world_of(const std::vector<std::string>& names) {
  int world = 0;
  for (const auto& name : names) world = std::max(world, writer_of(name) + 1);
  return world;
}

// The checkpoint files among `candidates` (in their order) that exist and verify, with their global steps, and
// the defects of those that do not, listed and joined with "; ".
struct Verified {
  std::vector<std::string> files;
  std::vector<torch::serialize::InputArchive> archives;
  std::vector<int64_t> steps;
  std::vector<std::string> defects;
  std::string all_defects;
};

Verified read_verified(const std::vector<std::string>& candidates, c10::Device device) {
  Verified v;
  for (const auto& file : candidates) {
    if (!fs::exists(file)) continue;
    try {
      auto archive = load_verified(file, device);
      c10::IValue step;
      TORCH_CHECK(archive.try_read("global_step", step) && step.isInt(), "checkpoint '", file,
                  "' has no 'global_step' entry");
      v.files.push_back(file);
      v.archives.push_back(std::move(archive));
      v.steps.push_back(step.toInt());
    } catch (const c10::Error& e) {
      v.defects.push_back(e.what_without_backtrace());
    }
  }
  for (const auto& d : v.defects) v.all_defects += (v.all_defects.empty() ? "" : "; ") + d;
  return v;
}

}  // namespace

Checkpointer::Checkpointer(std::string dir, int rank, int world, std::shared_ptr<comm::Communicator> communicator)
    : dir_(std::move(dir)), rank_(rank), world_(world), communicator_(std::move(communicator)) {}

std::string Checkpointer::path() const {
  // Each rank keeps its own file: with grad_worker_fraction < 1 ranks hold different K-FAC state.
  return dir_ + (world_ == 1 ? "/checkpoint.pt" : "/checkpoint-rank" + std::to_string(rank_) + ".pt");
}

std::vector<std::string> Checkpointer::existing_files() const {
  std::vector<std::string> names;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(dir_, error)) {
    const auto name = entry.path().filename().string();
    if (std::regex_match(name, kCheckpointName)) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string Checkpointer::open(bool resume, bool overwrite) {
  std::error_code error;
  fs::create_directories(dir_, error);
  TORCH_CHECK(!error, "cannot create --checkpoint-dir '", dir_, "': ", error.message());
  lock_ = tools::FileLock(dir_ + "/.lock-rank" + std::to_string(rank_),
                          "--checkpoint-dir '" + dir_ + "' (rank " + std::to_string(rank_) + ")");
  if (resume) return "";
  const auto names = existing_files();
  if (names.empty()) return "";
  TORCH_CHECK(overwrite, "--checkpoint-dir '", dir_, "' already holds checkpoints (", c10::Join(", ", names),
              "); pass --resume to continue that run, --overwrite to start over and replace them, or another "
              "--checkpoint-dir");
  // Each rank removes its own files (and rank 0 those of ranks this job does not have), so that no stale
  // checkpoint of the old run can be resumed later with this run's.
  int removed = 0;
  for (const auto& name : names) {
    const int owner = writer_of(name);
    const bool mine = owner == rank_ || (rank_ == 0 && owner >= world_);
    if (mine && fs::remove(dir_ + "/" + name, error)) ++removed;
  }
  return "--overwrite: removed " + std::to_string(removed) + " checkpoint file(s) of an earlier run from '" + dir_ + "'";
}

void Checkpointer::save(const std::function<void(torch::serialize::OutputArchive&)>& write) {
  fs::create_directories(dir_);
  const auto file = path();
  // The previous checkpoint stays as .prev: ranks killed while writing a step's checkpoints can then
  // still resume together from the step before. A second link (a copy where links are not supported), so
  // that `file` itself stays in place until save_atomically's rename replaces it.
  if (fs::exists(file)) {
    const auto prev = file + ".prev";
    fs::remove(prev);
    std::error_code linked;
    fs::create_hard_link(file, prev, linked);
    if (linked) fs::copy_file(file, prev);
  }
  save_atomically(file, write);
}

std::optional<Checkpointer::Found> Checkpointer::find(c10::Device device) {
  const auto names = existing_files();
  const int found_world = world_of(names);
  if (found_world != 0 && found_world != world_) return find_other_world(found_world, device);
  // This rank's files that verify, newest first; the defects of those that do not.
  auto [files, archives, steps, defects, all_defects] = read_verified({path(), path() + ".prev"}, device);
  auto found = [&](size_t i) {
    std::string note;
    if (i > 0 || !defects.empty()) {
      note = "passed over " + (defects.empty() ? std::string("the newer ") + path() + " (a step the other ranks lack)"
                                               : all_defects) +
             "; resuming from " + files[i] + " (step " + std::to_string(steps[i]) + ")";
    }
    return Found{files[i], std::move(archives[i]), note};
  };
  const auto unusable = [&] {
    return "no checkpoint of rank " + std::to_string(rank_) + " in '" + dir_ + "' can be resumed: " + all_defects;
  };
  if (!communicator_ || world_ == 1) {
    TORCH_CHECK(!files.empty() || defects.empty(), unusable());
    if (files.empty()) return std::nullopt;
    return found(0);
  }
  // Per rank: step + 1 of its verified files (0: none) and its count of damaged files.
  auto table = torch::zeros({world_, 3}, torch::kInt64);
  for (size_t i = 0; i < steps.size(); ++i) table[rank_][static_cast<int64_t>(i)] = steps[i] + 1;
  table[rank_][2] = static_cast<int64_t>(defects.size());
  communicator_->allreduce_sum(table, comm::kWorld, comm::Purpose::kSetup).wait();
  auto has = [&](int r, int64_t step) {
    return table[r][0].item<int64_t>() == step + 1 || table[r][1].item<int64_t>() == step + 1;
  };
  for (size_t i = 0; i < steps.size(); ++i) {
    bool everywhere = true;
    for (int r = 0; r < world_; ++r) everywhere = everywhere && has(r, steps[i]);
    if (everywhere) return found(i);
  }
  if (table.sum().item<int64_t>() == 0) return std::nullopt;  // no rank has a checkpoint
  TORCH_CHECK(files.size() > 0 || defects.empty(), unusable());
  std::ostringstream list;
  for (int r = 0; r < world_; ++r) {
    list << (r ? "; " : "") << "rank " << r << ":";
    for (int i = 0; i < 2; ++i) {
      const auto v = table[r][i].item<int64_t>();
      if (v > 0) list << " step " << v - 1;
    }
  }
  TORCH_CHECK(false, "the ranks' checkpoints in '", dir_, "' have no step in common (", list.str(),
              "); resume needs a checkpoint of the same step on every rank");
}

std::optional<Checkpointer::Found> Checkpointer::find_other_world(int found_world, c10::Device device) {
  // Rank 0's files of either naming (a job resumed on another world size writes the other one until
  // remove_other_worlds()), newest step first; each holds the whole state.
  std::vector<std::string> candidates;
  for (const char* name : {"checkpoint.pt", "checkpoint.pt.prev", "checkpoint-rank0.pt", "checkpoint-rank0.pt.prev"}) {
    candidates.push_back(dir_ + "/" + name);
  }
  auto [files, archives, steps, defects, all_defects] = read_verified(candidates, device);
  TORCH_CHECK(!files.empty(), "--checkpoint-dir '", dir_, "' holds the checkpoints of a ", found_world,
              "-rank job, but no rank 0 checkpoint there can be resumed",
              all_defects.empty() ? std::string(" (none found: rank 0's files are the ones a job on another "
                                                "number of ranks resumes from)")
                                  : ": " + all_defects);
  const size_t newest = static_cast<size_t>(std::max_element(steps.begin(), steps.end()) - steps.begin());
  if (communicator_ && world_ > 1) {
    // Every rank must have read the same file: the directory is shared by this job's ranks.
    auto chosen = torch::zeros({world_}, torch::kInt64);
    chosen[rank_] = steps[newest];
    communicator_->allreduce_sum(chosen, comm::kWorld, comm::Purpose::kSetup).wait();
    const auto lowest = chosen.min().item<int64_t>();
    const auto highest = chosen.max().item<int64_t>();
    TORCH_CHECK(lowest == highest, "resuming the ", found_world, "-rank job in '", dir_, "' on ", world_,
                " ranks: the ranks found different newest rank 0 checkpoints (steps ", lowest, " to ", highest,
                "); every rank must see the same --checkpoint-dir");
  }
  std::string note;
  if (!defects.empty()) note = "passed over " + all_defects + "; resuming from " + files[newest];
  return Found{files[newest], std::move(archives[newest]), note, /*other_world=*/true};
}

int Checkpointer::remove_other_worlds() {
  int removed = 0;
  std::error_code error;
  for (const auto& name : existing_files()) {
    const bool single = name.rfind("checkpoint.pt", 0) == 0;
    const bool foreign = world_ > 1 ? single : !single;
    const bool beyond = !single && writer_of(name) >= world_;
    if ((foreign || beyond) && fs::remove(dir_ + "/" + name, error)) ++removed;
  }
  return removed;
}

}  // namespace dkfac::train
