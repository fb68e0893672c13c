#include "dkfac/preconditioner.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>

// The step: the phase sequence of Preconditioner::step() (check the layers, factors, second order, precondition,
// guard and clip, apply) and what each phase does. Construction and re-planning: preconditioner_setup.cpp; the
// state's archive: preconditioner_archive.cpp.

#include "dkfac/comm/agreement.h"
#include "dkfac/device.h"
#include "dkfac/layers/discovery.h"
#include "dkfac/nn/kfac_module.h"
#include "dkfac/numbers.h"
#include "dkfac/strategy/time_model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <chrono>
#include <iomanip>
#include <limits>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <thread>
#include <sstream>

namespace dkfac {

namespace {

// "a, b, c, d and 2 more": the first four of `items`, for messages naming many layers.
std::string first_four(const std::vector<std::string>& items) {
  std::string list;
  for (size_t k = 0; k < items.size() && k < 4; ++k) list += (k > 0 ? ", " : "") + items[k];
  if (items.size() > 4) list += " and " + std::to_string(items.size() - 4) + " more";
  return list;
}

}  // namespace

bool Preconditioner::is_factor_step(int64_t step) const {
  return step % options_.factor_update_steps_at(step) == 0;
}

bool Preconditioner::is_inverse_step(int64_t step) const {
  const int64_t start = options_.start_preconditioning_step();  // its first second-order update
  return step == start || (step > start && step % options_.inv_update_steps_at(step) == 0);
}

bool Preconditioner::is_full_decomposition_step(int64_t step) const {
  const int64_t interval = options_.eigh_interval();
  return interval == 1 || step == options_.start_preconditioning_step() ||
         step % (interval * options_.inv_update_steps_at(step)) == 0;
}

void Preconditioner::check_schedules_agree(const std::string& written) const {
  // The constructor compared every constant option; a schedule (a function, as every Python hyper-parameter
  // is, so that assigning preconditioner.damping works) is compared by its values, at every step, first:
  // ranks whose intervals differ would otherwise start different collectives.
  if (!communicator_ || communicator_->size() == 1) return;
  // The next step's factor interval too: the end of this step arms the captures by it (arm_capture), and on a
  // factor step the capture hooks start factor collectives, before the next step's check could run.
  const int64_t s = steps_;
  struct Value {
    const char* name;
    int64_t step;  // the step it is the value at
    double value;
  };
  // Every schedule of the options table at this step, and the next step's factor interval.
#define DKFAC_SCHEDULE_AT_Schedule(name) {#name, s, static_cast<double>(options_.name##_at(s))},
#define DKFAC_SCHEDULE_AT_Value(name)
#define DKFAC_SCHEDULE_AT(kind, T, name, ...) DKFAC_SCHEDULE_AT_##kind(name)
  const Value values[] = {
      DKFAC_OPTIONS(DKFAC_SCHEDULE_AT)
      {"factor_update_steps", s + 1, static_cast<double>(options_.factor_update_steps_at(s + 1))}};
#undef DKFAC_SCHEDULE_AT
#undef DKFAC_SCHEDULE_AT_Value
#undef DKFAC_SCHEDULE_AT_Schedule
  std::vector<double> mine;
  for (const auto& v : values) mine.push_back(v.value);
  const size_t compared = mine.size();
  // And whether this rank refuses the step for weights written since the backward pass (one rank's loop may differ),
  // and the first layer it would refuse (unused_layer_policy error), or -1: a refusal on some ranks only would leave
  // the others waiting in the step's collectives, so every rank stops.
  mine.push_back(written.empty() ? 0.0 : 1.0);
  mine.push_back(static_cast<double>(first_refused_layer()));
  const auto table = comm::gather_over(*communicator_, comm::kWorld, mine, comm::Purpose::kControl);
  const int me = communicator_->rank();
  if (!written.empty()) return;  // this rank refuses in run_step, with its own message
  for (size_t rank = 0; rank < table.size(); ++rank) {
    TORCH_CHECK(table[rank][compared] == 0.0, "rank ", rank, " refused step ", s, ": the weights of its layers were "
                "written in place after their backward pass and before step() (its own error says which): every rank "
                "stops here rather than wait for it in the step's collectives");
  }
  if (const auto mine_refused = static_cast<int64_t>(table[static_cast<size_t>(me)].back()); mine_refused >= 0) {
    // Here, not in check_layers: strategy auto's choice, which comes between, may leave this rank's layer to another.
    const auto i = static_cast<size_t>(mine_refused);
    TORCH_CHECK(false, refusal_of(i, unusable_reason(i, captured_for_check(i, armed_factor_step()))));
  }
  for (size_t rank = 0; rank < table.size(); ++rank) {
    const auto layer = static_cast<int64_t>(table[rank].back());
    TORCH_CHECK(layer < 0, "rank ", rank, " cannot use K-FAC layer ", names_.layer(layers_[static_cast<size_t>(layer)],
                static_cast<size_t>(layer)), " at step ", s, " (its own error says why) and unused_layer_policy is "
                "error: every rank stops here rather than wait for it in the step's collectives. Where layers run on "
                "some ranks only (a mixture of experts' routing, stochastic depth), set unused_layer_policy='skip' "
                "(C++: UnusedLayerPolicy::kSkip): the ranks then agree to keep such a layer's plain gradient");
  }
  for (size_t rank = 1; rank < table.size(); ++rank) {
    for (size_t k = 0; k < compared; ++k) {
      if (table[rank][k] == table[0][k]) continue;
      const auto& v = values[k];
      const std::string name = v.step == s ? v.name : c10::str(v.name, " at step ", v.step);
      TORCH_CHECK(false, "the ranks' hyper-parameters differ at K-FAC step ", s, ": rank ", rank, " has ", name, "=",
                  table[rank][k], " where rank 0 has ", name, "=", table[0][k],
                  ". Every rank must use the same values (a schedule: the same function of the step)");
    }
  }
}

void Preconditioner::step(const Distributor& distributor) {
  TORCH_CHECK(!stepping_.exchange(true), "step() is already running on another thread: a Preconditioner takes one "
              "step() at a time (call it from the thread that trains)");
  struct Done {
    std::atomic<bool>& stepping;
    ~Done() { stepping = false; }
  } done{stepping_};
  // Strategy auto's agreement with the model's other parts (agree_strategy_over_model) sums through this step's.
  model_sum_ = distributor.sum_over_model ? &distributor.sum_over_model : nullptr;
  struct Forget {
    const std::function<void(torch::Tensor&)>*& sum;
    ~Forget() { sum = nullptr; }
  } forget{model_sum_};
  settle_pending_guards(/*wait=*/false);  // the finished steps' warnings and counts, without waiting
  front_end_seconds_ = 0.0;
  move_gradients(distributor.gather);
  bool factor_step = false;
  try {
    factor_step = run_step(distributor);
  } catch (...) {
    try {
      move_gradients(distributor.scatter);  // the gathered gradients back as they came: ranks stay in step
    } catch (const std::exception& e) {
      TORCH_WARN("K-FAC step ", steps_, " failed, and returning the gathered gradients failed too: ", e.what());
    }
    throw;
  }
  // The step is done once its gradients are written: a scatter that fails (a lost rank) still ends it, then says so.
  std::exception_ptr scatter_failed;
  try {
    move_gradients(distributor.scatter);
  } catch (...) {
    scatter_failed = std::current_exception();
  }
  close_step_timing();
  if (auto_ && auto_->profiles(steps_)) {  // reading the times waits for the step's events on a GPU
    auto t = last_step_times();
    // The time model prices K-FAC's own collectives, not the front end's (sharded rows, the pipeline's KL sum).
    t[KfacPhase::kCommunication] = std::max(0.0, t[KfacPhase::kCommunication] - front_end_seconds_);
    const bool inverse = is_inverse_step(steps_);
    auto_->record(steps_, {factor_step, inverse, inverse && !is_full_decomposition_step(steps_)}, t);
  }
  ++steps_;
  if (scatter_failed) {
    arm_capture();
    std::rethrow_exception(scatter_failed);
  }
  if (auto_ && auto_->recheck_due(steps_)) recheck_strategy();
  arm_capture();
}

bool Preconditioner::run_step(const Distributor& model) {
  follow_parameters();
  refuse_repeated_step();
  const auto written = weights_written_since_backward();
  check_schedules_agree(written);  // where several ranks run, the others refuse with this one
  TORCH_CHECK(written.empty(), written);
  // The end of this step arms the captures by the next step's factor interval (arm_capture): a schedule that fails
  // (throws, or gives a value out of range) fails this step now, before anything changed, not after it is done.
  (void)is_factor_step(steps_ + 1);
  const bool warming_up = steps_ < options_.start_preconditioning_step();  // factors only, gradients left plain
  if (auto_ && auto_->choice_pending() && !warming_up) choose_strategy();
  const bool factor_step = factor_step_as_armed();
  std::fill(factor_ok_.begin(), factor_ok_.end(), torch::Tensor());
  try {
    auto fates = check_layers(factor_step);
    if (factor_step) update_factors(fates);
    if (warming_up) {
      std::fill(fates.begin(), fates.end(), LayerFate::kPlainGradient);
    } else {
      const bool installs = job_ && steps_ >= job_->install_at;  // Options::second_order_lag
      if (installs) {
        PhaseClock::Span span(clock_, KfacPhase::kSecondOrder);
        install_second_order_job(&fates);
      }
      const bool inverse_step = is_inverse_step(steps_);
      if (inverse_step) compute_second_order(fates, !is_full_decomposition_step(steps_));
      const bool updated = factor_step || inverse_step || installs;
      precondition_and_write(fates, options_.kl_clip_at(steps_), model, updated);
    }
    remember_written_gradients(fates);
  } catch (const c10::OutOfMemoryError& e) {
    forget_failed_step();
    const std::string layer = phase_layer_ >= 0 ? " of layer " + names_.layer(layers_[phase_layer_], phase_layer_) : "";
    device::rethrow_out_of_memory(e, std::string("K-FAC step ") + std::to_string(steps_) + ", " + phase_ + layer);
  } catch (...) {
    forget_failed_step();
    throw;
  }
  return factor_step;
}

void Preconditioner::front_end(const std::function<void()>& run) {
  const auto start = std::chrono::steady_clock::now();
  run();
  front_end_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void Preconditioner::move_gradients(const std::function<Distributor::Moved()>& move) {
  if (!move) return;
  Distributor::Moved moved;
  front_end([&] { moved = clock_.communication(move); });
  if (communicator_) communicator_->add_traffic(comm::Purpose::kGradients, moved.calls, moved.bytes);
}

void Preconditioner::refuse_repeated_step() const {
  // Every rank runs the same loop, so every rank refuses alike: no collective is left waiting.
  bool any = false;
  for (size_t i = 0; i < written_.size() && i < layers_.size(); ++i) {
    if (!written_[i]) continue;  // step() wrote no gradient for it
    const auto& [weak, version] = *written_[i];
    const auto& grad = layers_[i].weight().grad();
    // Set to None since (zero_grad), another tensor, or written to (backward, an allreduce): a new gradient.
    if (!grad.defined() || weak.lock().get() != grad.unsafeGetTensorImpl() || grad._version() != version) return;
    any = true;
  }
  TORCH_CHECK(!any, "step() called again on the gradients the last step() (step ", steps_ - 1,
              ") preconditioned: no backward pass wrote them since, and a second step() would precondition them "
              "twice. Call step() once after each backward pass (after all accumulation micro-batches)");
}

std::string Preconditioner::weights_written_since_backward() {
  // Seen where the output gradients were captured (factor steps: the first step is one); refused before anything
  // changed. The sums a layer's first checks compare (FactorCapture::watch_weight) are read in one transfer.
  std::vector<FactorCapture::WeightCheck> checks;
  std::vector<torch::Tensor> sums_differ;
  for (auto& layer : layers_) {
    checks.push_back(layer.capture().take_weight_check());
    if (const auto& differs = checks.back().sum_differs; differs.defined()) {
      sums_differ.push_back(differs.to(sums_differ.empty() ? differs.device() : sums_differ[0].device()));
    }
  }
  const auto differ = sums_differ.empty() ? torch::Tensor() : torch::stack(sums_differ).cpu();
  std::vector<std::string> written;
  int64_t summed = 0;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const bool sum_moved = checks[i].sum_differs.defined() && differ[summed++].item<bool>();
    if (checks[i].written || sum_moved) written.push_back(names_.layer(layers_[i], i));
  }
  if (written.empty()) return "";
  return c10::str("step ", steps_, " refused: the weights of ", written.size(),
                  written.size() == 1 ? " layer (" : " layers (", first_four(written),
                  ") were written in place after their backward pass and before step(): optimizer.step() ran before "
                  "the preconditioner's step() (or an optimizer steps inside the backward pass). The optimizer has "
                  "already applied the gradients this step would precondition, so K-FAC would have no effect. Call "
                  "step() after the backward pass and before optimizer.step() (dkfac.optim.KFAC does both, in that "
                  "order)");
}

void Preconditioner::remember_written_gradients(const std::vector<LayerFate>& fates) {
  written_.assign(layers_.size(), std::nullopt);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const auto& grad = layers_[i].weight().grad();
    if (fates[i] == LayerFate::kPlainGradient || !grad.defined()) continue;
    written_[i] = std::pair{WeakTensor(grad.getIntrusivePtr()), grad._version()};
  }
}

