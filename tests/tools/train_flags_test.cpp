// `dkfac train`'s flags: --help groups and defaults, kfac_pytorch's aliases, errors that name the flag typed.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "tools/cli/train_flags.h"

namespace dkfac::cli {
namespace {

using train::TrainConfig;

// Parses `args` (after "train") as the train subcommand does; the config is valid when this returns.
struct Parsed {
  std::unique_ptr<CLI::App> app = std::make_unique<CLI::App>("train");
  TrainConfig config;

  explicit Parsed(std::vector<std::string> args) {
    add_train_options(*app, config);
    std::reverse(args.begin(), args.end());  // CLI11 takes them reversed
    app->parse(args);
  }
};

// The message of the CLI::ParseError that parsing `args` throws ("" if none).
std::string error_of(const std::vector<std::string>& args) {
  try {
    Parsed parsed(args);
  } catch (const CLI::ParseError& e) {
    return e.what();
  }
  return "";
}

TEST(TrainFlags, HelpGroupsFlagsAndStatesDefaultsOfPairedSwitches) {
  CLI::App app("train");
  TrainConfig config;
  add_train_options(app, config);
  const std::string help = app.help();
  size_t last = 0;
  for (const char* group : {"Data:", "Model:", "Optimizer:", "K-FAC:", "Distributed:", "Checkpoints:", "Output:",
                            "kfac_pytorch example-script names"}) {
    const size_t at = help.find(std::string("\n") + group);
    ASSERT_NE(at, std::string::npos) << group << " missing in:\n" << help;
    EXPECT_GT(at, last) << group << " out of order";
    last = at;
  }
  // Each flag sits under its group.
  auto group_of = [&help](const std::string& flag) {
    const size_t at = help.find("  " + flag + " ");
    EXPECT_NE(at, std::string::npos) << flag;
    const size_t heading = help.rfind(":\n", at);
    return help.substr(help.rfind('\n', heading - 1) + 1, heading - help.rfind('\n', heading - 1) - 1);
  };
  EXPECT_EQ(group_of("--data-dir"), "Data");
  EXPECT_EQ(group_of("--model"), "Model");
  EXPECT_EQ(group_of("--lr"), "Optimizer");
  EXPECT_EQ(group_of("--damping"), "K-FAC");
  EXPECT_EQ(group_of("--no-kfac"), "K-FAC");
  EXPECT_EQ(group_of("--strategy"), "Distributed");
  EXPECT_EQ(group_of("--checkpoint-dir"), "Checkpoints");
  EXPECT_EQ(group_of("--metrics"), "Output");
  // A paired switch no longer reads "--kfac,--no-kfac{false}" (off by default); each half says its default.
  EXPECT_EQ(help.find("{false}"), std::string::npos) << help;
  EXPECT_EQ(help.find("{true}"), std::string::npos) << help;
  for (const char* text : {"precondition with K-FAC (default: on)", "no K-FAC: plain SGD/Adam (default: off)",
                           "(lr / base lr)^2 (default: on)", "as kfac_pytorch does (default: off)",
                           "decompose A and G of a layer on the same rank (default: on)",
                           "the opposite of --colocate-factors (default: off)"}) {
    EXPECT_NE(help.find(text), std::string::npos) << text;
  }
  // Every library option with a flag is there, with its declaration's documentation (dkfac/options.h).
  for (const auto& info : option_table()) {
    if (info.flag.empty()) continue;
    EXPECT_NE(help.find("  " + info.flag), std::string::npos) << info.flag << " missing in:\n" << help;
    EXPECT_NE(help.find(info.doc.substr(0, 40)), std::string::npos) << info.name << "'s documentation";
  }
  EXPECT_NE(help.find("--damping TEXT=0.3"), std::string::npos) << "the recipe's default: " << help;
  EXPECT_NE(help.find("--large-factor-dim TEXT=4096"), std::string::npos) << help;
}

TEST(TrainFlags, PairedSwitchesSetAndExcludeEachOther) {
  EXPECT_TRUE(Parsed({}).config.kfac);
  EXPECT_FALSE(Parsed({"--no-kfac"}).config.kfac);
  EXPECT_TRUE(Parsed({"--kfac"}).config.kfac);
  EXPECT_FALSE(Parsed({"--kl-clip-fixed"}).config.kl_clip_follows_lr);
  EXPECT_FALSE(Parsed({"--no-colocate-factors"}).config.kfac_options.colocate_factors());
  EXPECT_TRUE(Parsed({"--symmetric-comm"}).config.kfac_options.symmetric_comm());
  EXPECT_NE(error_of({"--colocate-factors", "--no-colocate-factors"}), "");
  EXPECT_NE(error_of({"--kfac", "--no-kfac"}), "");
}

TEST(TrainFlags, KfacPytorchAliasesMeanWhatTheExamplesMean) {
  Parsed p({"--kfac-damping", "0.003", "--kfac-factor-decay", "0.9", "--kfac-kl-clip", "0.01",
            "--kfac-factor-update-steps", "1", "--kfac-inv-update-steps", "10", "--kfac-skip-layers", "Conv2d",
            "^7$", "--kfac-colocate-factors"});
  EXPECT_TRUE(p.config.kfac);
  const auto& o = p.config.kfac_options;
  EXPECT_EQ(o.damping_at(0), 0.003);
  EXPECT_EQ(o.factor_decay_at(0), 0.9);
  EXPECT_EQ(o.kl_clip_at(0), 0.01);
  EXPECT_EQ(o.factor_update_steps_at(0), 1);
  EXPECT_EQ(o.inv_update_steps_at(0), 10);
  EXPECT_EQ(o.skip_layers(), (std::vector<std::string>{"Conv2d", "^7$"}));
  EXPECT_TRUE(o.colocate_factors());
  // The examples' `--kfac-inv-update-steps 0` is SGD without K-FAC.
  EXPECT_FALSE(Parsed({"--kfac-inv-update-steps", "0"}).config.kfac);
  // Given together with the same value, an alias and its flag agree.
  EXPECT_EQ(Parsed({"--damping", "0.1", "--kfac-damping", "0.1"}).config.kfac_options.damping_at(0), 0.1);
}

TEST(TrainFlags, KfacStrategyMapsToKaisaFractions) {
  auto fraction = [](std::vector<std::string> args) { return Parsed(std::move(args)).config.kfac_options.grad_worker_fraction(); };
  auto comm = Parsed({"--kfac-strategy", "comm-opt"}).config.kfac_options;
  EXPECT_EQ(comm.strategy(), Strategy::kKaisa);
  EXPECT_EQ(comm.grad_worker_fraction(), 1.0);
  EXPECT_EQ(fraction({"--kfac-strategy", "mem-opt"}), 0.0) << "0: 1/P";
  EXPECT_EQ(fraction({"--kfac-strategy", "hybrid-opt"}), 0.5);
  EXPECT_EQ(fraction({"--kfac-strategy", "hybrid-opt", "--kfac-grad-worker-fraction", "0.25"}), 0.25);
  EXPECT_EQ(fraction({"--kfac-grad-worker-fraction", "0.5"}), 0.5);
  EXPECT_EQ(fraction({"--grad-worker-fraction", "mem-opt"}), 0.0) << "the declaration's named values";
  EXPECT_NE(error_of({"--kfac-strategy", "hybrid_opt"}), "");
}

TEST(TrainFlags, AliasAndFlagWithDifferentValuesIsAnErrorNamingBoth) {
  EXPECT_EQ(error_of({"--damping", "0.3", "--kfac-damping", "0.003"}),
            "--kfac-damping 0.003 and --damping 0.3 disagree (--kfac-damping is kfac_pytorch's name for --damping); "
            "give one");
  EXPECT_EQ(error_of({"--factor-update-steps", "10", "--kfac-factor-update-steps", "1"}),
            "--kfac-factor-update-steps 1 and --factor-update-steps 10 disagree (--kfac-factor-update-steps is "
            "kfac_pytorch's name for --factor-update-steps); give one");
  EXPECT_NE(error_of({"--inv-update-steps", "100", "--kfac-inv-update-steps", "10"})
                .find("--kfac-inv-update-steps 10 and --inv-update-steps 100 disagree"),
            std::string::npos);
  EXPECT_EQ(error_of({"--kfac", "--kfac-inv-update-steps", "0"}),
            "--kfac-inv-update-steps 0 (K-FAC off) and --kfac disagree; give one");
  EXPECT_NE(error_of({"--no-kfac", "--kfac-inv-update-steps", "5"}).find("and --no-kfac disagree"), std::string::npos);
  EXPECT_NE(error_of({"--skip-layers", "a", "--kfac-skip-layers", "b"})
                .find("--kfac-skip-layers b and --skip-layers a disagree"),
            std::string::npos);
  EXPECT_EQ(error_of({"--no-colocate-factors", "--kfac-colocate-factors"}),
            "--kfac-colocate-factors and --no-colocate-factors disagree; give one");
  EXPECT_NE(error_of({"--kfac-strategy", "mem-opt", "--strategy", "spd"})
                .find("--kfac-strategy mem-opt and --strategy spd disagree"),
            std::string::npos);
  EXPECT_EQ(error_of({"--kfac-strategy", "comm-opt", "--grad-worker-fraction", "0.5"}),
            "--kfac-strategy comm-opt (grad-worker fraction 1) and --grad-worker-fraction 0.5 disagree; give one");
  EXPECT_EQ(error_of({"--kfac-strategy", "mem-opt", "--kfac-grad-worker-fraction", "0.5"}),
            "--kfac-strategy mem-opt (grad-worker fraction 1/P) and --kfac-grad-worker-fraction 0.5 disagree; give "
            "one");
}

TEST(TrainFlags, BadValuesAreRefusedAtParseNamingTheFlagTyped) {
  // The library options' checks and messages are their declaration's (dkfac/options.h), naming the flag typed.
  EXPECT_EQ(error_of({"--factor-decay", "2"}), "--factor-decay must be finite and in [0, 1], got 2");
  EXPECT_EQ(error_of({"--kfac-factor-decay", "2"}), "--kfac-factor-decay must be finite and in [0, 1], got 2");
  EXPECT_EQ(error_of({"--damping", "0"}), "--damping must be finite and > 0, got 0");
  EXPECT_EQ(error_of({"--kfac-damping", "-1"}), "--kfac-damping must be finite and > 0, got -1");
  EXPECT_EQ(error_of({"--large-factor-dim", "-1"}), "--large-factor-dim must be >= 0, got -1");
  EXPECT_EQ(error_of({"--spd-fusion", "2", "x"}), "--spd-fusion takes integers, got 'x'");
  EXPECT_EQ(error_of({"--kfac-inv-update-steps", "-1"}), "--kfac-inv-update-steps must be >= 0 (0: K-FAC off), got -1");
  EXPECT_EQ(error_of({"--inv-update-steps", "0"}), "--inv-update-steps must be >= 1, got 0");
  EXPECT_EQ(error_of({"--kfac-grad-worker-fraction", "2"}),
            "--kfac-grad-worker-fraction must be finite and in [0, 1], got 2");
  EXPECT_EQ(error_of({"--threads", "-1"}), "--threads must be in [0, 4096] (0: LibTorch's default), got -1");
}

TEST(TrainFlags, ChoicesParseIntoEnumsAndABadOneNamesTheFlagAndTheChoices) {
  const auto c = Parsed({"--model", "resnet20", "--dataset", "cifar10", "--optimizer", "adam", "--lr-schedule", "step",
                         "--compute-method", "eigen", "--factor-dtype", "float64", "--inv-dtype", "bfloat16",
                         "--on-nan-loss", "skip", "--strategy", "dp", "--large-factor-dim", "100",
                         "--spd-fusion", "4", "2", "--skip-layers", "fc1", "conv"})
                     .config;
  EXPECT_EQ(c.model, train::Model::kResnet20);
  EXPECT_EQ(c.dataset, train::Dataset::kCifar10);
  EXPECT_EQ(c.optimizer, train::Optimizer::kAdam);
  EXPECT_EQ(c.lr_schedule, train::LrSchedule::kStep);
  EXPECT_EQ(c.kfac_options.compute_method(), ComputeMethod::kEigen);
  EXPECT_EQ(c.kfac_options.factor_dtype(), c10::kDouble);
  EXPECT_EQ(c.kfac_options.inv_dtype(), c10::kBFloat16);
  EXPECT_EQ(c.on_nan_loss, train::NanPolicy::kSkip);
  EXPECT_EQ(c.kfac_options.strategy(), Strategy::kDp);
  EXPECT_EQ(c.kfac_options.large_factor_dim(), 100) << "a new option reaches the command line by its declaration";
  EXPECT_EQ(c.kfac_options.spd().fusion(), (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(c.kfac_options.skip_layers(), (std::vector<std::string>{"fc1", "conv"}));
  EXPECT_EQ(train::to_json(c).at("large-factor-dim"), 100) << "and the metrics' run event";
  // The defaults, unparsed.
  const auto d = Parsed({}).config;
  EXPECT_EQ(d.model, train::Model::kCnn);
  EXPECT_EQ(d.kfac_options.compute_method(), ComputeMethod::kInverse);
  EXPECT_EQ(d.kfac_options.factor_dtype(), std::nullopt);

  EXPECT_EQ(error_of({"--model", "nosuch"}), "--model must be one of mlp, cnn, resnet20, autoencoder, got 'nosuch'");
  EXPECT_EQ(error_of({"--dataset", "imagenet"}),
            "--dataset must be one of fashion-mnist, mnist, cifar10, synthetic, got 'imagenet'");
  EXPECT_EQ(error_of({"--optimizer", "lamb"}), "--optimizer must be one of sgd, adam, adamw, got 'lamb'");
  EXPECT_EQ(error_of({"--lr-schedule", "linear"}), "--lr-schedule must be one of constant, step, cosine, got 'linear'");
  EXPECT_EQ(error_of({"--compute-method", "svd"}), "--compute-method must be one of eigen, inverse, got 'svd'");
  EXPECT_EQ(error_of({"--factor-dtype", "half"}),
            "--factor-dtype must be one of float32, float64, bfloat16, float16 or none (the default), got 'half'");
  EXPECT_EQ(error_of({"--on-nan-loss", "ignore"}), "--on-nan-loss must be one of stop, skip, got 'ignore'");
  EXPECT_EQ(error_of({"--strategy", "hogwild"}), "--strategy must be one of kaisa, spd, dp, auto, got 'hogwild'");
  EXPECT_NE(error_of({"--strategy", "dkfac-lw"}).find("--strategy kaisa --grad-worker-fraction 1"), std::string::npos);

  // --help states each choice flag's default, as it did when they were strings.
  CLI::App app("train");
  train::TrainConfig config;
  add_train_options(app, config);
  const std::string help = app.help();
  for (const char* text : {"--model TEXT=cnn", "--dataset TEXT=fashion-mnist", "--optimizer TEXT=sgd",
                           "--lr-schedule TEXT=cosine", "--compute-method TEXT=inverse", "--factor-dtype TEXT=none",
                           "--on-nan-loss TEXT=stop", "--strategy TEXT=kaisa"}) {
    EXPECT_NE(help.find(text), std::string::npos) << text << " missing in:\n" << help;
  }
}

TEST(TrainFlags, DeviceAndBackendParseTheirChoicesAndRefuseNcclOnTheCpu) {
  const auto d = Parsed({}).config;
  EXPECT_EQ(d.device, train::DeviceChoice::kCpu) << "the CPU by default: today's behaviour and numbers";
  EXPECT_EQ(d.backend, comm::CudaBackend::kAuto);
  EXPECT_EQ(Parsed({"--device", "cuda"}).config.device, train::DeviceChoice::kCuda);
  EXPECT_EQ(Parsed({"--device", "auto"}).config.device, train::DeviceChoice::kAuto);
  const auto gloo = Parsed({"--device", "cuda", "--backend", "gloo"}).config;
  EXPECT_EQ(gloo.backend, comm::CudaBackend::kGloo);
  EXPECT_EQ(Parsed({"--device", "auto", "--backend", "nccl"}).config.backend, comm::CudaBackend::kNccl);
  EXPECT_EQ(Parsed({"--backend", "gloo"}).config.backend, comm::CudaBackend::kGloo) << "harmless on the CPU";

  EXPECT_EQ(error_of({"--device", "gpu"}), "--device must be one of cpu, cuda, auto, got 'gpu'");
  EXPECT_EQ(error_of({"--device", "cuda:1"}), "--device must be one of cpu, cuda, auto, got 'cuda:1'");
  EXPECT_EQ(error_of({"--backend", "mpi"}), "--backend must be one of auto, nccl, gloo, got 'mpi'");
  EXPECT_EQ(error_of({"--backend", "nccl"}),
            "--backend nccl carries CUDA tensors, but --device cpu trains on the CPU (its collectives always go "
            "through Gloo); pass --device cuda or auto, or leave --backend out");

  // Both in the Distributed group, with their defaults; the ranks of a job must agree on both.
  CLI::App app("train");
  train::TrainConfig config;
  add_train_options(app, config);
  const std::string help = app.help();
  for (const char* text : {"--device TEXT=cpu", "--backend TEXT=auto"}) {
    const size_t at = help.find(text);
    ASSERT_NE(at, std::string::npos) << text << " missing in:\n" << help;
    EXPECT_LT(help.rfind("\nDistributed:", at), at) << text;
    EXPECT_EQ(help.rfind("\nCheckpoints:", at), std::string::npos) << text << " after the Checkpoints group";
  }
  const auto options = train::to_json(gloo);
  EXPECT_EQ(options.at("device"), "cuda");
  EXPECT_EQ(options.at("backend"), "gloo");
}

// --eigen-adam and --graft step through dkfac::optim::KFAC: --eigen-adam sets the library's eigen_adam, turns KL
// clipping off and takes the eigen method unless --kl-clip or --compute-method is given, needs --optimizer adamw,
// and neither goes with the other or with --no-kfac.
TEST(TrainFlags, EigenAdamAndGraftNeedWhatTheyStepThrough) {
  Parsed adam({"--optimizer", "adamw", "--eigen-adam"});
  EXPECT_EQ(adam.config.optimizer, train::Optimizer::kAdamW);
  EXPECT_TRUE(adam.config.kfac_options.eigen_adam());
  EXPECT_EQ(adam.config.kfac_options.kl_clip_at(0), 0.0);
  EXPECT_EQ(adam.config.kfac_options.compute_method(), ComputeMethod::kEigen);  // this command's default: inverse
  EXPECT_EQ(Parsed({}).config.kfac_options.compute_method(), ComputeMethod::kInverse);
  EXPECT_NE(error_of({"--optimizer", "adamw", "--eigen-adam", "--compute-method", "inverse"}).find("compute_method"),
            std::string::npos);
  EXPECT_EQ(train::to_json(adam.config)["eigen-adam"], true);
  Parsed clipped({"--optimizer", "adamw", "--eigen-adam", "--kl-clip", "none"});
  EXPECT_EQ(clipped.config.kfac_options.kl_clip_at(0), 0.0);
  EXPECT_NE(error_of({"--optimizer", "adamw", "--eigen-adam", "--kl-clip", "0.01"}).find("kl_clip"),
            std::string::npos) << error_of({"--optimizer", "adamw", "--eigen-adam", "--kl-clip", "0.01"});
  EXPECT_NE(error_of({"--eigen-adam"}).find("--eigen-adam is AdamW's update in the K-FAC eigenbasis: it needs "
                                            "--optimizer adamw, got --optimizer sgd"), std::string::npos)
      << error_of({"--eigen-adam"});
  EXPECT_NE(error_of({"--optimizer", "adamw", "--eigen-adam", "--no-kfac"}).find("--no-kfac turns K-FAC off"),
            std::string::npos);
  Parsed grafted({"--graft"});
  EXPECT_TRUE(grafted.config.graft);
  EXPECT_FALSE(Parsed({}).config.graft);
  EXPECT_NE(error_of({"--optimizer", "adamw", "--eigen-adam", "--graft"}).find("--graft takes the length"),
            std::string::npos);
  EXPECT_NE(error_of({"--graft", "--no-kfac"}).find("--no-kfac turns K-FAC off"), std::string::npos);
}

}  // namespace
}  // namespace dkfac::cli
