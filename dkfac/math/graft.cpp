#include "dkfac/math/graft.h"

#include <c10/util/Exception.h>

namespace dkfac::math {

namespace {

void check_block(const std::vector<torch::Tensor>& block, const std::vector<torch::Tensor>& start,
                 const std::vector<torch::Tensor>& direction) {
  TORCH_CHECK(block.size() == start.size() && block.size() == direction.size(), "graft_block: ", block.size(),
              " parameters, ", start.size(), " starting points and ", direction.size(), " directions");
  for (size_t i = 0; i < block.size(); ++i) {
    TORCH_CHECK(block[i].sizes() == start[i].sizes() && block[i].sizes() == direction[i].sizes(), "graft_block: ",
                "parameter ", i, " ", block[i].sizes(), ", its start ", start[i].sizes(), " and its direction ",
                direction[i].sizes(), " differ in shape");
  }
}

}  // namespace

void graft_block(const std::vector<torch::Tensor>& block, const std::vector<torch::Tensor>& start,
                 const std::vector<torch::Tensor>& direction) {
  if (block.empty()) {
    check_block(block, start, direction);
    return;
  }
  graft_apply(block, start, direction, graft_sums(block, start, direction));
}

torch::Tensor graft_sums(const std::vector<torch::Tensor>& block, const std::vector<torch::Tensor>& start,
                         const std::vector<torch::Tensor>& direction) {
  check_block(block, start, direction);
  TORCH_CHECK(!block.empty(), "graft_sums: an empty block");
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> rows;
  rows.reserve(block.size());
  for (size_t i = 0; i < block.size(); ++i) {
    rows.push_back(torch::stack({(block[i].detach() - start[i]).to(torch::kFloat64).pow(2).sum(),
                                 direction[i].to(torch::kFloat64).pow(2).sum()}));
  }
  return torch::stack(rows);
}

void graft_apply(const std::vector<torch::Tensor>& block, const std::vector<torch::Tensor>& start,
                 const std::vector<torch::Tensor>& direction, const torch::Tensor& sums) {
  check_block(block, start, direction);
  TORCH_CHECK(sums.dim() == 2 && sums.size(0) == static_cast<int64_t>(block.size()) && sums.size(1) == 2,
              "graft_apply: the sums are ", sums.sizes(), ", not one row of two per parameter (", block.size(), ")");
  if (block.empty()) return;
  torch::NoGradGuard no_grad;
  const auto norms = sums.to(torch::kFloat64).sum(0).sqrt();  // |p1 - p0| and |d| over the block
  const auto step = norms[0];
  const auto length = norms[1];
  const auto usable = length.gt(0).logical_and(length.isfinite());
  const auto scale = torch::where(usable, step / torch::where(usable, length, torch::ones_like(length)),
                                  torch::zeros_like(step));
  for (size_t i = 0; i < block.size(); ++i) {
    auto p = block[i];
    const auto grafted = (start[i].to(torch::kFloat64) - scale * direction[i].to(torch::kFloat64)).to(p.scalar_type());
    p.copy_(torch::where(usable, grafted, p.detach()));
  }
}

}  // namespace dkfac::math
