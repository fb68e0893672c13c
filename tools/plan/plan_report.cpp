#include "tools/plan/plan_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <thread>

#include "dkfac/dkfac.h"
#include "dkfac/numbers.h"
#include "dkfac/comm/communicator.h"
#include "dkfac/layers/discovery.h"
#include "dkfac/strategy/candidates.h"
#include "dkfac/strategy/prediction.h"
#include "tools/common/report_json.h"
#include "tools/models/models.h"
#include "tools/models/paper_shapes.h"

namespace dkfac::plan {
namespace {

/// The per-rank fields, in table order: JSON key, column header, bytes (else FLOPs).
struct Field {
  const char* key;
  const char* header;
  bool bytes;
};
const std::vector<Field>& fields() {
  static const std::vector<Field> f = {
      {"factor_bytes", "factors/f-step", true},    {"second_order_bytes", "2nd-ord/i-step", true},
      {"gradient_bytes", "V/step", true},          {"memory_bytes", "K-FAC memory", true},
      {"factor_flops", "factor", false},           {"decomposition_flops", "decomp", false},
      {"precondition_flops", "precond", false},    {"update_bytes", "update bytes", true},
      {"update_flops", "update FLOPs", false},
  };
  return f;
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

/// Shapes and counts of the requested model, with the dataset checked against it.
struct ModelTable {
  std::string dataset;
  std::string input;
  std::vector<assign::LayerShape> layers;
  int64_t parameters = 0;
  int64_t kfac_parameters = 0;
  int64_t seq_len = 0;  // sequence models only
  std::vector<models::ParallelLayer> parallel;  // transformers: each layer's tensor and pipeline placement
  int blocks = 0;
};

/// The layers pipeline stage `stage` of `stages` holds (blocks split evenly, the first stages taking one more where
/// they do not divide; what precedes the blocks with the first stage, what follows with the last), each split as
/// tensor parallelism over `tp` ranks splits it for the group's first rank, which holds the row-parallel biases
/// (docs/STRATEGIES.md, "Tensor and pipeline parallel"), or kept whole with `exact` factors. A factor split
/// narrower than Options::diagonal_factor_dim becomes dense again, as a job's would. `tp_elements` receives the
/// elements that rank moves over the tensor-parallel group per update (a step that builds factors): the
/// row-parallel biases' gradients it broadcasts (block-diagonal), or the all-gathers of each split layer's
/// output gradients (column) or inputs (row) over a `batch` of samples and of its gradient (exact).
std::vector<assign::LayerShape> stage_layers(const ModelTable& t, int stage, int stages, int tp, bool exact,
                                             int64_t batch, double& tp_elements) {
  const double others = static_cast<double>(tp - 1) / tp;  // an all-gather brings the other ranks' parts
  tp_elements = 0.0;
  const int per = t.blocks / stages, extra = t.blocks % stages;
  const int first = stage * per + std::min(stage, extra);
  const int last = first + per + (stage < extra ? 1 : 0);  // one past
  std::vector<assign::LayerShape> out;
  std::vector<int> index(t.layers.size(), -1);  // model index -> stage index (shared A factors)
  for (size_t i = 0; i < t.layers.size(); ++i) {
    const auto& where = t.parallel[i];
    const bool here = where.block < 0           ? stage == 0
                      : where.block >= t.blocks ? stage == stages - 1
                                                : where.block >= first && where.block < last;
    if (!here) continue;
    auto shape = t.layers[i];
    const int64_t bias = where.bias ? 1 : 0;
    const int64_t samples = batch * shape.rows_per_sample;
    if (exact && where.split == models::TpSplit::kColumn) {
      tp_elements += others * static_cast<double>(samples * shape.g_dim + shape.a_dim * shape.g_dim);
    } else if (exact && where.split == models::TpSplit::kRow) {
      tp_elements += others * static_cast<double>((samples + shape.g_dim) * (shape.a_dim - bias));
    } else if (where.split == models::TpSplit::kColumn) {
      TORCH_CHECK(shape.g_dim % tp == 0, "--tp ", tp, ": layer ", shape.name, "'s ", shape.g_dim,
                  " outputs do not split evenly (the plan models even splits; a job also runs torch.chunk's uneven "
                  "column splits)");
      shape.g_dim /= tp;
    } else if (where.split == models::TpSplit::kRow) {
      TORCH_CHECK((shape.a_dim - bias) % tp == 0, "--tp ", tp, ": layer ", shape.name, "'s ", shape.a_dim - bias,
                  " inputs do not split evenly (torch's DTensor fails on an uneven row-parallel split)");
      shape.a_dim = (shape.a_dim - bias) / tp + bias;
      tp_elements += static_cast<double>((tp - 1) * bias * shape.g_dim);  // the bias gradient, to every other rank
    }
    models::keep_wide_factors_diagonal(shape, where.embedding);
    if (shape.a_shared_with >= 0) shape.a_shared_with = index[static_cast<size_t>(shape.a_shared_with)];
    index[i] = static_cast<int>(out.size());
    out.push_back(std::move(shape));
  }
  return out;
}

ModelTable model_table(const PlanRequest& r) {
  const auto& tools = models::model_names();
  const bool is_tools = std::find(tools.begin(), tools.end(), r.model) != tools.end();
  std::vector<std::string> all = tools;
  for (const auto& n : models::paper_model_names()) all.push_back(n);
  TORCH_CHECK(is_tools || models::is_paper_model(r.model), "--model must be one of ", join(all), ", got '", r.model,
              "'");
  const auto sequence = models::sequence_input(r.model);
  TORCH_CHECK(r.seq_len == 0 || sequence.max_len > 0, "--seq-len applies only to the sequence models (bert-large, "
              "gpt-1.3b, gpt-6.7b); ", r.model, " has image inputs");
  ModelTable t;
  if (!is_tools) {
    const std::string expected = sequence.max_len > 0 ? sequence.dataset : "imagenet";
    t.dataset = r.dataset.empty() ? expected : r.dataset;
    TORCH_CHECK(t.dataset == expected, "--dataset for --model ", r.model, " must be ", expected, ", got '", t.dataset,
                "'");
    if (sequence.max_len > 0) {
      t.seq_len = r.seq_len == 0 ? sequence.default_len : r.seq_len;
      TORCH_CHECK(t.seq_len >= 1 && t.seq_len <= sequence.max_len, "--seq-len must be in [1, ", sequence.max_len,
                  "] (", r.model, "'s positions), got ", t.seq_len);
    }
    auto m = models::paper_model(r.model, sequence.max_len > 0 ? t.seq_len : 128, 1000);
    t.input = m.input;
    t.layers = std::move(m.layers);
    t.parameters = m.parameters;
    t.kfac_parameters = m.kfac_parameters;
    t.parallel = std::move(m.parallel);
    t.blocks = m.blocks;
    return t;
  }
  struct Input {
    int64_t channels, height, width, classes;
  };
  t.dataset = r.dataset.empty() ? "fashion-mnist" : r.dataset;
  TORCH_CHECK(t.dataset == "cifar10" || t.dataset == "fashion-mnist" || t.dataset == "mnist", "--dataset for --model ",
              r.model, " must be fashion-mnist, mnist or cifar10, got '", t.dataset, "'");
  const Input in = t.dataset == "cifar10" ? Input{3, 32, 32, 10} : Input{1, 28, 28, 10};
  t.input = std::to_string(in.channels) + "x" + std::to_string(in.height) + "x" + std::to_string(in.width);
  auto model = models::make_model(r.model, in.channels, in.height, in.width, in.classes);
  {
    torch::NoGradGuard no_grad;  // one forward of a zero sample records the conv output sizes
    model->eval();
    model->forward(torch::zeros({1, in.channels, in.height, in.width}));
  }
  for (const auto& p : model->parameters()) t.parameters += p.numel();
  dkfac::Preconditioner kfac(model.ptr());  // single process: only to list the K-FAC layers
  t.layers = strategy::layer_shapes(kfac.layers());
  for (const auto& layer : kfac.layers()) t.kfac_parameters += layer.a_dim() * layer.g_dim();
  return t;
}

/// 25557032 -> "25,557,032".
std::string grouped(int64_t n) {
  std::string digits = std::to_string(n);
  for (int i = static_cast<int>(digits.size()) - 3; i > 0; i -= 3) digits.insert(static_cast<size_t>(i), ",");
  return digits;
}

std::string cell(const nlohmann::json& value, bool bytes) {
  const double v = value.get<double>();
  return bytes ? human_bytes(v) : human_flops(v);
}

/// The published system a plan runs: "KAISA comm-opt" (SC20's D-KFAC), "KAISA hybrid-opt", "KAISA mem-opt"
/// (SC20's layer-wise variant), "SPD-KFAC", "DP-KFAC".
std::string system_of(const strategy::StepPlan& plan) {
  std::string name = system_name(plan.strategy);
  if (plan.strategy == Strategy::kKaisa) name += std::string(" ") + to_string(plan.placement.distributed_strategy());
  return name;
}

}  // namespace

PlanReport plan_report(const PlanRequest& r) {
  TORCH_CHECK(r.nproc >= 1, "--nproc must be >= 1, got ", r.nproc);
  TORCH_CHECK(r.batch_size >= 1, "--batch-size must be >= 1, got ", r.batch_size);
  ModelTable t = model_table(r);
  if (!r.shared_input_layers.empty()) {  // the groups a job's preconditioner forms (layers/discovery.h)
    Options().shared_input_layers(r.shared_input_layers).validate();
    std::vector<std::string> names;
    for (const auto& s : t.layers) names.push_back(s.name);
    const auto leaders = input_groups(names, r.shared_input_layers);
    for (size_t i = 0; i < t.layers.size(); ++i) t.layers[i].a_shared_with = leaders[i];
  }
  const auto& shapes = t.layers;
  TORCH_CHECK(r.tp >= 1 && r.pp >= 1, "--tp and --pp must be >= 1, got ", r.tp, " and ", r.pp);
  TORCH_CHECK(r.nproc % (r.tp * r.pp) == 0, "--tp ", r.tp, " x --pp ", r.pp, " must divide --nproc ", r.nproc);
  TORCH_CHECK((r.tp == 1 && r.pp == 1) || t.blocks > 0, "--tp and --pp need a transformer's layer table "
              "(bert-large, gpt-1.3b, gpt-6.7b), got --model ", r.model);
  TORCH_CHECK(r.pp <= std::max(1, t.blocks), "--pp ", r.pp, " stages for ", t.blocks, " blocks");
  // The K-FAC strategies run over the data-parallel ranks of each (tensor, pipeline) position.
  const int p = r.nproc / (r.tp * r.pp);
  std::vector<std::vector<assign::LayerShape>> stages = {shapes};
  std::vector<double> tp_elements(static_cast<size_t>(r.pp), 0.0);
  if (r.tp * r.pp > 1) {
    stages.clear();
    for (int stage = 0; stage < r.pp; ++stage) {
      stages.push_back(stage_layers(t, stage, r.pp, r.tp, r.tp_exact, r.batch_size, tp_elements[stage]));
    }
  }
  // Options as a training job would set them; the same make_step_plan() a job calls builds each plan.
  const Options base = Options()
                           .compute_method(r.compute_method)
                           .symmetric_comm(r.symmetric_comm)
                           .second_order_lag(r.second_order_lag)
                           .pad_widths(r.pad_widths)
                           .spd(SpdOptions().redundant_dim(r.spd_redundant_dim));
  // KAISA as the papers compare it: f = 1 (SC20's D-KFAC, comm-opt), 1/2 (hybrid-opt), 1/P (mem-opt), and the
  // fractions asked for.
  strategy::CandidateSpace space;
  space.both_layouts = false;
  space.grad_workers = {p};
  if (p > 2 && p % 2 == 0) space.grad_workers.push_back(p / 2);
  space.grad_workers.push_back(1);
  for (const double f : r.grad_worker_fractions) {
    TORCH_CHECK(f > 0.0 && f <= 1.0, "--grad-worker-fraction must be in (0, 1], got ", f);
    try {
      space.grad_workers.push_back(assign::grad_worker_count(p, f));
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "--grad-worker-fraction with ", p, " data-parallel ranks: ", e.what_without_backtrace());
    }
  }
  TORCH_CHECK(r.spd_redundant_dim >= 0, "--spd-redundant-dim must be >= 0, got ", r.spd_redundant_dim);
  if (r.shard_ranks > 0) {
    TORCH_CHECK(p % r.shard_ranks == 0, "--hsdp: the replicas must divide the ", p, " data-parallel ranks (",
                r.shard_ranks, " shard ranks)");
    space.shard_ranks = r.shard_ranks;
    for (auto& stage : stages) {
      for (auto& shape : stage) shape.sharded = true;
    }
  }
  const auto rows = strategy::candidates(p, base, space);

