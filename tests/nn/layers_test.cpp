#include <gtest/gtest.h>

#include "dkfac/dkfac.h"
#include "tests/test_util.h"

namespace dkfac::nn {
namespace {

namespace F = torch::nn::functional;

TEST(Layers, LinearIsDropInReplacement) {
  torch::manual_seed(7);
  torch::nn::Linear reference(torch::nn::LinearOptions(5, 3));
  torch::manual_seed(7);
  Linear ours(torch::nn::LinearOptions(5, 3));
  EXPECT_TRUE(torch::equal(reference->weight, ours->weight));
  EXPECT_TRUE(torch::equal(reference->bias, ours->bias));
  auto x = torch::randn({4, 2, 5});
  EXPECT_TRUE(torch::equal(reference->forward(x), ours->forward(x)));
  EXPECT_EQ(ours->a_dim(), 6);
  EXPECT_EQ(ours->g_dim(), 3);
  Linear no_bias(torch::nn::LinearOptions(5, 3).bias(false));
  EXPECT_FALSE(no_bias->bias.defined());
  EXPECT_EQ(no_bias->a_dim(), 5);
  std::ostringstream printed;
  printed << *ours;
  EXPECT_NE(printed.str().find("dkfac::nn::Linear"), std::string::npos);
}

TEST(Layers, Conv2dIsDropInReplacement) {
  torch::manual_seed(8);
  torch::nn::Conv2d reference(torch::nn::Conv2dOptions(2, 4, 3).stride(2).padding(1));
  torch::manual_seed(8);
  Conv2d ours(torch::nn::Conv2dOptions(2, 4, 3).stride(2).padding(1));
  EXPECT_TRUE(torch::equal(reference->weight, ours->weight));
  EXPECT_TRUE(torch::equal(reference->bias, ours->bias));
  auto x = torch::randn({3, 2, 9, 8});
  EXPECT_TRUE(torch::equal(reference->forward(x), ours->forward(x)));
  EXPECT_EQ(ours->a_dim(), 2 * 9 + 1);
  EXPECT_EQ(ours->g_dim(), 4);
}

TEST(Layers, Conv2dRefusesGroups) {
  try {
    Conv2d conv(torch::nn::Conv2dOptions(4, 4, 3).groups(2));
    FAIL() << "groups=2 must be refused";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("groups=2"), std::string::npos) << e.what();
  }
}

// Whatever the padding, the patches must reproduce the layer's own forward: out = P W^T + b.
class ConvGeometry : public ::testing::TestWithParam<int> {};

torch::nn::Conv2dOptions conv_case(int index) {
  switch (index) {
    case 0: return torch::nn::Conv2dOptions(3, 4, 3).padding(1);
    case 1: return torch::nn::Conv2dOptions(3, 4, {3, 2}).stride({2, 1}).padding({1, 0}).dilation({1, 2});
    case 2: return torch::nn::Conv2dOptions(3, 4, 2).padding(torch::kSame);
    case 3: return torch::nn::Conv2dOptions(3, 4, {3, 4}).padding(torch::kSame).dilation(2);
    case 4: return torch::nn::Conv2dOptions(3, 4, 3).padding(torch::kValid).stride(2).bias(false);
    case 5: return torch::nn::Conv2dOptions(3, 4, 3).padding({1, 2}).padding_mode(torch::kReflect);
    case 6: return torch::nn::Conv2dOptions(3, 4, 3).padding(1).padding_mode(torch::kCircular).stride(2);
    default: return torch::nn::Conv2dOptions(3, 4, 3).padding(2).padding_mode(torch::kReplicate).dilation(2);
  }
}

TEST_P(ConvGeometry, PatchesReproduceForward) {
  torch::manual_seed(9);
  Conv2d conv(conv_case(GetParam()));
  conv->to(torch::kFloat64);
  auto x = torch::randn({2, 3, 9, 10}, torch::kFloat64);
  auto out = conv->forward(x);
  auto patches = math::conv2d_patches(x, conv->geometry());
  auto rebuilt = torch::mm(patches, conv->weight.reshape({4, -1}).t());
  if (conv->bias.defined()) rebuilt = rebuilt + conv->bias;
  auto expected = out.permute({0, 2, 3, 1}).reshape({-1, 4});
  EXPECT_TENSOR_NEAR(rebuilt, expected, 1e-12);
}

INSTANTIATE_TEST_SUITE_P(Options, ConvGeometry, ::testing::Range(0, 8));

TEST(Layers, CapturesOnlyWhenEnabledTrainingAndGradMode) {
  torch::manual_seed(10);
  Linear fc(4, 2);
  auto x = torch::randn({3, 4});
  fc->forward(x).sum().backward();
  EXPECT_EQ(fc->factor_capture().a_count(), 0) << "capture is off until a preconditioner enables it";

  fc->factor_capture().set_enabled(true);
  {
    torch::NoGradGuard no_grad;
    fc->forward(x);
  }
  EXPECT_EQ(fc->factor_capture().a_count(), 0) << "NoGradGuard must capture nothing";
  fc->eval();
  fc->forward(x).sum().backward();
  EXPECT_EQ(fc->factor_capture().a_count(), 0) << "eval mode must capture nothing";
  fc->train();
  fc->forward(x).sum().backward();
  EXPECT_EQ(fc->factor_capture().a_count(), 1);
  EXPECT_EQ(fc->factor_capture().g_count(), 1);
  auto a = fc->factor_capture().take_a();
  EXPECT_TENSOR_NEAR(a, math::linear_a_factor(x, true), 1e-6);
  auto g = fc->factor_capture().take_g();
  EXPECT_TENSOR_NEAR(g, math::linear_g_factor(torch::ones({3, 2})), 1e-6);
  EXPECT_EQ(fc->factor_capture().a_count(), 0);
}

TEST(Layers, WorksInsideSequential) {
  torch::nn::Sequential seq(Conv2d(torch::nn::Conv2dOptions(1, 2, 3)), torch::nn::Flatten(), Linear(2 * 4 * 4, 3));
  auto out = seq->forward(torch::randn({2, 1, 6, 6}));
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 3}));
}

