// Options::stack_layers (docs/MATH.md section 2.9): the layers of one shape preconditioned together, from state held
// as slices of one stacked tensor per part. Exact: the stacked run equals the layer-by-layer run to rounding (float64
// here: 1e-12), through second-order updates, shared A factors, KL clipping, a non-finite factor and a checkpoint.

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>

#include "dkfac/dkfac.h"
#include "dkfac/layers/layer_group.h"
#include "dkfac/math/second_order.h"
#include "dkfac/strategy/prediction.h"
#include "dkfac/strategy/step_executor.h"
#include "tests/multi_rank.h"
#include "tests/test_util.h"

namespace dkfac {
namespace {

// The products each kernel takes, against precondition_eigen / precondition_inverse one layer at a time: m units of
// c layers, each unit's A side shared by its c layers.
TEST(StackedKernels, EqualTheLayerByLayerKernels) {
  torch::manual_seed(3);
  const int64_t g = 5, a = 7;
  for (const int64_t c : {1, 3}) {
    const int64_t m = 2, n = m * c;
    const auto orthogonal = [](int64_t count, int64_t d) {
      return std::get<0>(torch::linalg_qr(torch::randn({count, d, d}, torch::kFloat64)));
    };
    const auto qa = orthogonal(m, a), qg = orthogonal(n, g);
    const auto den = torch::rand({n, g, a}, torch::kFloat64) + 0.1;
    const auto grads = torch::randn({n, g, a}, torch::kFloat64);
    const auto a_inv = torch::randn({m, a, a}, torch::kFloat64), g_inv = torch::randn({n, g, g}, torch::kFloat64);
    const auto eigen = math::precondition_eigen_stacked(qa, qg, den, grads);
    const auto inverse = math::precondition_inverse_stacked(a_inv, g_inv, grads);
    ASSERT_EQ(eigen.sizes(), grads.sizes());
    for (int64_t k = 0; k < n; ++k) {
      const math::EigenFactor fa{qa[k / c], torch::ones({a}, torch::kFloat64)};
      const math::EigenFactor fg{qg[k], torch::ones({g}, torch::kFloat64)};
      EXPECT_TENSOR_NEAR(eigen[k], math::precondition_eigen(fa, fg, den[k], grads[k]), 1e-13)
          << "c " << c << " layer " << k;
      EXPECT_TENSOR_NEAR(inverse[k], math::precondition_inverse(a_inv[k / c], g_inv[k], grads[k]), 1e-13)
          << "c " << c << " layer " << k;
    }
  }
  try {
    math::precondition_inverse_stacked(torch::zeros({2, 7, 7}), torch::zeros({3, 5, 5}), torch::zeros({3, 5, 7}));
    FAIL() << "three layers in two units were accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("are not m [a, a], m c [g, g] and m c [g, a]"), std::string::npos) << e.what();
  }
}

// Three attention-like blocks (query, key and value of one input: 6 -> 6) each followed by a 6 -> 6 layer, between
// layers of other shapes: groups of 9 (3 units of 3 sharing an A side, or 9 alone without shared inputs) and 3.
struct Block : torch::nn::Module {
  Block() {
    query = register_module("query", nn::Linear(6, 6));
    key = register_module("key", nn::Linear(6, 6));
    value = register_module("value", nn::Linear(6, 6));
    mix = register_module("mix", nn::Linear(6, 6));
  }
  torch::Tensor forward(const torch::Tensor& h) {
    return torch::tanh(mix->forward(torch::tanh(query->forward(h) * key->forward(h) + value->forward(h))));
  }
  nn::Linear query{nullptr}, key{nullptr}, value{nullptr}, mix{nullptr};
};

struct Tower : torch::nn::Module {
  Tower() {
    in = register_module("in", nn::Linear(4, 6));
    for (int k = 0; k < 3; ++k) {
      blocks.push_back(register_module("block" + std::to_string(k), std::make_shared<Block>()));
    }
    head = register_module("head", nn::Linear(torch::nn::LinearOptions(6, 2).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(in->forward(x));
    for (size_t k = 0; k < blocks.size(); ++k) {
      auto& b = *blocks[k];
      const auto& dtype = b.query->weight.scalar_type();
      h = torch::tanh(b.query->forward(h) * b.key->forward(h) + b.value->forward(h));
      // `skip_last_mix`: the last block's mix does not run (an unused layer, Options::unused_layer_policy skip).
      if (!(skip_last_mix && k + 1 == blocks.size())) {
        const auto& mix_dtype = b.mix->weight.scalar_type();
        h = torch::tanh(b.mix->forward(h.to(mix_dtype))).to(dtype);
      }
    }
    return head->forward(h);
  }
  nn::Linear in{nullptr}, head{nullptr};
  std::vector<std::shared_ptr<Block>> blocks;
  bool skip_last_mix = false;
};

std::shared_ptr<Tower> make_tower() { return testing::seeded_float64<Tower>(11); }

void backward(Tower& net, int64_t step, int rank = 0) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(500 + step + 1000 * rank);
  const auto x = torch::randn({5, 3, 4}, g, torch::kFloat64);
  const auto y = torch::randn({5, 3, 2}, g, torch::kFloat64);
  net.zero_grad();
  (net.forward(x) - y).pow(2).mean().backward();
}

std::vector<torch::Tensor> grads_of(Tower& net) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : net.parameters()) grads.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
  return grads;
}

double largest_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double worst = 0.0;
  for (size_t p = 0; p < a.size(); ++p) {
    worst = std::max(worst, ((a[p] - b[p]).abs().max() / (b[p].abs().max() + 1e-300)).item<double>());
  }
  return worst;
}

