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

/// One paper-scale model.
struct PaperModel {
  std::string name;                          ///< as `--model` spells it
  std::string input;                         ///< e.g. "3x224x224" or "sequence of 128 tokens"
  std::vector<assign::LayerShape> layers;    ///< K-FAC layers (Conv2d and Linear), forward order
  int64_t parameters = 0;                    ///< every trainable parameter (incl. norms, embeddings)
  int64_t kfac_parameters = 0;               ///< weights and biases of `layers`
};

/// resnet50, resnet152, densenet201, inception-v4, bert-large.
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
///   `parameters` only.
/// Throws c10::Error naming the valid names for an unknown one.
PaperModel paper_model(const std::string& name, int64_t seq_len = 128, int64_t classes = 1000);

}  // namespace dkfac::models
