#include "dkfac/optim/kfac.h"

#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "dkfac/dkfac.h"
#include "dkfac/math/graft.h"
#include "tests/multi_rank.h"
#include "tests/test_util.h"

namespace dkfac {
namespace {

using testing::expect_error;

// Two K-FAC layers around a LayerNorm, which keeps its plain gradient (the base's own step with eigen_adam).
struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", nn::Linear(torch::nn::LinearOptions(6, 5)));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({5})));
    fc2 = register_module("fc2", nn::Linear(torch::nn::LinearOptions(5, 3)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2->forward(torch::tanh(norm->forward(fc1->forward(x)))); }
  nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};

std::shared_ptr<Net> make_net() { return testing::seeded_float64<Net>(7); }

torch::Tensor loss_at(Net& net, int64_t step) {
  torch::manual_seed(100 + step);
  auto x = torch::randn({8, 6}, torch::kFloat64);
  auto y = torch::randn({8, 3}, torch::kFloat64);
  return (net.forward(x) - y).pow(2).mean();
}

std::vector<torch::Tensor> parameters_of(torch::nn::Module& net) {
  std::vector<torch::Tensor> out;
  for (const auto& p : net.parameters()) out.push_back(p.detach().clone());
  return out;
}

void expect_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i], b[i])) << what << ": parameter " << i << " differs by "
                                          << (a[i] - b[i]).abs().max().item<double>();
  }
}

Options kfac_options() { return Options().factor_update_steps(1).inv_update_steps(2).damping(0.01).kl_clip(1e-6); }

// The lr a scheduler would set before step `step`.
double lr_at(int64_t step) { return step < 2 ? 0.1 : 0.02; }

// The hand-written loop of docs/CPP.md with SGD: kfac.step() then sgd.step(); KL clipping's lr set by a schedule that
// reads the SGD's lr, as KFAC's kfac_lr_follows does.
std::vector<torch::Tensor> hand_written_sgd(int64_t steps) {
  auto net = make_net();
  auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  Preconditioner kfac(net, kfac_options().lr(std::function<double(int64_t)>(
                               [sgd](int64_t) { return sgd->param_groups()[0].options().get_lr(); })));
  for (int64_t step = 0; step < steps; ++step) {
    sgd->param_groups()[0].options().set_lr(lr_at(step));
    sgd->zero_grad();
    loss_at(*net, step).backward();
    kfac.step();
    sgd->step();
  }
  return parameters_of(*net);
}

TEST(OptimKfac, SgdEqualsTheHandWrittenLoopWithKlClippingAtTheSchedulersLr) {
  auto net = make_net();
  auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  optim::KFAC opt(net, sgd, kfac_options());
  for (int64_t step = 0; step < 5; ++step) {
    opt.base().param_groups()[0].options().set_lr(lr_at(step));
    opt.zero_grad();
    loss_at(*net, step).backward();
    opt.step();
  }
  expect_equal(parameters_of(*net), hand_written_sgd(5), "KFAC against kfac.step(); sgd.step()");
  EXPECT_EQ(opt.preconditioner().steps(), 5);
  EXPECT_LT(opt.preconditioner().last_kl_scale(), 1.0);  // KL clipping acted, so the lr it read mattered

  // Without following, KL clipping keeps the Options' lr (0.1) after the scheduler lowered the base's: other steps.
  auto own = make_net();
  auto own_sgd = std::make_shared<torch::optim::SGD>(own->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  optim::KFAC own_opt(own, own_sgd, kfac_options().lr(0.1), nullptr, optim::KFACOptions().kfac_lr_follows(false));
  for (int64_t step = 0; step < 5; ++step) {
    own_opt.base().param_groups()[0].options().set_lr(lr_at(step));
    own_opt.zero_grad();
    loss_at(*own, step).backward();
    own_opt.step();
  }
  EXPECT_FALSE(torch::equal(parameters_of(*own)[0], parameters_of(*net)[0]));
}

TEST(OptimKfac, StepRunsTheClosureAndReturnsItsLoss) {
  auto net = make_net();
  auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1));
  optim::KFAC opt(net, sgd, kfac_options());
  torch::Tensor seen;
  auto loss = opt.step([&] {
    EXPECT_TRUE(torch::GradMode::is_enabled());
    opt.zero_grad();
    seen = loss_at(*net, 0);
    seen.backward();
    return seen;
  });
  EXPECT_TRUE(loss.defined());
  EXPECT_TRUE(torch::equal(loss, seen));
  EXPECT_EQ(opt.preconditioner().steps(), 1);
  opt.zero_grad();
  loss_at(*net, 1).backward();
  EXPECT_FALSE(opt.step().defined());  // no closure: no loss
}