// Whether layers i and j hold their Q_G (or G inverse) in one stacked tensor.
bool stacked_together(const Preconditioner& kfac, size_t i, size_t j) {
  const auto& si = kfac.layers()[i].second_order();
  const auto& sj = kfac.layers()[j].second_order();
  const auto& gi = si.method == ComputeMethod::kEigen ? si.g_eigen.eigenvectors : si.g_inverse;
  const auto& gj = sj.method == ComputeMethod::kEigen ? sj.g_eigen.eigenvectors : sj.g_inverse;
  return gi.defined() && gj.defined() && gi.storage().is_alias_of(gj.storage());
}

size_t index_of(const Preconditioner& kfac, const std::string& name) {
  for (size_t i = 0; i < kfac.layers().size(); ++i) {
    if (kfac.layers()[i].name() == name) return i;
  }
  ADD_FAILURE() << "no layer " << name;
  return 0;
}

struct Case {
  std::string name;
  Options options;
  /// Options::pad_widths' bytes (LayerGroups::padding_bytes): the tower's groups of [6, 7] layers padded to [8, 8],
  /// per unit (a^2: 64 - 49) and per member (g^2: 64 - 36, and eigen's denominator: 64 - 42), in float64. Without
  /// shared inputs one group of 12 layers: 12 (15 + 28 + 22) = 780 entries; with them, query, key and value share
  /// an A side (3 units of 3, and the 3 mix layers): 6 x 15 + 12 (28 + 22) = 690 entries, or 6 x 15 + 12 x 28 = 426
  /// with the inverse method (no denominator).
  int64_t padding = 0;
};

const std::vector<std::string> kShared = {"(query|key|value)$"};

// A stacked and a layer-by-layer run (`options`, and stack_layers off) on towers from `make`, in lockstep for `steps`
// steps; `tamper(net, step)` runs on each net between its backward pass and its step, `check(step)` after both
// steps. Every step's gradients agree to `tolerance` (relative to each parameter's largest; NaN where NaN), and KL
// clipping's scale to 1e-12.
struct Runs {
  std::shared_ptr<Tower> stacked_net, plain_net;
  std::unique_ptr<Preconditioner> stacked, plain;
};
Runs run_both(const Options& options, int64_t steps, const std::function<void(Tower&, int64_t)>& tamper = nullptr,
              const std::function<void(const Runs&, int64_t)>& check = nullptr,
              const std::function<std::shared_ptr<Tower>()>& make = make_tower, double tolerance = 1e-12) {
  Runs runs{make(), make(), nullptr, nullptr};
  runs.stacked = std::make_unique<Preconditioner>(runs.stacked_net, options);
  runs.plain = std::make_unique<Preconditioner>(runs.plain_net, Options(options).stack_layers(false));
  for (int64_t step = 0; step < steps; ++step) {
    for (auto* net : {runs.stacked_net.get(), runs.plain_net.get()}) {
      backward(*net, step);
      if (tamper) tamper(*net, step);
    }
    runs.stacked->step();
    runs.plain->step();
    const auto got = grads_of(*runs.stacked_net);
    const auto want = grads_of(*runs.plain_net);
    for (size_t p = 0; p < got.size(); ++p) {
      const double scale = want[p].nan_to_num(0.0).abs().max().item<double>();
      EXPECT_TRUE(torch::allclose(got[p], want[p], 0.0, tolerance * scale + 1e-300, /*equal_nan=*/true))
          << "step " << step << " parameter " << p;
    }
    EXPECT_NEAR(runs.stacked->last_kl_scale(), runs.plain->last_kl_scale(), 1e-12) << "step " << step;
    if (check) check(runs, step);
  }
  return runs;
}

class StackedLayers : public ::testing::TestWithParam<Case> {};

