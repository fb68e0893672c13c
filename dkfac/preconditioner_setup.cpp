#include "dkfac/preconditioner.h"

// The Preconditioner's construction and re-planning: binding layers, validation and the warnings about them,
// the plan's executor and strategy auto's choice, the ranks' agreement on options, and following replaced
// parameters. preconditioner.cpp holds the step's phase sequence; preconditioner_archive.cpp its state.

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
#include <set>
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
    if (!(large(sides[0]) && !layer.follows_a()) && !large(sides[1])) continue;
    const double factor_bytes = static_cast<double>(c10::elementSize(layer.factor_dtype()));
    const double state_bytes = static_cast<double>(c10::elementSize(layer.second_order_dtype()));
    std::ostringstream what;
    double flops = 0.0;
    for (const auto& side : sides) {
      if (!large(side) || (side.name[0] == 'A' && layer.follows_a())) continue;  // its leader's is reported
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
      if (side.name[0] == 'A' && layer.follows_a()) continue;  // its shared-input group's leader holds it
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
  // The tensors a module's forward uses: its registered parameters, and a dkfac::nn layer's kfac_weight() and
  // kfac_bias(), which a member assignment (`head->weight = embedding->weight`, LibTorch's way to tie) replaces
  // without touching the registered ones.
  const auto used = [](const torch::nn::Module& module) {
    auto tensors = module.parameters(/*recurse=*/false);
    if (const auto* kfac_module = dynamic_cast<const nn::KfacModule*>(&module)) {
      for (const auto& t : {kfac_module->kfac_weight(), kfac_module->kfac_bias()}) {
        const auto same = [&](const torch::Tensor& p) { return p.is_same(t); };
        if (t.defined() && std::none_of(tensors.begin(), tensors.end(), same)) tensors.push_back(t);
      }
    }
    return tensors;
  };
  std::map<const c10::TensorImpl*, std::vector<std::string>> owners;
  // LibTorch's named_modules lists a module registered under two names twice (Python's lists it once): it is one
  // layer, its first name.
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> named;
  std::set<const torch::nn::Module*> seen;
  for (const auto& item : model->named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    if (seen.insert(item.value().get()).second) named.emplace_back(item.key(), item.value());
  }
  for (const auto& [name, module] : named) {
    for (const auto& p : used(*module)) owners[p.unsafeGetTensorImpl()].push_back(name);
  }
  for (const auto& [name, module] : named) {
    const auto* kfac_module = dynamic_cast<const nn::KfacModule*>(module.get());
    if (kfac_module == nullptr) continue;
    const auto kind = kfac_module->shared_factor_capture()->geometry().kind;
    ModuleCandidate candidate{name, to_string(kind), kind, all_parameters_require_grad(*module), 1, "", {}};
    for (const auto& p : used(*module)) {
      for (const auto& other : owners[p.unsafeGetTensorImpl()]) {
        const auto& tied = candidate.tied_to;
        if (other != name && std::find(tied.begin(), tied.end(), other) == tied.end()) {
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
  for (const auto& layer : layers_) {
    module_holders_.push_back(named[layer.name()]);
    modules_.push_back(dynamic_cast<const nn::KfacModule*>(module_holders_.back().get()));
  }
}

std::string Preconditioner::replaced_module(size_t index) const {
  if (!model_ || index >= module_holders_.size()) return "";
  const auto named = model_->named_modules(/*name_prefix=*/"", /*include_self=*/true);
  const auto* now = named.find(layers_[index].name());
  if (now != nullptr && now->get() == module_holders_[index].get()) return "";
  return now == nullptr ? "is no longer in the model (its module was removed after the Preconditioner was built)"
                        : "was replaced in the model after the Preconditioner was built (replace_module, or another "
                          "module assigned in its place): the Preconditioner holds the module it was built with, "
                          "which no longer runs. Build a new Preconditioner for the model as it is now";
}

Preconditioner::Preconditioner(std::vector<LayerBinding> layers, Options options,
                               std::shared_ptr<comm::Communicator> communicator, MessageNames names)
    : options_(std::move(options)), names_(std::move(names)) {
  options_.validate();
  TORCH_CHECK(!layers.empty(), "Preconditioner needs at least one layer to precondition");
  TORCH_CHECK(names_.layer_classes.empty() || names_.layer_classes.size() == layers.size(),
              "MessageNames::layer_classes names ", names_.layer_classes.size(), " layers, but ", layers.size(),
              " are registered: give one class per layer or none");
  claims_.owner = this;
  for (const auto& binding : layers) {
    TORCH_CHECK(binding.capture->claim(this), "layer '", binding.name, "' is already registered with another "
                "Preconditioner: both would precondition its gradient and feed its factors. Build one per model "
                "(destroy the other first)");
    claims_.held.push_back(binding.capture);
  }
  for (auto& binding : layers) {
    binding.capture->set_factor_dtype(options_.factor_dtype());
    binding.capture->set_grad_scale(options_.grad_scaler());
    binding.capture->set_reduce(options_.kfac_approx() == KfacApprox::kReduce);
    layers_.emplace_back(std::move(binding));
    layers_.back().set_inv_dtype(options_.inv_dtype());
    layers_.back().set_eigen_adam(options_.eigen_adam());
    layers_.back().set_diagonal_limit(options_.diagonal_factor_dim());
  }
  group_shared_inputs();
  device_ = layers_.front().weight().device();
  clock_ = PhaseClock(device_);
  factor_ok_.resize(layers_.size());
  hook_folded_.resize(layers_.size());
  hook_fold_.assign(layers_.size(), HookFold::kAtStep);
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
  auto_requested_ = !options_.strategy();
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

void Preconditioner::group_shared_inputs() {
  leads_a_.assign(layers_.size(), false);
  if (options_.shared_input_layers().empty()) {
    // Every capture records its inputs (weakly: no memory), so that the first factor step can name the layers that
    // were given one tensor (suggest_shared_inputs).
    suggest_shared_inputs_ = layers_.size() > 1;
    for (auto& layer : layers_) {
      if (suggest_shared_inputs_) layer.capture().set_shared_input(/*member=*/true, /*follower=*/false);
    }
    return;
  }
  std::vector<std::string> names;
  for (const auto& layer : layers_) names.push_back(layer.name());
  const auto leaders = input_groups(names, options_.shared_input_layers());
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (leaders[i] < 0) continue;
    const auto& leader = layers_[static_cast<size_t>(leaders[i])];
    auto& layer = layers_[i];
    const auto& a = leader.capture().geometry();
    const auto& b = layer.capture().geometry();
    std::string differ;
    if (a.kind != b.kind) differ = c10::str("kinds ", to_string(a.kind), " and ", to_string(b.kind));
    else if (leader.a_dim() != layer.a_dim()) differ = c10::str("A widths ", leader.a_dim(), " and ", layer.a_dim());
    else if (a.has_bias != b.has_bias) differ = "a bias on one only (a column of A)";
    else if (a.a_diagonal != b.a_diagonal) differ = "a diagonal A on one only";
    else if (a.vocabulary != b.vocabulary || a.vocabulary_first != b.vocabulary_first) differ = "vocabularies";
    else if (a.kind == LayerKind::kConv2d &&
             (a.conv.kernel_size != b.conv.kernel_size || a.conv.stride != b.conv.stride ||
              a.conv.padding != b.conv.padding || a.conv.dilation != b.conv.dilation ||
              a.conv.padding_mode.index() != b.conv.padding_mode.index()))
      differ = "convolution geometries (kernel, stride, padding or dilation)";
    else if (leader.factor_dtype() != layer.factor_dtype())
      differ = c10::str("factor dtypes ", leader.factor_dtype(), " and ", layer.factor_dtype());
    else if (leader.sharded() || layer.sharded())
      differ = "a sharded gradient (FSDP2, HSDP): shared A factors are for unsharded layers (DDP or one process)";
    TORCH_CHECK(differ.empty(), "shared_input_layers groups ", names_.layer(leader, static_cast<size_t>(leaders[i])),
                " and ", names_.layer(layer, i), ", which cannot share an A factor: they have ", differ);
    layer.set_a_leader(leaders[i]);
    leads_a_[static_cast<size_t>(leaders[i])] = true;
  }
  for (size_t i = 0; i < layers_.size(); ++i) {  // each member's capture compares its inputs with the others'
    const int group = group_of(i);
    if (group < 0) continue;
    std::vector<std::shared_ptr<FactorCapture>> others;
    for (const auto j : group_members(static_cast<size_t>(group))) {
      if (j != i) others.push_back(layers_[j].shared_capture());
    }
    layers_[i].capture().set_shared_input(/*member=*/true, /*follower=*/layers_[i].follows_a(), others);
  }
}

std::vector<std::string> Preconditioner::description() const {
  std::vector<std::string> lines;
  lines.push_back(std::to_string(layers_.size()) + " layers");
  for (size_t i = 0; i < layers_.size(); ++i) {
    const auto& layer = layers_[i];
    std::ostringstream line;
    line << "layer " << i << " '" << layer.name() << "': " << to_string(layer.kind()) << ", weight "
         << layer.weight().sizes() << " " << layer.weight().scalar_type() << (layer.bias().defined() ? ", bias" : ", no bias")
         << (layer.sharded() ? ", sharded" : "")
         << (layer.follows_a() ? c10::str(", shares the A factor of layer ", layer.a_leader()) : std::string());
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
  for (size_t j = 0; j < layers_.size(); ++j) {
    // Tied since the build: both layers would write the one gradient, and the last would win.
    const auto& other = layers_[j];
    TORCH_CHECK(j == index || (!weight.is_same(other.weight()) && !(bias.defined() && bias.is_same(other.bias()))),
                "K-FAC layer ", names_.layer(layers_[index], index), " now uses the ", weight.is_same(other.weight())
                ? "weight" : "bias", " of K-FAC layer ", names_.layer(other, j), " (tied after the Preconditioner was "
                "built): each would precondition the one gradient with its own factors. Tie them before building "
                "it (a tied weight keeps its plain gradient), or build a new one");
  }
  layers_[index].rebind(std::move(weight), std::move(bias));
  forget_graphs();
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

void Preconditioner::agree_strategy_over_model(bool leader) {
  TORCH_CHECK(auto_requested_, "agree_strategy_over_model is for strategy auto; this preconditioner's strategy is ",
              to_string(options_.strategy()));
  TORCH_CHECK(!auto_ || auto_->choice_pending(), "agree_strategy_over_model after strategy auto chose");
  model_leader_ = leader;
}

strategy::ModelAgreement Preconditioner::model_agreement() const {
  if (!model_leader_) return {};
  TORCH_CHECK(model_sum_ != nullptr && *model_sum_, "strategy auto agrees with the model's other parts through "
              "step()'s sum over them (sum_over_model), which this step() was not given");
  return [sum = model_sum_, leader = *model_leader_, device = device_](size_t value) {
    // One sum over the model's parts: the leader's value + 1, 0 from every other rank.
    auto t = torch::full({1}, leader ? static_cast<double>(value) + 1.0 : 0.0,
                         torch::TensorOptions().dtype(torch::kFloat64).device(device));
    (*sum)(t);
    const double agreed = t.item<double>() - 1.0;
    TORCH_CHECK(agreed >= 0.0 && agreed == std::floor(agreed), "strategy auto: the model's parts did not agree on one "
                "leading rank (their sum gave ", agreed + 1.0, "): exactly one rank of them must lead");
    return static_cast<size_t>(agreed);
  };
}

void Preconditioner::choose_strategy() {
  int64_t samples = 1;
  for (const auto& layer : layers_) samples = std::max(samples, layer.capture().samples_per_pass());
  const auto dtype = options_.factor_dtype().value_or(layers_.front().weight().scalar_type());
  const Options chosen = auto_->choose(options_, strategy::layer_shapes(layers_),
                                       samples * options_.accumulation_steps(), device_, dtype, steps_,
                                       model_agreement());
  // State loaded (or computed) under the provisional plan: every rank holds every factor there, so they
  // agree on whether there is any; it is gathered whole and placed again as the chosen plan says.
  const bool has_state = std::any_of(layers_.begin(), layers_.end(), [](const KfacLayer& l) { return l.a_factor().defined(); });
  replace_executor(chosen, has_state);
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (!executor_->builds_factors(i)) layers_[i].capture().clear();  // captured under the provisional plan
  }
  if (armed_factor_step()) executor_->arm_factor_step(options_.accumulation_steps());
  choice_to_report_ = auto_->description() + "\n" + executor_->describe(/*per_layer=*/false);
}

void Preconditioner::replace_executor(const Options& chosen, bool has_state) {
  if (job_) {  // placed by the plan it started under
    PhaseClock::Span span(clock_, KfacPhase::kSecondOrder);
    install_second_order_job(nullptr);
  }
  // Options::eigen_adam: moments rotated now into a basis installed since their last step (the update just
  // installed), as their next step would: they are gathered with that basis and loaded as in it.
  for (auto& layer : layers_) layer.rotate_adam_moments_if_due();
  std::vector<std::map<std::string, torch::Tensor>> states;
  if (has_state) states = executor_->gather_states(layers_);
  disarm_hook_folds();  // armed by the old plan's reductions
  executor_ = std::make_shared<strategy::StepExecutor>(communicator_, layers_, chosen);
  // `chosen` is made from the options of the first choice: eigen_adam's constants as set since
  // (set_adam_constants, the base optimizer's betas followed) stay.
  const auto adam = adam_constants();
  options_ = chosen;
  options_.adam_beta1(adam.beta1).adam_beta2(adam.beta2).adam_eps(adam.eps);
  if (!has_state) return;
  for (size_t i = 0; i < layers_.size(); ++i) layers_[i].load_state(placed_here(i, states[i]), executor_->plan().method);
  settle_loaded_layers(layers_);
  layer_groups();  // Options::stack_layers: groups for the new plan now, the old stacks freed
}

void Preconditioner::recheck_strategy() {
  const auto switch_to = auto_->recheck(strategy::layer_shapes(layers_), executor_->plan(), options_, steps_,
                                        model_agreement());
  choice_to_report_ += auto_->last_report();
  if (!switch_to) return;
  replace_executor(*switch_to, /*has_state=*/true);
  choice_to_report_ += executor_->describe(/*per_layer=*/false);
}

Preconditioner::~Preconditioner() {
  disarm_hook_folds();  // the captures may outlive it (its modules, autograd's hooks)
  for (auto& layer : layers_) layer.set_capture(false);
}

void Preconditioner::follow_parameters() {
  for (size_t i = 0; i < modules_.size(); ++i) {
    // Held by this Preconditioner alone: no longer in the model (replace_module), whatever step this is. (One still
    // held elsewhere as well is found where its layer did not run: unusable_reason.)
    if (module_holders_[i].use_count() == 1) {
      const auto replaced = replaced_module(i);
      TORCH_CHECK(replaced.empty(), refusal_of(i, replaced));
    }
    auto weight = modules_[i]->kfac_weight();
    auto bias = modules_[i]->kfac_bias();
    const auto& layer = layers_[i];
    if (!weight.is_same(layer.weight()) || !bias.is_same(layer.bias())) rebind_layer(i, std::move(weight), std::move(bias));
  }
}

}  // namespace dkfac