void Preconditioner::discard_step() {
  warn_of_kept_folds("discard_step()");
  // Not where the model's parts must agree (agree_strategy_over_model): no sum over them here; the next step() chooses.
  if (auto_ && auto_->choice_pending() && steps_ >= options_.start_preconditioning_step() && !model_leader_) {
    choose_strategy();
  }
  const bool factor_step = factor_step_as_armed();
  auto fates = check_layers(factor_step, /*discarding=*/true);  // whatever ran: nothing, a forward without backward
  if (factor_step) {
    auto batches = take_factor_batches(fates);
    // The other ranks reduce this step's factors too (SPD has already started during backward).
    executor_->reduce_factors(batches);
  }
  for (auto& layer : layers_) layer.capture().clear();
  arm_capture();
}

void Preconditioner::update_second_order() {
  forget_graphs();
  std::vector<LayerFate> fates(layers_.size(), LayerFate::kPreconditioned);
  compute_second_order(fates, /*refresh=*/false, /*lag=*/false);
}

void Preconditioner::forget_failed_step() {
  // What the failed step's forward and backward captured must not be averaged into the next factors.
  drop_captures();
  arm_capture();
}

void Preconditioner::drop_captures() {
  for (auto& layer : layers_) layer.capture().clear();
  std::fill(hook_folded_.begin(), hook_folded_.end(), torch::Tensor());
}

int64_t Preconditioner::layers_folded_since_step() const {
  int64_t folded = 0;
  for (const auto& layer : layers_) folded += layer.capture().folded_passes() > 0 ? 1 : 0;
  return folded;
}

void Preconditioner::warn_of_kept_folds(const char* call) {
  if (const auto folded = layers_folded_since_step(); folded > 0 && !warned_fold_kept_) {
    warned_fold_kept_ = true;
    TORCH_WARN("dkfac: ", call, ": the backward hooks of ", folded, " layer(s) had already folded this step's batch "
               "into their factors (", names_.option_flag("fold_in_hooks", true), ", the default), where it stays: "
               "only what was not folded is dropped. To drop skipped batches from the factors, build the "
               "preconditioner with ", names_.option_flag("fold_in_hooks", false), " (warned once)");
  }
}

void Preconditioner::reset_batch() {
  warn_of_kept_folds("reset_batch()");
  drop_captures();
}

void Preconditioner::load_layer_states(int64_t steps,
                                       const std::vector<std::map<std::string, torch::Tensor>>& states) {
  TORCH_CHECK(steps >= 0, "steps must be >= 0, got ", steps);
  TORCH_CHECK(states.size() == layers_.size(), "state holds ", states.size(), " K-FAC layers, the model has ",
              layers_.size());
  auto staged = staged_layer_states(states);  // a bad entry leaves this preconditioner unchanged
  job_.reset();
  forget_graphs();
  layers_ = std::move(staged);
  layer_groups();  // the loaded state into the stacks (or the stacks freed), not beside them
  steps_ = steps;
  resume_second_order_job();
  drop_captures();
  arm_capture();
}

std::vector<KfacLayer> Preconditioner::staged_layer_states(
    const std::vector<std::map<std::string, torch::Tensor>>& states) const {
  std::vector<KfacLayer> staged = layers_;
  for (size_t i = 0; i < staged.size(); ++i) staged[i].load_state(placed_here(i, states[i]), options_.compute_method());
  settle_loaded_layers(staged);
  return staged;
}

void Preconditioner::settle_loaded_layers(std::vector<KfacLayer>& layers) {
  link_shared_inputs(layers);
  for (auto& layer : layers) layer.adam_moments_in_current_basis();
}

void Preconditioner::link_shared_inputs(std::vector<KfacLayer>& layers) {
  for (auto& layer : layers) {
    if (layer.follows_a()) layer.link_a(layers[static_cast<size_t>(layer.a_leader())]);
  }
}

void Preconditioner::relink_followers(double damping) {
  link_shared_inputs(layers_);
  for (auto& layer : layers_) {
    if (layer.follows_a() && layer.second_order().defined()) layer.finish_second_order(damping);
  }
}

std::vector<std::map<std::string, torch::Tensor>> Preconditioner::gathered_layer_states() const {
  return executor_->gather_states(layers_);
}