// eigen_adam: the hand-written form of AdamW in the K-FAC eigenbasis, each operation spelled out: the
// preconditioner's step with the base's betas and eps, AdamW on the LayerNorm alone, then p (1 - lr wd) - lr d.
TEST(OptimKfac, EigenAdamIsAdamWsUpdateWithTheBasesConstants) {
  const double lr = 3e-3, wd = 0.1;
  auto adamw = torch::optim::AdamWOptions(lr).betas({0.8, 0.95}).eps(1e-6).weight_decay(wd);
  auto net = make_net();
  auto base = std::make_shared<torch::optim::AdamW>(net->parameters(), adamw);
  // The Options' betas and eps are left at their defaults: KFAC takes the base's.
  optim::KFAC opt(net, base, Options().factor_update_steps(1).inv_update_steps(2).kl_clip(0).eigen_adam(true));

  auto ref = make_net();
  Preconditioner kfac(ref, Options().factor_update_steps(1).inv_update_steps(2).kl_clip(0).eigen_adam(true)
                               .adam_beta1(0.8).adam_beta2(0.95).adam_eps(1e-6));
  torch::optim::AdamW norm_only(ref->norm->parameters(), adamw);
  std::vector<torch::Tensor> layers;
  for (auto* layer : {&ref->fc1, &ref->fc2}) {
    layers.push_back((*layer)->weight);
    layers.push_back((*layer)->bias);
  }
  for (int64_t step = 0; step < 4; ++step) {
    opt.zero_grad();
    loss_at(*net, step).backward();
    opt.step();

    for (auto& p : ref->parameters()) p.mutable_grad() = torch::Tensor();
    loss_at(*ref, step).backward();
    kfac.step();
    norm_only.step();
    torch::NoGradGuard no_grad;
    for (auto& p : layers) {
      p.mul_(1.0 - lr * wd);
      p.add_(p.grad(), -lr);
    }
  }
  expect_equal(parameters_of(*net), parameters_of(*ref), "KFAC with eigen_adam against the spelled-out update");
  // The base keeps Adam's state for the LayerNorm only: the layers' moments are the preconditioner's.
  const auto& state = base->state();
  EXPECT_EQ(state.count(net->norm->weight.unsafeGetTensorImpl()), 1U);
  EXPECT_EQ(state.count(net->fc1->weight.unsafeGetTensorImpl()), 0U);
  EXPECT_FALSE(torch::equal(parameters_of(*net)[0], parameters_of(*make_net())[0]));
}

TEST(OptimKfac, EigenAdamFollowsTheBasesBetasAndRefusesGroupsThatDisagree) {
  auto net = make_net();
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(net->fc1->parameters(), std::make_unique<torch::optim::AdamWOptions>(
                                                  torch::optim::AdamWOptions(1e-3).betas({0.9, 0.99})));
  groups.emplace_back(net->fc2->parameters(), std::make_unique<torch::optim::AdamWOptions>(
                                                  torch::optim::AdamWOptions(1e-3).betas({0.9, 0.95})));
  auto base = std::make_shared<torch::optim::AdamW>(groups);
  expect_error([&] { optim::KFAC(net, base, Options().kl_clip(0).eigen_adam(true)); },
               {"param groups 0 and 1 hold preconditioned layers with (beta1, beta2, eps)", "one group"});
}

