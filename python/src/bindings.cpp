// dkfac._C: the Python front end's door into the C++ core. It binds layer captures (fed by torch module
// hooks), the options, the preconditioner, a communicator built on torch.distributed's process group and a
// collector of the core's warnings. Everything numeric runs in the core; this file only converts arguments.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/extension.h>

#include <pybind11/chrono.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <chrono>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "dkfac/allocator.h"
#include "dkfac/comm/agreement.h"
#include "dkfac/comm/communicator.h"
#include "dkfac/layers/discovery.h"
#include "dkfac/math/eigen_adam.h"
#include "dkfac/math/graft.h"
#include "dkfac/math/second_order.h"
#include "dkfac/preconditioner.h"
#include "dkfac/strategy/prediction.h"
#include "dkfac/strategy/step_plan.h"
#include "dkfac/version.h"

namespace py = pybind11;

namespace dkfac {
namespace {

torch::nn::functional::PadFuncOptions::mode_t pad_mode(const std::string& mode) {
  if (mode == "zeros") return torch::kConstant;
  if (mode == "reflect") return torch::kReflect;
  if (mode == "replicate") return torch::kReplicate;
  if (mode == "circular") return torch::kCircular;
  TORCH_CHECK(false, "Conv2d padding_mode '", mode, "' is not one of zeros, reflect, replicate, circular");
}

using Pair = std::array<int64_t, 2>;

// The patch layout of a torch.nn.Conv2d, by the same rules as torch's forward: a string padding
// ('valid', 'same': the odd pixel right/bottom), numbers, and for non-zero modes the module's own
// `_reversed_padding_repeated_twice` {left, right, top, bottom}.
math::Conv2dGeometry conv2d_geometry(Pair kernel, Pair stride, Pair dilation, const py::object& padding,
                                     const std::string& padding_mode, std::array<int64_t, 4> reversed_padding) {
  math::Conv2dGeometry g;
  g.kernel_size = kernel;
  g.stride = stride;
  g.dilation = dilation;
  g.padding_mode = pad_mode(padding_mode);
  if (padding_mode != "zeros") {
    g.padding = reversed_padding;
  } else if (py::isinstance<py::str>(padding)) {
    const auto spec = padding.cast<std::string>();
    if (spec == "valid") {
      g.padding = {0, 0, 0, 0};
    } else if (spec == "same") {
      g.padding = math::conv2d_same_padding(kernel, dilation);
    } else {
      TORCH_CHECK(false, "Conv2d padding '", spec, "' is not 'valid', 'same' or numbers");
    }
  } else {
    const auto pad = padding.cast<Pair>();
    g.padding = {pad[1], pad[1], pad[0], pad[0]};
  }
  return g;
}

// Options from the keyword arguments the package was given, each set by its declaration (dkfac/options.h,
// option_table()): the package turns enums into their names and torch dtypes into "float32" etc.; the core
// checks types, ranges and choices and names the keyword. `grad_scale` is the package's loss-scale function.
Options make_options(const py::dict& kw) {
  Options o;
  for (const auto& [key, value] : kw) {
    const auto name = key.cast<std::string>();
    if (name == "grad_scale") {
      if (!value.is_none()) o.grad_scaler(value.cast<GradScale>());
      continue;
    }
    OptionValue v;
    try {
      v = value.cast<OptionValue>();
    } catch (const py::cast_error&) {
      throw py::type_error(name + " must be " + (option_info(name).schedule ? "a number or a callable of the step"
                                                                           : "of the declared type") +
                           ", got " + py::repr(value).cast<std::string>());
    }
    try {
      o.set(name, v);
    } catch (const c10::Error& e) {
      throw py::value_error(e.what_without_backtrace());
    }
  }
  try {
    o.validate();
  } catch (const c10::Error& e) {
    throw py::value_error(e.what_without_backtrace());
  }
  return o;
}

// Collects the warnings (TORCH_WARN) raised on this thread between start() and stop(), for the package to
// re-raise through Python's warnings module. The core runs with the GIL released, so it cannot call into
// Python itself, and c10's default handler would print to stderr. c10's handler is per thread: start()
// and stop() must be called on the thread that makes the core's calls.
class WarningCollector : public c10::WarningHandler {
 public:
  /// (message, true for a DeprecationWarning) of one warning.
  using Collected = std::vector<std::pair<std::string, bool>>;