void Preconditioner::check_shared_inputs() const {
  std::string refusal;
  const auto index_of = [&](const FactorCapture* capture) {
    for (size_t j = 0; j < layers_.size(); ++j) {
      if (&layers_[j].capture() == capture) return j;
    }
    return layers_.size();
  };
  for (size_t i = 0; i < layers_.size(); ++i) {
    const auto& layer = layers_[i];
    if (group_of(i) < 0 || !executor_->builds_factors(i)) continue;
    const FactorCapture* other = nullptr;
    std::string differ = layer.capture().input_mismatch(&other);
    size_t with = index_of(other);
    if (differ.empty() && layer.follows_a()) {
      with = static_cast<size_t>(layer.a_leader());
      const size_t mine = layer.capture().input_passes();
      const size_t theirs = layers_[with].capture().input_passes();
      // A layer that did not run at all is the unused-layer policy's to handle.
      if (mine > 0 && theirs > 0 && mine != theirs) differ = c10::str("ran ", mine, " time(s) where it ran ", theirs);
    }
    if (differ.empty()) continue;
    const std::string other_name = with < layers_.size() ? names_.layer(layers_[with], with) : "another member";
    refusal = c10::str("shared_input_layers: K-FAC layer ", names_.layer(layer, i), " shares its A factor with ",
                       other_name, " but ", differ, " at step ", steps_, ". Layers share an A factor only when their "
                       "forward is given the same tensor (not a copy, not changed in place between them); correct "
                       "the shared_input_layers patterns");
    break;
  }
  // Where only some ranks build a group's factors (DP-KFAC's owners), only they can see a difference: the ranks
  // agree, so that every rank refuses the step (the others would wait in its collectives).
  bool every_rank_builds = true;
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (leads_a_[i] && executor_->plan().flows[i].factor_builder != assign::kEveryRank) every_rank_builds = false;
  }
  if (!every_rank_builds && communicator_ && communicator_->size() > 1 &&
      !comm::all_true(*communicator_, refusal.empty())) {
    TORCH_CHECK(!refusal.empty(), "shared_input_layers: another rank found that the layers of a group were not given "
                "the same input at step ", steps_, " (its error names them)");
  }
  TORCH_CHECK(refusal.empty(), refusal);
}

void Preconditioner::suggest_shared_inputs() {
  suggest_shared_inputs_ = false;
  // Layers whose first input this step was one tensor (its storage, data, view and version) and whose A factors are
  // built alike. The storage's memory is freed by now and may hold another tensor since (the next layer's input, at
  // the same address): its StorageImpl, held weakly by the pass, is not reused while held, so it tells them apart.
  std::map<std::string, std::vector<size_t>> alike;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const auto& layer = layers_[i];
    const auto pass = layer.capture().pass_at(0);
    if (!pass || layer.sharded()) continue;
    const auto& g = layer.capture().geometry();
    std::ostringstream key;
    key << (pass->storage ? pass->storage->_unsafe_get_target() : nullptr) << pass->data
        << c10::IntArrayRef(pass->sizes) << c10::IntArrayRef(pass->strides) << pass->dtype
        << pass->device << pass->version << to_string(g.kind) << layer.a_dim() << g.has_bias << g.a_diagonal
        << c10::IntArrayRef(g.conv.kernel_size) << c10::IntArrayRef(g.conv.stride) << c10::IntArrayRef(g.conv.padding)
        << c10::IntArrayRef(g.conv.dilation) << g.conv.padding_mode.index() << layer.factor_dtype();
    alike[key.str()].push_back(i);
  }
  std::vector<std::vector<size_t>> groups;  // in model order
  for (const auto& [key, members] : alike) {
    if (members.size() > 1) groups.push_back(members);
  }
  if (groups.empty()) return;
  std::sort(groups.begin(), groups.end());
  const auto escaped = [](const std::string& text) {
    static const std::regex special(R"([.^$|()\[\]{}*+?\\])");
    return std::regex_replace(text, special, R"(\$&)");
  };
  // Each group's pattern: the parts of its names between their common prefix and suffix as the alternatives of one
  // capture group, then the suffix; `anchored` adds the prefix too (where groups' short patterns would overlap).
  const auto pattern_of = [&](const std::vector<size_t>& members, bool anchored) {
    std::vector<std::string> names;
    for (size_t i : members) names.push_back(layers_[i].name());
    const auto& first = names.front();
    size_t shortest = first.size();
    for (const auto& n : names) shortest = std::min(shortest, n.size());
    const auto same_at = [&](const auto& index) {
      return std::all_of(names.begin(), names.end(),
                         [&](const std::string& n) { return n[index(n)] == first[index(first)]; });
    };
    size_t prefix = 0, suffix = 0;
    while (prefix < shortest && same_at([&](const std::string&) { return prefix; })) ++prefix;
    while (suffix < shortest - prefix && same_at([&](const std::string& n) { return n.size() - 1 - suffix; })) ++suffix;
    std::string alternatives;
    for (const auto& n : names) {
      alternatives += (alternatives.empty() ? "" : "|") + escaped(n.substr(prefix, n.size() - prefix - suffix));
    }
    return (anchored ? "^" + escaped(first.substr(0, prefix)) : std::string()) + "(" + alternatives + ")" +
           escaped(first.substr(first.size() - suffix)) + "$";
  };
  std::vector<int> wanted(layers_.size(), -1);  // the groups as input_groups gives them: each member's leader
  std::vector<std::string> names;
  for (const auto& layer : layers_) names.push_back(layer.name());
  for (const auto& members : groups) {
    for (size_t k = 1; k < members.size(); ++k) wanted[members[k]] = static_cast<int>(members[0]);
  }
  std::vector<std::string> patterns;
  for (const bool anchored : {false, true}) {  // the short patterns where they give exactly these groups
    patterns.clear();
    for (const auto& members : groups) {
      const auto p = pattern_of(members, anchored);
      if (std::find(patterns.begin(), patterns.end(), p) == patterns.end()) patterns.push_back(p);
    }
    struct Quiet : c10::WarningHandler {
      void process(const c10::Warning&) override {}
    } quiet;
    try {
      c10::WarningUtils::WarningHandlerGuard guard(&quiet);  // a trial: its warnings are not the user's
      if (input_groups(names, patterns) == wanted) break;
    } catch (const c10::Error&) {  // a layer in two groups: the anchored patterns next
    }
    patterns.clear();
  }
  std::string example;
  for (size_t k = 0; k < groups.front().size(); ++k) example += (k ? ", '" : "'") + names[groups.front()[k]] + "'";
  std::string listed;
  for (const auto& p : patterns) listed += (listed.empty() ? "'" : ", '") + p + "'";
  TORCH_WARN("dkfac: ", groups.size(), " group(s) of layers were given one input tensor at step ", steps_, " (",
             example, groups.size() > 1 ? " and others" : "", "), so each group's A factors are equal: ",
             listed.empty() ? std::string("shared_input_layers patterns that name them")
                            : names_.option("shared_input_layers", "[" + listed + "]"),
             " would build, reduce, decompose and hold one per group, with the same results (docs/MATH.md section "
             "2.7)");
}

void Preconditioner::spread_group_fates(std::vector<LayerFate>& fates) {
  std::vector<bool> group_plain(layers_.size(), false);  // by leader: some member keeps its plain gradient
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (group_of(i) >= 0 && fates[i] == LayerFate::kPlainGradient) group_plain[static_cast<size_t>(group_of(i))] = true;
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (group_of(i) < 0 || !group_plain[static_cast<size_t>(group_of(i))] || fates[i] == LayerFate::kPlainGradient) {
      continue;
    }
    warn_once(i, "shared input", "shares its A factor (shared_input_layers) with a layer that cannot be used at "
              "this step, so it keeps its plain gradient too");
    layers_[i].capture().clear();
    fates[i] = LayerFate::kPlainGradient;
    ++events_.skipped_unused;
  }
}

std::string Preconditioner::unusable_reason(size_t i, int64_t captured) const {
  const auto& layer = layers_[i];
  const int64_t empty = captured >= 0 ? layer.capture().empty_passes() : 0;  // not captured: no rows
  const auto replaced = captured == 0 ? replaced_module(i) : std::string();
  return !replaced.empty() ? replaced
         : !layer.weight().requires_grad() ? "is frozen (its weight has requires_grad=False)"
         : !layer.trainable() ? "is frozen in part (its bias has requires_grad=False, its weight trains): its "
                                "preconditioned gradient mixes the two and would move the bias"
         : captured == 0 && empty > 0 && layer.has_gradient()
             ? "ran only on empty batches (0 rows) since the last factor update (a mixture-of-experts expert that "
               "received no tokens, say): there is nothing to build its factors from"
         : captured == 0 && layer.has_gradient()
             ? "has a gradient, but its module's hooks saw no forward and backward pass since the last factor "
               "update: it did not run on this rank and its gradient is the other ranks' (DDP's "
               "find_unused_parameters), its weight was used without calling the module (a functional use, as "
               "torch.nn.MultiheadAttention does with its out_proj), the module ran outside training mode or "
               "gradient recording, or a torch.compile graph traced before the hooks were added ran it (Dynamo "
               "does not guard on module hooks by default: build the preconditioner before the first compiled call)"
         : captured == 0 ? "did not run forward/backward in training mode"
         : hook_folded_[i].defined()
             ? "has no gradient (its backward hook had folded this step's passes into its factors: "
               "Options::fold_in_hooks)"
             : "has no gradient";
}

std::string Preconditioner::refusal_of(size_t i, const std::string& reason) const {
  if (const auto replaced = replaced_module(i); !replaced.empty() && reason == replaced) {
    return c10::str("K-FAC layer ", names_.layer(layers_[i], i), " ", reason, " (step() at step ", steps_, ")");
  }
  return c10::str("K-FAC layer ", names_.layer(layers_[i], i), " ", reason, " before step() at step ", steps_,
                  "; run it in forward/backward, exclude it with skip_layers, or set the unused-layer policy to skip "
                  "(UnusedLayerPolicy::kSkip, Python unused_layer_policy='skip')");
}

