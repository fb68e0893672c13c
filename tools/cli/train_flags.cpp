// `dkfac train`'s training flags (the launcher's own flags are in train.cpp), in --help groups, with the
// flag names of kfac_pytorch's example scripts as aliases.
#include "tools/cli/train_flags.h"

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>

#include <c10/util/Exception.h>

namespace dkfac::cli {
namespace {

std::string show(double value) {
  std::ostringstream out;
  out << value;
  return out.str();
}
std::string show(int64_t value) { return std::to_string(value); }
std::string show(const std::vector<std::string>& values) {
  std::string out;
  for (const auto& v : values) out += (out.empty() ? "" : " ") + v;
  return out;
}

// What the kfac_pytorch aliases need after parsing: each resolver copies its alias into the dkfac field,
// or throws when the alias and its dkfac flag were both given with different values.
using Resolvers = std::vector<std::function<void()>>;

// One switch as two flags, `on` and `off`, so that --help says which one is the default (the value `field`
// holds now); they exclude each other. Returns the `off` flag.
CLI::Option* add_switch(CLI::App& app, const std::string& on, const std::string& off, bool& field,
                        const std::string& on_help, const std::string& off_help, const std::string& group) {
  const bool initially = field;
  auto* on_flag = app.add_flag_callback(on, [&field] { field = true; },
                                        on_help + (initially ? " (default: on)" : " (default: off)"))
                      ->group(group);
  auto* off_flag = app.add_flag_callback(off, [&field] { field = false; },
                                         off_help + (initially ? " (default: off)" : " (default: on)"))
                       ->group(group);
  on_flag->excludes(off_flag);
  return off_flag;
}

// The library's options given on the command line: flag -> the values typed.
using Given = std::map<std::string, std::vector<std::string>>;

// Sets the library option `name` of `c` from the command line, naming `flag` (as typed) if it is refused.
void set_option(train::TrainConfig& c, const std::string& name, const OptionValue& value, const std::string& flag) {
  try {
    c.kfac_options.set(name, value, flag);
  } catch (const c10::Error& e) {
    throw CLI::ValidationError(e.what_without_backtrace());
  }
}

// The value typed for an option of `info`'s type.
OptionValue typed_value(const OptionInfo& info, const std::vector<std::string>& text, const std::string& flag) {
  if (info.type == OptionType::kStrings) return text;
  if (info.type == OptionType::kInts) {
    std::vector<int64_t> values;
    for (const auto& t : text) {
      try {
        size_t used = 0;
        values.push_back(std::stoll(t, &used));
        if (used != t.size()) throw std::invalid_argument(t);
      } catch (const std::exception&) {
        throw CLI::ValidationError(flag + " takes integers, got '" + t + "'");
      }
    }
    return values;
  }
  return text.back();
}

// Options in the Distributed group of --help; the rest of the library's are in K-FAC.
bool is_distributed(const std::string& name) {
  static const std::set<std::string> names = {"grad_worker_fraction", "symmetric_comm", "balance", "colocate_factors",
                                              "update_factors_in_hook", "allreduce_bucket_cap_mb", "strategy",
                                              "memory_budget"};
  return names.count(name) > 0 || name.rfind("spd_", 0) == 0;
}

// Every library option that has a flag (dkfac/options.h), made from its declaration: a switch pair for a bool,
// a value (or values) otherwise, with its documentation, range or choices and default. Set when parsing completes.
void add_library_options(CLI::App& app, train::TrainConfig& c, Resolvers& resolvers, Given& given) {
  for (const auto& info : option_table()) {
    if (info.flag.empty()) continue;
    const std::string group = is_distributed(info.name) ? kDistributedGroup : kKfacGroup;
    const OptionValue now = c.kfac_options.get(info.name);
    if (info.type == OptionType::kBool) {
      auto state = std::make_shared<bool>(std::get<bool>(now));
      const std::string off = "--no-" + info.flag.substr(2);
      add_switch(app, info.flag, off, *state, info.doc, "the opposite of " + info.flag, group);
      resolvers.push_back([&app, &c, info, off, state] {
        if (app.count(info.flag) + app.count(off) > 0) set_option(c, info.name, *state, info.flag);
      });
      continue;
    }
    std::string help = info.doc;
    if (!info.choices.empty()) help += ": " + [&info] {
      std::string names;
      for (const auto& n : info.choices) names += (names.empty() ? "" : " | ") + n;
      return names;
    }();
    if (info.type == OptionType::kInt || info.type == OptionType::kDouble) help += " (" + info.range.describe() + ")";
    auto text = std::make_shared<std::vector<std::string>>();
    auto* option = app.add_option(info.flag, *text, help)->group(group)->default_str(option_text(info, now));
    if (info.type != OptionType::kStrings && info.type != OptionType::kInts) option->expected(1);
    resolvers.push_back([&c, &given, info, text, option] {
      if (option->count() == 0) return;
      if (info.name == "strategy" && (text->back() == "dkfac" || text->back() == "dkfac-lw")) {
        throw CLI::ValidationError("--strategy " + text->back() + " is KAISA's grid at one fraction: SC20's D-KFAC is "
                                   "--strategy kaisa --grad-worker-fraction 1, its layer-wise variant "
                                   "--grad-worker-fraction 0 (1/P)");
      }
      given[info.flag] = *text;
      set_option(c, info.name, typed_value(info, *text, info.flag), c.flag(info.flag));
    });
  }
}

// `alias` (kfac_pytorch's examples) stands for the library option whose flag is `flag`: same values, checked the
// same way; given with `flag` and another value, an error naming both.
void add_alias(CLI::App& app, Resolvers& resolvers, Given& given, train::TrainConfig& c, const std::string& alias,
               const std::string& flag, const std::string& extra_help = "") {
  const auto& info = *std::find_if(option_table().begin(), option_table().end(),
                                   [&flag](const OptionInfo& i) { return i.flag == flag; });
  auto text = std::make_shared<std::vector<std::string>>();
  auto* option = app.add_option(alias, *text, info.doc + extra_help + " (= " + flag + ")")->group(kAliasGroup);
  if (info.type != OptionType::kStrings) option->expected(1);
  resolvers.push_back([&c, &given, info, alias, flag, text, option] {
    if (option->count() == 0) return;
    const auto typed = given.find(flag);
    if (typed != given.end()) {
      const auto ours = c.kfac_options.get(info.name);
      train::TrainConfig other;
      set_option(other, info.name, typed_value(info, *text, alias), alias);
      if (option_text(info, other.kfac_options.get(info.name)) != option_text(info, ours)) {
        throw CLI::ValidationError(alias + " " + show(*text) + " and " + flag + " " + show(typed->second) +
                                   " disagree (" + alias + " is kfac_pytorch's name for " + flag + "); give one");
      }
    }
    c.typed_as[flag] = alias;
    set_option(c, info.name, typed_value(info, *text, alias), alias);
  });
}

}  // namespace

void add_train_options(CLI::App& app, dkfac::train::TrainConfig& c) {
  // --- Data
  add_choice(app, "--dataset", c.dataset, "fashion-mnist | mnist | cifar10 | synthetic")->group(kDataGroup);
  app.add_option("--data-dir", c.data_dir,
                 "dataset directory (default for fashion-mnist: /usr/share/datasets/fashion-mnist)")
      ->group(kDataGroup);
  app.add_option("--batch-size", c.batch_size, "examples per rank per step (the global batch is this x ranks)")
      ->capture_default_str()
      ->group(kDataGroup);
  app.add_option("--global-batch-size", c.global_batch_size,
                 "examples per step over all ranks, B / ranks each (must divide); replaces --batch-size, so that a "
                 "run resumed on another number of ranks sees the same batches; the logged step loss is then the "
                 "global batch's (0: off)")
      ->capture_default_str()
      ->group(kDataGroup);
  app.add_option("--eval-examples", c.eval_examples, "evaluate on the first N test examples (0: all)")
      ->capture_default_str()
      ->group(kDataGroup);
  app.add_option("--seed", c.seed, "seed of initialisation, shuffling and augmentation (>= 0)")
      ->capture_default_str()
      ->group(kDataGroup);
  // --- Model
  add_choice(app, "--model", c.model, "mlp | cnn | resnet20 | autoencoder")->group(kModelGroup);
  // --- Optimizer
  add_choice(app, "--optimizer", c.optimizer, "sgd | adam | adamw")->group(kOptimizerGroup);
  app.add_option("--lr", c.lr, "base learning rate (> 0)")->capture_default_str()->group(kOptimizerGroup);
  app.add_option("--momentum", c.momentum, "SGD momentum, in [0, 1)")->capture_default_str()->group(kOptimizerGroup);
  app.add_option("--weight-decay", c.weight_decay, "L2 weight decay (>= 0)")
      ->capture_default_str()
      ->group(kOptimizerGroup);
  app.add_option("--accumulation-steps", c.accumulation_steps,
                 "split each step's batch into this many micro-batches whose gradients accumulate before one "
                 "allreduce and one K-FAC/optimizer step (DDP's no_sync)")
      ->capture_default_str()
      ->group(kOptimizerGroup);
  app.add_option("--epochs", c.epochs, "passes over the training set")->capture_default_str()->group(kOptimizerGroup);
  app.add_option("--max-steps", c.max_steps, "stop after this many steps in total (-1: no limit)")
      ->capture_default_str()
      ->group(kOptimizerGroup);
  add_choice(app, "--lr-schedule", c.lr_schedule, "constant | step (x0.1 at 50% and 75%) | cosine")
      ->group(kOptimizerGroup);
  app.add_option("--warmup-epochs", c.warmup_epochs, "linear learning-rate warmup")
      ->capture_default_str()
      ->group(kOptimizerGroup);
  add_choice(app, "--on-nan-loss", c.on_nan_loss,
             "stop: end with an error before a non-finite loss or gradient reaches the weights; skip: drop "
             "that step and go on")
      ->group(kOptimizerGroup);
  app.add_option("--max-skipped-steps", c.max_skipped_steps,
                 "with --on-nan-loss skip: this many dropped steps in a row end the run with an error (the loss "
                 "is not recovering)")
      ->capture_default_str()
      ->group(kOptimizerGroup);
  // --- K-FAC. Paired switches are two flags each, so that --help says which one is the default.
  auto resolvers = std::make_shared<Resolvers>();
  add_switch(app, "--kfac", "--no-kfac", c.kfac, "precondition with K-FAC", "no K-FAC: plain SGD/Adam", kKfacGroup);
  add_switch(app, "--kl-clip-follows-lr", "--kl-clip-fixed", c.kl_clip_follows_lr,
             "scale the KL-clip bound by (lr / base lr)^2", "keep the KL-clip bound fixed, as kfac_pytorch does",
             kKfacGroup);
  auto given = std::make_shared<Given>();
  add_library_options(app, c, *resolvers, *given);
  // --- Distributed (the launcher's flags join this group in train.cpp)
  add_choice(app, "--device", c.device,
             "cpu | cuda (rank r of a node on cuda:LOCAL_RANK) | auto (cuda when a CUDA device is visible, else "
             "cpu): where the model, optimizer and K-FAC state, batches and evaluation live")
      ->group(kDistributedGroup);
  add_choice(app, "--backend", c.backend,
             "what carries collectives of CUDA tensors (CPU tensors always go through Gloo): auto (NCCL when "
             "built with it and a GPU is visible, else Gloo) | nccl | gloo (copies through the host; lets more "
             "ranks than GPUs share them round-robin, rank r on cuda:(LOCAL_RANK % GPUs)). nccl or gloo with "
             "--device cuda in a single process: a one-rank group over that backend")
      ->group(kDistributedGroup);
  app.add_option("--threads", c.threads, "intra-op threads (>= 0; 0: LibTorch's default, or cores / local ranks)")
      ->capture_default_str()
      ->group(kDistributedGroup);
  // --- Checkpoints
  app.add_option("--checkpoint-dir", c.checkpoint_dir, "directory for checkpoint.pt (written atomically)")
      ->group(kCheckpointGroup);
  app.add_option("--checkpoint-every-epochs", c.checkpoint_every_epochs, "epochs between checkpoints (>= 1)")
      ->capture_default_str()
      ->group(kCheckpointGroup);
  app.add_option("--checkpoint-every-steps", c.checkpoint_every_steps,
                 "also checkpoint every N steps (0: only at epoch ends)")
      ->capture_default_str()
      ->group(kCheckpointGroup);
  app.add_flag("--resume", c.resume, "continue from --checkpoint-dir/checkpoint.pt if it exists (default: off)")
      ->group(kCheckpointGroup);
  app.add_flag("--allow-seed-change", c.allow_seed_change,
               "--resume with another --seed than the checkpoint's: the rest of the run sees the new seed's order of "
               "examples (default: off: such a resume is refused)")
      ->group(kCheckpointGroup);
  app.add_flag("--overwrite", c.overwrite,
               "start a fresh run even if --checkpoint-dir holds checkpoints or --metrics holds events, replacing "
               "them (default: off: such a run is refused)")
      ->group(kCheckpointGroup);
  // --- Output
  app.add_option("--metrics", c.metrics, "write JSON Lines metrics to this file")->group(kOutputGroup);
  app.add_option("--log-every", c.log_every, "steps between progress lines (0: ~10 per epoch)")
      ->capture_default_str()
      ->group(kOutputGroup);
  app.add_option("--kfac-rates", c.kfac_rates,
                 "--strategy auto: choose from the rates in this JSON file (written by dkfac plan --measure-rates) "
                 "instead of measuring them at the first step")
      ->check(CLI::ExistingFile)
      ->group(kDistributedGroup);
  app.add_flag("--print-plan", c.print_plan,
               "print the K-FAC step plan this job runs at start: how factors are reduced, which rank decomposes "
               "each layer's A and G, which ranks precondition it, what is broadcast (default: off; a distributed "
               "job prints the plan's job-wide lines anyway)")
      ->group(kOutputGroup);

  // --- kfac_pytorch's example flags (examples/torch_cifar10_resnet.py, v0.4.2), with their meanings there.
  auto inv_steps_value = std::make_shared<int64_t>(0);
  auto* inv_steps = app.add_option("--kfac-inv-update-steps", *inv_steps_value,
                                   "steps between eigendecompositions/inverses; 0 turns K-FAC off (= "
                                   "--inv-update-steps, or --no-kfac for 0)")
                        ->group(kAliasGroup);
  resolvers->push_back([&app, &c, inv_steps, inv_steps_value, given] {
    if (inv_steps->count() == 0) return;
    const int64_t steps = *inv_steps_value;
    if (steps < 0) {
      throw CLI::ValidationError("--kfac-inv-update-steps must be >= 0 (0: K-FAC off), got " + show(steps));
    }
    if (steps == 0) {
      if (app.count("--kfac") > 0) {
        throw CLI::ValidationError("--kfac-inv-update-steps 0 (K-FAC off) and --kfac disagree; give one");
      }
      c.kfac = false;
      return;
    }
    if (app.count("--no-kfac") > 0) {
      throw CLI::ValidationError("--kfac-inv-update-steps " + show(steps) + " (K-FAC on) and --no-kfac disagree; give "
                                 "one");
    }
    const auto flag = given->find("--inv-update-steps");
    if (flag != given->end() && c.kfac_options.inv_update_steps_at(0) != steps) {
      throw CLI::ValidationError("--kfac-inv-update-steps " + show(steps) + " and --inv-update-steps " +
                                 show(flag->second) + " disagree (--kfac-inv-update-steps is kfac_pytorch's name for "
                                 "--inv-update-steps); give one");
    }
    c.typed_as["--inv-update-steps"] = "--kfac-inv-update-steps";
    set_option(c, "inv_update_steps", steps, "--kfac-inv-update-steps");
  });
  add_alias(app, *resolvers, *given, c, "--kfac-factor-update-steps", "--factor-update-steps");
  add_alias(app, *resolvers, *given, c, "--kfac-damping", "--damping");
  add_alias(app, *resolvers, *given, c, "--kfac-factor-decay", "--factor-decay");
  add_alias(app, *resolvers, *given, c, "--kfac-kl-clip", "--kl-clip");
  add_alias(app, *resolvers, *given, c, "--kfac-skip-layers", "--skip-layers");
  add_alias(app, *resolvers, *given, c, "--kfac-grad-worker-fraction", "--grad-worker-fraction",
            "; with --kfac-strategy hybrid-opt, its fraction");
  // The description as a named const std::string: built against torch 2.15's headers, a string literal here
  // made CLI11's add_flag(name, description) and add_flag(name, result&) ambiguous.
  static const std::string colocate_help = "decompose A and G of a layer on one rank (= --colocate-factors)";
  auto* colocate_alias = app.add_flag("--kfac-colocate-factors", colocate_help)->group(kAliasGroup);
  resolvers->push_back([&app, &c, colocate_alias] {
    if (colocate_alias->count() == 0) return;
    if (app.count("--no-colocate-factors") > 0) {
      throw CLI::ValidationError("--kfac-colocate-factors and --no-colocate-factors disagree; give one");
    }
    set_option(c, "colocate_factors", true, "--kfac-colocate-factors");
  });
  auto kfac_strategy_value = std::make_shared<std::string>();
  auto* kfac_strategy =
      app.add_option("--kfac-strategy", *kfac_strategy_value,
                     "comm-opt (= --grad-worker-fraction 1) | mem-opt (= 0, i.e. 1/P) | hybrid-opt (= 0.5, or "
                     "--kfac-grad-worker-fraction), all with --strategy kaisa")
          ->check(CLI::IsMember({"comm-opt", "mem-opt", "hybrid-opt"}))
          ->group(kAliasGroup);
  // After --kfac-grad-worker-fraction's resolver: an explicit fraction is in the options by then.
  resolvers->push_back([&app, &c, kfac_strategy, kfac_strategy_value] {
    if (kfac_strategy->count() == 0) return;
    const std::string name = *kfac_strategy_value;
    if (app.count("--strategy") > 0 && c.kfac_options.strategy() != Strategy::kKaisa) {
      throw CLI::ValidationError("--kfac-strategy " + name + " and --strategy " + to_string(c.kfac_options.strategy()) +
                                 " disagree (kfac_pytorch's strategies are --strategy kaisa); give one");
    }
    const bool explicit_fraction = app.count("--grad-worker-fraction") + app.count("--kfac-grad-worker-fraction") > 0;
    const std::string fraction_flag = c.flag("--grad-worker-fraction");
    const double given_fraction = c.kfac_options.grad_worker_fraction();
    double fraction = name == "comm-opt" ? 1.0 : name == "mem-opt" ? 0.0 : 0.5;  // kfac_pytorch's shortcuts
    if (name == "hybrid-opt" && explicit_fraction) fraction = given_fraction;
    if (explicit_fraction && given_fraction != fraction) {
      throw CLI::ValidationError("--kfac-strategy " + name + " (grad-worker fraction " +
                                 (name == "mem-opt" ? std::string("1/P") : show(fraction)) + ") and " + fraction_flag +
                                 " " + show(given_fraction) + " disagree; give one");
    }
    set_option(c, "strategy", std::string("kaisa"), "--kfac-strategy");
    set_option(c, "grad_worker_fraction", fraction, "--kfac-strategy");
  });
  // Through dkfac::optim::KFAC (docs/CPP.md): Adam in the K-FAC eigenbasis, and grafting. --eigen-adam turns KL
  // clipping off unless it is given (the library refuses it with eigen_adam: it bounds a natural-gradient step), and
  // takes the eigen method unless --compute-method is given (this command's default is inverse).
  static const std::string eigen_adam_help =
      "Adam in the K-FAC eigenbasis, with AdamW's update (--optimizer adamw): each K-FAC layer's step is Adam's on "
      "its gradient rotated into the eigenbasis of its factors (docs/MATH.md section 8); KL clipping off and "
      "--compute-method eigen unless given";
  auto* eigen_adam = app.add_flag("--eigen-adam", eigen_adam_help)->group(kOptimizerGroup);
  static const std::string graft_help =
      "each K-FAC layer moves along K-FAC's direction by the length of the optimizer's own step on its plain "
      "gradient (grafting; not with --eigen-adam)";
  app.add_flag("--graft", c.graft, graft_help)->group(kOptimizerGroup);
  resolvers->push_back([&app, &c, eigen_adam] {
    if (eigen_adam->count() == 0) return;
    set_option(c, "eigen_adam", true, "--eigen-adam");
    if (app.count("--kl-clip") + app.count("--kfac-kl-clip") == 0) set_option(c, "kl_clip", 0.0, "--eigen-adam");
    if (app.count("--compute-method") == 0) c.kfac_options.compute_method(ComputeMethod::kEigen);
  });
  // Aliases first, then every range check, naming the flag as typed: all before any worker starts.
  app.parse_complete_callback([resolvers, given, &c] {
    for (const auto& resolve : *resolvers) resolve();
    try {
      c.validate();
    } catch (const c10::Error& e) {
      throw CLI::ValidationError(e.what_without_backtrace());
    }
  });
}

}  // namespace dkfac::cli

