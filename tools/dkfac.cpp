// The dkfac command line: `dkfac train` and `dkfac plot`.
#include <CLI/CLI.hpp>

#include <iostream>

#include "dkfac/version.h"
#include "tools/plot/plot.h"
#include "tools/train/trainer.h"

namespace {

void add_train_options(CLI::App& app, dkfac::train::TrainConfig& c) {
  app.add_option("--model", c.model, "mlp | cnn | resnet20 | autoencoder")->capture_default_str();
  app.add_option("--dataset", c.dataset, "fashion-mnist | mnist | cifar10 | synthetic")->capture_default_str();
  app.add_option("--data-dir", c.data_dir,
                 "dataset directory (default for fashion-mnist: /usr/share/datasets/fashion-mnist)");
  app.add_option("--optimizer", c.optimizer, "sgd | adam")->capture_default_str();
  app.add_option("--lr", c.lr, "base learning rate")->capture_default_str();
  app.add_option("--momentum", c.momentum, "SGD momentum")->capture_default_str();
  app.add_option("--weight-decay", c.weight_decay, "L2 weight decay")->capture_default_str();
  app.add_option("--batch-size", c.batch_size, "examples per step")->capture_default_str();
  app.add_option("--epochs", c.epochs, "passes over the training set")->capture_default_str();
  app.add_option("--max-steps", c.max_steps, "stop after this many steps in total (-1: no limit)")
      ->capture_default_str();
  app.add_option("--lr-schedule", c.lr_schedule, "constant | step (x0.1 at 50% and 75%) | cosine")
      ->capture_default_str();
  app.add_option("--warmup-epochs", c.warmup_epochs, "linear learning-rate warmup")->capture_default_str();
  app.add_option("--seed", c.seed, "seed of initialisation, shuffling and augmentation")->capture_default_str();
  app.add_option("--threads", c.threads, "intra-op threads (0: LibTorch default)")->capture_default_str();
  app.add_flag("--kfac,!--no-kfac", c.kfac, "K-FAC on (default) or off (plain SGD/Adam)");
  app.add_option("--damping", c.damping, "K-FAC damping")->capture_default_str();
  app.add_option("--factor-decay", c.factor_decay, "K-FAC running-average decay")->capture_default_str();
  app.add_option("--kl-clip", c.kl_clip, "K-FAC KL clip (0: off)")->capture_default_str();
  app.add_flag("--kl-clip-follows-lr,!--kl-clip-fixed", c.kl_clip_follows_lr,
               "scale the KL-clip bound by (lr / base lr)^2 (default) or keep it fixed (kfac_pytorch)");
  app.add_option("--factor-update-steps", c.factor_update_steps, "steps between factor updates")
      ->capture_default_str();
  app.add_option("--inv-update-steps", c.inv_update_steps, "steps between eigendecompositions/inverses")
      ->capture_default_str();
  app.add_option("--compute-method", c.compute_method, "eigen | inverse")->capture_default_str();
  app.add_option("--metrics", c.metrics, "write JSON Lines metrics to this file");
  app.add_option("--checkpoint-dir", c.checkpoint_dir, "directory for checkpoint.pt (written atomically)");
  app.add_option("--checkpoint-every-epochs", c.checkpoint_every_epochs, "epochs between checkpoints")
      ->capture_default_str();
  app.add_flag("--resume", c.resume, "continue from --checkpoint-dir/checkpoint.pt if it exists");
  app.add_option("--log-every", c.log_every, "steps between progress lines (0: ~10 per epoch)")
      ->capture_default_str();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dkfac: distributed K-FAC training for LibTorch"};
  app.set_version_flag("--version", std::string("dkfac ") + DKFAC_VERSION_STRING);
  app.require_subcommand(1);

  dkfac::train::TrainConfig train_config;
  auto* train = app.add_subcommand("train", "train a model with (or without) K-FAC");
  add_train_options(*train, train_config);

  std::vector<std::string> plot_inputs;
  std::string plot_output = "curves.png";
  auto* plot = app.add_subcommand("plot", "plot test accuracy and loss of metrics files against epochs and time");
  plot->add_option("metrics", plot_inputs, "metrics .jsonl files written by dkfac train")->required()->check(
      CLI::ExistingFile);
  plot->add_option("-o,--output", plot_output, "PNG to write")->capture_default_str();

  CLI11_PARSE(app, argc, argv);
  try {
    if (*train) {
      dkfac::train::Trainer trainer(train_config);
      trainer.run();
      if (!train_config.metrics.empty()) std::cout << "metrics: " << train_config.metrics << std::endl;
    } else if (*plot) {
      dkfac::plot::plot_metrics(plot_inputs, plot_output);
      std::cout << "plot: " << plot_output << std::endl;
    }
  } catch (const c10::Error& e) {
    std::cerr << "dkfac: error: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "dkfac: error: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