int64_t Preconditioner::first_refused_layer() const {
  if (options_.unused_layer_policy() != UnusedLayerPolicy::kError) return -1;
  const bool factor_step = armed_factor_step();
  for (size_t i = 0; i < layers_.size(); ++i) {  // check_layers' refusals, without its warnings and changes
    const auto& layer = layers_[i];
    const int64_t captured = captured_for_check(i, factor_step);
    if (captured == 0 || !layer.has_gradient() || !layer.trainable()) return static_cast<int64_t>(i);
  }
  return -1;
}

std::vector<Preconditioner::LayerFate> Preconditioner::check_layers(bool factor_step, bool discarding) {
  if (factor_step && suggest_shared_inputs_) suggest_shared_inputs();
  if (factor_step) check_shared_inputs();
  std::vector<LayerFate> fates(layers_.size(), LayerFate::kPreconditioned);
  if (factor_step) warn_of_broadcast_embeddings();
  std::vector<std::pair<size_t, int64_t>> late_forwards, orphan_forwards;  // warned once for all, after the loop
  for (size_t i = 0; i < layers_.size(); ++i) {
    auto& layer = layers_[i];
    int64_t captured = captured_for_check(i, factor_step);
    const auto late = captured > 0 ? check_hook_fold(i) : std::string();
    if (!late.empty()) warn_once(i, "hook fold", late);
    if (late.empty() && captured >= 0) {
      if (const auto dropped = layer.capture().drop_inputs_after_last_backward(); dropped > 0) {
        late_forwards.emplace_back(i, dropped);
        captured = layer.captured_batches();
      }
    }
    const int64_t empty = captured >= 0 ? layer.capture().empty_passes() : 0;  // not captured: no rows
    // A weight or bias frozen with its gradient zeroed in place (zero_grad(set_to_none=False)) still has one: frozen
    // all the same, or its preconditioned gradient (which mixes the two) would move it.
    if (captured != 0 && layer.has_gradient() && layer.trainable()) {
      if (!discarding && late.empty() && captured > 0 && captured + empty != options_.accumulation_steps()) {
        warn_once(i, "accumulation",
                  "ran forward and backward " + std::to_string(captured) + " times since the last factor update "
                  "but accumulation_steps is " + std::to_string(options_.accumulation_steps()) +
                      " (a layer called several times in one forward, or micro-batches not declared); its factors "
                      "average the " + std::to_string(captured) + " passes");
      }
      // A shared-input follower's passes are its leader's inputs: the leader warns (and dropped the late ones).
      const auto orphans = !discarding && captured > 0 && late.empty() && !layer.follows_a()
                               ? layer.capture().a_count() - layer.capture().g_count() : 0;
      if (orphans > 0) orphan_forwards.emplace_back(i, orphans);
      continue;
    }
    if (discarding) {
      layer.capture().clear();
      fates[i] = LayerFate::kPlainGradient;
      continue;
    }
    const std::string what = unusable_reason(i, captured);
    TORCH_CHECK(options_.unused_layer_policy() == UnusedLayerPolicy::kSkip, refusal_of(i, what));
    warn_once(i, "unused", what + "; it keeps its plain gradient meanwhile");
    layer.capture().clear();
    fates[i] = LayerFate::kPlainGradient;
    ++events_.skipped_unused;
  }
  warn_once_for_layers("late forward", late_forwards,
                       "in training mode after their last backward pass of this step (an evaluation without "
                       "torch.no_grad() or model.eval(), say): they are dropped from the factors");
  warn_once_for_layers("orphan forward", orphan_forwards,
                       "in training mode whose backward pass never reached them, before the passes that did (an "
                       "evaluation without torch.no_grad() or model.eval(), say): their A factors average those "
                       "inputs too, their G factors only the passes that had a backward pass");
  // A discarded step agrees whatever the policy: its factor collectives must reduce the same layers on every rank.
  const bool distributed = communicator_ && communicator_->size() > 1;
  if (agrees_on_unused_layers() || (discarding && distributed)) agree_on_unused_layers(fates);
  spread_group_fates(fates);
  return fates;
}

void Preconditioner::warn_of_broadcast_embeddings() {
  // An Embedding given one row of ids for the whole batch (transformers' position ids, [1, T]) whose output is added
  // to every example's: its output gradient is the batch's sum, so its G factor is the outer product of sums, not
  // the mean of the examples' products, and depends on how the batch is split. Told apart by the samples its
  // passes had (1) where other layers of a batch of sequences had more. Only those count: a layer given the tokens
  // flattened ([B*T, d], a mixture of experts' shared expert) has B*T rows of one row each, not B*T examples.
  int64_t most = 0;
  for (const auto& layer : layers_) {
    const auto& capture = layer.capture();
    if (capture.rows_per_sample() > 1) most = std::max(most, capture.samples_per_pass());
  }
  if (most <= 1) return;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const auto& capture = layers_[i].capture();
    if (capture.geometry().kind != LayerKind::kEmbedding || capture.samples_per_pass() != 1) continue;
    warn_once(i, "broadcast embedding",
              "was given one example's ids (its output had batch size 1) where other layers had " +
                  std::to_string(most) + " examples: ids shared by the batch (transformers' position ids, [1, T]), "
                  "whose output is broadcast over it. Its output gradient then sums the examples', so its G factor "
                  "is not the examples' mean and depends on the batch size; pass the ids per example (position_ids="
                  "ids.expand(batch, -1)) or leave the layer out (skip_layers)");
  }
}

bool Preconditioner::agrees_on_unused_layers() const {
  return options_.unused_layer_policy() == UnusedLayerPolicy::kSkip && communicator_ && communicator_->size() > 1;
}

void Preconditioner::agree_on_unused_layers(std::vector<LayerFate>& fates) {
  // The share of ranks that can use each layer this step (one allreduce of one number a layer: exactly 1 where
  // all can). A layer that some rank cannot use keeps its plain gradient on every rank this step: every
  // collective keeps its size, and every rank writes the same gradients.
  std::vector<double> usable;
  for (const auto fate : fates) usable.push_back(fate == LayerFate::kPreconditioned ? 1.0 : 0.0);
  comm::average_over(*communicator_, comm::kWorld, usable, comm::Purpose::kControl);
  const int world = communicator_->size();
  for (size_t i = 0; i < fates.size(); ++i) {
    if (fates[i] != LayerFate::kPreconditioned || usable[i] == 1.0) continue;
    const auto ran = static_cast<int>(std::lround(usable[i] * world));
    warn_once(i, "unused elsewhere", "could be used on " + std::to_string(ran) + " of " + std::to_string(world) +
                                         " ranks; every rank keeps its plain gradient at such steps (the ranks agree)");
    layers_[i].capture().clear();
    fates[i] = LayerFate::kPlainGradient;
    ++events_.skipped_unused;
  }
}

namespace {

// The storages of a computed state (its check included), which its computing stream made.
std::vector<c10::Storage> storages(const std::optional<PendingSecondOrder>& pending) {
  std::vector<c10::Storage> made;
  if (!pending) return made;
  for (const auto* part : pending->state.parts()) {
    if (part->defined()) made.push_back(part->storage());
  }
  made.push_back(pending->ok.storage());
  return made;
}

// Computes `pending[k]` for `sources[k]`, k in [first, first + count), as KfacLayer::start_second_order: several
// at once where `count` > 1, each on one thread; a failure is kept in `failed[k]` for the caller to report.
void compute_states(const std::vector<const KfacLayer*>& sources, const std::vector<std::pair<bool, bool>>& parts,
                    size_t first, size_t count, ComputeMethod method, double damping, bool pi_damping, bool refresh,
                    std::vector<std::optional<PendingSecondOrder>>& pending, std::vector<std::exception_ptr>& failed) {
  const auto compute = [&](size_t k) {
    try {
      pending[k] = sources[k]->start_second_order(method, damping, pi_damping, parts[k].first, parts[k].second,
                                                  refresh);
    } catch (...) {
      failed[k] = std::current_exception();
    }
  };
  if (count == 1) {
    compute(first);
    return;
  }
  const auto device = sources[first]->weight().device();
  if (device.is_cpu()) {
    at::parallel_for(0, static_cast<int64_t>(count), 1, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) compute(first + static_cast<size_t>(k));
    });
    return;
  }
  // On a device: one host thread per layer, each enqueuing on a stream of its own (lanes 1, 2, ...; a job's thread
  // has lane 0) after the work enqueued so far, and the calling thread's stream waits for them all (a
  // decomposition's waits for the device hold its thread).
  std::vector<device::SideWork> sides;
  sides.reserve(count);
  for (size_t k = 0; k < count; ++k) sides.emplace_back(device, k + 1);
  std::vector<std::thread> threads;
  try {
    for (size_t k = 0; k < count; ++k) {
      threads.emplace_back([&, k] {
        try {
          sides[k].run([&] { compute(first + k); });
        } catch (...) {  // the stream could not be set up
          if (!failed[first + k]) failed[first + k] = std::current_exception();
        }
      });
    }
  } catch (...) {  // a thread could not be started: the others end first
    for (auto& thread : threads) thread.join();
    throw;
  }
  for (auto& thread : threads) thread.join();
  for (size_t k = 0; k < count; ++k) sides[k].join(storages(pending[first + k]));
}

}  // namespace