// Grafting against its definition, from two plain runs of the same step: a preconditioner alone gives K-FAC's
// direction d, the base alone on the plain gradients its step p1 - p0; each layer (weight and bias together) is at
// p0 - |p1 - p0| / |d| d, the LayerNorm at the base's p1, and the gradients left are the plain ones.
TEST(OptimKfac, GraftingMovesEachLayerAlongKfacsDirectionByTheBasesStepLength) {
  auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  auto grafted = make_net(), directions_net = make_net(), plain_net = make_net();
  optim::KFAC opt(grafted, std::make_shared<torch::optim::AdamW>(grafted->parameters(), adamw), kfac_options(),
                  nullptr, optim::KFACOptions().graft(true));
  Preconditioner kfac(directions_net, kfac_options());
  torch::optim::AdamW plain(plain_net->parameters(), adamw);
  for (int64_t step = 0; step < 3; ++step) {
    for (auto* net : {grafted.get(), directions_net.get(), plain_net.get()}) {
      net->zero_grad();
      loss_at(*net, step).backward();
    }
    const auto start = parameters_of(*plain_net);
    std::vector<torch::Tensor> plain_grads, directions;
    for (const auto& p : grafted->parameters()) plain_grads.push_back(p.grad().clone());
    kfac.step();
    for (const auto& p : directions_net->parameters()) directions.push_back(p.grad().clone());
    plain.step();
    opt.step();
    auto expected = parameters_of(*plain_net);  // p1
    for (const auto& block : {std::vector<size_t>{0, 1}, std::vector<size_t>{4, 5}}) {  // fc1, fc2; 2, 3: the norm
      torch::Tensor moved = torch::zeros({}, torch::kFloat64), length = torch::zeros({}, torch::kFloat64);
      for (const auto k : block) {
        moved += (expected[k] - start[k]).pow(2).sum();
        length += directions[k].pow(2).sum();
      }
      for (const auto k : block) expected[k] = start[k] - moved.sqrt() / length.sqrt() * directions[k];
    }
    const auto got = parameters_of(*grafted);
    for (size_t k = 0; k < got.size(); ++k) {
      EXPECT_TRUE(testing::tensors_near(got[k], expected[k], 1e-12)) << "step " << step << " parameter " << k;
      EXPECT_TRUE(torch::equal(grafted->parameters()[k].grad(), plain_grads[k])) << "the plain gradient " << k;
    }
    torch::NoGradGuard no_grad;  // the plain runs go on from the grafted parameters
    for (auto* net : {directions_net.get(), plain_net.get()}) {
      auto params = net->parameters();
      for (size_t k = 0; k < params.size(); ++k) params[k].copy_(grafted->parameters()[k]);
    }
  }
  expect_error([&] {
    auto net = make_net();
    optim::KFAC(net, std::make_shared<torch::optim::AdamW>(net->parameters()), Options().kl_clip(0).eigen_adam(true),
                nullptr, optim::KFACOptions().graft(true));
  }, {"graft takes the length of the base optimizer's step", "use one of them"});
}

TEST(OptimKfac, GraftingsSumsOverShardsAddUpToTheWholeBlocks) {
  // A block split into row shards, as FSDP2 shards a layer: each shard's graft_sums, added, then graft_apply on each
  // shard, put the shards where graft_block puts the whole block (Python's dkfac.optim.KFAC adds them over ranks).
  torch::manual_seed(3);
  const auto weight = torch::randn({5, 4}, torch::kFloat64), bias = torch::randn({5}, torch::kFloat64);
  const auto start_w = weight + 0.1 * torch::randn({5, 4}, torch::kFloat64), start_b = bias - 0.2;
  const auto dir_w = torch::randn({5, 4}, torch::kFloat64), dir_b = torch::randn({5}, torch::kFloat64);
  auto whole_w = weight.clone(), whole_b = bias.clone();
  math::graft_block({whole_w, whole_b}, {start_w, start_b}, {dir_w, dir_b});
  auto split_w = weight.clone(), split_b = bias.clone();
  std::vector<std::vector<torch::Tensor>> shards, starts, directions;
  for (const auto& [from, rows] : {std::make_pair(0, 3), std::make_pair(3, 2)}) {
    shards.push_back({split_w.narrow(0, from, rows), split_b.narrow(0, from, rows)});
    starts.push_back({start_w.narrow(0, from, rows), start_b.narrow(0, from, rows)});
    directions.push_back({dir_w.narrow(0, from, rows), dir_b.narrow(0, from, rows)});
  }
  const auto sums = math::graft_sums(shards[0], starts[0], directions[0]) +
                    math::graft_sums(shards[1], starts[1], directions[1]);
  for (size_t k = 0; k < shards.size(); ++k) math::graft_apply(shards[k], starts[k], directions[k], sums);
  EXPECT_TRUE(testing::tensors_near(split_w, whole_w, 1e-14));
  EXPECT_TRUE(testing::tensors_near(split_b, whole_b, 1e-14));
  EXPECT_FALSE(torch::allclose(whole_w, weight));  // the block moved
  // graft_block is its two halves, bit for bit; a shard's own sums alone put it elsewhere.
  auto halves_w = weight.clone(), halves_b = bias.clone();
  math::graft_apply({halves_w, halves_b}, {start_w, start_b}, {dir_w, dir_b},
                    math::graft_sums({halves_w, halves_b}, {start_w, start_b}, {dir_w, dir_b}));
  EXPECT_TRUE(torch::equal(halves_w, whole_w) && torch::equal(halves_b, whole_b));
  auto alone = weight.narrow(0, 0, 3).clone();
  math::graft_block({alone}, {start_w.narrow(0, 0, 3)}, {dir_w.narrow(0, 0, 3)});
  EXPECT_FALSE(torch::allclose(alone, whole_w.narrow(0, 0, 3)));
  expect_error([&] { math::graft_apply({halves_w}, {start_w}, {dir_w}, torch::zeros({2, 2}, torch::kFloat64)); },
               {"graft_apply: the sums are", "one row of two per parameter"});
}

