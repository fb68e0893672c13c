// `dkfac plan`: every strategy's placement and predicted cost for a model, without training.
#include <iomanip>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "dkfac/dkfac.h"
#include "tools/cli/commands.h"
#include "tools/models/models.h"

namespace dkfac::cli {
namespace {

struct PlanConfig {
  std::string model = "cnn";
  std::string dataset = "fashion-mnist";
  int nproc = 4;
  int64_t batch_size = 128;
  std::string compute_method = "inverse";
  int64_t spd_redundant_dim = 0;
  bool json = false;
};

/// `dkfac plan`: every strategy's placement and its predicted per-rank bytes, memory and FLOPs, from
/// the model's layer shapes alone (one forward of a zero sample records the conv output sizes).
int run_plan(const PlanConfig& c) {
  using dkfac::assign::PlanInputs;
  struct Input {
    int64_t channels, height, width, classes;
  };
  const Input in = c.dataset == "cifar10" ? Input{3, 32, 32, 10} : Input{1, 28, 28, 10};
  TORCH_CHECK(c.dataset == "cifar10" || c.dataset == "fashion-mnist" || c.dataset == "mnist",
              "--dataset must be fashion-mnist, mnist or cifar10, got '", c.dataset, "'");
  auto model = dkfac::models::make_model(c.model, in.channels, in.height, in.width, in.classes);
  {
    torch::NoGradGuard no_grad;
    model->eval();
    model->forward(torch::zeros({1, in.channels, in.height, in.width}));
  }
  int64_t parameters = 0;
  for (const auto& p : model->parameters()) parameters += p.numel();
  dkfac::Preconditioner kfac(model.ptr());  // single process: only to list the K-FAC layers
  std::vector<dkfac::assign::LayerShape> shapes;
  for (const auto& layer : kfac.layers()) {
    shapes.push_back({layer.name(), layer.a_dim(), layer.g_dim(), layer.capture().rows_per_sample()});
  }
  struct Row {
    std::string name;
    dkfac::assign::Assignment assignment;
    PlanInputs::Flow flow;
  };
  const int p = c.nproc;
  std::vector<Row> rows = {{"dkfac (kaisa f=1, comm-opt)", dkfac::assign::assign_kaisa(shapes, p, 1.0), PlanInputs::Flow::kKaisa}};
  if (p > 2 && p % 2 == 0) {
    rows.push_back({"kaisa f=1/2 (hybrid-opt)", dkfac::assign::assign_kaisa(shapes, p, 0.5), PlanInputs::Flow::kKaisa});
  }
  if (p > 1) {
    rows.push_back({"dkfac-lw (kaisa f=1/P, mem-opt)", dkfac::assign::assign_kaisa(shapes, p, 1.0 / p),
                    PlanInputs::Flow::kKaisa});
  }
  rows.push_back({"spd (redundant dim <= " + std::to_string(c.spd_redundant_dim) + ")",
                  dkfac::assign::assign_spd(shapes, p, c.spd_redundant_dim), PlanInputs::Flow::kSpd});
  rows.push_back({"dp", dkfac::assign::assign_dp(shapes, p), PlanInputs::Flow::kDp});

  nlohmann::json out = {{"model", c.model}, {"dataset", c.dataset}, {"nproc", p}, {"batch_size", c.batch_size},
                        {"compute_method", c.compute_method}, {"data_parallel_bytes_per_step", 4 * parameters},
                        {"strategies", nlohmann::json::array()}};
  std::ostringstream text;
  text << "plan: " << c.model << " on " << c.dataset << ", " << p << " ranks x batch " << c.batch_size << ", "
       << c.compute_method << "; float32; data-parallel gradient allreduce " << 4 * parameters
       << " B per step on every strategy\n";
  for (const auto& row : rows) {
    PlanInputs inputs;
    inputs.flow = row.flow;
    inputs.eigen = c.compute_method == "eigen";
    inputs.batch_size = c.batch_size;
    const auto plan = dkfac::assign::predict(row.assignment, shapes, inputs);
    text << "\n== " << row.name << "\n" << row.assignment.to_string(shapes)
         << "  rank  factors B/factor-step  2nd-order B/inv-step  gradients B/step  K-FAC memory B  "
            "factor GFLOP  decomp GFLOP  precond GFLOP\n";
    nlohmann::json ranks = nlohmann::json::array();
    for (int r = 0; r < p; ++r) {
      const auto& x = plan[r];
      text << "  " << std::setw(4) << r << std::setw(22) << x.factor_bytes << std::setw(22) << x.second_order_bytes
           << std::setw(18) << x.gradient_bytes << std::setw(16) << x.memory_bytes << std::fixed
           << std::setprecision(3) << std::setw(14) << x.factor_flops / 1e9 << std::setw(14)
           << x.decomposition_flops / 1e9 << std::setw(15) << x.precondition_flops / 1e9 << "\n";
      text.unsetf(std::ios::fixed);
      ranks.push_back({{"rank", r}, {"factor_bytes", x.factor_bytes}, {"second_order_bytes", x.second_order_bytes},
                       {"gradient_bytes", x.gradient_bytes}, {"memory_bytes", x.memory_bytes},
                       {"factor_flops", x.factor_flops}, {"decomposition_flops", x.decomposition_flops},
                       {"precondition_flops", x.precondition_flops}});
    }
    out["strategies"].push_back({{"strategy", row.name}, {"ranks", ranks}});
  }
  std::cout << (c.json ? out.dump(2) : text.str()) << std::endl;
  return 0;
}

}  // namespace

Command add_plan_command(CLI::App& app) {
  auto config = std::make_shared<PlanConfig>();
  auto* plan = app.add_subcommand("plan", "predicted per-rank bytes, memory and FLOPs of every strategy for a model");
  plan->add_option("--model", config->model, "mlp | cnn | resnet20 | autoencoder")->capture_default_str();
  plan->add_option("--dataset", config->dataset, "fashion-mnist | mnist | cifar10 (input shape)")
      ->capture_default_str();
  plan->add_option("--nproc", config->nproc, "ranks")->capture_default_str()->check(CLI::Range(1, 4096));
  plan->add_option("--batch-size", config->batch_size, "examples per rank per step")->capture_default_str()
      ->check(CLI::PositiveNumber);
  plan->add_option("--compute-method", config->compute_method, "eigen | inverse")->capture_default_str()
      ->check(CLI::IsMember({"eigen", "inverse"}));
  plan->add_option("--spd-redundant-dim", config->spd_redundant_dim,
                   "SPD-KFAC: factors up to this dimension are decomposed on every rank (a training job measures it)")
      ->capture_default_str();
  plan->add_flag("--json", config->json, "print JSON instead of tables");

  return {plan, [config](const Invocation&) { return run_plan(*config); }};
}

}  // namespace dkfac::cli
