#include "dkfac/preconditioner.h"

#include "dkfac/comm/agreement.h"
#include "dkfac/device.h"
#include "dkfac/layers/discovery.h"
#include "dkfac/nn/kfac_module.h"
#include "dkfac/numbers.h"
#include "dkfac/strategy/time_model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <iomanip>
#include <limits>
#include <map>
#include <regex>
#include <sstream>

namespace dkfac {
namespace {

// A layer's two factors as messages name them, with their width and whether they are kept diagonal.
struct FactorSide {
  const char* name;
  int64_t dim;
  bool diagonal;
};
std::array<FactorSide, 2> factor_sides(const KfacLayer& layer) {
  return {{{"A", layer.a_dim(), layer.a_diagonal()}, {"G", layer.g_dim(), layer.g_diagonal()}}};
}

// Warns, once per layer at construction, about factors wider than options.large_factor_dim(): their
// memory and the cost of one second-order update, which the first step() pays without a word otherwise.
void report_large_factors(const std::vector<KfacLayer>& layers, const Options& options, const MessageNames& names) {
  const int64_t limit = options.large_factor_dim();
  if (limit <= 0) return;
  const bool eigen = options.compute_method() == ComputeMethod::kEigen;
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& layer = layers[i];
    // A diagonal factor costs d values and no decomposition: never large.
    const auto sides = factor_sides(layer);
    const auto large = [limit](const FactorSide& f) { return !f.diagonal && f.dim > limit; };
    if (!large(sides[0]) && !large(sides[1])) continue;
    const double factor_bytes = static_cast<double>(c10::elementSize(layer.factor_dtype()));
    const double state_bytes = static_cast<double>(c10::elementSize(layer.second_order_dtype()));
    std::ostringstream what;
    double flops = 0.0;
    for (const auto& side : sides) {
      if (!large(side)) continue;
      const int64_t dim = side.dim;
      const double d = static_cast<double>(dim);
      // Eigen: eigenvectors d x d and eigenvalues d; inverse: one d x d inverse.
      const double decomposition = (eigen ? d * d + d : d * d) * state_bytes;
      const double cost = eigen ? 9.0 * d * d * d : d * d * d;
      flops += cost;
      what << (what.tellp() > 0 ? "; " : "") << side.name << " factor " << dim << " x " << dim << ": "
           << human_bytes(d * d * factor_bytes) << " (" << c10::toString(layer.factor_dtype()) << "), its "
           << (eigen ? "eigendecomposition " : "inverse ") << human_bytes(decomposition) << ", "
           << human_flops(cost) << " per second-order update (" << (eigen ? "9 d^3" : "d^3") << ")";
    }
    TORCH_WARN("dkfac: layer ", names.layer(layer, i), " has a factor wider than ",
               names.option("large_factor_dim", std::to_string(limit)), ": ", what.str(),
               ". Each second-order update of this layer costs ", human_flops(flops),
               " (the first one comes with the first step(); tens of seconds on a few cores for d ~ 6000); make the ",
               "layer narrower (e.g. pool before a Linear), keep it diagonal with ",
               names.option("diagonal_factor_dim", std::to_string(limit)), ", skip it with skip_layers, or update less ",
               "often with inv_update_steps");
  }
}

// Refuses, before anything is allocated, layers whose dense factors could not fit in the device's memory: on the
// CPU the kernel's out-of-memory killer would end the process at the first factor step without a word (a
// 50257-token head with diagonal_factor_dim 0 asks 9.4 GiB per copy of its G factor). Counted: each dense
// factor three times (the running factor, the captured batch, and its eigenvectors or inverse).
void refuse_factors_beyond_memory(const std::vector<KfacLayer>& layers, const Options& options,
                                  const MessageNames& names) {
  const auto total = device::total_memory(layers.front().weight().device());
  if (!total) return;
  double needed = 0.0;
  std::string widest;
  double widest_bytes = 0.0;
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& layer = layers[i];
    const double element = static_cast<double>(c10::elementSize(layer.factor_dtype()));
    for (const auto& side : factor_sides(layer)) {
      const double d = static_cast<double>(side.dim);
      const double bytes = (side.diagonal ? d : d * d) * element;
      needed += 3.0 * bytes;
      if (bytes > widest_bytes) {
        widest_bytes = bytes;
        const auto dim = std::to_string(side.dim);
        widest = names.layer(layer, i) + "'s " + side.name + " factor " + dim + " x " + dim;
      }
    }
  }
  TORCH_CHECK(needed <= static_cast<double>(*total), "dkfac: the K-FAC factors of these layers need about ",
              human_bytes(needed), " (each dense factor three times: running, captured, decomposed), more than this ",
              "machine's ", human_bytes(static_cast<double>(*total)), " of memory; the widest is ", widest, " (",
              human_bytes(widest_bytes), "). Keep wide factors diagonal with ",
              names.option("diagonal_factor_dim", std::to_string(options.diagonal_factor_dim() > 0
                                                                      ? options.diagonal_factor_dim()
                                                                      : Options().diagonal_factor_dim())),
              ", or leave the layer out with skip_layers");
}