// Factors every step, second order every 3 steps, KL clipping on: every step's gradients equal the layer-by-layer
// run's, the memory held is the same, and the state is stacked (query and key of one block; two blocks' mix).
TEST_P(StackedLayers, EqualLayerByLayer) {
  const int64_t padding = GetParam().padding;
  const auto runs = run_both(Options(GetParam().options).inv_update_steps(3).kl_clip(1e-6), 8, nullptr,
                             [padding](const Runs& r, int64_t step) {
                               EXPECT_EQ(r.stacked->stack_padding_bytes(), padding) << "step " << step;
                               EXPECT_EQ(r.stacked->memory_bytes(), r.plain->memory_bytes() + padding)
                                   << "step " << step;
                             });
  const auto& stacked = *runs.stacked;
  // Padded, a layer's part is its slot's leading block: rows 8 apart.
  const auto& q = stacked.layers()[index_of(stacked, "block1.mix")].second_order();
  const auto& g_part = q.method == ComputeMethod::kEigen ? q.g_eigen.eigenvectors : q.g_inverse;
  EXPECT_EQ(g_part.stride(0), padding > 0 ? 8 : 6);
  EXPECT_TRUE(stacked_together(stacked, index_of(stacked, "block0.query"), index_of(stacked, "block0.key")));
  EXPECT_TRUE(stacked_together(stacked, index_of(stacked, "block0.mix"), index_of(stacked, "block2.mix")));
  EXPECT_FALSE(stacked_together(*runs.plain, index_of(stacked, "block0.mix"), index_of(stacked, "block2.mix")));
  EXPECT_LT(runs.stacked->last_kl_scale(), 1.0) << "KL clipping is exercised";
}

INSTANTIATE_TEST_SUITE_P(
    MethodsAndSharing, StackedLayers,
    // Unpadded (pad_widths 1), where a batched GEMM computes each matrix as mm does: bit for bit here.
    ::testing::Values(Case{"eigen", Options().pad_widths(1)},
                      Case{"eigenShared", Options().shared_input_layers(kShared).pad_widths(1)},
                      Case{"inverse", Options().compute_method(ComputeMethod::kInverse).pad_widths(1)},
                      Case{"inverseShared", Options()
                                                .compute_method(ComputeMethod::kInverse)
                                                .shared_input_layers(kShared)
                                                .pad_widths(1)},
                      // a refresh reads the basis from its slots; several layers' updates installed per chunk
                      Case{"eighInterval", Options().eigh_interval(2).shared_input_layers(kShared).pad_widths(1)},
                      Case{"concurrent",
                           Options().second_order_concurrency(4).shared_input_layers(kShared).pad_widths(1)},
                      // computed beside the steps from the slots' views, installed into the slots 1 or 2 steps later
                      Case{"lag", Options().second_order_lag(2).shared_input_layers(kShared).pad_widths(1)},
                      Case{"lagInverse",
                           Options().second_order_lag(1).compute_method(ComputeMethod::kInverse).pad_widths(1)},
                      Case{"lagRefresh",
                           Options().second_order_lag(1).eigh_interval(2).shared_input_layers(kShared).pad_widths(1)},
                      // Options::pad_widths (8 by default): stacks of [8, 8] for the [6, 7] layers (Case::padding)
                      Case{"eigenPadded", Options(), 780 * 8},
                      Case{"inverseSharedPadded",
                           Options().compute_method(ComputeMethod::kInverse).shared_input_layers(kShared).pad_widths(8),
                           426 * 8},
                      Case{"eighIntervalPadded", Options().eigh_interval(2).pad_widths(8), 780 * 8},
                      Case{"lagPadded", Options().second_order_lag(2).shared_input_layers(kShared).pad_widths(8),
                           690 * 8}),
    [](const auto& info) { return info.param.name; });

// Options::eigen_adam (KL clipping off, as it requires): the eigenbases stacked, each layer's Adam moments its own.
// Every step equals the layer-by-layer run (run_both), and each layer's moments were rotated as often as there
// (KfacLayer::adam_rotations: a new basis installed into a slot in place is rotated out of, and a basis that only
// moved into a slot is not) and hold the same values; the memory is the same but for the pads.
class StackedEigenAdam : public ::testing::TestWithParam<Case> {};