  const int64_t element_bytes = 4;
  PlanReport report;
  report.json = {{"model", r.model},
                        {"dataset", t.dataset},
                        {"input", t.input},
                        {"nproc", r.nproc},
                        {"tp", r.tp},
                        {"tensor_parallel_factors", r.tp_exact ? "exact" : "block_diagonal"},
                        {"pp", r.pp},
                        {"dp", p},
                        {"batch_size", r.batch_size},
                        {"compute_method", to_string(r.compute_method)},
                        {"symmetric_comm", r.symmetric_comm},
                        {"second_order_lag", r.second_order_lag},
                        {"pad_widths", r.pad_widths},
                        {"element_bytes", element_bytes},
                        {"parameters", t.parameters},
                        {"kfac_parameters", t.kfac_parameters},
                        {"data_parallel_bytes_per_step", element_bytes * t.parameters},
                        {"model_state_bytes", 3 * element_bytes * t.parameters},
                        {"layers", nlohmann::json::array()},
                        {"strategies", nlohmann::json::array()}};
  nlohmann::json& out = report.json;
  if (t.seq_len > 0) out["seq_len"] = t.seq_len;
  if (r.shard_ranks > 0) {
    out["sharding"] = r.shard_ranks == p ? "fsdp" : "hsdp";
    out["shard_ranks"] = r.shard_ranks;
  }
  if (r.spd_redundant_dim > 0) out["spd_redundant_dim"] = r.spd_redundant_dim;
  for (const auto& s : shapes) {
    out["layers"].push_back({{"name", s.name},
                             {"a_dim", s.a_dim},
                             {"g_dim", s.g_dim},
                             {"rows_per_sample", s.rows_per_sample},
                             {"a_diagonal", s.a_diagonal},
                             {"g_diagonal", s.g_diagonal},
                             {"a_kernel", math::to_string(s.a_kernel)},
                             {"g_kernel", math::to_string(s.g_kernel)}});
    if (s.a_shared_with >= 0) out["layers"].back()["a_shared_with"] = s.a_shared_with;
  }
  const double ring = p > 1 ? static_cast<double>(p - 1) / p : 0.0;
  // Each rank's figures of a plan, with the derived update totals.
  const auto rank_rows = [&](const strategy::StepPlan& step_plan) {
    nlohmann::json ranks = nlohmann::json::array();
    const auto costs = strategy::predict(step_plan, element_bytes, r.batch_size);
    for (int rank = 0; rank < p; ++rank) {
      const auto& x = costs[rank];
      nlohmann::json entry = x;
      entry["rank"] = rank;
      entry["update_bytes"] = x.factor_bytes + x.second_order_bytes + x.gradient_bytes;
      entry["update_ring_bytes"] = ring * (2.0 * x.factor_bytes + x.second_order_bytes + x.gradient_bytes);
      entry["update_flops"] = x.factor_flops + x.decomposition_flops + x.precondition_flops;
      ranks.push_back(std::move(entry));
    }
    return ranks;
  };
  const auto most = [](const nlohmann::json& ranks, const char* key) {
    double m = 0;
    for (const auto& x : ranks) m = std::max(m, x[key].get<double>());
    return m;
  };
  for (const auto& row : rows) {
    // Under pipeline parallelism every stage is planned; the fullest (the most K-FAC memory on a rank) is shown.
    std::vector<strategy::StepPlan> plans;
    std::vector<nlohmann::json> stage_ranks;
    size_t fullest = 0;
    for (const auto& stage : stages) {
      plans.push_back(strategy::make_step_plan(stage, p, row.options, -1, r.shard_ranks));
      stage_ranks.push_back(rank_rows(plans.back()));
      if (most(stage_ranks.back(), "memory_bytes") > most(stage_ranks[fullest], "memory_bytes")) {
        fullest = stage_ranks.size() - 1;
      }
    }
    const auto& step_plan = plans[fullest];
    const nlohmann::json& ranks = stage_ranks[fullest];
    report.placements.push_back(step_plan.describe());
    nlohmann::json summary;
    std::vector<std::string> keys;
    for (const auto& f : fields()) keys.push_back(f.key);
    keys.push_back("update_ring_bytes");
    for (const auto& key : keys) {
      std::vector<double> v;
      for (const auto& x : ranks) v.push_back(x[key].get<double>());
      double sum = 0;
      for (double y : v) sum += y;
      summary[key] = {{"min", *std::min_element(v.begin(), v.end())},
                      {"median", median(v)},
                      {"max", *std::max_element(v.begin(), v.end())},
                      {"sum", sum}};
    }
    out["strategies"].push_back({{"strategy", row.name},
                                 {"system", system_of(step_plan)},
                                 {"grad_workers", step_plan.grad_workers()},
                                 {"factor_reduction", strategy::to_string(step_plan.reduction)},
                                 {"factor_triangles", step_plan.factor_triangles},
                                 {"broadcast_gradients", step_plan.broadcast_gradients},
                                 {"ranks", ranks},
                                 {"summary", summary}});
    if (r.tp * r.pp > 1) {
      nlohmann::json per_stage = nlohmann::json::array();
      for (size_t k = 0; k < stages.size(); ++k) {
        per_stage.push_back({{"stage", k},
                             {"layers", stages[k].size()},
                             {"memory_bytes", most(stage_ranks[k], "memory_bytes")},
                             {"update_bytes", most(stage_ranks[k], "update_bytes")},
                             {"update_flops", most(stage_ranks[k], "update_flops")},
                             {"tensor_parallel_bytes", element_bytes * tp_elements[k]}});
      }
      out["strategies"].back()["stage"] = fullest;
      out["strategies"].back()["stages"] = per_stage;
    }
  }
  return report;
}

std::string plan_text(const PlanReport& plan, bool per_rank) {
  const nlohmann::json& report = plan.json;
  const int p = report["dp"].get<int>();  // the ranks a strategy runs over
  const int tp = report["tp"].get<int>(), pp = report["pp"].get<int>();
  const size_t layers = report["layers"].size();
  const bool detail = per_rank || (p <= 8 && layers <= 32);
  std::ostringstream text;
  text << "plan: " << report["model"].get<std::string>() << " on " << report["dataset"].get<std::string>() << " ("
       << report["input"].get<std::string>() << "), " << report["nproc"].get<int>() << " ranks"
       << (tp * pp > 1 ? " (tp " + std::to_string(tp) + " x pp " + std::to_string(pp) + " x dp " + std::to_string(p) +
                             "; K-FAC runs over the dp ranks of each tensor and pipeline position)"
                       : std::string())
       << " x batch " << report["batch_size"].get<int64_t>()
       << ", " << report["compute_method"].get<std::string>() << ", float32"
       << (report["symmetric_comm"].get<bool>() ? ", KAISA factors as upper triangles" : "") << "\n"
       << "  " << grouped(report["parameters"].get<int64_t>()) << " parameters, " << layers
       << " K-FAC layers holding " << grouped(report["kfac_parameters"].get<int64_t>()) << "; data-parallel gradient allreduce "
       << human_bytes(report["data_parallel_bytes_per_step"].get<double>())
       << (tp * pp > 1 ? " for the whole model (a rank's stage and tensor shard a part)" : "")
       << " per step on every strategy\n"
       << "  bytes: payload per collective call on each rank; update = one step that builds factors, decomposes "
          "and preconditions\n";
  constexpr int kWidth = 15;
  for (size_t i = 0; i < report["strategies"].size(); ++i) {
    const auto& s = report["strategies"][i];
    text << "\n== " << s["strategy"].get<std::string>() << "  [" << s["system"].get<std::string>() << ", P=" << p
         << ", W=" << s["grad_workers"].get<int>() << "]\n";
    if (s.contains("stages")) {  // tensor or pipeline parallel: the fullest stage below, every stage's maxima here
      text << "  stage (layers): most K-FAC memory / update bytes / update FLOPs on a rank of its first tp rank, "
           << "and the bytes it moves over the tensor-parallel group per update ("
           << report["tensor_parallel_factors"].get<std::string>() << " factors)\n";
      for (const auto& stage : s["stages"]) {
        text << "    " << (stage["stage"] == s["stage"] ? "* " : "  ") << stage["stage"].get<int>() << " ("
             << stage["layers"].get<int>() << "): " << human_bytes(stage["memory_bytes"].get<double>()) << " / "
             << human_bytes(stage["update_bytes"].get<double>()) << " / "
             << human_flops(stage["update_flops"].get<double>()) << ", tp "
             << human_bytes(stage["tensor_parallel_bytes"].get<double>()) << "\n";
      }
    }
    if (detail) {
      text << plan.placements.at(i);
    } else {
      const auto placed = s.contains("stages") ? s["stages"][s["stage"].get<size_t>()]["layers"].get<size_t>() : layers;
      text << "  (" << placed << " layers placed; --per-rank lists each layer's placement and every rank)\n";
    }
    text << "  " << std::setw(6) << (detail ? "rank" : "ranks");
    for (const auto& f : fields()) text << " " << std::setw(kWidth - 1) << f.header;
    text << "\n";
    if (detail) {
      for (const auto& x : s["ranks"]) {
        text << "  " << std::setw(6) << x["rank"].get<int>();
        for (const auto& f : fields()) text << " " << std::setw(kWidth - 1) << cell(x[f.key], f.bytes);
        text << "\n";
      }
    } else {
      for (const char* stat : {"min", "median", "max"}) {
        text << "  " << std::setw(6) << stat;
        for (const auto& f : fields()) {
          text << " " << std::setw(kWidth - 1) << cell(s["summary"][f.key][stat], f.bytes);  // spaced when wider
        }
        text << "\n";
      }
    }
  }
  return text.str();
}

namespace {

std::string us(double seconds) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1) << seconds * 1e6 << " us";
  return out.str();
}

}  // namespace