  void process(const c10::Warning& warning) override {
    collected_.emplace_back(warning.msg(), std::holds_alternative<c10::DeprecationWarning>(warning.type()));
  }
  void start() {
    TORCH_CHECK(!guard_, "WarningCollector.start() called twice without stop()");
    guard_.emplace(this);
  }
  /// Restores the previous handler and hands over what was collected, in order.
  Collected stop() {
    TORCH_CHECK(guard_, "WarningCollector.stop() called without start()");
    guard_.reset();
    return std::exchange(collected_, {});
  }

 private:
  Collected collected_;
  std::optional<c10::WarningUtils::WarningHandlerGuard> guard_;
};

// KAISA's grid as the core resolved it (assign::kaisa_layout): what the package reports as kfac_pytorch's
// distributed_strategy, grad_worker_fraction and colocate_factors.
/// One figure of strategy::predict for each rank of `p`'s plan, with K-FAC tensors of `element_bytes`.
std::vector<int64_t> predicted(const Preconditioner& p, int64_t element_bytes, int64_t strategy::RankCost::*figure) {
  std::vector<int64_t> out;
  for (const auto& cost : strategy::predict(p.executor()->plan(), element_bytes, 1)) out.push_back(cost.*figure);
  return out;
}

py::dict layout_dict(const assign::Assignment& grid) {
  py::dict d;
  d["world_size"] = grid.world_size;
  d["grad_workers"] = grid.grad_workers;
  d["grad_worker_fraction"] = grid.grad_worker_fraction;
  d["colocate_factors"] = grid.colocate_factors;
  d["distributed_strategy"] = assign::to_string(grid.distributed_strategy());
  return d;
}

}  // namespace
}  // namespace dkfac