void expect_same_moments(const Runs& r, int64_t step) {
  for (size_t i = 0; i < r.stacked->layers().size(); ++i) {
    const auto& got = r.stacked->layers()[i];
    const auto& want = r.plain->layers()[i];
    EXPECT_EQ(got.adam_rotations(), want.adam_rotations()) << got.name() << " step " << step;
    ASSERT_EQ(got.adam_moments().defined(), want.adam_moments().defined()) << got.name() << " step " << step;
    if (!want.adam_moments().defined()) continue;
    // After a step the moments are in the basis in use: the next step needs no host decision about them (what a
    // CUDA graph's replay needs, Options::cuda_graphs), unless an update installs another basis.
    EXPECT_TRUE(got.adam_moments_current()) << got.name() << " step " << step;
    EXPECT_TRUE(want.adam_moments_current()) << got.name() << " step " << step;
    EXPECT_TENSOR_NEAR(got.adam_moments().exp_avg, want.adam_moments().exp_avg, 1e-12) << got.name() << " step " << step;
    EXPECT_TENSOR_NEAR(got.adam_moments().exp_avg_sq, want.adam_moments().exp_avg_sq, 1e-12)
        << got.name() << " step " << step;
    EXPECT_TRUE(torch::equal(got.adam_moments().steps, want.adam_moments().steps)) << got.name() << " step " << step;
  }
}

TEST_P(StackedEigenAdam, EqualLayerByLayer) {
  const int64_t padding = GetParam().padding;
  // Unpadded (pad_widths 1), the products at the odd widths 6 and 7 run batched kernels that round otherwise than
  // the one-matrix ones on some CPUs (an AVX-512 Xeon: the eigen method 5e-16 apart), and Adam's first step
  // P / (|P| + eps) multiplies a change of an entry near eps by up to 1 / (4 eps): 1.8e-11 apart there, measured.
  const double tolerance = padding > 0 ? 1e-12 : 1e-9;
  const auto runs = run_both(Options(GetParam().options).eigen_adam(true).kl_clip(0).inv_update_steps(3), 8, nullptr,
                             [padding](const Runs& r, int64_t step) {
                               expect_same_moments(r, step);
                               EXPECT_EQ(r.stacked->stack_padding_bytes(), padding) << "step " << step;
                               EXPECT_EQ(r.stacked->memory_bytes(), r.plain->memory_bytes() + padding)
                                   << "step " << step;
                             },
                             make_tower, tolerance);
  const auto& stacked = *runs.stacked;
  const auto& mix = stacked.layers()[index_of(stacked, "block1.mix")];
  EXPECT_FALSE(mix.second_order().denominator.defined());
  EXPECT_EQ(mix.second_order().g_eigen.eigenvectors.stride(0), padding > 0 ? 8 : 6);
  // Updates at steps 0, 3 and 6 (the last two installed 2 steps later with lag 2): the moments, made at step 0,
  // rotated out of each basis after the first (as many times as layer by layer: expect_same_moments).
  EXPECT_GE(mix.adam_rotations(), 1);
  EXPECT_TRUE(stacked_together(stacked, index_of(stacked, "block0.query"), index_of(stacked, "block0.key")));
  EXPECT_TRUE(stacked_together(stacked, index_of(stacked, "block0.mix"), index_of(stacked, "block2.mix")));
}

INSTANTIATE_TEST_SUITE_P(
    MethodsAndSharing, StackedEigenAdam,
    // Case::padding without the denominator: 12 (15 + 28) = 516 entries, or 6 x 15 + 12 x 28 = 426 with shared inputs.
    ::testing::Values(Case{"plain", Options().pad_widths(1)},
                      Case{"shared", Options().shared_input_layers(kShared).pad_widths(1)},
                      Case{"padded", Options(), 516 * 8},
                      Case{"sharedPadded", Options().shared_input_layers(kShared), 426 * 8},
                      Case{"eighInterval", Options().eigh_interval(2).shared_input_layers(kShared).pad_widths(1)},
                      Case{"lag", Options().second_order_lag(2).shared_input_layers(kShared), 426 * 8},
                      Case{"lagRefresh", Options().second_order_lag(1).eigh_interval(2).pad_widths(1)}),
    [](const auto& info) { return info.param.name; });

// Groups planned again while the moments exist (a member's first factors at step 4): every basis is copied out of
// the old stacks and into the new ones, and no layer's moments are rotated for it, as none are layer by layer.
// adam_eps 1e-6: the late member's first update sees factors of its three batches alone, so some of its P's entries
// are rounding's (directions its inputs never took), which Adam's first step divides by |P| + eps: with the default
// 1e-8, the products' rounding (batched here, one at a time there) came out at 1.05x the 1e-12 bound.
TEST(StackedEigenAdam, GroupsPlannedAgainRotateNothing) {
  run_both(Options().eigen_adam(true).adam_eps(1e-6).kl_clip(0).inv_update_steps(3)
               .unused_layer_policy(UnusedLayerPolicy::kSkip).shared_input_layers(kShared),
           7, [](Tower& net, int64_t step) { net.skip_last_mix = step < 3; }, expect_same_moments, [] {
             auto net = make_tower();
             net->skip_last_mix = true;  // from the first pass
             return net;
           });
}

