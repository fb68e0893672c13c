// The paper-scale layer tables: parameter counts against the published ones, and layer shapes by hand.
#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include "tools/models/paper_shapes.h"

namespace dkfac::models {
namespace {

const assign::LayerShape& layer(const PaperModel& m, const std::string& name) {
  for (const auto& l : m.layers) {
    if (l.name == name) return l;
  }
  throw std::runtime_error("no layer " + name + " in " + m.name);
}

void expect_shape(const PaperModel& m, const std::string& name, int64_t a, int64_t g, int64_t rows) {
  SCOPED_TRACE(m.name + " " + name);
  const auto& l = layer(m, name);
  EXPECT_EQ(l.a_dim, a);
  EXPECT_EQ(l.g_dim, g);
  EXPECT_EQ(l.rows_per_sample, rows);
}

int64_t kfac_parameters(const PaperModel& m) {
  int64_t n = 0;
  for (const auto& l : m.layers) n += l.a_dim * l.g_dim;
  return n;
}

TEST(PaperShapes, ParameterCountsMatchThePublishedOnes) {
  // torchvision 0.14: sum(p.numel() for p in torchvision.models.NAME().parameters()).
  EXPECT_EQ(paper_model("resnet50").parameters, 25557032);
  EXPECT_EQ(paper_model("resnet152").parameters, 60192808);
  EXPECT_EQ(paper_model("densenet201").parameters, 20013928);
  // The widely used Inception-v4 (42,679,816) has 1000 classes; 1001 adds a 1536-input row plus its bias.
  EXPECT_EQ(paper_model("inception-v4").parameters, 42679816);
  EXPECT_EQ(paper_model("inception-v4", 128, 1001).parameters, 42679816 + 1537);
  // bert-large-uncased's BertModel (embeddings, 24 layers, pooler; no pre-training heads).
  EXPECT_EQ(paper_model("bert-large").parameters, 335141888);
  EXPECT_EQ(paper_model("bert-large", 512).parameters, 335141888);  // positions are 512 whatever the length
  // GPT-2's architecture at GPT-3's 1.3B and 6.7B shapes: token and position embeddings V d + 2048 d, per block
  // two LayerNorms (4 d) and the four Linear layers with biases (12 d^2 + 9 d), the final LayerNorm (2 d).
  const auto gpt = [](int64_t blocks, int64_t d) {
    return 50257 * d + 2048 * d + blocks * (12 * d * d + 13 * d) + 2 * d;
  };
  EXPECT_EQ(paper_model("gpt-1.3b").parameters, gpt(24, 2048));
  EXPECT_EQ(paper_model("gpt-1.3b").parameters, 1315723264);
  EXPECT_EQ(paper_model("gpt-6.7b").parameters, gpt(32, 4096));
  EXPECT_EQ(paper_model("gpt-6.7b").parameters, 6658404352);  // both: transformers.GPT2Model at these sizes
}

TEST(PaperShapes, GptLayersAndTheirParallelLayout) {
  const auto m = paper_model("gpt-1.3b", 2048);
  ASSERT_EQ(m.layers.size(), 1u + 24 * 4);  // the position embedding and 4 Linear layers per block
  ASSERT_EQ(m.parallel.size(), m.layers.size());
  EXPECT_EQ(m.blocks, 24);
  expect_shape(m, "transformer.wpe", 2048, 2048, 2048);
  EXPECT_TRUE(layer(m, "transformer.wpe").a_diagonal);
  expect_shape(m, "transformer.h.0.attn.c_attn", 2049, 6144, 2048);
  expect_shape(m, "transformer.h.0.attn.c_proj", 2049, 2048, 2048);
  expect_shape(m, "transformer.h.0.mlp.c_fc", 2049, 8192, 2048);
  expect_shape(m, "transformer.h.23.mlp.c_proj", 8193, 2048, 2048);
  // Wider than diagonal_factor_dim (8192): diagonal, as a job keeps it.
  EXPECT_FALSE(layer(m, "transformer.h.0.mlp.c_fc").g_diagonal);
  EXPECT_TRUE(layer(m, "transformer.h.0.mlp.c_proj").a_diagonal);
  EXPECT_TRUE(layer(paper_model("gpt-6.7b"), "transformer.h.0.mlp.c_fc").g_diagonal);
  // Megatron-LM's layout: QKV and the MLP's first layer split by output rows, the projections after them by input.
  EXPECT_EQ(m.parallel[1].split, TpSplit::kColumn);
  EXPECT_EQ(m.parallel[2].split, TpSplit::kRow);
  EXPECT_EQ(m.parallel[3].split, TpSplit::kColumn);
  EXPECT_EQ(m.parallel[4].split, TpSplit::kRow);
  EXPECT_EQ(m.parallel[0].block, -1);
  EXPECT_EQ(m.parallel.back().block, 23);
  EXPECT_TRUE(paper_model("resnet50").parallel.empty()) << "no tensor or pipeline layout for a CNN table";
  EXPECT_THROW(paper_model("gpt-1.3b", 4096), c10::Error);
  EXPECT_THROW(paper_model("bert-large", 1024), c10::Error);
}

TEST(PaperShapes, LayerCounts) {
  EXPECT_EQ(paper_model("resnet50").layers.size(), 1u + 3 * (3 + 4 + 6 + 3) + 4 + 1);       // 54
  EXPECT_EQ(paper_model("resnet152").layers.size(), 1u + 3 * (3 + 8 + 36 + 3) + 4 + 1);     // 156
  EXPECT_EQ(paper_model("densenet201").layers.size(), 1u + 2 * (6 + 12 + 48 + 32) + 3 + 1);  // 201
  // stem 3 + mixed_3a 1 + mixed_4a 6 + mixed_5a 1, 4 A x 7, reduction A 4, 7 B x 10, reduction B 6,
  // 3 C x 10, classifier.
  EXPECT_EQ(paper_model("inception-v4").layers.size(), 11u + 28 + 4 + 70 + 6 + 30 + 1);  // 150
  EXPECT_EQ(paper_model("bert-large").layers.size(), 24u * 6 + 1);                       // 145
}

TEST(PaperShapes, KfacParametersAreTheLayersWeightsAndBiases) {
  for (const auto& name : paper_model_names()) {
    const auto m = paper_model(name);
    EXPECT_EQ(m.kfac_parameters, kfac_parameters(m)) << name;
    EXPECT_LT(m.kfac_parameters, m.parameters) << name;
  }
  // Outside K-FAC: ResNet-50's 53 BatchNorms hold 2 x 26,560 = 53,120 parameters.
  const auto r = paper_model("resnet50");
  EXPECT_EQ(r.parameters - r.kfac_parameters, 53120);
  // BERT-Large: embeddings (30522 + 512 + 2) x 1024 and 49 LayerNorms x 2048.
  const auto b = paper_model("bert-large");
  EXPECT_EQ(b.parameters - b.kfac_parameters, (30522 + 512 + 2) * 1024 + 49 * 2048);
}

TEST(PaperShapes, ResNetShapesByHand) {
  const auto m = paper_model("resnet50");
  expect_shape(m, "conv1", 3 * 7 * 7, 64, 112 * 112);  // no bias; 224 -> 112
  expect_shape(m, "layer1.0.conv1", 64, 64, 56 * 56);  // after the 3x3/2 max pool
  expect_shape(m, "layer1.0.conv2", 64 * 9, 64, 56 * 56);
  expect_shape(m, "layer1.0.downsample.0", 64, 256, 56 * 56);
  expect_shape(m, "layer2.0.conv1", 256, 128, 56 * 56);  // v1.5: the 1x1 keeps stride 1
  expect_shape(m, "layer2.0.conv2", 128 * 9, 128, 28 * 28);
  expect_shape(m, "layer2.0.downsample.0", 256, 512, 28 * 28);
  expect_shape(m, "layer4.2.conv2", 512 * 9, 512, 7 * 7);
  expect_shape(m, "layer4.2.conv3", 512, 2048, 7 * 7);
  expect_shape(m, "fc", 2048 + 1, 1000, 1);
  expect_shape(paper_model("resnet152"), "layer3.35.conv3", 256, 1024, 14 * 14);
}

TEST(PaperShapes, FactorKernelsFollowEachConvolutionsGeometry) {
  using math::FactorKernel;
  const auto m = paper_model("resnet50");
  EXPECT_EQ(layer(m, "conv1").a_kernel, FactorKernel::kConvUnfold);             // 3 channels
  EXPECT_EQ(layer(m, "layer1.0.conv1").a_kernel, FactorKernel::kConvPatches);   // 1x1
  EXPECT_EQ(layer(m, "layer1.0.conv2").a_kernel, FactorKernel::kConvRowShift);  // 3x3, stride 1
  EXPECT_EQ(layer(m, "layer2.0.conv2").a_kernel, FactorKernel::kConvPatches);   // 3x3, stride 2
  EXPECT_EQ(layer(m, "layer2.0.conv2").g_kernel, FactorKernel::kConvGradient);
  EXPECT_EQ(layer(m, "fc").a_kernel, FactorKernel::kCovariance);
  EXPECT_EQ(layer(m, "fc").g_kernel, FactorKernel::kCovariance);
  const auto i = paper_model("inception-v4");
  EXPECT_EQ(layer(i, "stem.mixed_4a.branch1.1").a_kernel, FactorKernel::kConvPatches);  // 1x7: one kernel row
  const auto b = paper_model("bert-large");
  for (const auto& l : b.layers) EXPECT_EQ(l.a_kernel, FactorKernel::kCovariance) << l.name;  // 128 rows, Linear
}

TEST(PaperShapes, DenseNetShapesByHand) {
  const auto m = paper_model("densenet201");
  expect_shape(m, "features.conv0", 147, 64, 112 * 112);
  expect_shape(m, "features.denseblock1.denselayer1.conv1", 64, 128, 56 * 56);
  expect_shape(m, "features.denseblock1.denselayer1.conv2", 128 * 9, 32, 56 * 56);
  expect_shape(m, "features.transition1.conv", 256, 128, 56 * 56);  // pooled after
  expect_shape(m, "features.denseblock2.denselayer1.conv1", 128, 128, 28 * 28);
  expect_shape(m, "features.transition3.conv", 256 + 48 * 32, 896, 14 * 14);
  expect_shape(m, "features.denseblock4.denselayer32.conv1", 896 + 31 * 32, 128, 7 * 7);
  expect_shape(m, "classifier", 1920 + 1, 1000, 1);
}

TEST(PaperShapes, InceptionV4ShapesByHand) {
  const auto m = paper_model("inception-v4");
  expect_shape(m, "stem.conv1", 27, 32, 149 * 149);  // 299, 3x3/2 valid
  expect_shape(m, "stem.conv3", 32 * 9, 64, 147 * 147);
  expect_shape(m, "stem.mixed_4a.branch1.1", 64 * 7, 64, 73 * 73);
  expect_shape(m, "stem.mixed_4a.branch1.3", 64 * 9, 96, 71 * 71);
  expect_shape(m, "stem.mixed_5a.conv", 192 * 9, 192, 35 * 35);
  expect_shape(m, "inception_a4.branch3.1", 384, 96, 35 * 35);
  expect_shape(m, "reduction_a.branch1.2", 224 * 9, 256, 17 * 17);
  expect_shape(m, "inception_b1.branch1.1", 192 * 7, 224, 17 * 17);
  expect_shape(m, "reduction_b.branch1.3", 320 * 9, 320, 8 * 8);
  expect_shape(m, "inception_c3.branch2.2", 448 * 3, 512, 8 * 8);
  expect_shape(m, "last_linear", 1536 + 1, 1000, 1);
}

TEST(PaperShapes, BertLargeShapesByHand) {
  const auto m = paper_model("bert-large");
  expect_shape(m, "encoder.layer.0.attention.self.query", 1024 + 1, 1024, 128);
  expect_shape(m, "encoder.layer.23.attention.output.dense", 1024 + 1, 1024, 128);
  expect_shape(m, "encoder.layer.5.intermediate.dense", 1024 + 1, 4096, 128);
  expect_shape(m, "encoder.layer.5.output.dense", 4096 + 1, 1024, 128);
  expect_shape(m, "pooler.dense", 1024 + 1, 1024, 1);  // the first token only
  expect_shape(paper_model("bert-large", 512), "encoder.layer.0.attention.self.key", 1025, 1024, 512);
  EXPECT_THROW(paper_model("bert-large", 513), c10::Error);
}

TEST(PaperShapes, UnknownNameThrows) {
  EXPECT_TRUE(is_paper_model("inception-v4"));
  EXPECT_FALSE(is_paper_model("resnet20"));
  EXPECT_THROW(paper_model("vgg16"), c10::Error);
}

}  // namespace
}  // namespace dkfac::models
