#include "dkfac/nn/embedding.h"

namespace dkfac::nn {

EmbeddingImpl::EmbeddingImpl(const torch::nn::EmbeddingOptions& options) : torch::nn::EmbeddingImpl(options) {
  TORCH_CHECK(!options.sparse(), "dkfac::nn::Embedding(", options.num_embeddings(), ", ", options.embedding_dim(),
              ") with sparse=true: K-FAC preconditions dense gradients; use torch::nn::Embedding for a sparse "
              "embedding (its gradient then stays plain)");
  capture_ = std::make_shared<FactorCapture>(embedding_geometry(options.num_embeddings()));
  // max_norm renormalizes the looked-up rows of the weight in place at every forward.
  capture_->set_weight_written_in_forward(options.max_norm().has_value());
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& tokens) {
  auto output = torch::nn::EmbeddingImpl::forward(tokens);
  capture_module_pass(capture_, tokens, output, is_training());
  return output;
}

void EmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "dkfac::nn::Embedding(num_embeddings=" << options.num_embeddings()
         << ", embedding_dim=" << options.embedding_dim() << ")";
}

}  // namespace dkfac::nn