std::vector<std::pair<bool, bool>> Preconditioner::second_order_parts(const std::vector<size_t>& layers) const {
  std::vector<std::pair<bool, bool>> parts;
  for (size_t i : layers) parts.emplace_back(executor_->computes_a(i), executor_->computes_g(i));
  return parts;
}

size_t Preconditioner::second_order_chunk() const {
  // Options::second_order_concurrency: that many layers' decompositions at once; on a CPU each on one thread (a
  // decomposition of a few hundred rows uses two threads poorly), on a device each on a stream of its own.
  const int64_t concurrency = options_.second_order_concurrency();
  return static_cast<size_t>(std::max<int64_t>(1, concurrency > 0 ? concurrency : at::get_num_threads()));
}

void Preconditioner::start_second_order_job(int64_t step, bool refresh) {
  // Computed by another thread from copies of the layers as they are now (their tensors are replaced, never
  // written in place, so the copies keep this step's factors and state; a state in a group's slots, LayerGroups, is
  // written in place only where an update is installed, shared or loaded, after this job has ended).
  auto job = std::make_unique<SecondOrderJob>();
  job->started = step;
  job->install_at = step + options_.second_order_lag();
  job->method = executor_->plan().method;
  job->damping = options_.damping_at(step);
  job->layers = second_order_layers();
  job->parts = second_order_parts(job->layers);
  for (size_t i : job->layers) job->sources.push_back(layers_[i]);
  job->pending.resize(job->layers.size());
  job->failed.resize(job->layers.size());
  job->side.emplace(device_);
  auto* work = job.get();
  job->worker = std::thread([work, parts = job->parts, chunk = second_order_chunk(),
                             pi_damping = options_.pi_damping(), refresh] {
    try {
      work->side->run([&] {
        std::vector<const KfacLayer*> sources;
        for (const auto& layer : work->sources) sources.push_back(&layer);
        for (size_t first = 0; first < sources.size(); first += chunk) {
          compute_states(sources, parts, first, std::min(chunk, sources.size() - first), work->method,
                         work->damping, pi_damping, refresh, work->pending, work->failed);
        }
      });
    } catch (...) {  // the side stream could not be set up: every layer reports it
      for (auto& failed : work->failed) {
        if (!failed) failed = std::current_exception();
      }
    }
  });
  job_ = std::move(job);
}

void Preconditioner::resume_second_order_job() {
  job_.reset();
  const int64_t lag = options_.second_order_lag();
  for (int64_t t = steps_ - 1; lag > 0 && t >= 0 && t >= steps_ - lag; --t) {
    if (!is_inverse_step(t)) continue;
    // The update of step t, in flight when the state was saved: recomputed from what was loaded, installed at the
    // step it would have been (its factors are step t's unless a factor update came between).
    if (t > options_.start_preconditioning_step()) start_second_order_job(t, !is_full_decomposition_step(t));
    return;
  }
}

std::vector<size_t> Preconditioner::second_order_layers() const {
  std::vector<size_t> todo;
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (layers_[i].has_factors() && (executor_->computes_a(i) || executor_->computes_g(i))) todo.push_back(i);
  }
  return todo;
}

void Preconditioner::compute_second_order(std::vector<LayerFate>& fates, bool refresh, bool lag) {
  PhaseClock::Span span(clock_, KfacPhase::kSecondOrder);
  // One update in flight at a time: the one before goes in first; one this step started before it failed and is
  // now retried (the same step count) is dropped, and computed again below.
  if (job_ && job_->started == steps_) job_.reset();
  if (job_) install_second_order_job(&fates);
  const double damping = options_.damping_at(steps_);
  const auto method = executor_->plan().method;
  // Options::second_order_lag: beside the steps, after the first update (at start_preconditioning_step).
  if (lag && options_.second_order_lag() > 0 && steps_ > options_.start_preconditioning_step()) {
    start_second_order_job(steps_, refresh);
    return;
  }
  // Layer by layer: each new state replaces the old one as it is computed (chosen on the device by its own
  // check), so that one layer's two states are alive at a time; then every layer's check in one read. Concurrent
  // chunks are computed, then installed in order on this thread, so that at most a chunk's new states wait beside
  // the old ones.
  const auto todo = second_order_layers();
  const auto parts = second_order_parts(todo);
  const auto chunk = second_order_chunk();
  std::vector<const KfacLayer*> sources;
  for (size_t i : todo) sources.push_back(&layers_[i]);
  std::vector<std::optional<PendingSecondOrder>> pending(todo.size());
  std::vector<std::exception_ptr> failed(todo.size());
  Installed installed;
  try {
    for (size_t first = 0; first < todo.size(); first += chunk) {
      const size_t count = std::min(chunk, todo.size() - first);
      compute_states(sources, parts, first, count, method, damping, options_.pi_damping(), refresh, pending, failed);
      for (size_t k = first; k < first + count; ++k) install_computed(todo[k], pending[k], failed[k], installed);
    }
  } catch (...) {  // out of memory part-way (rethrown by keeping_previous_state): no unchecked state stays
    undo_installed(installed, damping);
    throw;
  }
  check_installed(installed, [this](size_t i) -> const KfacLayer& { return layers_[i]; }, method, damping);
  share_second_order(&fates, damping);
}

void Preconditioner::install_computed(size_t index, std::optional<PendingSecondOrder>& pending,
                                      const std::exception_ptr& failed, Installed& installed, bool beside_the_steps) {
  keeping_previous_state(
      index,
      [&] {
        if (failed) std::rethrow_exception(failed);
        auto had = layers_[index].install_second_order(std::move(pending->state), pending->ok);
        if (had) {
          installed.fallback.emplace(index, *had);  // checked first (share_second_order absorbs it)
        } else {
          layer_groups().absorb(layers_, index);  // into its group's stacks: one layer's new state beside them
        }
        installed.layers.push_back(index);
        installed.checks.push_back(pending->ok);
      },
      beside_the_steps);
  pending.reset();  // the layer holds what it needs
}

void Preconditioner::undo_installed(Installed& installed, double damping) {
  for (auto& [i, had] : installed.fallback) layers_[i].set_second_order(std::move(had));
  relink_followers(damping);  // followers' A side and denominators as their leaders'
}

void Preconditioner::check_installed(Installed& installed, const std::function<const KfacLayer&(size_t)>& source,
                                     ComputeMethod method, double damping) {
  if (installed.layers.empty()) return;
  const auto ok = torch::stack(installed.checks).to(torch::kCPU);
  for (size_t k = 0; k < installed.layers.size(); ++k) {
    if (ok.data_ptr<bool>()[k]) continue;
    const size_t i = installed.layers[k];
    auto& layer = layers_[i];
    if (auto had = installed.fallback.find(i); had != installed.fallback.end()) {
      layer.set_second_order(std::move(had->second));
    }
    // The checked path: a general inverse where Cholesky failed, a full eigendecomposition where a refresh failed
    // (from a basis that was not finite); eigendecompositions report the NaN. From the factors the update started
    // from, into a copy whose state is the layer's own.
    keeping_previous_state(i, [&] {
      KfacLayer from = source(i);
      from.set_second_order(layer.second_order());
      from.compute_second_order(method, damping, options_.pi_damping(), executor_->computes_a(i),
                                executor_->computes_g(i));
      layer.set_second_order(from.second_order());
    });
  }
}

void Preconditioner::share_second_order(std::vector<LayerFate>* fates, double damping) {
  mark("second-order broadcast");
  clock_.collective(KfacPhase::kSecondOrder, [&] { executor_->share_second_order(layers_, damping); });
  relink_followers(damping);
  layer_groups().absorb_all(layers_);  // what the broadcasts and the followers' denominators replaced
  if (!fates) return;
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (!layers_[i].second_order().defined() && executor_->preconditions(i)) (*fates)[i] = LayerFate::kPlainGradient;
  }
}

Preconditioner::SecondOrderJob::~SecondOrderJob() {
  if (worker.joinable()) worker.join();
  // A job dropped unjoined (a load): the step's stream still waits for the side stream, before the tensors that
  // stream reads go back to the step stream's pool.
  try {
    if (side) side->join({});
  } catch (const std::exception& e) {  // a device already in error: nothing more to wait for
    TORCH_WARN("K-FAC: waiting for a second-order update beside the steps failed: ", e.what());
  }
}

void Preconditioner::install_second_order_job(std::vector<LayerFate>* fates) {
  auto job = std::move(job_);
  mark("second-order wait");
  job->worker.join();  // the time it still needed shows in this step's second-order phase
  std::vector<c10::Storage> made;
  for (const auto& pending : job->pending) {
    const auto more = storages(pending);
    made.insert(made.end(), more.begin(), more.end());
  }
  job->side->join(made);
  Installed installed;
  try {
    for (size_t k = 0; k < job->layers.size(); ++k) {
      // Whatever the thread failed with (out of memory beside the next steps' passes included) is that layer's
      // failure, counted and warned about: the layer keeps its state, and this rank still shares with the others.
      install_computed(job->layers[k], job->pending[k], job->failed[k], installed, /*beside_the_steps=*/true);
    }
  } catch (...) {
    undo_installed(installed, job->damping);
    throw;
  }
  std::map<size_t, size_t> source_of;
  for (size_t k = 0; k < job->layers.size(); ++k) source_of[job->layers[k]] = k;
  check_installed(installed, [&](size_t i) -> const KfacLayer& { return job->sources[source_of.at(i)]; },
                  job->method, job->damping);
  share_second_order(fates, job->damping);
}


