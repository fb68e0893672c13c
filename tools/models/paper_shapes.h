#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dkfac/assign/assignment.h"

/// Layer-shape tables of the paper-scale models that `dkfac plan` knows without building them:
/// the models of the distributed K-FAC papers' 64-GPU experiments, written out from their published
/// architectures. Nothing here allocates a tensor; a table is a list of K-FAC layers (docs/MATH.md
/// section 0: a = in_features or C_in*kh*kw, +1 with a bias; g = out_features or C_out; rows per sample =
/// H_out*W_out for a conv, tokens for a Linear applied to a sequence) plus the model's parameter count.
namespace dkfac::models {

/// How tensor parallelism splits a layer over the T ranks of a group (Megatron-LM's layout, as
/// torch.distributed.tensor.parallel's ColwiseParallel and RowwiseParallel place it).
enum class TpSplit {
  kReplicated,  ///< every rank of the group holds the whole layer
  kColumn,      ///< the output rows: each rank g / T of them, the whole input (A whole, G a block)
  kRow,         ///< the input columns: each rank a_in / T of them (A a block; the bias with the group's first
                ///< rank), the whole output (G whole)
};

/// Where a transformer's layer sits for tensor and pipeline parallelism.
struct ParallelLayer {
  TpSplit split = TpSplit::kReplicated;
  int block = -1;          ///< its transformer block; -1 before the first (embeddings), `blocks` after the last
  bool bias = true;        ///< the A factor's last column is the bias
  bool embedding = false;  ///< an Embedding: A is diagonal at any width
};

/// One paper-scale model.
struct PaperModel {
  std::string name;                          ///< as `--model` spells it
  std::string input;                         ///< e.g. "3x224x224" or "sequence of 128 tokens"
  std::vector<assign::LayerShape> layers;    ///< K-FAC layers (Conv2d, Linear, Embedding), forward order
  int64_t parameters = 0;                    ///< every trainable parameter (incl. norms, embeddings)
  int64_t kfac_parameters = 0;               ///< weights and biases of `layers`
  /// Transformers only (else empty): one entry per layer of `layers`, and the number of blocks.
  std::vector<ParallelLayer> parallel;
  int blocks = 0;
};

/// resnet50, resnet152, densenet201, inception-v4, bert-large, gpt-1.3b, gpt-6.7b.
const std::vector<std::string>& paper_model_names();

/// True for a name of paper_model_names().
bool is_paper_model(const std::string& name);

/// The table of `name`:
/// - resnet50 / resnet152: torchvision's ResNet v1.5 (stride on the 3x3 conv), 3x224x224, 1000 classes;
/// - densenet201: torchvision's DenseNet-BC (growth 32, blocks 6/12/48/32, bottleneck 4x32), 3x224x224;
/// - inception-v4: Szegedy et al. 2016 with the widely used layer sizes (conv without bias + batch norm),
///   3x299x299, `classes` outputs (1000 by default: 42,679,816 parameters, the widely used count; 1001
///   classes would give 42,681,353);
/// - bert-large: BERT-Large encoder (24 layers, hidden 1024, 16 heads, FFN 4096, vocabulary 30522,
///   512 positions, 2 token types) with the pooler, no pre-training or task head; K-FAC layers are the
///   Linear layers Q, K, V, attention output, FFN in, FFN out of every layer (rows = `seq_len` tokens per
///   sample) and the pooler (rows = 1: it sees the first token only). Embeddings and LayerNorms count in
///   `parameters` only;
/// - gpt-1.3b / gpt-6.7b: GPT-3's 1.3B ("XL": 24 blocks, width 2048) and 6.7B (32 blocks, width 4096) shapes
///   (Brown et al. 2020, table 2.1) on GPT-2's architecture: vocabulary 50257, 2048 learned positions, pre-norm
///   blocks of a fused QKV projection, attention output, 4x MLP, every Linear with a bias, a final LayerNorm
///   and the LM head tied to the token embedding. K-FAC layers: the position embedding (an Embedding: diagonal
///   A) and the four Linear layers of every block (rows = `seq_len` tokens per sample); the tied token
///   embedding and head are left to the optimizer, as dkfac leaves tied weights.
/// Factors wider than Options::diagonal_factor_dim (8192) are kept diagonal, as a job keeps them. `seq_len`:
/// 1..512 for bert-large, 1..2048 for the GPT models. Throws c10::Error naming the valid names for an unknown one.
PaperModel paper_model(const std::string& name, int64_t seq_len = 128, int64_t classes = 1000);

/// Keeps `shape`'s factors diagonal where a job would (KfacLayer): an Embedding's A (`embedding`) always, and any
/// factor wider than Options::diagonal_factor_dim's default; the others dense.
void keep_wide_factors_diagonal(assign::LayerShape& shape, bool embedding);

/// The default tokens per sample of a sequence model (bert-large 128, the GPT models 2048), its most
/// (512, 2048), and its dataset's name ("wikipedia", "webtext"); 0, 0, "" for an image model.
struct SequenceInput {
  int64_t default_len = 0;
  int64_t max_len = 0;
  std::string dataset;
};
SequenceInput sequence_input(const std::string& name);

}  // namespace dkfac::models