strategy::Rates measure_rates_in_process(int nproc, int threads, ComputeMethod method) {
  TORCH_CHECK(nproc >= 1, "--nproc must be >= 1, got ", nproc);
  TORCH_CHECK(threads >= 1, "threads must be >= 1, got ", threads);
  if (nproc == 1) {
    at::set_num_threads(threads);
    return strategy::measure_local_rates(c10::Device(c10::kCPU), c10::kFloat, method);
  }
  auto store = std::make_shared<comm::InProcessStore>();
  std::vector<strategy::Rates> out(nproc);
  std::vector<std::exception_ptr> errors(nproc);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < nproc; ++rank) {
    ranks.emplace_back([&, rank] {
      try {
        at::set_num_threads(threads);  // per thread: each rank's own intra-op team, as a process would have
        auto communicator = comm::Communicator::connect_in_process(store, rank, nproc);
        out[rank] = strategy::measure_rates(*communicator, c10::Device(c10::kCPU), c10::kFloat, method);
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return out[0];
}

AutoReport auto_report(const PlanRequest& r, const strategy::Rates& rates) {
  TORCH_CHECK(r.nproc >= 1, "--nproc must be >= 1, got ", r.nproc);
  TORCH_CHECK(r.batch_size >= 1, "--batch-size must be >= 1, got ", r.batch_size);
  TORCH_CHECK(r.factor_update_steps >= 1 && r.inv_update_steps >= 1,
              "--factor-update-steps and --inv-update-steps must be >= 1, got ", r.factor_update_steps, " and ",
              r.inv_update_steps);
  TORCH_CHECK(rates.method == r.compute_method, "the rates were measured for --compute-method ",
              to_string(rates.method), ", but the plan is for ", to_string(r.compute_method),
              ": measure them for that method (dkfac plan --measure-rates FILE --compute-method ",
              to_string(r.compute_method), ")");
  rates.validate();
  const ModelTable t = model_table(r);
  const Options base = Options()
                           .compute_method(r.compute_method)
                           .second_order_lag(r.second_order_lag)
                           .pad_widths(r.pad_widths)
                           .spd(SpdOptions().redundant_dim(-1));
  const auto choice = strategy::choose_strategy(t.layers, r.nproc, base, rates, r.memory_budget_bytes, r.batch_size,
                                                {r.factor_update_steps, r.inv_update_steps});
  AutoReport report;
  report.json = {{"model", r.model},
                 {"dataset", t.dataset},
                 {"input", t.input},
                 {"nproc", r.nproc},
                 {"batch_size", r.batch_size},
                 {"compute_method", to_string(r.compute_method)},
                 {"factor_update_steps", r.factor_update_steps},
                 {"inv_update_steps", r.inv_update_steps},
                 {"second_order_lag", r.second_order_lag},
                 {"pad_widths", r.pad_widths},
                 {"memory_budget_bytes", r.memory_budget_bytes},
                 {"rates", rates},
                 {"candidates", choice.candidates},
                 {"chosen", choice.pick().name},
                 {"fits", choice.fits},
                 {"reason", choice.reason}};
  std::ostringstream text;
  text << "plan: " << r.model << " on " << t.dataset << " (" << t.input << "), " << r.nproc << " ranks x batch "
       << r.batch_size << ", " << to_string(r.compute_method) << ", " << storage_dtype_name(rates.dtype)
       << "; strategy auto\n";
  text << "  rates: measured on " << rates.world_size << (rates.world_size == 1 ? " rank" : " ranks") << ", "
       << rates.device << ", " << storage_dtype_name(rates.dtype) << ", " << to_string(rates.method) << ", " << rates.threads
       << " intra-op thread(s) per rank; nodes of " << rates.ranks_per_node << " ranks computing at "
       << std::setprecision(3) << rates.parallel_ranks << " ranks' full speed at once; a decomposition beside the "
       << "steps costs them " << rates.side_work_cost << " of its time"
       << (rates.conditions.empty() ? "" : "; " + rates.conditions) << "\n";
  text << "    allreduce " << us(rates.allreduce.alpha) << " + " << std::setprecision(3) << rates.allreduce.beta * 1e9
       << " ns/B (" << us(rates.allreduce_busy.alpha) << " + " << rates.allreduce_busy.beta * 1e9
       << " ns/B while the ranks compute), broadcast " << us(rates.broadcast.alpha) << " + " << rates.broadcast.beta * 1e9
       << " ns/B (on the measured ranks; scaled to each group's size)\n";
  const auto factor_rate = [](const strategy::FactorRate& rate) {
    std::ostringstream out;
    out << us(rate.seconds) << " + " << std::setprecision(3) << rate.per_entry * 1e9 << " ns/entry + "
        << (rate.per_flop > 0 ? 1e-9 / rate.per_flop : 0.0) << " GFLOP/s";
    return out.str();
  };
  text << "    factors (start-up + per input entry + 2 rows d^2 FLOPs): covariance " << factor_rate(rates.factor)
       << ";\n    conv A, 3x3 stride 1 (row shifts) " << factor_rate(rates.conv_factor) << ", strided or 1x1 (patches) "
       << factor_rate(rates.conv_patches_factor) << ", under " << math::kChannelsLastMin << " channels (unfold) "
       << factor_rate(rates.conv_unfold_factor) << ";\n    conv G " << factor_rate(rates.conv_g_factor) << "; fold "
       << us(rates.fold.seconds) << " + " << rates.fold.per_entry * 1e9 << " ns/entry;\n    "
       << to_string(rates.method) << " d=64 / 256 / 1024: " << 1e3 * rates.decomposition.seconds_for(64) << " / "
       << 1e3 * rates.decomposition.seconds_for(256) << " / " << 1e3 * rates.decomposition.seconds_for(1024)
       << " ms; preconditioning " << us(rates.precondition.seconds) << " + "
       << (rates.precondition.per_flop > 0 ? 1e-9 / rates.precondition.per_flop : 0.0) << " GFLOP/s\n";
  text << choice.describe();
  report.text = text.str();
  return report;
}

}  // namespace dkfac::plan
