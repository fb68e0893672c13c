#include "tools/models/paper_shapes.h"

#include <algorithm>

#include <c10/util/Exception.h>

#include "dkfac/options.h"

namespace dkfac::models {
namespace {

/// Spatial size of a feature map.
struct Size {
  int64_t h = 0;
  int64_t w = 0;
};

/// Accumulates K-FAC layers and the parameter count while walking an architecture forward.
class Builder {
 public:
  explicit Builder(std::string name, std::string input) {
    model_.name = std::move(name);
    model_.input = std::move(input);
  }

  /// Conv2d `in -> out` with a kh x kw kernel, stride s and padding (ph, pw) on an `x` input; no bias
  /// unless asked. Returns the output size.
  Size conv(const std::string& name, int64_t in, int64_t out, Size x, int64_t kh, int64_t kw, int64_t stride,
            int64_t ph, int64_t pw, bool bias = false) {
    const Size y{(x.h + 2 * ph - kh) / stride + 1, (x.w + 2 * pw - kw) / stride + 1};
    TORCH_CHECK(y.h > 0 && y.w > 0, name, ": empty output");
    const int64_t a = in * kh * kw + (bias ? 1 : 0);
    add_layer({name, a, out, y.h * y.w, math::conv2d_a_kernel(in, kh, stride), math::FactorKernel::kConvGradient});
    return y;
  }
  /// Square kernel k, stride s, padding p.
  Size conv(const std::string& name, int64_t in, int64_t out, Size x, int64_t k, int64_t stride, int64_t pad,
            bool bias = false) {
    return conv(name, in, out, x, k, k, stride, pad, pad, bias);
  }
  /// Linear `in -> out` with a bias applied to `rows` rows per sample; `split` and `block` for a transformer.
  void linear(const std::string& name, int64_t in, int64_t out, int64_t rows = 1, bool bias = true,
              TpSplit split = TpSplit::kReplicated, int block = -1) {
    add_layer({name, in + (bias ? 1 : 0), out, rows}, {split, block, bias, false});
  }
  /// Embedding of `count` rows of width `dim` looked up `rows` times per sample (A diagonal).
  void embedding(const std::string& name, int64_t count, int64_t dim, int64_t rows, int block = -1) {
    add_layer({name, count, dim, rows}, {TpSplit::kReplicated, block, false, true});
  }
  void blocks(int n) { model_.blocks = n; }
  /// Parameters outside K-FAC: a BatchNorm's or LayerNorm's weight and bias over `channels`.
  void norm(int64_t channels) { model_.parameters += 2 * channels; }
  /// Other parameters outside K-FAC (embeddings).
  void other(int64_t count) { model_.parameters += count; }

  PaperModel done() {
    if (model_.blocks == 0) model_.parallel.clear();  // not a transformer: no tensor or pipeline layout
    return std::move(model_);
  }