bool all_parameters_require_grad(const torch::nn::Module& module) {
  for (const auto& p : module.parameters(/*recurse=*/false)) {
    if (!p.requires_grad()) return false;
  }
  return true;
}

}  // namespace

std::string MessageNames::layer(const KfacLayer& layer, size_t index) const {
  const std::string kind = index < layer_classes.size() ? layer_classes[index] : to_string(layer.kind());
  return "'" + layer.name() + "' (" + kind + ")";
}

std::string MessageNames::option(const std::string& name, const std::string& value) const {
  return option_prefix + name + option_separator + value;
}


namespace {

// The dkfac::nn modules of `model` that choose_layers (layers/discovery.h) keeps.
std::vector<LayerBinding> bind_modules(const std::shared_ptr<torch::nn::Module>& model, const Options& options) {
  TORCH_CHECK(model != nullptr, "Preconditioner needs a model, got nullptr");
  options.validate();  // before the skip_layers patterns are used
  std::vector<ModuleCandidate> candidates;
  std::vector<const nn::KfacModule*> modules;
  // Every module holding each parameter: a Parameter in two modules is a tied weight (a language model's head
  // and its token embedding).
  std::map<const c10::TensorImpl*, std::vector<std::string>> owners;
  const auto named = model->named_modules(/*name_prefix=*/"", /*include_self=*/true);
  for (const auto& item : named) {
    for (const auto& p : item.value()->parameters(/*recurse=*/false)) owners[p.unsafeGetTensorImpl()].push_back(item.key());
  }
  for (const auto& item : named) {
    const auto* kfac_module = dynamic_cast<const nn::KfacModule*>(item.value().get());
    if (kfac_module == nullptr) continue;
    const auto kind = kfac_module->shared_factor_capture()->geometry().kind;
    ModuleCandidate candidate{item.key(), to_string(kind), kind, all_parameters_require_grad(*item.value()), 1, "", {}};
    for (const auto& p : item.value()->parameters(/*recurse=*/false)) {
      for (const auto& other : owners[p.unsafeGetTensorImpl()]) {
        const auto& tied = candidate.tied_to;
        if (other != item.key() && std::find(tied.begin(), tied.end(), other) == tied.end()) {
          candidate.tied_to.push_back(other);
        }
      }
    }
    candidates.push_back(std::move(candidate));
    modules.push_back(kfac_module);
  }
  std::vector<LayerBinding> bindings;
  for (size_t i : choose_layers(candidates, options.skip_layers(), model->name())) {
    bindings.push_back({candidates[i].name, modules[i]->kfac_weight(), modules[i]->kfac_bias(),
                        modules[i]->shared_factor_capture()});
  }
  return bindings;
}

}  // namespace

Preconditioner::Preconditioner(std::shared_ptr<torch::nn::Module> model, Options options,
                               std::shared_ptr<comm::Communicator> communicator)
    : Preconditioner(bind_modules(model, options), options, std::move(communicator)) {
  // `options` is copied, not moved: the arguments' evaluation order is unspecified.
  model_ = std::move(model);
  const auto named = model_->named_modules(/*name_prefix=*/"", /*include_self=*/true);
  for (const auto& layer : layers_) modules_.push_back(dynamic_cast<const nn::KfacModule*>(named[layer.name()].get()));
}