// clone() (torch::nn::Sequential's, torch::nn::parallel's): torch's Cloneable copied the torch base class alone, so
// a Sequential's clone held null children and its forward segfaulted, and a lone module's clone was a torch module
// (K-FAC silently off). A clone is now of its dkfac class, with equal but separate parameters, a capture of its own
// (feeding no preconditioner), and a forward equal to the original's.
TEST(Layers, CloneIsADkfacModuleWithItsOwnCapture) {
  torch::manual_seed(11);
  torch::nn::Sequential seq(Conv2d(torch::nn::Conv2dOptions(1, 2, 3).stride(2).padding(1).bias(false)),
                            torch::nn::Flatten(), Linear(2 * 3 * 3, 5), Embedding(torch::nn::EmbeddingOptions(7, 3)));
  seq->eval();
  auto copy = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(seq->clone());
  ASSERT_NE(copy, nullptr);
  ASSERT_NE(copy->ptr<Conv2dImpl>(0), nullptr);
  ASSERT_NE(copy->ptr<LinearImpl>(2), nullptr);
  ASSERT_NE(copy->ptr<EmbeddingImpl>(3), nullptr);
  EXPECT_FALSE(copy->ptr<LinearImpl>(2)->is_training());  // its own mode (torch copies no container's)
  const auto original = seq->named_parameters(), cloned = copy->named_parameters();
  ASSERT_EQ(original.size(), cloned.size());
  for (const auto& item : original) {
    const auto& twin = cloned[item.key()];
    EXPECT_TRUE(torch::equal(item.value(), twin)) << item.key();
    EXPECT_NE(item.value().data_ptr(), twin.data_ptr()) << item.key();
  }
  const auto x = torch::randn({2, 1, 6, 6});
  const auto head = [](torch::nn::Sequential& s, const torch::Tensor& in) {
    const auto patches = s[0]->as<Conv2dImpl>()->forward(in);
    return s[2]->as<LinearImpl>()->forward(s[1]->as<torch::nn::FlattenImpl>()->forward(patches));
  };
  torch::nn::Sequential back(copy);
  EXPECT_TRUE(torch::equal(head(seq, x), head(back, x)));
  EXPECT_NE(&copy->ptr<LinearImpl>(2)->factor_capture(), &seq->ptr<LinearImpl>(2)->factor_capture());
  // A lone module's clone too.
  Linear fc(4, 2);
  auto twin = std::dynamic_pointer_cast<LinearImpl>(fc->clone());
  ASSERT_NE(twin, nullptr);
  twin->factor_capture().set_enabled(true);
  twin->forward(torch::randn({3, 4})).sum().backward();
  EXPECT_EQ(twin->factor_capture().a_count(), 1);
  EXPECT_EQ(fc->factor_capture().a_count(), 0);
}

TEST(Layers, EmbeddingIsDropInReplacementAndRefusesSparse) {
  torch::manual_seed(9);
  torch::nn::Embedding reference(torch::nn::EmbeddingOptions(7, 3).padding_idx(0));
  torch::manual_seed(9);
  Embedding ours(torch::nn::EmbeddingOptions(7, 3).padding_idx(0));
  EXPECT_TRUE(torch::equal(reference->weight, ours->weight));
  const auto tokens = torch::tensor({{1, 0, 6}, {2, 2, 0}}, torch::kLong);
  EXPECT_TRUE(torch::equal(reference->forward(tokens), ours->forward(tokens)));
  EXPECT_EQ(ours->a_dim(), 7);
  EXPECT_EQ(ours->g_dim(), 3);
  EXPECT_EQ(ours->kfac_kind(), "Embedding");
  testing::expect_error<c10::Error>([] { Embedding sparse(torch::nn::EmbeddingOptions(7, 3).sparse(true)); },
                                    {"sparse=true", "K-FAC preconditions dense gradients", "torch::nn::Embedding"});
}