 private:
  void add_layer(assign::LayerShape shape, ParallelLayer parallel = {}) {
    const int64_t parameters = shape.a_dim * shape.g_dim;  // the bias is the A factor's last column
    keep_wide_factors_diagonal(shape, parallel.embedding);
    model_.layers.push_back(std::move(shape));
    model_.parallel.push_back(parallel);
    model_.parameters += parameters;
    model_.kfac_parameters += parameters;
  }
  PaperModel model_;
};

/// Max pooling / average pooling: only the size changes.
Size pool(Size x, int64_t k, int64_t stride, int64_t pad) {
  return {(x.h + 2 * pad - k) / stride + 1, (x.w + 2 * pad - k) / stride + 1};
}

/// torchvision's ResNet with bottleneck blocks (v1.5: the stride sits on the 3x3 conv), each conv
/// followed by a BatchNorm; the first block of each stage projects the shortcut (1x1 conv + BatchNorm).
PaperModel resnet(const std::string& name, const std::vector<int>& blocks, int64_t classes) {
  Builder b(name, "3x224x224");
  Size x = b.conv("conv1", 3, 64, {224, 224}, 7, 2, 3);
  b.norm(64);
  x = pool(x, 3, 2, 1);
  int64_t in = 64;
  for (size_t stage = 0; stage < blocks.size(); ++stage) {
    const int64_t width = int64_t{64} << stage;
    const int64_t out = 4 * width;
    for (int block = 0; block < blocks[stage]; ++block) {
      const std::string p = "layer" + std::to_string(stage + 1) + "." + std::to_string(block) + ".";
      const int64_t stride = (block == 0 && stage > 0) ? 2 : 1;
      b.conv(p + "conv1", in, width, x, 1, 1, 0);
      b.norm(width);
      const Size y = b.conv(p + "conv2", width, width, x, 3, stride, 1);
      b.norm(width);
      b.conv(p + "conv3", width, out, y, 1, 1, 0);
      b.norm(out);
      if (block == 0) {
        b.conv(p + "downsample.0", in, out, x, 1, stride, 0);
        b.norm(out);
      }
      x = y;
      in = out;
    }
  }
  b.linear("fc", in, classes);
  return b.done();
}

/// torchvision's DenseNet-201: conv0 (7x7/2) + BatchNorm + max pool, four dense blocks of 6, 12, 48, 32
/// layers (BatchNorm, 1x1 conv to 4 x 32, BatchNorm, 3x3 conv to 32, concatenated), transitions
/// (BatchNorm, 1x1 conv halving the channels, 2x2 average pool), a final BatchNorm and the classifier.
PaperModel densenet201(int64_t classes) {
  Builder b("densenet201", "3x224x224");
  const int64_t growth = 32;
  const int64_t bottleneck = 4 * growth;
  const std::vector<int> blocks = {6, 12, 48, 32};
  Size x = b.conv("features.conv0", 3, 64, {224, 224}, 7, 2, 3);
  b.norm(64);
  x = pool(x, 3, 2, 1);
  int64_t channels = 64;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const std::string block = "features.denseblock" + std::to_string(i + 1) + ".";
    for (int l = 0; l < blocks[i]; ++l) {
      const std::string p = block + "denselayer" + std::to_string(l + 1) + ".";
      b.norm(channels);
      b.conv(p + "conv1", channels, bottleneck, x, 1, 1, 0);
      b.norm(bottleneck);
      b.conv(p + "conv2", bottleneck, growth, x, 3, 1, 1);
      channels += growth;
    }
    if (i + 1 < blocks.size()) {
      const std::string p = "features.transition" + std::to_string(i + 1) + ".";
      b.norm(channels);
      b.conv(p + "conv", channels, channels / 2, x, 1, 1, 0);
      channels /= 2;
      x = pool(x, 2, 2, 0);
    }
  }
  b.norm(channels);
  b.linear("classifier", channels, classes);
  return b.done();
}

/// Inception-v4 (Szegedy et al. 2016, figures 3-9) with every conv a "basic conv": Conv2d without
/// bias + BatchNorm (affine) + ReLU. Input 3x299x299.
PaperModel inception_v4(int64_t classes) {
  Builder b("inception-v4", "3x299x299");
  // Basic conv: kernel kh x kw, stride, padding (ph, pw), then its BatchNorm.
  const auto bc = [&b](const std::string& name, int64_t in, int64_t out, Size x, int64_t kh, int64_t kw,
                       int64_t stride = 1, int64_t ph = 0, int64_t pw = 0) {
    const Size y = b.conv(name, in, out, x, kh, kw, stride, ph, pw);
    b.norm(out);
    return y;
  };
  // Stem (figure 3).
  Size x = bc("stem.conv1", 3, 32, {299, 299}, 3, 3, 2);  // 149
  x = bc("stem.conv2", 32, 32, x, 3, 3);                  // 147
  x = bc("stem.conv3", 32, 64, x, 3, 3, 1, 1, 1);         // 147
  x = bc("stem.mixed_3a.conv", 64, 96, x, 3, 3, 2);       // 73; concat with a 3x3/2 max pool: 64 + 96
  {
    const Size in = x;  // 73, 160 channels
    Size y = bc("stem.mixed_4a.branch0.0", 160, 64, in, 1, 1);
    y = bc("stem.mixed_4a.branch0.1", 64, 96, y, 3, 3);  // 71
    Size z = bc("stem.mixed_4a.branch1.0", 160, 64, in, 1, 1);
    z = bc("stem.mixed_4a.branch1.1", 64, 64, z, 1, 7, 1, 0, 3);
    z = bc("stem.mixed_4a.branch1.2", 64, 64, z, 7, 1, 1, 3, 0);
    z = bc("stem.mixed_4a.branch1.3", 64, 96, z, 3, 3);  // 71
    x = y;                                               // 192 channels
  }
  x = bc("stem.mixed_5a.conv", 192, 192, x, 3, 3, 2);  // 35; concat with a max pool: 384
  // 4 x Inception-A (figure 4), 384 -> 384 at 35x35.
  for (int i = 0; i < 4; ++i) {
    const std::string p = "inception_a" + std::to_string(i + 1) + ".";
    bc(p + "branch0", 384, 96, x, 1, 1);
    bc(p + "branch1.1", 64, 96, bc(p + "branch1.0", 384, 64, x, 1, 1), 3, 3, 1, 1, 1);
    Size y = bc(p + "branch2.0", 384, 64, x, 1, 1);
    y = bc(p + "branch2.1", 64, 96, y, 3, 3, 1, 1, 1);
    bc(p + "branch2.2", 96, 96, y, 3, 3, 1, 1, 1);
    bc(p + "branch3.1", 384, 96, x, 1, 1);  // after a 3x3/1 average pool
  }
  // Reduction-A (figure 7, k=192, l=224, m=256, n=384): 384 -> 384 + 256 + 384 = 1024 at 17x17.
  {
    const Size y = bc("reduction_a.branch0", 384, 384, x, 3, 3, 2);
    Size z = bc("reduction_a.branch1.0", 384, 192, x, 1, 1);
    z = bc("reduction_a.branch1.1", 192, 224, z, 3, 3, 1, 1, 1);
    bc("reduction_a.branch1.2", 224, 256, z, 3, 3, 2);
    x = y;
  }
  // 7 x Inception-B (figure 5), 1024 -> 384 + 256 + 256 + 128 at 17x17.
  for (int i = 0; i < 7; ++i) {
    const std::string p = "inception_b" + std::to_string(i + 1) + ".";
    bc(p + "branch0", 1024, 384, x, 1, 1);
    Size y = bc(p + "branch1.0", 1024, 192, x, 1, 1);
    y = bc(p + "branch1.1", 192, 224, y, 1, 7, 1, 0, 3);
    bc(p + "branch1.2", 224, 256, y, 7, 1, 1, 3, 0);
    Size z = bc(p + "branch2.0", 1024, 192, x, 1, 1);
    z = bc(p + "branch2.1", 192, 192, z, 7, 1, 1, 3, 0);
    z = bc(p + "branch2.2", 192, 224, z, 1, 7, 1, 0, 3);
    z = bc(p + "branch2.3", 224, 224, z, 7, 1, 1, 3, 0);
    bc(p + "branch2.4", 224, 256, z, 1, 7, 1, 0, 3);
    bc(p + "branch3.1", 1024, 128, x, 1, 1);  // after a 3x3/1 average pool
  }
  // Reduction-B (figure 8): 1024 -> 192 + 320 + 1024 = 1536 at 8x8.
  {
    Size y = bc("reduction_b.branch0.0", 1024, 192, x, 1, 1);
    y = bc("reduction_b.branch0.1", 192, 192, y, 3, 3, 2);
    Size z = bc("reduction_b.branch1.0", 1024, 256, x, 1, 1);
    z = bc("reduction_b.branch1.1", 256, 256, z, 1, 7, 1, 0, 3);
    z = bc("reduction_b.branch1.2", 256, 320, z, 7, 1, 1, 3, 0);
    bc("reduction_b.branch1.3", 320, 320, z, 3, 3, 2);
    x = y;
  }
  // 3 x Inception-C (figure 6), 1536 -> 256 + 512 + 512 + 256 at 8x8.
  for (int i = 0; i < 3; ++i) {
    const std::string p = "inception_c" + std::to_string(i + 1) + ".";
    bc(p + "branch0", 1536, 256, x, 1, 1);
    const Size y = bc(p + "branch1.0", 1536, 384, x, 1, 1);
    bc(p + "branch1.1a", 384, 256, y, 1, 3, 1, 0, 1);
    bc(p + "branch1.1b", 384, 256, y, 3, 1, 1, 1, 0);
    Size z = bc(p + "branch2.0", 1536, 384, x, 1, 1);
    z = bc(p + "branch2.1", 384, 448, z, 3, 1, 1, 1, 0);
    z = bc(p + "branch2.2", 448, 512, z, 1, 3, 1, 0, 1);
    bc(p + "branch2.3a", 512, 256, z, 1, 3, 1, 0, 1);
    bc(p + "branch2.3b", 512, 256, z, 3, 1, 1, 1, 0);
    bc(p + "branch3.1", 1536, 256, x, 1, 1);  // after a 3x3/1 average pool
  }
  b.linear("last_linear", 1536, classes);  // after an 8x8 average pool
  return b.done();
}

/// BERT-Large (Devlin et al. 2019) encoder with the pooler.
PaperModel bert_large(int64_t seq_len) {
  const int64_t hidden = 1024;
  const int64_t ffn = 4096;
  const int64_t layers = 24;
  Builder b("bert-large", "sequence of " + std::to_string(seq_len) + " tokens");
  b.other((30522 + 512 + 2) * hidden);  // word, position and token-type embeddings
  b.norm(hidden);                        // embedding LayerNorm
  b.blocks(layers);
  for (int i = 0; i < layers; ++i) {
    const std::string p = "encoder.layer." + std::to_string(i) + ".";
    for (const char* projection : {"query", "key", "value"}) {
      b.linear(p + "attention.self." + projection, hidden, hidden, seq_len, true, TpSplit::kColumn, i);
    }
    b.linear(p + "attention.output.dense", hidden, hidden, seq_len, true, TpSplit::kRow, i);
    b.norm(hidden);
    b.linear(p + "intermediate.dense", hidden, ffn, seq_len, true, TpSplit::kColumn, i);
    b.linear(p + "output.dense", ffn, hidden, seq_len, true, TpSplit::kRow, i);
    b.norm(hidden);
  }
  b.linear("pooler.dense", hidden, hidden, 1, true, TpSplit::kReplicated, layers);  // the first token only
  return b.done();
}

/// GPT-3's shapes on GPT-2's architecture (paper_model's comment).
PaperModel gpt(const std::string& name, int blocks, int64_t width, int64_t seq_len) {
  const int64_t vocabulary = 50257, positions = 2048;
  Builder b(name, "sequence of " + std::to_string(seq_len) + " tokens");
  b.blocks(blocks);
  b.other(vocabulary * width);  // the token embedding, tied with the LM head: left to the optimizer
  b.embedding("transformer.wpe", positions, width, seq_len);
  for (int i = 0; i < blocks; ++i) {
    const std::string p = "transformer.h." + std::to_string(i) + ".";
    b.norm(width);
    b.linear(p + "attn.c_attn", width, 3 * width, seq_len, true, TpSplit::kColumn, i);
    b.linear(p + "attn.c_proj", width, width, seq_len, true, TpSplit::kRow, i);
    b.norm(width);
    b.linear(p + "mlp.c_fc", width, 4 * width, seq_len, true, TpSplit::kColumn, i);
    b.linear(p + "mlp.c_proj", 4 * width, width, seq_len, true, TpSplit::kRow, i);
  }
  b.norm(width);  // ln_f
  return b.done();
}

}  // namespace