// A member that does not run (unused_layer_policy skip, the last block's mix at steps 4-6) leaves its group to be
// preconditioned layer by layer while it is skipped; every step equals the layer-by-layer run. Under
// second_order_lag too, with updates computed from views of the stacks in flight meanwhile (steps 4-5 and 6-7).
TEST(StackedLayersFallback, UnusedMember) {
  for (const int64_t lag : {0, 1}) {
    SCOPED_TRACE("second_order_lag " + std::to_string(lag));
    run_both(
        Options().inv_update_steps(2).unused_layer_policy(UnusedLayerPolicy::kSkip).second_order_lag(lag), 8,
        [](Tower& net, int64_t step) { net.skip_last_mix = step >= 3 && step < 6; },  // for the next step's pass
        [](const Runs& r, int64_t step) {  // padded (the default): the pads beside the same state
          EXPECT_EQ(r.stacked->memory_bytes(), r.plain->memory_bytes() + r.stacked->stack_padding_bytes())
              << "step " << step;
        });
  }
}

// A layer that never runs (skipped from the first step) holds no slot in its group's stacks.
TEST(StackedLayersFallback, NeverUsedMemberHoldsNoSlot) {
  // Unpadded, so that a slot is its part's bytes.
  const auto options = Options().unused_layer_policy(UnusedLayerPolicy::kSkip).pad_widths(1);
  const auto runs = run_both(options, 3, nullptr, nullptr, [] {
    auto net = make_tower();
    net->skip_last_mix = true;
    return net;
  });
  const auto& stacked = *runs.stacked;
  EXPECT_TRUE(stacked_together(stacked, index_of(stacked, "block0.mix"), index_of(stacked, "block1.mix")));
  const auto& mix = stacked.layers()[index_of(stacked, "block0.mix")].second_order().g_eigen.eigenvectors;
  // One group of the 11 layers of (g, a) = (6, 7) that run (the blocks' query, key and value, two mixes), not 12.
  EXPECT_EQ(mix.storage().nbytes(), 11u * static_cast<size_t>(mix.nbytes()));
}

// A member that first runs at step 4, under second_order_lag 2 with updates every 3 steps: its first factors re-plan
// the groups at step 4, while step 3's update runs beside the steps from views of the old stacks, so the old stacks
// stay alive until step 5 installs it. memory_bytes counts them then, and only then: at every other step it equals
// the layer-by-layer run's, which holds no stacks. (Where an update is installed first, the groups are planned
// again there, before the next update starts: nothing stays behind.)
TEST(StackedLayersFallback, ReplanWhileAnUpdateRunsCountsTheOldStacks) {
  std::map<const void*, size_t> stacks_before;  // storages that hold two or more layers' parts after step 3
  const auto storages_of = [](const Preconditioner& kfac) {
    std::map<const void*, std::pair<size_t, int>> held;  // storage -> (bytes, parts viewing it)
    for (const auto& layer : kfac.layers()) {
      for (const auto* part : layer.second_order().parts()) {
        if (!part->defined()) continue;
        auto& [bytes, parts] = held[part->storage().unsafeGetStorageImpl()];
        bytes = part->storage().nbytes();
        ++parts;
      }
    }
    return held;
  };
  run_both(
      // unpadded: the old stacks' bytes are the layers' parts', counted here from their storages
      Options().second_order_lag(2).inv_update_steps(3).unused_layer_policy(UnusedLayerPolicy::kSkip).pad_widths(1), 7,
      [](Tower& net, int64_t step) { net.skip_last_mix = step < 3; },  // for the next step's pass: runs from step 4
      [&](const Runs& r, int64_t step) {
        int64_t old_stacks = 0;
        if (step == 3) {
          for (const auto& [storage, held] : storages_of(*r.stacked)) {
            if (held.second > 1) stacks_before[storage] = held.first;
          }
          ASSERT_FALSE(stacks_before.empty()) << "no stacks at step 3";
        } else if (step == 4) {
          const auto now = storages_of(*r.stacked);
          for (const auto& [storage, bytes] : stacks_before) {
            EXPECT_EQ(now.count(storage), 0u) << "an old stack is still a layer's at step 4: no re-plan";
            old_stacks += static_cast<int64_t>(bytes);
          }
        }
        EXPECT_EQ(r.stacked->memory_bytes(), r.plain->memory_bytes() + old_stacks) << "step " << step;
      },
      [] {
        auto net = make_tower();
        net->skip_last_mix = true;
        return net;
      });
}