Preconditioner::Preconditioner(std::vector<LayerBinding> layers, Options options,
                               std::shared_ptr<comm::Communicator> communicator, MessageNames names)
    : options_(std::move(options)), names_(std::move(names)) {
  options_.validate();
  TORCH_CHECK(!layers.empty(), "Preconditioner needs at least one layer to precondition");
  TORCH_CHECK(names_.layer_classes.empty() || names_.layer_classes.size() == layers.size(),
              "MessageNames::layer_classes names ", names_.layer_classes.size(), " layers, but ", layers.size(),
              " are registered: give one class per layer or none");
  for (auto& binding : layers) {
    binding.capture->set_factor_dtype(options_.factor_dtype());
    binding.capture->set_grad_scale(options_.grad_scaler());
    binding.capture->set_reduce(options_.kfac_approx() == KfacApprox::kReduce);
    layers_.emplace_back(std::move(binding));
    layers_.back().set_inv_dtype(options_.inv_dtype());
    layers_.back().set_diagonal_limit(options_.diagonal_factor_dim());
  }
  device_ = layers_.front().weight().device();
  clock_ = PhaseClock(device_);
  factor_ok_.resize(layers_.size());
  refuse_factors_beyond_memory(layers_, options_, names_);
  report_large_factors(layers_, options_, names_);
  communicator_ = std::move(communicator);
  if (communicator_) communicator_->use_device(device_);  // control tensors follow the layers (NCCL-only groups)
  check_ranks_agree();
  if (agrees_on_unused_layers()) {
    // A layer may run on some ranks only (stochastic depth, DDP's find_unused_parameters): step() has the
    // ranks agree which layers all of them can use, so factors are reduced there, not from the capture hooks,
    // which start their collectives before any rank knows what the others ran.
    TORCH_CHECK(options_.strategy() != Strategy::kSpd, "unused_layer_policy skip with strategy spd on several "
                "ranks: SPD-KFAC reduces factors from the capture hooks, before the ranks can agree which layers "
                "ran; use strategy kaisa, dp or auto");
    options_.update_factors_in_hook(false);
  }
  Options plan_options = options_;
  auto_requested_ = options_.strategy() == Strategy::kAuto;
  if (auto_requested_) {
    if (!communicator_ || communicator_->size() == 1) {
      strategy_choice_ = "strategy auto: one process, where every strategy is the same plan: kaisa";
      options_.strategy(Strategy::kKaisa).memory_budget(0);
      plan_options = options_;
    } else {
      // Until the first step chooses: every rank captures every layer (a superset of any candidate's
      // captures) and nothing moves before step(), so the choice can still replace the executor.
      auto_ = std::make_unique<strategy::AutoStrategy>(communicator_);
      plan_options = Options(options_).strategy(Strategy::kKaisa).memory_budget(0).update_factors_in_hook(false);
    }
  }
  executor_ = std::make_shared<strategy::StepExecutor>(communicator_, layers_, plan_options);
  arm_capture();
}

std::vector<std::string> Preconditioner::description() const {
  std::vector<std::string> lines;
  lines.push_back(std::to_string(layers_.size()) + " layers");
  for (size_t i = 0; i < layers_.size(); ++i) {
    const auto& layer = layers_[i];
    std::ostringstream line;
    line << "layer " << i << " '" << layer.name() << "': " << to_string(layer.kind()) << ", weight "
         << layer.weight().sizes() << " " << layer.weight().scalar_type() << (layer.bias().defined() ? ", bias" : ", no bias");
    lines.push_back(line.str());
  }
  for (const auto& info : option_table()) lines.push_back(info.name + "=" + option_text(info, options_.get(info.name)));
  return lines;
}

void Preconditioner::check_ranks_agree() {
  // Before any collective that depends on the options or the layers (the plan's groups, strategy auto's
  // measurements): ranks that differ there would start different collectives and hang or abort.
  if (!communicator_ || communicator_->size() == 1) return;
  const auto difference = comm::first_difference(*communicator_, comm::kWorld, description());
  TORCH_CHECK(difference.empty(), "the ranks built their preconditioners differently: ", difference,
              ". Every rank must register the same layers (names, kinds, shapes, dtypes) with the same options");
}