void Preconditioner::keeping_previous_state(size_t index, const std::function<void()>& update, bool beside_the_steps) {
  mark("second-order update", static_cast<int64_t>(index));
  const auto failed = [&](const std::string& what) {
    ++events_.second_order_failures;
    warn_once(index, "second_order",
              std::string(beside_the_steps ? "second-order update beside the steps failed"
                                           : "second-order update failed") +
                  ", keeping the previous state: " + what);
  };
  try {
    update();
  } catch (const c10::OutOfMemoryError& e) {
    if (!beside_the_steps) throw;  // step() names it with the phase and layer
    failed(e.what_without_backtrace());
  } catch (const c10::Error& e) {
    failed(e.what_without_backtrace());
  } catch (const std::exception& e) {
    if (!beside_the_steps) throw;
    failed(e.what());
  } catch (...) {
    if (!beside_the_steps) throw;
    failed("an unknown error");
  }
}

namespace {

/// cuBLAS's float32 matmuls in TF32 while it lives, as Options::precondition_dtype tf32 asks, then off again where
/// it switched them on (torch's allow_tf32 was off).
/// The setting is the process's, read when each product is launched: products another thread launches meanwhile
/// take it too (step() runs between the backward pass and the optimizer's step).
class Tf32Matmuls {
 public:
  // torch's allow_tf32 switch (torch.backends.cuda.matmul.allow_tf32), which keeps its newer fp32_precision
  // setting in step: reading one after the other was set alone raises in torch 2.9 and later.
  explicit Tf32Matmuls(bool on) : on_(on && !at::globalContext().allowTF32CuBLAS()) {
    if (on_) at::globalContext().setAllowTF32CuBLAS(true);
  }
  ~Tf32Matmuls() {
    if (on_) at::globalContext().setAllowTF32CuBLAS(false);
  }
  Tf32Matmuls(const Tf32Matmuls&) = delete;
  Tf32Matmuls& operator=(const Tf32Matmuls&) = delete;

 private:
  bool on_;  // switched on here, so switched off again
};

}  // namespace

std::vector<torch::Tensor> Preconditioner::precondition(const std::vector<LayerFate>& fates, double kl_clip,
                                                        std::vector<torch::Tensor>& vg) {
  PhaseClock::Span span(clock_, KfacPhase::kPrecondition);
  std::vector<torch::Tensor> preconditioned(layers_.size());
  torch::NoGradGuard no_grad;
  const Tf32Matmuls tf32(options_.precondition_dtype() == PreconditionDtype::kTf32 && device_.is_cuda());
  const double nan = std::numeric_limits<double>::quiet_NaN();
  vg.assign(layers_.size(), torch::Tensor());
  std::vector<bool> done(layers_.size(), false);
  guard_rows_.assign(layers_.size(), torch::Tensor());
  precondition_groups(fates, kl_clip, preconditioned, vg, done);
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (done[i]) continue;
    auto& layer = layers_[i];
    mark("preconditioning", static_cast<int64_t>(i));
    const bool mine = executor_->preconditions(i);
    const auto options = layer.weight().options();
    if (mine && fates[i] == LayerFate::kPreconditioned && layer.second_order().defined()) {
      auto& v = preconditioned[i];
      const auto grad = layer.gradient();  // [g, a]: a copy where the bias gradient joins as a column
      if (options_.eigen_adam()) {
        v = layer.precondition_adam(grad, adam_constants());
      } else {
        if (!options_.compute_eigenvalue_outer_product() && layer.second_order().method == ComputeMethod::kEigen) {
          layer.finish_second_order(options_.damping_at(steps_));  // this step's damping, not the last update's
        }
        v = layer.second_order().precondition(grad);
      }
      // A layer whose factors were not finite this step sends NaN, so that its whole row falls back.
      if (factor_ok_[i].defined()) v.masked_fill_(factor_ok_[i].logical_not(), nan);
      // KL clipping's sum, while the gradient is at hand (guard_and_clip would gather it again).
      if (kl_clip > 0.0) vg[i] = (v * grad).sum().to(torch::kFloat64);
    } else if (mine && executor_->plan().world_size() > 1) {
      // A grad worker that cannot precondition sends NaN so that its whole row falls back together.
      preconditioned[i] = torch::full({layer.g_dim(), layer.a_dim()}, nan, options);
    } else if (!mine && !executor_->owner_rows(i)) {
      preconditioned[i] = torch::empty({layer.g_dim(), layer.a_dim()}, options);  // filled by the row broadcast
    }
  }
  mark("gradient broadcast");
  clock_.collective(KfacPhase::kPrecondition, [&] { executor_->share_gradients(preconditioned); });
  return preconditioned;
}

LayerGroups& Preconditioner::layer_groups() {
  const bool applies = executor_->plan().stack_layers;
  std::vector<bool> held(layers_.size(), false);
  // A weight moved to another dtype or device in place (module.float(), .to(...): the same Parameter) leaves its
  // group of layers alike: planned again.
  std::vector<std::pair<c10::ScalarType, c10::Device>> kinds(applies ? layers_.size() : 0,
                                                             {c10::ScalarType::Undefined, c10::kCPU});
  for (size_t i = 0; applies && i < layers_.size(); ++i) {
    held[i] = executor_->preconditions(i) && (layers_[i].has_factors() || layers_[i].second_order().defined());
    kinds[i] = {layers_[i].weight().scalar_type(), layers_[i].weight().device()};
  }
  if (grouped_for_.lock() != executor_ || held != grouped_layers_ || kinds != grouped_kinds_) {
    groups_.clear(layers_);
    if (applies) {
      groups_.plan(layers_, [&](size_t i) { return held[i]; }, executor_->plan().method, executor_->plan().pad_widths,
                   options_.eigen_adam());
    }
    groups_.absorb_all(layers_);
    grouped_for_ = executor_;
    grouped_layers_ = std::move(held);
    grouped_kinds_ = std::move(kinds);
  }
  return groups_;
}

void Preconditioner::precondition_groups(const std::vector<LayerFate>& fates, double kl_clip,
                                         std::vector<torch::Tensor>& preconditioned, std::vector<torch::Tensor>& vg,
                                         std::vector<bool>& done) {
  auto& groups = layer_groups();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (size_t k = 0; k < groups.groups().size(); ++k) {
    const auto& group = groups.groups()[k];
    const bool all = std::all_of(group.members.begin(), group.members.end(), [&](size_t i) {
      return fates[i] == LayerFate::kPreconditioned && layers_[i].second_order().defined();
    });
    if (!all || !groups.ready(layers_, k)) continue;  // layer by layer this step
    const auto& first = layers_[group.members.front()];
    mark("preconditioning", static_cast<int64_t>(group.members.front()));
    const auto grad_options = first.weight().options();
    const int64_t g = group.g_dim, a = group.a_dim;
    const int64_t pg = group.padded_g, pa = group.padded_a;  // Options::pad_widths: the stacks' widths
    const int64_t units = static_cast<int64_t>(group.units.size());
    const int64_t per_batch = strategy::stacked_batch_units(
        pg, pa, group.share, static_cast<int64_t>(c10::elementSize(grad_options.dtype().toScalarType())));
    for (int64_t u = 0; u < units; u += per_batch) {
      const int64_t count = std::min(per_batch, units - u);
      const int64_t first_member = u * group.share;
      const int64_t members = count * group.share;
      // The gradients, gathered once; padded with zeros, which the products keep out of each layer's [g, a].
      auto grads = group.padded() ? torch::zeros({members, pg, pa}, grad_options)
                                  : torch::empty({members, g, a}, grad_options);
      for (int64_t m = 0; m < members; ++m) {
        layers_[group.members[static_cast<size_t>(first_member + m)]].copy_gradient_to(
            grads[m].narrow(0, 0, g).narrow(1, 0, a));
      }
      const auto state_dtype = group.g.scalar_type();
      const auto x = grads.scalar_type() == state_dtype ? grads : grads.to(state_dtype);
      const auto a_side = group.a.narrow(0, u, count);
      const auto g_side = group.g.narrow(0, first_member, members);
      torch::Tensor v;
      if (group.adam) {  // Options::eigen_adam: each layer's moments, in its current basis, stepped with the batch
        std::vector<math::EigenAdamMoments*> moments;
        for (int64_t m = 0; m < members; ++m) {
          moments.push_back(&layers_[group.members[static_cast<size_t>(first_member + m)]].adam_moments_for_step());
        }
        v = math::eigen_adam_step_stacked(a_side, g_side, moments, x, g, a, adam_constants());
      } else if (group.method == ComputeMethod::kEigen) {
        v = math::precondition_eigen_stacked(a_side, g_side, group.denominator.narrow(0, first_member, members), x);
      } else {
        v = math::precondition_inverse_stacked(a_side, g_side, x);
      }
      if (v.scalar_type() != grads.scalar_type()) v = v.to(grads.scalar_type());
      std::vector<torch::Tensor> folded(static_cast<size_t>(members));  // factor_ok_, where factors folded
      bool any_folded = false;
      for (int64_t m = 0; m < members; ++m) {
        const size_t i = group.members[static_cast<size_t>(first_member + m)];
        preconditioned[i] = v[m].narrow(0, 0, g).narrow(1, 0, a);
        // A layer whose factors were not finite this step sends NaN, so that its whole row falls back.
        if (factor_ok_[i].defined()) {
          preconditioned[i].masked_fill_(factor_ok_[i].logical_not(), nan);
          folded[static_cast<size_t>(m)] = factor_ok_[i];
          any_folded = true;
        }
        done[i] = true;
      }
      if (any_folded) {  // 1 (true) for the members that folded none this step
        const auto yes = torch::ones({}, torch::TensorOptions().dtype(torch::kBool).device(v.device()));
        for (auto& ok : folded) {
          if (!ok.defined()) ok = yes;
        }
      }
      // The batch's guard rows (guard_and_clip's columns for each layer) in a few kernels for all its layers, and
      // KL clipping's sums in one reduction (in the gradient's dtype, as layer by layer).
      const auto options64 = torch::TensorOptions().dtype(torch::kFloat64).device(v.device());
      const auto ones = torch::ones({members}, options64);
      const auto finite = math::finite_by_sum(v, {{1, 2}}).to(torch::kFloat64);
      const auto sums = kl_clip > 0.0 ? (v * grads).sum({1, 2}).to(torch::kFloat64) : ones;
      const auto folded_column = any_folded ? torch::stack(folded).to(torch::kFloat64) : ones;
      const auto rows = torch::stack({ones, finite, folded_column, sums}, 1);
      for (int64_t m = 0; m < members; ++m) {
        const size_t i = group.members[static_cast<size_t>(first_member + m)];
        guard_rows_[i] = rows[m];
        if (kl_clip > 0.0) vg[i] = sums[m];
      }
    }
  }
}