// Layers of one shape in other dtypes (float32 and float64 weights, float64 factors: one second-order dtype) are
// not grouped together: each is preconditioned in its gradient's dtype, as layer by layer.
TEST(StackedLayersFallback, WeightDtypesAreNotMixed) {
  const auto runs = run_both(Options().factor_dtype(torch::kFloat64), 3, nullptr, nullptr, [] {
    auto net = make_tower();
    net->blocks[0]->mix->to(torch::kFloat32);
    return net;
  });
  const auto& stacked = *runs.stacked;
  EXPECT_FALSE(stacked_together(stacked, index_of(stacked, "block0.mix"), index_of(stacked, "block1.mix")));
  EXPECT_TRUE(stacked_together(stacked, index_of(stacked, "block1.mix"), index_of(stacked, "block2.mix")));
}

// A second-order update whose check fails (a damped A factor exactly singular: Cholesky and the general inverse
// both fail) keeps the member's previous state in its slot, as layer by layer; also where the update was computed
// beside the steps (second_order_lag 1: installed, and refused, at step 3).
TEST(StackedLayersFallback, FailedUpdateOfOneMember) {
  for (const int64_t lag : {0, 1}) {
    SCOPED_TRACE("second_order_lag " + std::to_string(lag));
    const auto runs = run_both(
        // add_a after the backward pass: a batch for step() to fold (fold_in_hooks off)
        Options().kl_clip(0).compute_method(ComputeMethod::kInverse).inv_update_steps(2).factor_decay(0.0)
            .fold_in_hooks(false).second_order_lag(lag), 4 + lag,
        [](Tower& net, int64_t step) {
          if (step == 2) {
            net.blocks[1]->mix->factor_capture().add_a(
                torch::full({7, 7}, std::numeric_limits<double>::max(), torch::kFloat64), 0.0);
          }
        });
    EXPECT_EQ(runs.stacked->events().second_order_failures, 1);
    EXPECT_EQ(runs.plain->events().second_order_failures, 1);
  }
}

// Under every strategy, at 2 and 4 ranks, the stacked run equals the layer-by-layer run on every rank (broadcasts
// into slots, a rank's groups its own layers only).
TEST(StackedLayersDistributed, EveryStrategyEqualsLayerByLayer) {
  const Options base = Options().damping(0.01).kl_clip(1e-3).inv_update_steps(2);
  const std::pair<int, Options> cases[] = {
      {2, Options(base).grad_worker_fraction(0.5).shared_input_layers(kShared)},
      {4, Options(base).grad_worker_fraction(0.0)},
      {4, Options(base).grad_worker_fraction(0.5).compute_method(ComputeMethod::kInverse)},
      {2, Options(base).strategy(Strategy::kSpd).spd(SpdOptions().redundant_dim(0).profile_steps(1))},
      {4, Options(base).strategy(Strategy::kDp).shared_input_layers(kShared)},
      {2, Options(base).grad_worker_fraction(0.5).second_order_lag(1).shared_input_layers(kShared)},
      // padded stacks (Options::pad_widths): parts broadcast from and into their slots' leading blocks
      {4, Options(base).grad_worker_fraction(0.5).shared_input_layers(kShared).pad_widths(8)},
      {2, Options(base).grad_worker_fraction(0.5).compute_method(ComputeMethod::kInverse).second_order_lag(1)
              .pad_widths(8)},
      // eigen_adam: bases broadcast into copies (the moments' basis kept), then into their slots
      {2, Options(base).kl_clip(0).eigen_adam(true).grad_worker_fraction(0.5).shared_input_layers(kShared)},
      {4, Options(base).kl_clip(0).eigen_adam(true).grad_worker_fraction(0.0).second_order_lag(1)}};
  for (const auto& [world, options] : cases) {
    const std::string what = std::to_string(world) + " ranks, " + to_string(options.strategy()) + ", fraction " +
                             std::to_string(options.grad_worker_fraction()) + ", pad " +
                             std::to_string(options.pad_widths());
    const auto run = [&, world = world](const Options& o) {
      std::vector<std::vector<std::vector<torch::Tensor>>> got(world);
      testing::run_ranks(world, [&](int rank, std::shared_ptr<comm::Communicator> communicator) {
        auto net = make_tower();
        Preconditioner kfac(net, o, communicator);
        for (int64_t step = 0; step < 5; ++step) {
          backward(*net, step, rank);
          testing::average_gradients(*communicator, *net);
          kfac.step();
          got[rank].push_back(grads_of(*net));
        }
      });
      return got;
    };
    const auto stacked = run(options);
    const auto plain = run(Options(options).stack_layers(false));
    for (int rank = 0; rank < world; ++rank) {
      for (size_t step = 0; step < stacked[rank].size(); ++step) {
        EXPECT_LT(largest_difference(stacked[rank][step], plain[rank][step]), 1e-12)
            << what << ": rank " << rank << " step " << step;
      }
    }
  }
}