void Preconditioner::rebind_layer(size_t index, torch::Tensor weight, torch::Tensor bias) {
  TORCH_CHECK(index < layers_.size(), "rebind_layer: no layer ", index, " (", layers_.size(), " are registered)");
  layers_[index].rebind(std::move(weight), std::move(bias));
}

std::string Preconditioner::take_plan_change() {
  std::string change = std::exchange(choice_to_report_, "");
  return change + executor_->take_plan_change();
}

void Preconditioner::use_rates(strategy::Rates rates) {
  TORCH_CHECK(auto_requested_, "use_rates: rates are for strategy auto, but this preconditioner's strategy is ",
              to_string(options_.strategy()));
  if (auto_) {
    TORCH_CHECK(auto_->choice_pending(), "use_rates: strategy auto already chose at the first step (",
                to_string(options_.strategy()), "); give rates before it");
    auto_->use_rates(std::move(rates));
  } else {
    rates.validate();  // one process: nothing to choose, but the rates must still be rates
  }
}

void Preconditioner::choose_strategy() {
  int64_t samples = 1;
  for (const auto& layer : layers_) samples = std::max(samples, layer.capture().samples_per_pass());
  const auto dtype = options_.factor_dtype().value_or(layers_.front().weight().scalar_type());
  const Options chosen = auto_->choose(options_, strategy::layer_shapes(layers_),
                                       samples * options_.accumulation_steps(), device_, dtype, steps_);
  // State loaded (or computed) under the provisional plan: every rank holds every factor there, so they
  // agree on whether there is any; it is gathered whole and placed again as the chosen plan says.
  const bool has_state = std::any_of(layers_.begin(), layers_.end(), [](const KfacLayer& l) { return l.a_factor().defined(); });
  replace_executor(chosen, has_state);
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (!executor_->builds_factors(i)) layers_[i].capture().clear();  // captured under the provisional plan
  }
  if (is_factor_step(steps_)) executor_->arm_factor_step(options_.accumulation_steps());
  choice_to_report_ = auto_->description() + "\n" + executor_->describe(/*per_layer=*/false);
}

void Preconditioner::replace_executor(const Options& chosen, bool has_state) {
  std::vector<std::map<std::string, torch::Tensor>> states;
  if (has_state) states = executor_->gather_states(layers_);
  executor_ = std::make_shared<strategy::StepExecutor>(communicator_, layers_, chosen);
  options_ = chosen;
  if (!has_state) return;
  for (size_t i = 0; i < layers_.size(); ++i) layers_[i].load_state(placed_here(i, states[i]), executor_->plan().method);
}

void Preconditioner::recheck_strategy() {
  const auto switch_to = auto_->recheck(strategy::layer_shapes(layers_), executor_->plan(), options_, steps_);
  choice_to_report_ += auto_->last_report();
  if (!switch_to) return;
  replace_executor(*switch_to, /*has_state=*/true);
  choice_to_report_ += executor_->describe(/*per_layer=*/false);
}

Preconditioner::~Preconditioner() {
  for (auto& layer : layers_) layer.set_capture(false);
}

bool Preconditioner::is_factor_step(int64_t step) const {
  return step % options_.factor_update_steps_at(step) == 0;
}

bool Preconditioner::is_inverse_step(int64_t step) const { return step % options_.inv_update_steps_at(step) == 0; }

void Preconditioner::check_schedules_agree() const {
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
  const Value values[] = {
      {"lr", s, options_.lr_at(s)},
      {"damping", s, options_.damping_at(s)},
      {"kl_clip", s, options_.kl_clip_at(s)},
      {"factor_decay", s, options_.factor_decay_at(s)},
      {"factor_update_steps", s, static_cast<double>(options_.factor_update_steps_at(s))},
      {"inv_update_steps", s, static_cast<double>(options_.inv_update_steps_at(s))},
      {"factor_update_steps", s + 1, static_cast<double>(options_.factor_update_steps_at(s + 1))}};
  std::vector<double> mine;
  for (const auto& v : values) mine.push_back(v.value);
  const auto table = comm::gather_over(*communicator_, comm::kWorld, mine, comm::Phase::kControl);
  for (size_t rank = 1; rank < table.size(); ++rank) {
    for (size_t k = 0; k < mine.size(); ++k) {
      if (table[rank][k] == table[0][k]) continue;
      const auto& v = values[k];
      const std::string name = v.step == s ? v.name : c10::str(v.name, " at step ", v.step);
      TORCH_CHECK(false, "the ranks' hyper-parameters differ at K-FAC step ", s, ": rank ", rank, " has ", name, "=",
                  table[rank][k], " where rank 0 has ", name, "=", table[0][k],
                  ". Every rank must use the same values (a schedule: the same function of the step)");
    }
  }
}

