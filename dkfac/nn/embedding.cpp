#include "dkfac/nn/embedding.h"

namespace dkfac::nn {

EmbeddingImpl::EmbeddingImpl(const torch::nn::EmbeddingOptions& options) : torch::nn::EmbeddingImpl(options) {
  TORCH_CHECK(!options.sparse(), "dkfac::nn::Embedding(", options.num_embeddings(), ", ", options.embedding_dim(),
              ") with sparse=true: K-FAC preconditions dense gradients; use torch::nn::Embedding for a sparse "
              "embedding (its gradient then stays plain)");
  capture_ = std::make_shared<FactorCapture>(embedding_geometry(options.num_embeddings()));
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& tokens) {
  auto output = torch::nn::EmbeddingImpl::forward(tokens);
  capture_->observe_output(output);
  if (!capture_->active(is_training())) return output;

  capture_->capture_input(tokens);
  if (output.requires_grad()) {
    // The hook holds the capture, not the module: it stays valid if the module goes first.
    output.register_hook([capture = capture_](const torch::Tensor& grad) { capture->capture_output_grad(grad); });
  }
  return output;
}

void EmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "dkfac::nn::Embedding(num_embeddings=" << options.num_embeddings()
         << ", embedding_dim=" << options.embedding_dim() << ")";
}

}  // namespace dkfac::nn