// A member whose factors are not finite this step keeps its plain gradient, and the warning names its factors (the
// guard row's folded column, made with its group's batch); the rest of its group is preconditioned, as layer by layer.
TEST(StackedLayersFallback, NonFiniteFactorOfOneMember) {
  testing::CapturedWarnings warnings;
  std::vector<torch::Tensor> plain;  // block1.mix's and block0.mix's plain weight gradients at step 2, stacked run
  run_both(
      Options().kl_clip(0).fold_in_hooks(false), 3,  // add_a after the backward pass: a batch for step() to fold
      [&](Tower& net, int64_t step) {
        if (step != 2) return;
        net.blocks[1]->mix->factor_capture().add_a(
            torch::full({7, 7}, std::numeric_limits<double>::quiet_NaN(), torch::kFloat64), 0.0);
        if (plain.empty()) {
          plain = {net.blocks[1]->mix->weight.grad().clone(), net.blocks[0]->mix->weight.grad().clone()};
        }
      },
      [&](const Runs& r, int64_t step) {
        if (step != 2) return;
        EXPECT_TRUE(torch::equal(r.stacked_net->blocks[1]->mix->weight.grad(), plain[0])) << "the poisoned member";
        EXPECT_FALSE(torch::equal(r.stacked_net->blocks[0]->mix->weight.grad(), plain[1])) << "its group's others";
        EXPECT_EQ(r.stacked->events().fallbacks, 1);
      });
  const auto named = std::count_if(warnings.messages.begin(), warnings.messages.end(), [](const std::string& m) {
    return m.find("'block1.mix'") != std::string::npos && m.find("captured factors contain NaN") != std::string::npos;
  });
  EXPECT_EQ(named, 2) << "the stacked and the layer-by-layer run each name the factors: " << warnings.all();
}

// A member whose gradient holds a NaN keeps its plain gradient (the guard's row made with its group's batch says
// so); the rest of its group is preconditioned, as layer by layer.
TEST(StackedLayersFallback, NonFiniteGradientOfOneMember) {
  const auto runs = run_both(Options().kl_clip(1e-6), 3, [](Tower& net, int64_t step) {
    if (step == 2) net.blocks[1]->mix->weight.mutable_grad()[0][0] = std::numeric_limits<double>::quiet_NaN();
  });
  EXPECT_EQ(runs.stacked->events().fallbacks, 1);
  EXPECT_EQ(runs.plain->events().fallbacks, 1);
}

// The C++ archive writes each slot alone (not the stack's whole storage), and it loads into a layer-by-layer
// preconditioner, whose next steps equal the stacked one's.
size_t save_and_load(const Options& options);

TEST(StackedLayersCheckpoint, WritesSlotsAndLoadsLayerByLayer) {
  std::vector<size_t> bytes;
  for (const int64_t pad : {1, 8}) {
    SCOPED_TRACE("pad_widths " + std::to_string(pad));
    bytes.push_back(save_and_load(Options().inv_update_steps(2).pad_widths(pad)));
  }
  EXPECT_EQ(bytes[1], bytes[0]) << "the padded run's archive holds its pads";
}