TEST(OptimKfac, RefusesBasesItCannotWrapNamingWhy) {
  auto net = make_net();
  auto eigen_adam = Options().kl_clip(0).eigen_adam(true);
  expect_error([&] {
    optim::KFAC(net, std::make_shared<torch::optim::LBFGS>(net->parameters()), Options());
  }, {"LBFGS re-evaluates its closure"});
  expect_error([&] {
    optim::KFAC(net, std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1)),
                eigen_adam);
  }, {"the base optimizer must be torch::optim::AdamW (or Adam)"});
  expect_error([&] {
    optim::KFAC(net, std::make_shared<torch::optim::Adam>(net->parameters(),
                                                          torch::optim::AdamOptions(1e-3).weight_decay(0.1)),
                eigen_adam);
  }, {"weight_decay 0.1, Adam's L2 penalty", "use torch::optim::AdamW"});
  expect_error([&] {
    optim::KFAC(net, std::make_shared<torch::optim::AdamW>(net->parameters(),
                                                           torch::optim::AdamWOptions(1e-3).amsgrad(true)),
                eigen_adam);
  }, {"amsgrad"});
  auto other = make_net();  // an optimizer built for another model: K-FAC would be off without a word
  expect_error([&] {
    optim::KFAC(net, std::make_shared<torch::optim::SGD>(other->parameters(), torch::optim::SGDOptions(0.1)));
  }, {"none of the preconditioned layers has its parameters in the base optimizer's param groups", "'fc1'"});
  testing::CapturedWarnings warnings;
  optim::KFAC partial(net, std::make_shared<torch::optim::SGD>(net->fc2->parameters(), torch::optim::SGDOptions(0.1)));
  ASSERT_EQ(warnings.messages.size(), 1U) << warnings.all();
  EXPECT_NE(warnings.messages[0].find("1 preconditioned layer(s) are not optimized by the base optimizer"),
            std::string::npos) << warnings.all();
  EXPECT_NE(warnings.messages[0].find("'fc1'"), std::string::npos) << warnings.all();
}

// Two optimizers trained alike for `steps`.
struct Trained {
  std::shared_ptr<Net> net;
  std::shared_ptr<torch::optim::SGD> sgd;
  std::unique_ptr<optim::KFAC> opt;
};