// A head whose weight can be tied to an embedding's: both modules then hold one Parameter.
struct HeadImpl : LinearImpl {
  HeadImpl() : LinearImpl(torch::nn::LinearOptions(4, 11).bias(false)) {}
  void tie(const torch::Tensor& embedding_weight) {
    parameters_.erase("weight");
    weight = register_parameter("weight", embedding_weight);
  }
};
TORCH_MODULE(Head);

// A small language model in the C++ front end: token embedding, a Linear, and a head; tied or not.
struct TinyLanguageModelImpl : torch::nn::Module {
  explicit TinyLanguageModelImpl(bool tied) {
    wte = register_module("wte", Embedding(torch::nn::EmbeddingOptions(11, 4).padding_idx(0)));
    mix = register_module("mix", Linear(4, 4));
    head = register_module("head", Head());
    if (tied) head->tie(wte->weight);
  }
  torch::Tensor forward(const torch::Tensor& tokens) { return head(torch::tanh(mix(wte(tokens)))); }
  Embedding wte{nullptr};
  Linear mix{nullptr};
  Head head{nullptr};
};
TORCH_MODULE(TinyLanguageModel);

TEST(Layers, EmbeddingIsPreconditionedAndTiedWeightsKeepTheirPlainGradient) {
  torch::manual_seed(10);
  const auto tokens = torch::tensor({{1, 0, 6, 3}, {2, 2, 0, 5}}, torch::kLong);
  auto loss_of = [&](TinyLanguageModel& m) {
    return F::cross_entropy(m(tokens).flatten(0, 1), tokens.flatten());
  };
  TinyLanguageModel untied(false);
  Preconditioner kfac(untied.ptr(), Options().kl_clip(0.0));
  ASSERT_EQ(kfac.layers().size(), 3u);
  EXPECT_EQ(kfac.layers()[0].kind(), LayerKind::kEmbedding);
  EXPECT_TRUE(kfac.layers()[0].a_diagonal());
  loss_of(untied).backward();
  const auto plain = untied->wte->weight.grad().clone();
  kfac.step();
  const auto& preconditioned = untied->wte->weight.grad();
  EXPECT_FALSE(torch::allclose(preconditioned, plain));
  EXPECT_TRUE(torch::equal(preconditioned[0], torch::zeros({4}))) << "the padding row got a gradient";

  TinyLanguageModel tied(true);
  ASSERT_TRUE(tied->head->weight.is_same(tied->wte->weight));
  std::string warnings;
  {
    testing::CapturedWarnings captured;
    Preconditioner tied_kfac(tied.ptr(), Options());
    warnings = captured.all();
    ASSERT_EQ(tied_kfac.layers().size(), 1u);
    EXPECT_EQ(tied_kfac.layers()[0].name(), "mix");
  }
  EXPECT_NE(warnings.find("layer 'wte' (Embedding) keeps its plain gradient: tied to 'head'"), std::string::npos) << warnings;
  EXPECT_NE(warnings.find("layer 'head' (Linear) keeps its plain gradient: tied to 'wte'"), std::string::npos) << warnings;
}

// Tied LibTorch's usual way, by member assignment (`head->weight = wte->weight`: the head's registered parameter
// stays its own, its forward uses the embedding's): the same as registered ties. Both layers used to be
// preconditioned, each writing the one gradient with its own factors, the last winning, without a word. Tied after
// the build: the next step is refused, naming both. One module registered under two names is one layer.
TEST(Layers, WeightsTiedByMemberAssignmentOrAfterTheBuildAreNamed) {
  TinyLanguageModel tied(false);
  tied->head->weight = tied->wte->weight;
  std::string warnings;
  {
    testing::CapturedWarnings captured;
    Preconditioner kfac(tied.ptr(), Options());
    warnings = captured.all();
    ASSERT_EQ(kfac.layers().size(), 1u);
    EXPECT_EQ(kfac.layers()[0].name(), "mix");
  }
  EXPECT_NE(warnings.find("layer 'head' (Linear) keeps its plain gradient: tied to 'wte'"), std::string::npos)
      << warnings;

  TinyLanguageModel later(false);
  Preconditioner kfac(later.ptr(), Options());
  ASSERT_EQ(kfac.layers().size(), 3u);
  later->head->weight = later->wte->weight;
  const auto tokens = torch::tensor({{1, 0, 6, 3}, {2, 2, 0, 5}}, torch::kLong);
  F::cross_entropy(later(tokens).flatten(0, 1), tokens.flatten()).backward();
  testing::expect_error<c10::Error>([&] { kfac.step(); },
                                    {"K-FAC layer 'head' (Linear) now uses the weight of K-FAC layer 'wte' (Embedding)",
                                     "tied after the Preconditioner was built"});

  struct Twice : torch::nn::Module {
    Twice() {
      layer = register_module("layer", Linear(3, 2));
      register_module("again", layer);
    }
    Linear layer{nullptr};
  };
  auto twice = std::make_shared<Twice>();
  ASSERT_EQ(twice->named_modules().size(), 3u);
  Preconditioner once(twice, Options());
  ASSERT_EQ(once.layers().size(), 1u);
  EXPECT_EQ(once.layers()[0].name(), "layer");
}

}  // namespace
}  // namespace dkfac::nn