// Options::pad_widths: strategy::predict counts each rank's pads as the run holds them (RankCost::stack_padding_bytes,
// in memory_bytes), and the products at the padded widths: in one process and on 2 ranks (KAISA f = 1/2, where
// each rank preconditions half the layers); with eigen_adam too.
TEST(StackedLayersPadded, PredictCountsThePadsAsTheRunHoldsThem) {
  for (const auto& [world, adam] : {std::pair{1, false}, std::pair{2, false}, std::pair{1, true}, std::pair{2, true}}) {
    SCOPED_TRACE(std::string(adam ? "eigen_adam, " : "") + std::to_string(world) + " ranks");
    Options base = Options().inv_update_steps(2).shared_input_layers(kShared);
    if (world > 1) base.grad_worker_fraction(0.5);
    if (adam) base.kl_clip(0).eigen_adam(true);  // no denominator: its pads neither
    std::vector<int64_t> held(world), padding(world), unpadded(world);
    std::vector<strategy::StepPlan> plans(world);
    testing::run_ranks(world, [&](int rank, std::shared_ptr<comm::Communicator> communicator) {
      for (const int64_t pad : {1, 8}) {
        auto net = make_tower();
        Preconditioner kfac(net, Options(base).pad_widths(pad), world > 1 ? communicator : nullptr);
        for (int64_t step = 0; step < 3; ++step) {
          backward(*net, step, rank);
          if (world > 1) testing::average_gradients(*communicator, *net);
          kfac.step();
        }
        (pad == 1 ? unpadded : held)[rank] = kfac.memory_bytes();
        if (pad == 1) continue;
        padding[rank] = kfac.stack_padding_bytes();
        plans[rank] = kfac.plan();
        plans[rank].shapes = strategy::layer_shapes(kfac.layers());
      }
    });
    auto unpadded_plan = plans[0];
    unpadded_plan.pad_widths = 1;
    const auto cost = strategy::predict(plans[0], /*element_bytes=*/8, /*batch_size=*/15);
    const auto unpadded_cost = strategy::predict(unpadded_plan, 8, 15);
    int64_t total = 0;
    for (int rank = 0; rank < world; ++rank) {
      EXPECT_EQ(plans[rank].pad_widths, 8);
      EXPECT_EQ(cost[rank].stack_padding_bytes, padding[rank]) << world << " ranks, rank " << rank;
      EXPECT_EQ(held[rank] - unpadded[rank], padding[rank]) << world << " ranks, rank " << rank;
      EXPECT_EQ(cost[rank].memory_bytes - unpadded_cost[rank].memory_bytes, padding[rank]);
      total += padding[rank];
      // The products: 4 g a (g + a) per layer at [8, 8] in place of [6, 7], for each layer the rank preconditions.
      int64_t layers = 0;
      for (const auto& group : strategy::stack_groups(plans[0], rank)) {
        layers += static_cast<int64_t>(group.members.size());
      }
      EXPECT_DOUBLE_EQ(cost[rank].precondition_flops - unpadded_cost[rank].precondition_flops,
                       static_cast<double>(layers) * 4.0 * (8 * 8 * 16 - 6 * 7 * 13));
    }
    // One process holds the 690 entries of Case::padding (426 without the denominators); 2 ranks hold each group's
    // pads where they precondition it.
    if (world == 1) EXPECT_EQ(total, (adam ? 426 : 690) * 8);
    if (world == 2) EXPECT_GT(total, 0);
  }
}

// A stacked run's checkpoint, saved and loaded into a layer-by-layer preconditioner and into a stacked one: the
// saved slots are written alone (not with their stacks, nor their pads), and the next steps are the saved run's.
// Returns the archive's size.
size_t save_and_load(const Options& options) {
  auto net = make_tower();
  Preconditioner stacked(net, options);
  for (int64_t step = 0; step < 3; ++step) {
    backward(*net, step);
    stacked.step();
  }
  auto plain_net = make_tower();
  Preconditioner plain(plain_net, Options(options).stack_layers(false));
  for (int64_t step = 0; step < 3; ++step) {
    backward(*plain_net, step);
    plain.step();
  }
  std::stringstream stacked_bytes, plain_bytes;
  torch::save(stacked, stacked_bytes);
  torch::save(plain, plain_bytes);
  EXPECT_LT(stacked_bytes.str().size(), plain_bytes.str().size() * 11 / 10) << "a slot was written with its stack";

  auto restored_net = make_tower();
  {
    torch::NoGradGuard no_grad;
    const auto from = net->parameters();
    auto to = restored_net->parameters();
    for (size_t p = 0; p < to.size(); ++p) to[p].copy_(from[p]);
  }
  Preconditioner restored(restored_net, Options(options).stack_layers(false));
  const std::string saved = stacked_bytes.str();
  torch::load(restored, stacked_bytes);
  // Into a stacked preconditioner that holds stacks of its own (two steps of another model): its next steps are the
  // saved run's too.
  auto other_net = make_tower();
  Preconditioner into_stacked(other_net, options);
  for (int64_t step = 0; step < 2; ++step) {
    backward(*other_net, 100 + step);
    into_stacked.step();
  }
  {
    torch::NoGradGuard no_grad;
    const auto from = net->parameters();
    auto to = other_net->parameters();
    for (size_t p = 0; p < to.size(); ++p) to[p].copy_(from[p]);
  }
  std::stringstream saved_bytes(saved);
  torch::load(into_stacked, saved_bytes);
  for (int64_t step = 3; step < 6; ++step) {
    backward(*net, step);
    backward(*restored_net, step);
    backward(*other_net, step);
    stacked.step();
    restored.step();
    into_stacked.step();
    EXPECT_LT(largest_difference(grads_of(*net), grads_of(*restored_net)), 1e-12) << "step " << step;
    EXPECT_LT(largest_difference(grads_of(*net), grads_of(*other_net)), 1e-12) << "into stacked, step " << step;
  }
  EXPECT_EQ(into_stacked.memory_bytes(), stacked.memory_bytes());
  return saved.size();
}

}  // namespace
}  // namespace dkfac