void Preconditioner::follow_parameters() {
  for (size_t i = 0; i < modules_.size(); ++i) {
    auto weight = modules_[i]->kfac_weight();
    auto bias = modules_[i]->kfac_bias();
    const auto& layer = layers_[i];
    if (!weight.is_same(layer.weight()) || !bias.is_same(layer.bias())) rebind_layer(i, std::move(weight), std::move(bias));
  }
}

void Preconditioner::step() {
  follow_parameters();
  check_schedules_agree();
  if (auto_ && auto_->choice_pending()) choose_strategy();
  const bool factor_step = is_factor_step(steps_);
  std::fill(factor_ok_.begin(), factor_ok_.end(), torch::Tensor());
  try {
    auto fates = check_layers(factor_step);
    if (factor_step) update_factors(fates);
    if (is_inverse_step(steps_)) compute_second_order(fates);
    auto preconditioned = precondition(fates);
    const double scale = guard_and_clip(fates, preconditioned);
    apply(fates, preconditioned, scale);
  } catch (const c10::OutOfMemoryError& e) {
    forget_failed_step();
    const std::string layer = phase_layer_ >= 0 ? " of layer " + names_.layer(layers_[phase_layer_], phase_layer_) : "";
    device::rethrow_out_of_memory(e, std::string("K-FAC step ") + std::to_string(steps_) + ", " + phase_ + layer);
  } catch (...) {
    forget_failed_step();
    throw;
  }
  close_step_timing();
  if (auto_ && auto_->profiles(steps_)) {  // reading the times waits for the step's events on a GPU
    const auto t = last_step_times();
    auto_->record(steps_, {factor_step, is_inverse_step(steps_)}, t);
  }
  ++steps_;
  if (auto_ && auto_->recheck_due(steps_)) recheck_strategy();
  arm_capture();
}

void Preconditioner::discard_step() {
  if (auto_ && auto_->choice_pending()) choose_strategy();
  const bool factor_step = is_factor_step(steps_);
  auto fates = check_layers(factor_step);
  if (factor_step) {
    auto batches = take_factor_batches(fates);
    // The other ranks reduce this step's factors too (SPD has already started during backward).
    executor_->reduce_factors(batches);
  }
  for (auto& layer : layers_) layer.capture().clear();
  arm_capture();
}

void Preconditioner::update_second_order() {
  std::vector<LayerFate> fates(layers_.size(), LayerFate::kPreconditioned);
  compute_second_order(fates);
}

void Preconditioner::forget_failed_step() {
  // What the failed step's forward and backward captured must not be averaged into the next factors.
  reset_batch();
  arm_capture();
}

void Preconditioner::reset_batch() {
  for (auto& layer : layers_) layer.capture().clear();
}

void Preconditioner::load_layer_states(int64_t steps,
                                       const std::vector<std::map<std::string, torch::Tensor>>& states) {
  TORCH_CHECK(steps >= 0, "steps must be >= 0, got ", steps);
  TORCH_CHECK(states.size() == layers_.size(), "state holds ", states.size(), " K-FAC layers, the model has ",
              layers_.size());
  std::vector<KfacLayer> loaded = layers_;  // a bad entry leaves this preconditioner unchanged
  for (size_t i = 0; i < loaded.size(); ++i) {
    loaded[i].load_state(placed_here(i, states[i]), options_.compute_method());
  }
  layers_ = std::move(loaded);
  steps_ = steps;
  reset_batch();
  arm_capture();
}

std::vector<std::map<std::string, torch::Tensor>> Preconditioner::gathered_layer_states() const {
  return executor_->gather_states(layers_);
}