PYBIND11_MODULE(_C, m) {
  using namespace dkfac;
  m.doc() = "dkfac's C++ core (used by the dkfac package; not a public API)";
  m.attr("__version__") = DKFAC_VERSION_STRING;
  m.def("configure_allocator", &configure_allocator,
        "Keeps freed memory in the process (glibc: no mmap, trim threshold 1 GiB); once, at start-up");
  m.def("option_table", [] {
    // One dict per option (dkfac/options.h): what KFACPreconditioner's keywords, repr() and docs are made from.
    py::list out;
    const char* types[] = {"bool", "int", "float", "choice", "dtype", "strings", "ints"};
    for (const auto& info : option_table()) {
      py::dict d;
      d["name"] = info.name;
      d["type"] = types[static_cast<int>(info.type)];
      d["schedule"] = info.schedule;
      d["default"] = info.default_text;
      d["kfac_pytorch_default"] = info.kfac_pytorch_default;
      d["range"] = info.type == OptionType::kInt || info.type == OptionType::kDouble ? info.range.describe() : "";
      d["choices"] = info.choices;
      d["flag"] = info.flag;
      d["alias"] = info.alias;
      d["doc"] = info.doc;
      out.append(d);
    }
    return out;
  });
  // The eigen method's two decompositions (dkfac/math/second_order.h), for benchmarks and tests: the core's
  // eigendecomposition of a factor, and its refresh of an earlier one (Options::eigh_interval).
  m.def("eigen_decompose", [](const torch::Tensor& factor) {
    auto e = math::eigen_decompose(factor);
    return std::make_pair(e.eigenvectors, e.eigenvalues);
  }, py::call_guard<py::gil_scoped_release>());
  m.def("refresh_eigenbasis", [](const torch::Tensor& factor, const torch::Tensor& eigenvectors,
                                 const torch::Tensor& eigenvalues) {
    auto e = math::refresh_eigenbasis(factor, {eigenvectors, eigenvalues});
    return std::make_pair(e.eigenvectors, e.eigenvalues);
  }, py::call_guard<py::gil_scoped_release>());
  // AdamW's decoupled update with eigen_adam's steps (dkfac/math/eigen_adam.h), which dkfac.optim.KFAC applies as
  // the C++ dkfac::optim::KFAC does.
  m.def("apply_decoupled_step", &math::apply_decoupled_step, py::arg("params"), py::arg("directions"), py::arg("lr"),
        py::arg("weight_decay"), py::call_guard<py::gil_scoped_release>());
  // Grafting's update of one layer's block (dkfac/math/graft.h), which dkfac.optim.KFAC(graft=True) applies as the
  // C++ dkfac::optim::KFAC does.
  m.def("graft_block", &math::graft_block, py::arg("block"), py::arg("start"), py::arg("direction"),
        py::call_guard<py::gil_scoped_release>());
  // Its two halves, for a block of shards (FSDP2): the sums, reduced over the shards' ranks, then the update.
  m.def("graft_sums", &math::graft_sums, py::arg("block"), py::arg("start"), py::arg("direction"),
        py::call_guard<py::gil_scoped_release>());
  m.def("graft_apply", &math::graft_apply, py::arg("block"), py::arg("start"), py::arg("direction"), py::arg("sums"),
        py::call_guard<py::gil_scoped_release>());
  m.def("layer_state_entries", [] {
    // KfacLayer::state()'s entries (dkfac/layers/kfac_layer.h): key, whether a factor, side 'a' or 'g', whether
    // one of Adam's moments (eigen_adam).
    std::vector<std::tuple<std::string, bool, std::string, bool>> out;
    for (const auto& e : layer_state_entries()) out.emplace_back(e.key, e.factor, std::string(1, e.side), e.moment());
    return out;
  });
  m.def("skip_layers_match", &skip_layers_match, py::arg("skip_layers"), py::arg("texts"),
        "Whether a skip_layers pattern (ECMAScript, searched) matches one of texts: the core's rule, for modules of "
        "other kinds");
  m.def(
      "choose_layers",
      // candidates: (name, class name, kind "Linear"/"Conv2d"/"Embedding", trainable, groups, reason the front end
      // cannot precondition it or "", the other modules holding one of its parameters) each; the core's one rule set
      // (dkfac/layers/discovery.h), its warnings collected by the caller. Returns the chosen indices and, per
      // candidate, why it was not chosen ("").
      [](const std::vector<std::tuple<std::string, std::string, std::string, bool, int64_t, std::string,
                                      std::vector<std::string>>>& candidates,
         const std::vector<std::string>& skip_layers, const std::string& model) {
        std::vector<ModuleCandidate> modules;
        for (const auto& [name, class_name, kind, trainable, groups, reason, tied_to] : candidates) {
          const auto layer_kind = kind == "Conv2d"      ? LayerKind::kConv2d
                                  : kind == "Embedding" ? LayerKind::kEmbedding
                                                        : LayerKind::kLinear;
          modules.push_back({name, class_name, layer_kind, trainable, groups, reason, tied_to});
        }
        std::vector<std::string> reasons;
        try {
          auto chosen = choose_layers(modules, skip_layers, model, &reasons);
          return std::make_pair(chosen, reasons);
        } catch (const c10::Error& e) {
          throw py::value_error(e.what_without_backtrace());
        }
      });
  m.def("option_values", [](const py::dict& kw) {
    // The options the keywords give, as the core holds them: name -> value text, in declaration order.
    const auto o = make_options(kw);
    std::vector<std::pair<std::string, std::string>> out;
    for (const auto& info : option_table()) out.emplace_back(info.name, option_text(info, o.get(info.name)));
    return out;
  });

  m.def(
      "kaisa_layout",
      // The grid the core places KAISA's work on for these options on `world_size` ranks (no process needed);
      // a running preconditioner's is its `layout`.
      [](int world_size, double grad_worker_fraction, bool colocate_factors) {
        try {
          return layout_dict(assign::kaisa_layout(world_size, grad_worker_fraction, colocate_factors));
        } catch (const c10::Error& e) {
          throw py::value_error(e.what_without_backtrace());
        }
      },
      py::arg("world_size"), py::arg("grad_worker_fraction"), py::arg("colocate_factors"));
  m.def(
      "step_plan_placement",
      // The placement of the step plan a job of `world_size` ranks runs for these options and layers (a_dim, g_dim)
      // each: strategy::make_step_plan, as StepExecutor calls it, with nothing run. The grid as layout_dict, plus
      // per layer (a_worker, g_worker, grad_workers).
      [](int world_size, const py::dict& options, const std::vector<std::pair<int64_t, int64_t>>& dims) {
        std::vector<assign::LayerShape> shapes;
        for (const auto& [a, g] : dims) shapes.push_back({"layer" + std::to_string(shapes.size()), a, g});
        const auto o = make_options(options);
        try {
          const auto placement = strategy::make_step_plan(shapes, world_size, o).placement;
          auto out = layout_dict(placement);
          std::vector<std::tuple<int, int, std::vector<int>>> layers;
          for (const auto& l : placement.layers) layers.emplace_back(l.a_worker, l.g_worker, l.grad_workers);
          out["layers"] = layers;
          return out;
        } catch (const c10::Error& e) {
          throw py::value_error(e.what_without_backtrace());
        }
      },
      py::arg("world_size"), py::arg("options"), py::arg("layers"));

  py::class_<WarningCollector>(m, "WarningCollector")
      .def(py::init<>())
      .def("start", &WarningCollector::start)
      .def("stop", &WarningCollector::stop);

  py::class_<FactorCapture, std::shared_ptr<FactorCapture>>(m, "FactorCapture")
      .def_property_readonly("enabled", &FactorCapture::enabled)
      .def("capture_input", &FactorCapture::capture_input, py::arg("input"), py::arg("at_once") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("capture_output_grad", &FactorCapture::capture_output_grad, py::call_guard<py::gil_scoped_release>())
      .def("watch_weight", &FactorCapture::watch_weight)
      .def("mark_weight_written", &FactorCapture::mark_weight_written)
      .def("set_weight_written_in_forward", &FactorCapture::set_weight_written_in_forward)
      .def("set_vocabulary_slice", &FactorCapture::set_vocabulary_slice, py::arg("first"), py::arg("rows"))
      .def_property_readonly("a_count", &FactorCapture::a_count)
      .def_property_readonly("g_count", &FactorCapture::g_count)
      .def("pending_bytes", &FactorCapture::pending_bytes);

  m.def(
      "linear_capture",
      [](bool has_bias, bool transposed) {
        LayerGeometry geometry{LayerKind::kLinear, has_bias, {}};
        geometry.transposed = transposed;  // transformers' Conv1D: weight [in, out]
        return std::make_shared<FactorCapture>(geometry);
      },
      py::arg("has_bias"), py::arg("transposed") = false);
  m.def("embedding_capture", [](int64_t num_embeddings) {
    try {
      return std::make_shared<FactorCapture>(embedding_geometry(num_embeddings));
    } catch (const c10::Error& e) {
      throw py::value_error(e.what_without_backtrace());
    }
  });
  m.def("conv2d_capture",
        [](bool has_bias, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride, std::array<int64_t, 2> dilation,
           const py::object& padding, const std::string& padding_mode, std::array<int64_t, 4> reversed_padding) {
          return std::make_shared<FactorCapture>(LayerGeometry{
              LayerKind::kConv2d, has_bias, conv2d_geometry(kernel, stride, dilation, padding, padding_mode,
                                                            reversed_padding)});
        });

  py::class_<comm::Communicator, std::shared_ptr<comm::Communicator>>(m, "Communicator")
      .def_property_readonly("rank", &comm::Communicator::rank)
      .def_property_readonly("size", &comm::Communicator::size)
      .def_property_readonly("cuda_backend", [](const comm::Communicator& c) { return comm::to_string(c.cuda_backend()); })
      .def(
          "all_true",
          [](comm::Communicator& c, bool flag) { return comm::all_true(c, flag); },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "first_refusal",
          [](comm::Communicator& c, const std::string& refusal) { return comm::first_refusal(c, refusal); },
          py::arg("refusal"), py::call_guard<py::gil_scoped_release>())
      .def("stop_watchdog", &comm::Communicator::stop_watchdog, py::call_guard<py::gil_scoped_release>())
      .def("diagnose_failure", &comm::Communicator::diagnose_failure, py::call_guard<py::gil_scoped_release>())
      .def("silent_ranks",
           [](const comm::Communicator& c, double seconds) {
             return c.silent_ranks(std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
           })
      .def("traffic", [](const comm::Communicator& c) {
        std::map<std::string, std::pair<int64_t, int64_t>> out;
        for (const auto& [phase, t] : c.traffic()) out[phase] = {t.calls, t.bytes};
        return out;
      });
  m.def(
      "communicator",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& group, const c10::intrusive_ptr<c10d::Store>& store,
         const std::string& prefix, double timeout_seconds) {
        // The subgroups' Gloo backends come from torch.distributed: this extension needs no gloo headers (pip's
        // torch compiles Gloo in but ships none), and they are the same backends torch's own groups use.
        comm::GlooBackendMaker torch_gloo = [](c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                               std::chrono::milliseconds timeout) {
          py::gil_scoped_acquire gil;
          py::object backend =
              py::module_::import("torch.distributed").attr("ProcessGroupGloo")(store, rank, size, timeout);
          return backend.cast<c10::intrusive_ptr<c10d::Backend>>();
        };
        return comm::Communicator::from_process_group(
            group, store, prefix, std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000)),
            std::move(torch_gloo));
      },
      py::call_guard<py::gil_scoped_release>());

  py::class_<Preconditioner>(m, "Preconditioner")
      // layers: (name, class name of the torch.nn module, weight, bias, capture) each.
      .def(py::init([](const std::vector<std::tuple<std::string, std::string, torch::Tensor,
                                                    std::optional<torch::Tensor>, std::shared_ptr<FactorCapture>>>&
                           layers,
                       const py::dict& options, std::shared_ptr<comm::Communicator> communicator,
                       const std::vector<int>& shard_ranks) {
             // shard_ranks: per layer, the ranks its rows are sharded over (FSDP2, HSDP), 0 for one not sharded.
             TORCH_CHECK(shard_ranks.empty() || shard_ranks.size() == layers.size(), "shard_ranks names ",
                         shard_ranks.size(), " layers, ", layers.size(), " are given");
             std::vector<LayerBinding> bindings;
             MessageNames names;  // messages name torch.nn classes and keyword arguments (large_factor_dim=4096)
             names.option_prefix = "";
             names.option_separator = "=";
             names.bool_values = {"False", "True"};
             for (const auto& [name, class_name, weight, bias, capture] : layers) {
               const int ranks = shard_ranks.empty() ? 0 : shard_ranks[bindings.size()];
               bindings.push_back({name, weight, bias.value_or(torch::Tensor()), capture, ranks > 0, ranks});
               names.layer_classes.push_back(class_name);
             }
             auto o = make_options(options);
             py::gil_scoped_release release;  // collective under a communicator (SPD measures the link)
             return std::make_unique<Preconditioner>(std::move(bindings), std::move(o), std::move(communicator),
                                                     std::move(names));
           }),
           py::arg("layers"), py::arg("options"), py::arg("communicator") = nullptr,
           py::arg("shard_ranks") = std::vector<int>{})
      .def(
          "step",
          // gather and scatter: a front end's distributors (Distributor), each returning (collectives, bytes);
          // sum_over_model: sums a tensor over the model-parallel group in place; counted_elsewhere: the layers
          // whose KL term another rank of that group adds.
          [](Preconditioner& p, std::optional<py::function> gather, std::optional<py::function> scatter,
             std::optional<py::function> sum_over_model, std::vector<bool> counted_elsewhere) {
            const auto call = [](const py::function& move) {
              return [&move]() -> Distributor::Moved {
                py::gil_scoped_acquire gil;
                const auto moved = move().cast<std::pair<int64_t, int64_t>>();
                return {moved.first, moved.second};
              };
            };
            Distributor distributor;
            if (gather) distributor.gather = call(*gather);
            if (scatter) distributor.scatter = call(*scatter);
            if (sum_over_model) {
              distributor.sum_over_model = [&sum = *sum_over_model](torch::Tensor& t) {
                py::gil_scoped_acquire gil;
                sum(t);  // in place
              };
            }
            distributor.counted_elsewhere = std::move(counted_elsewhere);
            py::gil_scoped_release release;  // back before `distributor` goes: it refers to the functions only
            p.step(distributor);
          },
          py::arg("gather") = py::none(), py::arg("scatter") = py::none(), py::arg("sum_over_model") = py::none(),
          py::arg("counted_elsewhere") = std::vector<bool>{})
      .def("agree_strategy_over_model", &Preconditioner::agree_strategy_over_model, py::arg("leader"))
      .def("update_second_order", &Preconditioner::update_second_order, py::call_guard<py::gil_scoped_release>())
      .def("reset_batch", &Preconditioner::reset_batch)
      .def("layers_folded_since_step", &Preconditioner::layers_folded_since_step)
      .def("rearm_capture", &Preconditioner::rearm_capture)
      .def("set_adam_constants", &Preconditioner::set_adam_constants, py::arg("beta1"), py::arg("beta2"),
           py::arg("eps"))
      .def("rebind_layer",  // bias None for a layer without one
           [](Preconditioner& p, size_t index, torch::Tensor weight, std::optional<torch::Tensor> bias) {
             p.rebind_layer(index, std::move(weight), bias.value_or(torch::Tensor()));
           })
      .def_property_readonly("steps", &Preconditioner::steps)
      .def("is_factor_step", &Preconditioner::is_factor_step)
      .def("memory_bytes", &Preconditioner::memory_bytes)
      .def("second_order_in_flight_bytes", &Preconditioner::second_order_in_flight_bytes)
      .def("stack_padding_bytes", &Preconditioner::stack_padding_bytes)
      .def("layer_dims",
           [](const Preconditioner& p) {
             // (a, g, A diagonal, G diagonal) per layer, as the core sized them
             std::vector<std::tuple<int64_t, int64_t, bool, bool>> out;
             for (const auto& l : p.layers()) out.emplace_back(l.a_dim(), l.g_dim(), l.a_diagonal(), l.g_diagonal());
             return out;
           })
      .def_property_readonly("last_kl_scale", &Preconditioner::last_kl_scale)
      .def("last_step_times", [](const Preconditioner& p) { return p.last_step_times().by_name(); })
      .def("total_times", [](const Preconditioner& p) { return p.total_times().by_name(); })
      .def("layer_states",
           [](const Preconditioner& p) {
             std::vector<std::map<std::string, torch::Tensor>> states;
             for (const auto& layer : p.layers()) states.push_back(layer.state());
             return states;
           })
      .def("load_layer_states", &Preconditioner::load_layer_states)
      .def(
          "restore",  // Preconditioner::restore: method "eigen", "inverse" or None (not known)
          [](Preconditioner& p, int64_t steps, std::vector<std::map<std::string, torch::Tensor>> layers,
             const std::optional<std::string>& method, std::string per_rank_writer, bool recompute,
             std::vector<std::set<std::string>> unheld) {
            SavedState saved;
            saved.steps = steps;
            saved.layers = std::move(layers);
            if (method == to_string(ComputeMethod::kEigen)) saved.method = ComputeMethod::kEigen;
            if (method == to_string(ComputeMethod::kInverse)) saved.method = ComputeMethod::kInverse;
            saved.per_rank_writer = std::move(per_rank_writer);
            saved.recompute = recompute;
            saved.unheld = std::move(unheld);
            try {
              const auto restored = p.restore(std::move(saved));
              return std::make_pair(restored.placed_layers, restored.recomputed_layers);
            } catch (const c10::ValueError& e) {  // a refusal (another rank's share): Python's ValueError
              throw py::value_error(e.what_without_backtrace());
            }
          },
          py::arg("steps"), py::arg("layers"), py::arg("method"), py::arg("per_rank_writer"), py::arg("recompute"),
          py::arg("unheld"),
          py::call_guard<py::gil_scoped_release>())
      .def("gathered_layer_states", &Preconditioner::gathered_layer_states, py::call_guard<py::gil_scoped_release>())
      .def("state_template", &Preconditioner::state_template)
      .def("describe", [](const Preconditioner& p) { return p.executor()->describe(); })
      // Per rank, the gradient bytes the plan says it moves per step (strategy::predict): V's broadcasts and a
      // sharded layer's rows, which the distributors move and the core counts.
      .def("predicted_gradient_bytes",
           [](const Preconditioner& p, int64_t element_bytes) {
             return predicted(p, element_bytes, &strategy::RankCost::gradient_bytes);
           })
      // Per rank, the factor bytes the plan says it hands to collectives per factor step.
      .def("predicted_factor_bytes",
           [](const Preconditioner& p, int64_t element_bytes) {
             return predicted(p, element_bytes, &strategy::RankCost::factor_bytes);
           })
      // Per rank, the K-FAC state (factors and second-order state) the plan says it holds.
      .def("predicted_memory_bytes",
           [](const Preconditioner& p, int64_t element_bytes) {
             return predicted(p, element_bytes, &strategy::RankCost::memory_bytes);
           })
      .def("row_owners",
           [](const Preconditioner& p) {
             // Owner placement, for this rank: the ranks of its row of the grid, and per layer the owner there
             // (the rank that gathers the gradient's shards and scatters V's rows) or -1 for a layer not so placed.
             const auto executor = p.executor();
             const auto& plan = executor->plan();
             const int rank = executor->rank();
             const auto row = plan.placement.rows().at(plan.placement.row_of(rank));
             std::vector<int> owners;
             for (size_t i = 0; i < plan.flows.size(); ++i) {
               owners.push_back(plan.flows[i].owner_rows ? plan.gradient_source(i, rank) : -1);
             }
             return std::make_pair(row, owners);
           })
      .def("take_plan_change", &Preconditioner::take_plan_change)
      .def_property_readonly("strategy", [](const Preconditioner& p) { return to_string(p.options().strategy()); })
      .def_property_readonly("start_preconditioning_step",
                             [](const Preconditioner& p) { return p.options().start_preconditioning_step(); })
      .def_property_readonly("strategy_choice", &Preconditioner::strategy_choice)
      .def_property_readonly("layout",
                             [](const Preconditioner& p) {
                               // KAISA's grid for the running options on this job's ranks: the one assign_kaisa
                               // places on (SPD-KFAC and DP-KFAC place their own work: see describe()).
                               return layout_dict(assign::kaisa_layout(p.plan().placement.world_size,
                                                                       p.options().grad_worker_fraction(),
                                                                       p.options().colocate_factors()));
                             })
      .def_property_readonly("system",
                             [](const Preconditioner& p) {
                               const auto& strategy = p.options().strategy();  // auto until the first step chose
                               return strategy ? system_name(*strategy) : "strategy auto";
                             })
      .def_property_readonly("compute_method",
                             [](const Preconditioner& p) { return to_string(p.options().compute_method()); })
      .def("cuda_graph_report",
           [](const Preconditioner& p) {
             const auto& r = p.cuda_graph_report();
             return py::dict(py::arg("captures") = r.captures, py::arg("replays") = r.replays,
                             py::arg("eager_steps") = r.eager_steps, py::arg("off") = r.off,
                             py::arg("last_eager") = r.last_eager);
           })
      .def("events", [](Preconditioner& p) {
        const auto& e = p.events();
        return std::map<std::string, int64_t>{{"fallbacks", e.fallbacks},
                                              {"skipped_unused", e.skipped_unused},
                                              {"second_order_failures", e.second_order_failures}};
      });
}