Trained trained(int64_t steps) {
  Trained t{make_net(), nullptr, nullptr};
  t.sgd = std::make_shared<torch::optim::SGD>(t.net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  t.opt = std::make_unique<optim::KFAC>(t.net, t.sgd, kfac_options());
  for (int64_t step = 0; step < steps; ++step) {
    t.opt->zero_grad();
    loss_at(*t.net, step).backward();
    t.opt->step();
  }
  return t;
}

void train_on(Trained& t, int64_t from, int64_t to) {
  for (int64_t step = from; step < to; ++step) {
    t.opt->zero_grad();
    loss_at(*t.net, step).backward();
    t.opt->step();
  }
}

TEST(OptimKfac, SaveAndLoadResumeBitForBit) {
  auto first = trained(3);
  std::stringstream saved;
  torch::save(*first.opt, saved);
  std::stringstream weights;
  torch::save(first.net, weights);
  train_on(first, 3, 6);

  auto second = trained(1);  // another state, which the load replaces
  torch::load(second.net, weights);
  torch::load(*second.opt, saved);
  EXPECT_EQ(second.opt->preconditioner().steps(), 3);
  train_on(second, 3, 6);
  expect_equal(parameters_of(*second.net), parameters_of(*first.net), "resumed against uninterrupted");
}

// The base's momentum buffers, in parameter order.
std::vector<torch::Tensor> momenta(torch::optim::SGD& sgd) {
  std::vector<torch::Tensor> out;
  for (const auto& p : sgd.param_groups()[0].params()) {
    auto& state = static_cast<torch::optim::SGDParamState&>(*sgd.state().at(p.unsafeGetTensorImpl()));
    out.push_back(state.momentum_buffer().clone());
  }
  return out;
}

TEST(OptimKfac, ARefusedLoadLeavesBothHalvesAsTheyWere) {
  auto t = trained(2);
  const auto momenta_before = momenta(*t.sgd);
  const auto lr_before = t.sgd->param_groups()[0].options().get_lr();

  // A preconditioner's own archive: no "base" entry.
  {
    torch::serialize::OutputArchive archive;
    t.opt->preconditioner().save(archive);
    std::stringstream bytes;
    archive.save_to(bytes);
    torch::serialize::InputArchive in;
    in.load_from(bytes);
    expect_error([&] { t.opt->load(in); }, {"has no 'base' entry", "nothing was loaded"});
  }
  // A KFAC archive of another model: the base's half (another lr, other momenta) loads, the preconditioner's is
  // refused, and the base's state is put back.
  {
    struct Wider : torch::nn::Module {
      Wider() {
        fc1 = register_module("fc1", nn::Linear(torch::nn::LinearOptions(6, 5)));
        norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({5})));
        fc2 = register_module("fc2", nn::Linear(torch::nn::LinearOptions(5, 4)));
      }
      torch::Tensor forward(const torch::Tensor& x) { return fc2->forward(norm->forward(fc1->forward(x))); }
      nn::Linear fc1{nullptr}, fc2{nullptr};
      torch::nn::LayerNorm norm{nullptr};
    };
    auto wider = testing::seeded_float64<Wider>(3);
    auto sgd = std::make_shared<torch::optim::SGD>(wider->parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));
    optim::KFAC other(wider, sgd, kfac_options());
    for (int64_t step = 0; step < 2; ++step) {
      other.zero_grad();
      torch::manual_seed(step);
      (wider->forward(torch::randn({8, 6}, torch::kFloat64)) - 1).pow(2).mean().backward();
      other.step();
    }
    std::stringstream bytes;
    torch::save(other, bytes);
    expect_error([&] { torch::load(*t.opt, bytes); }, {"fc2"});
  }
  expect_equal(momenta(*t.sgd), momenta_before, "the base's momenta after the refused loads");
  EXPECT_EQ(t.sgd->param_groups()[0].options().get_lr(), lr_before);
  EXPECT_EQ(t.opt->preconditioner().steps(), 2);
  // And it trains on as one never offered those archives.
  auto untouched = trained(2);
  train_on(t, 2, 4);
  train_on(untouched, 2, 4);
  expect_equal(parameters_of(*t.net), parameters_of(*untouched.net), "after the refused loads");
}

// A base state refused on one rank only: every rank stops together, naming it, and puts its base back; no rank
// waits in the preconditioner's load.
TEST(OptimKfac, ABaseStateRefusedOnOneRankIsRefusedOnEveryRank) {
  std::vector<std::string> errors(2);
  std::vector<bool> base_kept(2, false);
  testing::run_ranks(2, [&](int rank, std::shared_ptr<comm::Communicator> communicator) {
    auto net = make_net();
    auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    optim::KFAC opt(net, sgd, kfac_options(), communicator);
    for (int64_t step = 0; step < 2; ++step) {
      opt.zero_grad();
      loss_at(*net, step + 10 * rank).backward();
      testing::average_gradients(*communicator, *net);
      opt.step();
    }
    // Every rank's archive: the base's state and the preconditioner's (whose save is collective); rank 1's base
    // half is an optimizer's of other parameters, which LibTorch refuses.
    torch::serialize::OutputArchive archive, base_part, kfac_part;
    opt.preconditioner().save(kfac_part);
    torch::nn::Linear lone(torch::nn::LinearOptions(2, 2));
    torch::optim::SGD other(lone->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    if (rank == 1) {
      other.save(base_part);
    } else {
      sgd->save(base_part);
    }
    archive.write("base", base_part);
    archive.write("kfac", kfac_part);
    std::stringstream bytes;
    archive.save_to(bytes);
    const auto before = momenta(*sgd);
    torch::serialize::InputArchive in;
    in.load_from(bytes);
    try {
      opt.load(in);
    } catch (const c10::Error& e) {
      errors[static_cast<size_t>(rank)] = e.what_without_backtrace();
    }
    const auto after = momenta(*sgd);
    bool same = after.size() == before.size();
    for (size_t i = 0; same && i < after.size(); ++i) same = torch::equal(after[i], before[i]);
    base_kept[static_cast<size_t>(rank)] = same;
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(errors[static_cast<size_t>(rank)].find("rank 1: the base optimizer's state was refused"),
              std::string::npos) << "rank " << rank << ": " << errors[static_cast<size_t>(rank)];
    EXPECT_TRUE(base_kept[static_cast<size_t>(rank)]) << "rank " << rank;
  }
}

}  // namespace
}  // namespace dkfac