// This step's captured (A, G) batches of the layers that build factors here; undefined for the others.
std::vector<std::pair<torch::Tensor, torch::Tensor>> Preconditioner::take_factor_batches(
    const std::vector<LayerFate>& fates) {
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches(layers_.size());
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (fates[i] == LayerFate::kPreconditioned && executor_->builds_factors(i)) batches[i] = layers_[i].take_factor_batches();
  }
  return batches;
}

std::vector<Preconditioner::LayerFate> Preconditioner::check_layers(bool factor_step) {
  std::vector<LayerFate> fates(layers_.size(), LayerFate::kPreconditioned);
  for (size_t i = 0; i < layers_.size(); ++i) {
    auto& layer = layers_[i];
    const int64_t captured = factor_step && executor_->builds_factors(i) ? layer.captured_batches() : -1;
    if (captured != 0 && layer.has_gradient()) {
      if (captured > 0 && captured != options_.accumulation_steps()) {
        warn_once(i, "accumulation",
                  "ran forward and backward " + std::to_string(captured) + " times since the last factor update "
                  "but accumulation_steps is " + std::to_string(options_.accumulation_steps()) +
                      " (a layer called several times in one forward, or micro-batches not declared); its factors "
                      "average the " + std::to_string(captured) + " passes");
      }
      continue;
    }
    const std::string what = !layer.weight().requires_grad() ? "is frozen (its weight has requires_grad=False)"
                             : captured == 0                    ? "did not run forward/backward in training mode"
                                                                : "has no gradient";
    TORCH_CHECK(options_.unused_layer_policy() == UnusedLayerPolicy::kSkip, "K-FAC layer ", names_.layer(layer, i), " ",
                what, " before step() at step ", steps_,
                "; run it in forward/backward, exclude it with skip_layers, or set the unused-layer policy to "
                "skip (UnusedLayerPolicy::kSkip, Python unused_layer_policy='skip')");
    warn_once(i, "unused", what + "; it keeps its plain gradient meanwhile");
    layer.capture().clear();
    fates[i] = LayerFate::kPlainGradient;
    ++events_.skipped_unused;
  }
  if (agrees_on_unused_layers()) agree_on_unused_layers(fates);
  return fates;
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
  comm::average_over(*communicator_, comm::kWorld, usable, comm::Phase::kControl);
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

void Preconditioner::update_factors(std::vector<LayerFate>& fates) {
  PhaseClock::Span span(clock_, KfacPhase::kFactors);
  at("factor update");
  auto batches = take_factor_batches(fates);
  // Averaged before the NaN check, so that every rank takes the same decision.
  clock_.collective(KfacPhase::kFactors, [&] { executor_->reduce_factors(batches); });
  const double decay = options_.factor_decay_at(steps_);
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (fates[i] == LayerFate::kPlainGradient || !executor_->keeps_factors(i)) continue;
    at("factor update", static_cast<int64_t>(i));
    // Checked with the gradients, in guard_and_clip: a layer whose batch was not finite keeps its factors
    // and, this step, its plain gradient.
    factor_ok_[i] = layers_[i].fold_factors(batches[i].first, batches[i].second, decay);
    if (!layers_[i].a_factor().defined()) {  // a first update that was not finite: known here already
      factor_ok_[i] = torch::Tensor();
      warn_factor_fallback(i);
      fates[i] = LayerFate::kPlainGradient;
    }
  }
}

void Preconditioner::compute_second_order(std::vector<LayerFate>& fates) {
  PhaseClock::Span span(clock_, KfacPhase::kSecondOrder);
  const double damping = options_.damping_at(steps_);
  const auto method = executor_->plan().method;
  std::vector<std::pair<size_t, PendingSecondOrder>> pending;
  for (size_t i = 0; i < layers_.size(); ++i) {
    auto& layer = layers_[i];
    if (!layer.a_factor().defined()) continue;
    const bool a_part = executor_->computes_a(i);
    const bool g_part = executor_->computes_g(i);
    if (!a_part && !g_part) continue;
    keeping_previous_state(i, [&] {
      pending.emplace_back(i, layer.start_second_order(method, damping, options_.pi_damping(), a_part, g_part));
    });
  }
  // Every layer's check at once: one wait for the device.
  std::vector<torch::Tensor> checks;
  for (const auto& [i, p] : pending) checks.push_back(p.ok);
  const auto ok = checks.empty() ? torch::Tensor() : torch::stack(checks).to(torch::kCPU);
  for (size_t k = 0; k < pending.size(); ++k) {
    auto& [i, p] = pending[k];
    auto& layer = layers_[i];
    if (ok.data_ptr<bool>()[k]) {
      layer.set_second_order(std::move(p.state));
      continue;
    }
    // The checked path: a general inverse where Cholesky failed; eigendecompositions report the NaN.
    keeping_previous_state(i, [&] {
      layer.compute_second_order(method, damping, options_.pi_damping(), executor_->computes_a(i),
                                 executor_->computes_g(i));
    });
  }
  at("second-order broadcast");
  clock_.collective(KfacPhase::kSecondOrder, [&] { executor_->share_second_order(layers_, damping); });
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (!layers_[i].second_order().defined() && executor_->preconditions(i)) fates[i] = LayerFate::kPlainGradient;
  }
}

