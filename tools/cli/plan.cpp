// `dkfac plan`: every strategy's placement and predicted cost for a model, without training.
#include <iostream>

#include "tools/cli/commands.h"
#include "tools/cli/train_flags.h"
#include "tools/models/models.h"
#include "tools/models/paper_shapes.h"
#include "tools/plan/plan_report.h"

namespace dkfac::cli {
namespace {

struct PlanConfig {
  plan::PlanRequest request;
  bool json = false;
  bool per_rank = false;
};

}  // namespace

Command add_plan_command(CLI::App& app) {
  auto config = std::make_shared<PlanConfig>();
  auto& r = config->request;
  auto* plan = app.add_subcommand(
      "plan",
      "predicted per-rank bytes, memory and FLOPs of every strategy for a model (docs/PLANS.md). Text output in "
      "KiB/MiB/GiB and kFLOP/MFLOP/GFLOP/TFLOP; --json prints raw bytes and FLOPs");
  std::string models;
  for (const auto& n : dkfac::models::model_names()) models += n + " | ";
  for (const auto& n : dkfac::models::paper_model_names()) models += n + (n == "bert-large" ? "" : " | ");
  plan->add_option("--model", r.model,
                   models + " (the last five are paper-scale layer tables on ImageNet / BERT inputs)")
      ->capture_default_str();
  plan->add_option("--dataset", r.dataset,
                   "input shape: fashion-mnist | mnist | cifar10 for the small models (default fashion-mnist); "
                   "imagenet for resnet50, resnet152, densenet201 (3x224x224) and inception-v4 (3x299x299); "
                   "wikipedia for bert-large (default: the model's own)");
  auto* seq = plan->add_option("--seq-len", r.seq_len, "bert-large only: tokens per sample, 1..512 (default 128)");
  plan->add_option("--nproc", r.nproc, "ranks")->capture_default_str()->check(CLI::Range(1, 4096));
  plan->add_option("--batch-size", r.batch_size, "examples per rank per step")->capture_default_str()
      ->check(CLI::PositiveNumber);
  add_choice(*plan, "--compute-method", r.compute_method, "eigen | inverse");
  plan->add_option("--spd-redundant-dim", r.spd_redundant_dim,
                   "SPD-KFAC: factors up to this dimension are decomposed on every rank (a training job measures it)")
      ->capture_default_str();
  plan->add_option("--grad-worker-fraction", r.grad_worker_fractions,
                   "extra KAISA rows at these fractions (repeatable; W = nproc x f must divide nproc), besides "
                   "f = 1, 1/2 and 1/P");
  plan->add_flag("--symmetric-comm", r.symmetric_comm,
                 "KAISA rows (dkfac, kaisa, dkfac-lw): factors, and inverses, sent as upper triangles");
  plan->add_flag("--per-rank", config->per_rank,
                 "text: every rank's row and every layer's placement (the default when --nproc <= 8 and the model "
                 "has <= 32 K-FAC layers; otherwise min / median / max over ranks)");
  plan->add_flag("--json", config->json, "print JSON (raw bytes and FLOPs, every rank) instead of tables");

  return {plan, [config, seq](const Invocation&) {
            plan::PlanRequest request = config->request;
            TORCH_CHECK(seq->count() == 0 || request.model == "bert-large",
                        "--seq-len applies only to --model bert-large, got --model ", request.model);
            TORCH_CHECK(seq->count() == 0 || (request.seq_len >= 1 && request.seq_len <= 512),
                        "--seq-len must be in [1, 512] (BERT-Large's positions), got ", config->request.seq_len);
            const auto report = plan::plan_report(request);
            std::cout << (config->json ? report.json.dump(2) : plan::plan_text(report, config->per_rank)) << std::endl;
            return 0;
          }};
}

}  // namespace dkfac::cli