const std::vector<std::string>& paper_model_names() {
  static const std::vector<std::string> names = {"resnet50", "resnet152", "densenet201", "inception-v4",
                                                 "bert-large", "gpt-1.3b", "gpt-6.7b"};
  return names;
}

bool is_paper_model(const std::string& name) {
  const auto& names = paper_model_names();
  return std::find(names.begin(), names.end(), name) != names.end();
}

void keep_wide_factors_diagonal(assign::LayerShape& shape, bool embedding) {
  const int64_t widest = Options().diagonal_factor_dim();
  shape.a_diagonal = embedding || shape.a_dim > widest;
  shape.g_diagonal = shape.g_dim > widest;
}

SequenceInput sequence_input(const std::string& name) {
  if (name == "bert-large") return {128, 512, "wikipedia"};
  if (name == "gpt-1.3b" || name == "gpt-6.7b") return {2048, 2048, "webtext"};
  return {};
}

PaperModel paper_model(const std::string& name, int64_t seq_len, int64_t classes) {
  const auto sequence = sequence_input(name);
  TORCH_CHECK(sequence.max_len == 0 || (seq_len >= 1 && seq_len <= sequence.max_len), "sequence length must be in [1, ",
              sequence.max_len, "], got ", seq_len);
  TORCH_CHECK(classes >= 1, "classes must be >= 1, got ", classes);
  if (name == "resnet50") return resnet(name, {3, 4, 6, 3}, classes);
  if (name == "resnet152") return resnet(name, {3, 8, 36, 3}, classes);
  if (name == "densenet201") return densenet201(classes);
  if (name == "inception-v4") return inception_v4(classes);
  if (name == "bert-large") return bert_large(seq_len);
  if (name == "gpt-1.3b") return gpt(name, 24, 2048, seq_len);
  if (name == "gpt-6.7b") return gpt(name, 32, 4096, seq_len);
  TORCH_CHECK(false, "unknown paper model '", name,
              "'; valid: resnet50, resnet152, densenet201, inception-v4, bert-large, gpt-1.3b, gpt-6.7b");
}

}  // namespace dkfac::models
