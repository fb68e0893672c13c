// Preconditioner's archive: save and load (format 2, every layer's whole state, world-size independent),
// the state a checkpoint reader fills in place (state_template) and what the plan places on this rank.
#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "dkfac/preconditioner.h"

#include "dkfac/comm/agreement.h"

namespace dkfac {
namespace {

constexpr int64_t kFormatVersion = 2;  // every layer's whole state, world-size independent

bool is_factor_key(const std::string& key) {
  const auto* entry = layer_state_entry(key);  // an unknown key is refused by KfacLayer::load_state
  return entry != nullptr && entry->factor;
}

// An integer entry of a preconditioner archive, or a refusal naming it.
int64_t read_int(torch::serialize::InputArchive& archive, const std::string& key, const std::string& where) {
  c10::IValue value;
  TORCH_CHECK(archive.try_read(key, value) && value.isInt(), "dkfac preconditioner checkpoint", where,
              " has no integer '", key, "' entry: the archive is damaged");
  return value.toInt();
}

std::string read_string(torch::serialize::InputArchive& archive, const std::string& key, const std::string& where) {
  c10::IValue value;
  TORCH_CHECK(archive.try_read(key, value) && value.isString(), "dkfac preconditioner checkpoint", where,
              " has no '", key, "' entry: the archive is damaged");
  return value.toStringRef();
}

// FNV-1a over 8-byte words of the archive's header values and of every layer's name and tensors (key, dtype, shape,
// bytes): torch's zip reader does not check its records, so a changed byte in a tensor used to load as a changed
// value. Written as the archive's "checksum"; an archive without one (written before 2026-11-30) is not checked.
class Checksum {
 public:
  void add(const void* data, size_t size) {
    const auto* bytes = static_cast<const unsigned char*>(data);
    size_t i = 0;
    for (; i + 8 <= size; i += 8) {
      uint64_t word = 0;
      std::memcpy(&word, bytes + i, 8);
      mix(word);
    }
    uint64_t tail = 0;
    if (size > i) std::memcpy(&tail, bytes + i, size - i);
    mix(tail ^ (static_cast<uint64_t>(size) << 56));
  }
  void add(int64_t v) { add(&v, sizeof v); }
  void add(const std::string& text) { add(text.data(), text.size()); }
  void add(const torch::Tensor& t) {
    const auto bytes = t.detach().to(torch::kCPU).contiguous();
    add(static_cast<int64_t>(bytes.scalar_type()));
    for (const auto size : bytes.sizes()) add(size);
    add(bytes.data_ptr(), bytes.nbytes());
  }
  int64_t value() const { return static_cast<int64_t>(hash_); }

