#pragma once

#include <torch/torch.h>

#include "dkfac/nn/kfac_module.h"

namespace dkfac::nn {

/// Drop-in replacement for torch::nn::EmbeddingImpl: same options, parameters, initialisation and forward
/// (padding_idx, max_norm included). K-FAC sees it as the Linear of one-hot token rows (docs/MATH.md 7.2): its
/// A factor is diagonal (token frequencies), its G factor the output gradient's covariance. While the
/// preconditioner has capture enabled, forward counts the tokens and hooks the output gradient. sparse=true is
/// refused: K-FAC preconditions dense gradients (use torch::nn::Embedding for a sparse one).
class EmbeddingImpl : public torch::nn::EmbeddingImpl, public KfacModule {
 public:
  EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim)
      : EmbeddingImpl(torch::nn::EmbeddingOptions(num_embeddings, embedding_dim)) {}
  explicit EmbeddingImpl(const torch::nn::EmbeddingOptions& options);

  /// y = W[tokens]; integer tokens of any shape -> [..., embedding_dim].
  torch::Tensor forward(const torch::Tensor& tokens);

  void pretty_print(std::ostream& stream) const override;
  /// A deep copy of the same dkfac class, with a capture of its own (clone_kfac_module).
  std::shared_ptr<torch::nn::Module> clone(const std::optional<torch::Device>& device = std::nullopt) const override {
    return clone_kfac_module<EmbeddingImpl>(*this, options, device);
  }

  torch::Tensor kfac_weight() const override { return weight; }
  torch::Tensor kfac_bias() const override { return {}; }
  int64_t a_dim() const override { return options.num_embeddings(); }
  int64_t g_dim() const override { return options.embedding_dim(); }
};

/// Module holder for EmbeddingImpl, used like torch::nn::Embedding.
TORCH_MODULE(Embedding);

}  // namespace dkfac::nn