void Preconditioner::keeping_previous_state(size_t index, const std::function<void()>& update) {
  at("second-order update", static_cast<int64_t>(index));
  try {
    update();
  } catch (const c10::OutOfMemoryError&) {
    throw;  // step() names it with the phase and layer
  } catch (const c10::Error& e) {
    ++events_.second_order_failures;
    warn_once(index, "second_order",
              std::string("second-order update failed, keeping the previous state: ") + e.what_without_backtrace());
  }
}

std::vector<torch::Tensor> Preconditioner::precondition(const std::vector<LayerFate>& fates) {
  PhaseClock::Span span(clock_, KfacPhase::kPrecondition);
  std::vector<torch::Tensor> preconditioned(layers_.size());
  torch::NoGradGuard no_grad;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (size_t i = 0; i < layers_.size(); ++i) {
    auto& layer = layers_[i];
    at("preconditioning", static_cast<int64_t>(i));
    const bool mine = executor_->preconditions(i);
    const auto options = layer.weight().options();
    if (mine && fates[i] == LayerFate::kPreconditioned && layer.second_order().defined()) {
      if (!options_.compute_eigenvalue_outer_product() && layer.second_order().method == ComputeMethod::kEigen) {
        layer.finish_second_order(options_.damping_at(steps_));  // this step's damping, not the last update's
      }
      auto& v = preconditioned[i] = layer.second_order().precondition(layer.gradient());
      // A layer whose factors were not finite this step sends NaN, so that its whole row falls back.
      if (factor_ok_[i].defined()) v.masked_fill_(factor_ok_[i].logical_not(), nan);
    } else if (mine && executor_->plan().world_size() > 1) {
      // A grad worker that cannot precondition sends NaN so that its whole row falls back together.
      preconditioned[i] = torch::full({layer.g_dim(), layer.a_dim()}, nan, options);
    } else if (!mine && !executor_->owner_rows(i)) {
      preconditioned[i] = torch::empty({layer.g_dim(), layer.a_dim()}, options);  // filled by the row broadcast
    }
  }
  at("gradient broadcast");
  clock_.collective(KfacPhase::kPrecondition, [&] { executor_->share_gradients(preconditioned); });
  return preconditioned;
}