 private:
  void mix(uint64_t word) {
    hash_ ^= word;
    hash_ *= 1099511628211ULL;
  }
  uint64_t hash_ = 1469598103934665603ULL;
};

// The checksum of what an archive holds (save writes it, load compares).
// `named`: the model's layers, whose names the archive holds (load checks them equal before).
int64_t archive_checksum(int64_t steps, int64_t world_size, const std::string& plan, int64_t method,
                         const std::vector<KfacLayer>& named,
                         const std::vector<std::map<std::string, torch::Tensor>>& layers) {
  Checksum sum;
  for (const int64_t v : {steps, static_cast<int64_t>(layers.size()), world_size, method}) sum.add(v);
  sum.add(plan);
  for (size_t i = 0; i < layers.size(); ++i) {
    sum.add(named[i].name());
    for (const auto& [key, tensor] : layers[i]) {
      sum.add(key);
      sum.add(tensor);
    }
  }
  return sum.value();
}

// Each rank's own part of a state handed to another plan (a rank's own DP-KFAC state loaded under strategy auto's
// provisional plan, or another strategy, on as many ranks): every part a rank keeps but was not handed is sent to
// it by the lowest rank that was, so that the ranks' own states together resume as the whole one. Collective: one
// allreduce of how many ranks lack each part and of the ranks' step counts (layers x entries + ranks numbers);
// where some part is lacking, one of who holds those parts, then their broadcasts. A part held in another shape is
// not sent (its holder refuses it after). Ranks handed states of different steps are refused, on every rank.
void take_parts_from_other_ranks(comm::Communicator& communicator, const std::vector<KfacLayer>& layers,
                                 SavedState& saved, const std::vector<std::map<std::string, torch::Tensor>>& wanted,
                                 const std::function<bool(size_t, const std::string&)>& blank) {
  const auto& entries = layer_state_entries();
  const auto parts = static_cast<int64_t>(layers.size() * entries.size());
  const int64_t ranks = communicator.size();
  const int64_t rank = communicator.rank();
  const auto device = communicator.control_device();
  const auto key_of = [&](int64_t k) { return std::string(entries[static_cast<size_t>(k) % entries.size()].key); };
  const auto layer_of = [&](int64_t k) { return static_cast<size_t>(k) / entries.size(); };
  // A part this rank holds in the layer's shape: sendable.
  const auto holds = [&](int64_t k) {
    const auto& mine = saved.layers[layer_of(k)];
    const auto it = mine.find(key_of(k));
    const auto shape = layers[layer_of(k)].state_shape(entries[static_cast<size_t>(k) % entries.size()]);
    return it != mine.end() && !shape.empty() && it->second.sizes().vec() == shape;
  };
  const auto lacks = [&](int64_t k) {
    const auto key = key_of(k);
    return saved.layers[layer_of(k)].count(key) == 0 && wanted[layer_of(k)].count(key) > 0 && !blank(layer_of(k), key);
  };
  // How many ranks lack each part; then each rank's step count.
  auto table = torch::zeros({parts + ranks}, torch::kFloat64);
  auto cell = table.accessor<double, 1>();
  for (int64_t k = 0; k < parts; ++k) cell[k] = lacks(k) ? 1.0 : 0.0;
  cell[parts + rank] = static_cast<double>(saved.steps);
  auto summed = table.to(device);
  communicator.allreduce_sum(summed, comm::kWorld, comm::Purpose::kSetup).wait();
  table = summed.cpu();
  cell = table.accessor<double, 1>();
  std::string steps;  // every rank's step count, said where they differ
  bool one_step = true;
  for (int64_t r = 0; r < ranks; ++r) {
    one_step = one_step && cell[parts + r] == cell[parts];
    steps += c10::str(r == 0 ? "" : ", ", "rank ", r, ": ", static_cast<int64_t>(cell[parts + r]));
  }
  TORCH_CHECK_VALUE(one_step, "the ranks were handed states of different steps (", steps, "): they resume as one "
                    "state only if saved at one step. Load each rank's state_dict() of one save on its own rank, or "
                    "one state_dict(gathered=True) on every rank");
  std::vector<int64_t> lacking;
  for (int64_t k = 0; k < parts; ++k) {
    if (cell[k] > 0.0) lacking.push_back(k);
  }
  if (lacking.empty()) return;
  // Who holds each lacking part: per rank, the dtype + 1 of its part (0: none).
  const auto count = static_cast<int64_t>(lacking.size());
  auto held = torch::zeros({count * ranks}, torch::kFloat64);
  auto at = held.accessor<double, 1>();
  for (int64_t n = 0; n < count; ++n) {
    const auto k = lacking[static_cast<size_t>(n)];
    if (holds(k)) at[n * ranks + rank] = static_cast<double>(saved.layers[layer_of(k)].at(key_of(k)).scalar_type()) + 1;
  }
  auto gathered = held.to(device);
  communicator.allreduce_sum(gathered, comm::kWorld, comm::Purpose::kSetup).wait();
  held = gathered.cpu();
  at = held.accessor<double, 1>();
  // One at a time: a rank that does not keep a part holds its buffer only while it passes.
  for (int64_t n = 0; n < count; ++n) {
    int64_t root = 0;
    while (root < ranks && at[n * ranks + root] == 0.0) ++root;
    if (root == ranks) continue;  // no rank holds it: this rank's restore refuses it, naming the layer
    const auto k = lacking[static_cast<size_t>(n)];
    const auto dtype = static_cast<c10::ScalarType>(static_cast<int>(at[n * ranks + root]) - 1);
    torch::Tensor part =
        root == rank ? saved.layers[layer_of(k)].at(key_of(k)).detach().to(device, dtype).contiguous()
                     : torch::empty(layers[layer_of(k)].state_shape(entries[static_cast<size_t>(k) % entries.size()]),
                                    torch::TensorOptions().dtype(dtype).device(device));
    communicator.broadcast(part, static_cast<int>(root), comm::kWorld, comm::Purpose::kSetup).wait();
    if (root != rank && lacks(k)) saved.layers[layer_of(k)][key_of(k)] = std::move(part);
  }
}

}  // namespace

std::string StateRestore::describe(int world_size_now) const {
  const auto ranks = [](int n) { return std::to_string(n) + (n == 1 ? " rank" : " ranks"); };
  std::ostringstream out;  // load() reads format 2 only: it refuses every other version
  if (same_plan) {
    out << "K-FAC state restored exactly (same world size and plan)";
  } else {
    out << "K-FAC state of a " << world_size << "-rank job re-placed for " << ranks(world_size_now)
        << " (factors, and second-order state exact as saved)";
  }
  if (recomputed_layers > 0) {
    out << "; the second-order state of " << recomputed_layers << " layer(s) recomputed from the factors (the "
        << "archive's compute method is not this job's)";
  }
  return out.str();
}

std::map<std::string, torch::Tensor> Preconditioner::placed_here(size_t index,
                                                                 std::map<std::string, torch::Tensor> state) const {
  const bool factors = executor_->keeps_factors(index);
  const bool second_order = executor_->holds_second_order(index);
  const bool moments = executor_->preconditions(index);  // Adam's moments live where the step is computed
  for (auto it = state.begin(); it != state.end();) {
    const auto* entry = layer_state_entry(it->first);
    const bool keep = is_factor_key(it->first) ? factors : entry != nullptr && entry->moment() ? moments : second_order;
    it = keep ? std::next(it) : state.erase(it);
  }
  return state;
}

std::vector<std::map<std::string, torch::Tensor>> Preconditioner::state_template() const {
  const bool eigen = options_.compute_method() == ComputeMethod::kEigen;
  std::vector<std::map<std::string, torch::Tensor>> templates(layers_.size());
  for (size_t i = 0; i < layers_.size(); ++i) {
    const auto& layer = layers_[i];
    const bool factors = executor_->keeps_factors(i);
    const bool whole = executor_->preconditions(i);
    for (const auto& entry : layer_state_entries()) {
      // Second-order entries: eigenvectors, eigenvalues and their denominator for eigen; inverses ('f') else;
      // Adam's moments with eigen_adam.
      const bool wanted = entry.factor   ? factors
                          : entry.moment() ? whole && options_.eigen_adam()
                                           : whole && (entry.form == 'f') != eigen;
      const auto shape = layer.state_shape(entry);
      if (!wanted || shape.empty()) continue;
      const auto dtype = entry.factor ? layer.factor_dtype() : layer.second_order_dtype();
      templates[i][entry.key] = torch::empty(shape, layer.weight().options().dtype(dtype));
    }
  }
  return templates;
}

void Preconditioner::save(torch::serialize::OutputArchive& archive) const {
  if (const auto folded = layers_folded_since_step(); folded > 0) {
    TORCH_WARN("dkfac: save: the factors of ", folded, " layer(s) already hold this step's batch, folded in their "
               "backward hooks (", names_.option_flag("fold_in_hooks", true), "), though step() has not run and the "
               "step count does not include it: a resume that repeats this step counts that batch twice. Save after "
               "step(), or build the preconditioner with ", names_.option_flag("fold_in_hooks", false));
  }
  const auto states = executor_->gather_states(layers_);  // collective; the whole state on every rank
  const auto& plan = executor_->plan();
  const auto described = plan.describe(/*per_layer=*/true);
  archive.write("format_version", c10::IValue(kFormatVersion));
  archive.write("steps", c10::IValue(steps_));
  archive.write("num_layers", c10::IValue(static_cast<int64_t>(layers_.size())));
  archive.write("world_size", c10::IValue(static_cast<int64_t>(plan.world_size())));
  archive.write("plan", c10::IValue(described));
  archive.write("method", c10::IValue(static_cast<int64_t>(plan.method)));
  std::vector<std::map<std::string, torch::Tensor>> written(layers_.size());
  for (size_t i = 0; i < layers_.size(); ++i) {
    torch::serialize::OutputArchive nested;
    nested.write("name", c10::IValue(layers_[i].name()));
    for (const auto& [key, tensor] : states[i]) {
      written[i][key] = written_alone(tensor);
      nested.write(key, written[i][key], /*is_buffer=*/true);
    }
    archive.write("layer" + std::to_string(i), nested);
  }
  archive.write("checksum", c10::IValue(archive_checksum(steps_, plan.world_size(), described,
                                                         static_cast<int64_t>(plan.method), layers_, written)));
}

void Preconditioner::read_archive(torch::serialize::InputArchive& archive, StateRestore& restore,
                                  SavedState& saved) {
  c10::IValue version;
  TORCH_CHECK(archive.try_read("format_version", version) && version.isInt(),
              "not a dkfac preconditioner checkpoint (no format_version)");
  restore.format_version = version.toInt();
  TORCH_CHECK(restore.format_version == kFormatVersion, "dkfac preconditioner checkpoint has format version ",
              restore.format_version, "; this build reads version ", kFormatVersion, " only");
  const int64_t steps = read_int(archive, "steps", "");
  TORCH_CHECK(steps >= 0, "dkfac preconditioner checkpoint has steps ", steps, ": the archive is damaged");
  const int64_t num_layers = read_int(archive, "num_layers", "");
  TORCH_CHECK(num_layers == static_cast<int64_t>(layers_.size()), "checkpoint holds ", num_layers,
              " K-FAC layers, the model has ", layers_.size());
  const auto& plan = executor_->plan();
  restore.world_size = static_cast<int>(read_int(archive, "world_size", ""));
  TORCH_CHECK(restore.world_size >= 1, "dkfac preconditioner checkpoint has world_size ", restore.world_size,
              ": the archive is damaged");
  const auto saved_plan = read_string(archive, "plan", "");
  restore.same_plan = !(auto_ && auto_->choice_pending()) && restore.world_size == plan.world_size() &&
                      saved_plan == plan.describe(/*per_layer=*/true);
  const int64_t method = read_int(archive, "method", "");
  TORCH_CHECK(method == static_cast<int64_t>(ComputeMethod::kEigen) ||
                  method == static_cast<int64_t>(ComputeMethod::kInverse),
              "dkfac preconditioner checkpoint has compute method ", method, ": the archive is damaged");
  saved.steps = steps;
  saved.method = static_cast<ComputeMethod>(method);
  saved.layers.resize(layers_.size());
  for (size_t i = 0; i < layers_.size(); ++i) {
    const std::string where = " (K-FAC layer " + std::to_string(i) + ")";
    torch::serialize::InputArchive nested;
    TORCH_CHECK(archive.try_read("layer" + std::to_string(i), nested), "dkfac preconditioner checkpoint has no "
                "entry for K-FAC layer ", i, " ('", layers_[i].name(), "'): the archive is damaged");
    const auto name = read_string(nested, "name", where);
    TORCH_CHECK(name == layers_[i].name(), "checkpoint holds K-FAC layer '", name, "' where the model has '",
                layers_[i].name(), "'");
    for (const auto& key : nested.keys()) {
      if (key == "name") continue;
      torch::Tensor tensor;
      TORCH_CHECK(nested.try_read(key, tensor, /*is_buffer=*/true), "dkfac preconditioner checkpoint", where,
                  ": entry '", key, "' is not a tensor: the archive is damaged");
      saved.layers[i][key] = tensor;
    }
  }
  c10::IValue checksum;
  if (archive.try_read("checksum", checksum)) {
    TORCH_CHECK(checksum.isInt() && checksum.toInt() == archive_checksum(steps, restore.world_size, saved_plan, method,
                                                                         layers_, saved.layers),
                "dkfac preconditioner checkpoint: its contents do not match the checksum written with them: the "
                "archive is damaged (a changed byte); nothing was loaded");
  }
}

StateRestore Preconditioner::load(torch::serialize::InputArchive& archive) {
  StateRestore restore;
  SavedState saved;
  // What torch's reader throws on a damaged archive other than its own errors (std::out_of_range from a map, ...)
  // is refused as damage, before anything changed.
  try {
    read_archive(archive, restore, saved);
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "dkfac preconditioner checkpoint could not be read (", e.what(), "): the archive is damaged; "
                "nothing was loaded");
  }
  const auto restored = this->restore(std::move(saved));
  restore.placed_layers = restored.placed_layers;
  restore.recomputed_layers = restored.recomputed_layers;
  return restore;
}