Preconditioner::GuardVerdict Preconditioner::guard_verdict(const double* row) {
  if (row[GuardReport::kReported] < 1.0) return GuardVerdict::kNotPreconditioned;  // an owner could not (and said why)
  if (row[GuardReport::kFolded] < 1.0) return GuardVerdict::kFactorsNotFinite;
  if (row[GuardReport::kFinite] < 1.0) return GuardVerdict::kGradientNotFinite;
  return GuardVerdict::kPrecondition;
}

torch::Tensor Preconditioner::kl_scale(const GuardReport& report, double kl_clip) const {
  const auto one = torch::ones({}, report.rows.options());
  if (kl_clip <= 0.0) return one;
  // math::kl_clip_scale on the device: 1 where the sum is 0. An unusable row's sum may be NaN: selected out, not
  // multiplied by 0 (NaN * 0 is NaN). Both divisions and the square root are IEEE's, as the host's.
  const auto vg = report.vg_sum * step_scalars_[0];
  return torch::where(vg == 0, one, torch::clamp_max(torch::sqrt(step_scalars_[1] / vg.abs()), 1.0));
}

void Preconditioner::set_step_scalars(double kl_clip) {
  const double lr = options_.lr_at(steps_);
  const auto host = torch::TensorOptions().dtype(torch::kFloat64).pinned_memory(device_.is_cuda());
  auto values = torch::empty({2}, host);
  values[0] = lr * lr;
  values[1] = kl_clip;
  const auto stream = device::current_stream(device_);
  if (!step_scalars_.defined() || step_scalars_.device() != device_ || scalars_stream_ != stream) {
    step_scalars_ = torch::empty({2}, torch::TensorOptions().dtype(torch::kFloat64).device(device_));
    scalars_stream_ = stream;
  }
  step_scalars_.copy_(values, /*non_blocking=*/true);  // pinned: queued, the host goes on
}

Preconditioner::GuardReport Preconditioner::guard_and_clip(std::vector<LayerFate>& fates,
                                                           const std::vector<torch::Tensor>& preconditioned,
                                                           const std::vector<torch::Tensor>& vg, double kl_clip,
                                                           const Distributor& model) {
  PhaseClock::Span span(clock_, KfacPhase::kApply);
  mark("NaN guard and KL clipping");
  torch::NoGradGuard no_grad;
  GuardReport report;
  report.step = steps_;
  report.kl_clip = kl_clip;
  report.lr = options_.lr_at(steps_);
  // Owner placement: a layer's V is on its owners only (one per row); every rank has a row for it (zeros where
  // it is no owner), which agree_on_reports makes the owners' mean everywhere.
  std::vector<torch::Tensor> rows;
  const auto one = torch::ones({}, torch::TensorOptions().dtype(torch::kFloat64).device(device_));
  for (size_t i = 0; i < layers_.size(); ++i) {
    const auto& v = preconditioned[i];
    const bool placed = executor_->owner_rows(i);
    const bool reported = fates[i] == LayerFate::kPreconditioned && v.defined() && (!placed || executor_->preconditions(i));
    if (!reported) {
      fates[i] = LayerFate::kPlainGradient;
      if (!placed) continue;
      rows.push_back(torch::zeros({GuardReport::kColumns}, one.options()));
    } else if (guard_rows_.size() > i && guard_rows_[i].defined() &&
               (kl_clip <= 0.0 || i >= model.counted_elsewhere.size() || !model.counted_elsewhere[i])) {
      rows.push_back(guard_rows_[i]);  // computed with its group's batch (precondition_groups), the same columns
    } else {
      auto finite = math::finite_by_sum(v).to(torch::kFloat64);
      auto folded = factor_ok_[i].defined() ? factor_ok_[i].to(torch::kFloat64) : one;
      const bool counted = i >= model.counted_elsewhere.size() || !model.counted_elsewhere[i];
      auto vg_i = kl_clip <= 0.0    ? one
                  : !counted        ? torch::zeros({}, one.options())  // another model-parallel rank adds it
                  : vg[i].defined() ? vg[i]                            // preconditioned here
                                    : (v * layers_[i].gradient()).sum().to(torch::kFloat64);
      rows.push_back(torch::stack({one, finite, folded, vg_i}));
    }
    report.layers.push_back(i);
  }
  std::fill(factor_ok_.begin(), factor_ok_.end(), torch::Tensor());
  guard_rows_.clear();
  report.rows = rows.empty() ? torch::zeros({0, GuardReport::kColumns}, one.options()) : torch::stack(rows);
  if (std::any_of(report.layers.begin(), report.layers.end(), [&](size_t i) { return executor_->owner_rows(i); })) {
    clock_.collective(KfacPhase::kApply, [&] { executor_->agree_on_reports(report.rows, report.layers); });
  }
  report.usable = (report.rows.narrow(1, 0, GuardReport::kVg) >= 1.0).all(1);
  if (kl_clip > 0.0) {
    // An unusable row's sum may be NaN: selected out, not multiplied by 0 (NaN * 0 is NaN).
    const auto vgs = report.rows.select(1, GuardReport::kVg);
    report.vg_sum = torch::where(report.usable, vgs, torch::zeros_like(vgs)).sum();
    if (model.sum_over_model) {  // the other parts' layers (stages, tensor-parallel slices): one nu for the model
      front_end([&] { clock_.collective(KfacPhase::kApply, [&] { model.sum_over_model(report.vg_sum); }); });
      if (communicator_) communicator_->add_traffic(comm::Purpose::kControl, 1, 8);
      report.model_summed = true;
    }
  }
  report.scale = kl_scale(report, kl_clip);
  for (const size_t i : report.layers) {
    // An owner-placed layer is written by its owners alone; the front end scatters their rows.
    const bool writes = !executor_->owner_rows(i) || executor_->preconditions(i);
    if (!writes) fates[i] = LayerFate::kPlainGradient;
  }
  // The fates final before write_gradients().
  if (read_guard_at_once_.value_or(device_.is_cpu())) settle_guard(report, &fates);
  return report;
}

void Preconditioner::settle_guard(GuardReport& report, std::vector<LayerFate>* fates) {
  const auto rows = (report.host_rows.defined() ? report.host_rows : report.rows.to(torch::kCPU)).contiguous();
  double vg_sum = 0.0;
  for (size_t k = 0; k < report.layers.size(); ++k) {
    const size_t i = report.layers[k];
    const double* row = rows.data_ptr<double>() + GuardReport::kColumns * static_cast<int64_t>(k);
    const auto verdict = guard_verdict(row);
    if (verdict == GuardVerdict::kPrecondition) vg_sum += row[GuardReport::kVg];
    if (verdict == GuardVerdict::kFactorsNotFinite) {
      warn_factor_fallback(i, report.step);
    } else if (verdict == GuardVerdict::kGradientNotFinite) {
      warn_once(i, "gradient", "gradient or preconditioned gradient contains NaN or Inf; keeping the plain gradient "
                               "for this step", report.step);
      ++events_.fallbacks;
    }
    if (verdict != GuardVerdict::kPrecondition && fates != nullptr) (*fates)[i] = LayerFate::kPlainGradient;
  }
  if (fates == nullptr) {  // after the device applied its scale
    last_kl_scale_ = (report.host_scale.defined() ? report.host_scale : report.scale).item<double>();
    return;
  }
  if (report.model_summed) vg_sum = report.vg_sum.item<double>();  // this part's and the others'
  last_kl_scale_ = report.kl_clip > 0.0 ? math::kl_clip_scale(vg_sum * report.lr * report.lr, report.kl_clip) : 1.0;
  report.scale = torch::Tensor();  // settled: write_gradients() uses the fates and last_kl_scale_
}