double Preconditioner::guard_and_clip(std::vector<LayerFate>& fates, const std::vector<torch::Tensor>& preconditioned) {
  PhaseClock::Span span(clock_, KfacPhase::kApply);
  at("NaN guard and KL clipping");
  torch::NoGradGuard no_grad;
  const double kl_clip = options_.kl_clip_at(steps_);
  // Per layer: reported, V finite, the factors' fold (1 when none), sum(V * grad): one transfer to the host.
  // Owner placement: a layer's V is on its owners only; row 0's owner reports it, and every rank learns it from
  // one sum over the world (StepExecutor::sum_owner_reports), so that all take the same decisions and scale.
  std::vector<torch::Tensor> rows;
  std::vector<size_t> checked;
  std::vector<int64_t> owned;  // positions in `rows` of the owner-placed layers
  const auto one = torch::ones({}, torch::TensorOptions().dtype(torch::kFloat64).device(device_));
  for (size_t i = 0; i < layers_.size(); ++i) {
    const auto& v = preconditioned[i];
    const bool placed = executor_->owner_rows(i);
    if (fates[i] == LayerFate::kPlainGradient || !v.defined() || (placed && !executor_->reports(i))) {
      fates[i] = LayerFate::kPlainGradient;
      if (!placed) continue;
      owned.push_back(static_cast<int64_t>(rows.size()));
      rows.push_back(torch::zeros({4}, one.options()));  // not reported here
      checked.push_back(i);
      continue;
    }
    if (placed) owned.push_back(static_cast<int64_t>(rows.size()));
    auto finite = torch::isfinite(v).all().to(torch::kFloat64);
    auto folded = factor_ok_[i].defined() ? factor_ok_[i].to(torch::kFloat64) : one;
    auto vg = kl_clip > 0.0 ? (v * layers_[i].gradient()).sum().to(torch::kFloat64) : one;
    rows.push_back(torch::stack({one, finite, folded, vg}));
    checked.push_back(i);
  }
  auto values = rows.empty() ? torch::Tensor() : torch::stack(rows).to(torch::kCPU).contiguous();
  if (!owned.empty()) {
    const auto index = torch::tensor(owned, torch::kInt64);
    auto reports = values.index_select(0, index);
    clock_.collective(KfacPhase::kApply, [&] { executor_->sum_owner_reports(reports); });
    values.index_copy_(0, index, reports.to(torch::kCPU));
  }
  double vg_sum = 0.0;
  for (size_t k = 0; k < checked.size(); ++k) {
    const size_t i = checked[k];
    const double* row = values.data_ptr<double>() + 4 * k;  // reported, finite, folded, sum(V * grad)
    // An owner-placed layer is written by its owners alone; the front end scatters their rows.
    const bool writes = !executor_->owner_rows(i) || executor_->preconditions(i);
    if (row[0] == 0.0) {  // its owner could not precondition it (and said why)
      fates[i] = LayerFate::kPlainGradient;
      continue;
    } else if (row[2] == 0.0) {
      warn_factor_fallback(i);
      fates[i] = LayerFate::kPlainGradient;
      continue;
    } else if (row[1] == 0.0) {
      warn_once(i, "gradient", "gradient or preconditioned gradient contains NaN or Inf; keeping the plain "
                               "gradient for this step");
    } else {
      vg_sum += row[3];
      fates[i] = writes ? LayerFate::kPreconditioned : LayerFate::kPlainGradient;
      continue;
    }
    fates[i] = LayerFate::kPlainGradient;
    ++events_.fallbacks;
  }
  std::fill(factor_ok_.begin(), factor_ok_.end(), torch::Tensor());
  if (kl_clip <= 0.0) return 1.0;
  const double lr = options_.lr_at(steps_);
  return math::kl_clip_scale(vg_sum * lr * lr, kl_clip);
}

void Preconditioner::apply(const std::vector<LayerFate>& fates, const std::vector<torch::Tensor>& preconditioned,
                           double scale) {
  PhaseClock::Span span(clock_, KfacPhase::kApply);
  at("writing gradients");
  torch::NoGradGuard no_grad;
  last_kl_scale_ = scale;
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (fates[i] == LayerFate::kPlainGradient) continue;
    layers_[i].set_gradient(scale == 1.0 ? preconditioned[i] : preconditioned[i] * scale);
  }
}

void Preconditioner::arm_capture() {
  const bool capture = is_factor_step(steps_);
  for (size_t i = 0; i < layers_.size(); ++i) {
    layers_[i].set_capture(capture && executor_->builds_factors(i));
  }
  if (capture) executor_->arm_factor_step(options_.accumulation_steps());
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

void Preconditioner::warn_factor_fallback(size_t index) {
  warn_once(index, "factor", "captured factors contain NaN or Inf; factors not updated and the plain gradient is kept "
                             "for this step");
  ++events_.fallbacks;
}

void Preconditioner::warn_once(size_t index, const std::string& kind, const std::string& message) {
  const auto& layer = layers_[index];
  if (!warned_.emplace(layer.name(), kind).second) return;
  TORCH_WARN("dkfac: layer ", names_.layer(layer, index), ", step ", steps_, ": ", message, " (warned once per layer)");
}

int64_t Preconditioner::memory_bytes() const {
  int64_t total = 0;
  for (const auto& layer : layers_) total += layer.memory_bytes();
  return total;
}

}  // namespace dkfac