StateRestore Preconditioner::restore(SavedState saved) {
  TORCH_CHECK(saved.steps >= 0, "steps must be >= 0, got ", saved.steps);
  TORCH_CHECK(saved.layers.size() == layers_.size(), "state holds ", saved.layers.size(), " K-FAC layers, the model has ",
              layers_.size());
  TORCH_CHECK(saved.unheld.empty() || saved.unheld.size() == layers_.size(), "state marks blanks of ",
              saved.unheld.size(), " layers, the model has ", layers_.size());
  const auto blank = [&](size_t i, const std::string& key) {
    return !saved.unheld.empty() && saved.unheld[i].count(key) > 0;
  };
  for (size_t i = 0; i < layers_.size(); ++i) {  // blanks are not loaded
    for (auto it = saved.layers[i].begin(); it != saved.layers[i].end();) {
      it = blank(i, it->first) || !it->second.defined() ? saved.layers[i].erase(it) : std::next(it);
    }
  }
  const auto wanted = state_template();
  // Every rank takes the same branch: the recompute is collective, and a refusal must reach every rank.
  const bool distributed = communicator_ && communicator_->size() > 1;
  if (distributed) take_parts_from_other_ranks(*communicator_, layers_, saved, wanted, blank);
  bool exact = saved.method == executor_->plan().method;
  std::string refusal;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const auto& have = saved.layers[i];
    const bool has_factors = have.count("a_factor") > 0 || have.count("g_factor") > 0;
    // One factor without the other: not another rank's share (which lacks both), but a follower's state.
    const bool keeps_a = wanted[i].count("a_factor") > 0;  // a shared-input follower keeps its leader's
    if (keeps_a && have.count("g_factor") > 0 && have.count("a_factor") == 0 && refusal.empty()) {
      refusal = c10::str("state holds the G factor of layer '", layers_[i].name(), "' but no A factor: it was saved "
                         "with shared_input_layers, where this layer shared the A factor of an earlier one (or it is "
                         "damaged); build the preconditioner with the same shared_input_layers to load it");
    }
    if (layers_[i].follows_a() && have.count("a_factor") > 0) {
      const auto& leader = saved.layers[static_cast<size_t>(layers_[i].a_leader())];
      const auto it = leader.find("a_factor");
      if (it != leader.end() && !torch::equal(it->second.cpu(), have.at("a_factor").cpu())) {
        TORCH_WARN("dkfac: the state's A factor of layer '", layers_[i].name(), "' differs from that of layer '",
                   layers_[static_cast<size_t>(layers_[i].a_leader())].name(), "', whose A factor it shares "
                   "(shared_input_layers): the shared one is the latter's (the layers' inputs differed when it was "
                   "saved?)");
      }
    }
    for (const auto& [key, unused] : wanted[i]) {
      const auto& entry = *layer_state_entry(key);
      if (have.count(key) > 0) continue;
      if (!entry.factor) {
        // A second-order part this rank holds is missing: recomputed. Not for a layer without factors (it never
        // built any: nothing to restore or recompute).
        if (!entry.moment() && has_factors) exact = false;
      } else if (saved.steps > 0 && !saved.per_rank_writer.empty() && !blank(i, key) && refusal.empty()) {
        refusal = c10::str("state holds no ", entry.what, " of layer '", layers_[i].name(),
                           "', which this rank builds: ", saved.per_rank_writer);
      }
    }

  }
  if (distributed) exact = comm::all_true(*communicator_, exact);
  StateRestore restore;
  for (size_t i = 0; i < layers_.size(); ++i) {
    auto& layer = saved.layers[i];
    bool second_order = false;
    for (auto it = layer.begin(); it != layer.end();) {
      const auto* entry = layer_state_entry(it->first);
      const bool kept = entry == nullptr || entry->factor || entry->moment() || exact;  // unknown: refused below
      second_order = second_order || (kept && entry != nullptr && !entry->factor && !entry->moment());
      it = kept ? std::next(it) : layer.erase(it);
    }
    if (second_order && executor_->holds_second_order(i)) ++restore.placed_layers;
  }
  // What this rank would load, checked before any rank changes anything (shapes, NaN, unknown entries).
  std::vector<KfacLayer> staged;
  std::string unfit;  // a layer's entries that do not fit it
  if (refusal.empty()) {
    try {
      staged = staged_layer_states(saved.layers);
    } catch (const c10::Error& e) {
      unfit = e.what_without_backtrace();
    }
  }
  if (distributed) {
    // Every rank stops together; one whose own state passed names the first rank that refused, and why.
    const auto first = comm::first_refusal(*communicator_, refusal.empty() ? unfit : refusal);
    TORCH_CHECK(unfit.empty(), unfit);
    TORCH_CHECK_VALUE(first.empty() || !refusal.empty(), "the state given to ", first.substr(0, first.find(':')),
                      " was refused there, so nothing was loaded on any rank: ", first);
  }
  TORCH_CHECK_VALUE(refusal.empty(), refusal);
  TORCH_CHECK(unfit.empty(), unfit);
  job_.reset();  // Options::second_order_lag: the state it would install is replaced
  forget_graphs();
  layers_ = std::move(staged);
  layer_groups();  // Options::stack_layers: the loaded state into the stacks (or the stacks freed), not beside them
  steps_ = saved.steps;
  drop_captures();
  arm_capture();
  if (!exact && saved.recompute) {
    update_second_order();
    for (size_t i = 0; i < layers_.size(); ++i) {
      if (executor_->holds_second_order(i) && layers_[i].second_order().defined()) ++restore.recomputed_layers;
    }
  }
  resume_second_order_job();
  if (restore.recomputed_layers > 0 && job_ && job_->install_at > steps_) {
    // Options::second_order_lag >= 2: the saved run used the update before the one in flight until it installs it;
    // this one has just computed the latter from the loaded factors (none saved, or another compute method's),
    // and uses it at once.
    TORCH_WARN("dkfac: the second-order state was recomputed from the loaded factors (the state holds none this "
               "rank can use as saved) and is used from step ", steps_, "; the saved run (second_order_lag = ",
               options_.second_order_lag(),
               ") used the update before it until step ", job_->install_at, ", so the resumed run differs from it "
               "until then. Save the whole state (state_dict(include_second_order=True)) for an exact resume");
  } else if (job_) {
    // The update in flight is computed again from the loaded factors: the saved run's if no factor update came
    // after its inverse step, else one from newer factors (the state holds no copy of the older ones).
    int64_t moved = -1;
    for (int64_t s = job_->started + 1; s < steps_ && moved < 0; ++s) moved = is_factor_step(s) ? s : -1;
    if (moved >= 0) {
      TORCH_WARN("dkfac: the second-order update in flight when this state was saved (step ", job_->started,
                 "'s, second_order_lag = ", options_.second_order_lag(), ") is computed again from the loaded "
                 "factors, which step ", moved, "'s factor update changed after it: the update installed at step ",
                 job_->install_at, " differs from the saved run's, and so do the steps from then on. For an exact "
                 "resume, save at the step right after an inverse step, or once its update is installed");
    }
  }
  return restore;
}

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const Preconditioner& preconditioner) {
  preconditioner.save(archive);
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, Preconditioner& preconditioner) {
  preconditioner.load(archive);
  return archive;
}

}  // namespace dkfac