void Preconditioner::settle_pending_guards(bool wait) {
  while (!pending_guards_.empty()) {
    auto& report = pending_guards_.front();
    const bool done = !report.copied || report.copied->reached();
    if (!done && !wait && pending_guards_.size() <= kMaxPendingGuards) return;
    // The copies, waited for: the device's rows may be a later step's by now (Options::cuda_graphs: a graph's
    // replays write the same tensors).
    if (!done) report.copied->wait();
    settle_guard(report, nullptr);
    pending_guards_.pop_front();
  }
}

void Preconditioner::write_gradients(const std::vector<LayerFate>& fates,
                                     const std::vector<torch::Tensor>& preconditioned, const GuardReport& report) {
  PhaseClock::Span span(clock_, KfacPhase::kApply);
  mark("writing gradients");
  torch::NoGradGuard no_grad;
  if (!report.scale.defined()) {  // settled on the host
    const double scale = last_kl_scale_;
    for (size_t i = 0; i < layers_.size(); ++i) {
      if (fates[i] == LayerFate::kPlainGradient) continue;
      layers_[i].set_gradient(scale == 1.0 ? preconditioned[i] : preconditioned[i] * scale);
    }
    return;
  }
  // On the device: each candidate layer keeps its plain gradient where its row says so, without the host
  // reading the rows; the report is read once the device is done with it, or when needed (settle_pending_guards).
  for (size_t k = 0; k < report.layers.size(); ++k) {
    const size_t i = report.layers[k];
    if (fates[i] == LayerFate::kPlainGradient) continue;
    const auto& v = preconditioned[i];
    const auto scaled = v * report.scale.to(v.scalar_type());
    layers_[i].set_gradient_where(report.usable[static_cast<int64_t>(k)], scaled);
  }
}

void Preconditioner::defer_guard_read(GuardReport report) {
  auto& pending = report;
  if (pending.rows.is_cuda()) {  // copies the host reads later without waiting, once the mark is reached
    const auto pinned = torch::TensorOptions().dtype(torch::kFloat64).pinned_memory(true);
    pending.host_rows = torch::empty(pending.rows.sizes(), pinned);
    pending.host_rows.copy_(pending.rows, /*non_blocking=*/true);
    pending.host_scale = torch::empty({}, pinned);
    pending.host_scale.copy_(pending.scale, /*non_blocking=*/true);
    pending.copied = device::Mark::now(device_);
  }
  pending_guards_.push_back(std::move(pending));
}

void Preconditioner::arm_capture() {
  drop_stale_hook_folds();
  const bool capture = is_factor_step(steps_);
  for (size_t i = 0; i < layers_.size(); ++i) {
    layers_[i].set_capture(capture && executor_->builds_factors(i));
  }
  if (capture) executor_->arm_factor_step(options_.accumulation_steps());
  armed_step_ = steps_;
  armed_factor_step_ = capture;
}

bool Preconditioner::rearm_capture() {
  const bool captured = std::any_of(layers_.begin(), layers_.end(), [](KfacLayer& layer) {
    auto& c = layer.capture();
    return c.a_count() > 0 || c.g_count() > 0 || c.folded_passes() > 0 || c.empty_passes() > 0;
  });
  if (captured) return false;
  arm_capture();
  return true;
}

void Preconditioner::set_adam_constants(double beta1, double beta2, double eps) {
  auto next = options_;
  next.set("adam_beta1", beta1).set("adam_beta2", beta2).set("adam_eps", eps);
  next.validate();
  options_ = std::move(next);
}

bool Preconditioner::factor_step_as_armed() {
  if (armed_step_ != steps_) return is_factor_step(steps_);
  if (armed_factor_step_ != is_factor_step(steps_) && !warned_schedule_change_) {  // armed_factor_step(), warned
    warned_schedule_change_ = true;
    TORCH_WARN("dkfac: step ", steps_, " is ", armed_factor_step_ ? "" : "not ", "a factor step, as the end of the "
               "last step() armed the captures by factor_update_steps then; the schedule now says the opposite: it "
               "changed after that, once this step's passes were ", armed_factor_step_ ? "captured" : "left out",
               ". The change applies from the next step (a change made before this step's forward pass applies to "
               "it: dkfac.LambdaParamScheduler.step() and an assignment of preconditioner._factor_update_steps "
               "re-arm the captures; C++: Preconditioner::rearm_capture) (warned once)");
  }
  return armed_factor_step_;
}

void Preconditioner::close_step_timing() {
  for (auto& layer : layers_) {
    auto timing = layer.capture().take_timing();
    clock_.add_seconds(KfacPhase::kFactors, timing.seconds);
    for (auto& [start, end] : timing.spans) clock_.add(KfacPhase::kFactors, start, end);
  }
  clock_.close_step();
}

PhaseTimes Preconditioner::last_step_times() const { return clock_.last_step(); }

PhaseTimes Preconditioner::total_times() const { return clock_.total(); }

void Preconditioner::warn_factor_fallback(size_t index, int64_t step) {
  warn_once(index, "factor", "captured factors contain NaN or Inf; factors not updated and the plain gradient is kept "
                             "for this step", step);
  ++events_.fallbacks;
}

void Preconditioner::warn_once(size_t index, const std::string& kind, const std::string& message, int64_t step) {
  const auto& layer = layers_[index];
  if (!warned_.emplace(layer.name(), kind).second) return;
  TORCH_WARN("dkfac: layer ", names_.layer(layer, index), ", step ", step >= 0 ? step : steps_, ": ", message,
             " (warned once per layer)");
}

void Preconditioner::warn_once_for_layers(const std::string& kind,
                                         const std::vector<std::pair<size_t, int64_t>>& counts,
                                         const std::string& message) {
  std::vector<std::pair<std::string, int64_t>> named;
  for (const auto& [index, passes] : counts) {
    if (warned_.emplace(layers_[index].name(), kind).second) {
      named.emplace_back(names_.layer(layers_[index], index), passes);
    }
  }
  if (named.empty()) return;
  const bool same = std::all_of(named.begin(), named.end(), [&](const auto& n) { return n.second == named[0].second; });
  std::vector<std::string> items;
  for (const auto& [name, passes] : named) items.push_back(name + (same ? "" : ": " + std::to_string(passes)));
  TORCH_WARN("dkfac: step ", steps_, ": ", named.size(), named.size() == 1 ? " layer (" : " layers (",
             first_four(items), ") ran ",
             same ? std::to_string(named[0].second) : std::string("some"), " forward pass(es) ", message,
             " (warned once per layer)");
}

int64_t Preconditioner::memory_bytes() const {
  int64_t total = second_order_in_flight_bytes() + groups_.padding_bytes();
  for (const auto& layer : layers_) total += layer.memory_bytes();
  return total;
}

int64_t Preconditioner::second_order_in_flight_bytes() const {
  // The states computed beside the steps (as large as the ones they replace) wait beside the ones in use until
  // installed, and the factors they are computed from stay until then where newer ones replaced them (read here, not
  // the job's results, which its thread may be writing). A shared-input group's follower holds its leader's A: each
  // factor is counted once, whichever copies keep it.
  //
  // Where the groups were planned again while the job runs (Options::stack_layers: a layer's first factors), the
  // copies it reads hold views of the old stacks, which no layer holds any more: each such storage is alive whole
  // until the job is installed, and counted once.
  int64_t total = 0;
  if (!job_) return total;
  std::set<const void*> held;  // storages: the layers' second-order parts', then the old ones counted
  for (const auto& layer : layers_) {
    for (const auto* part : layer.second_order().parts()) {
      if (part->defined()) held.insert(part->storage().unsafeGetStorageImpl());
    }
  }
  for (const auto& from : job_->sources) {
    for (const auto* part : from.second_order().parts()) {
      if (!part->defined()) continue;
      const void* storage = part->storage().unsafeGetStorageImpl();
      if (held.insert(storage).second) total += static_cast<int64_t>(part->storage().nbytes());
    }
  }
  std::set<const void*> counted;
  for (size_t k = 0; k < job_->layers.size(); ++k) {
    const auto& now = layers_[job_->layers[k]];
    const auto& from = job_->sources[k];
    // The sides this rank computes are new (KfacLayer::start_second_order: the others are the state's own tensors),
    // and the denominator where it computes both; the layer's state in use stands in for their sizes (a follower
    // computes no A: StepPlan::computes_a, its leader's).
    const auto [a, g] = job_->parts[k];
    const auto state = now.second_order();
    const auto all = state.parts();
    for (size_t p = 0; p < all.size(); ++p) {
      const bool denominator = all[p] == &state.denominator;
      const bool computed = denominator ? a && g : SecondOrderState::a_side(p) ? a : g;
      if (computed && all[p]->defined()) total += static_cast<int64_t>(all[p]->nbytes());
    }
    const std::pair<const torch::Tensor*, const torch::Tensor*> sides[] = {{&from.a_factor(), &now.a_factor()},
                                                                           {&from.g_factor(), &now.g_factor()}};
    for (const auto& [was, is] : sides) {
      if (was->defined() && !was->is_same(*is) && counted.insert(was->data_ptr()).second) {
        total += static_cast<int64_t>(was->nbytes());
      }
    }
  }
  return total;
}

}  // namespace dkfac
