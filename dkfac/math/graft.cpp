#include "dkfac/math/graft.h"

#include <c10/util/Exception.h>

namespace dkfac::math {

void graft_block(const std::vector<torch::Tensor>& block, const std::vector<torch::Tensor>& start,
                 const std::vector<torch::Tensor>& direction) {
  TORCH_CHECK(block.size() == start.size() && block.size() == direction.size(), "graft_block: ", block.size(),
              " parameters, ", start.size(), " starting points and ", direction.size(), " directions");
  for (size_t i = 0; i < block.size(); ++i) {
    TORCH_CHECK(block[i].sizes() == start[i].sizes() && block[i].sizes() == direction[i].sizes(), "graft_block: ",
                "parameter ", i, " ", block[i].sizes(), ", its start ", start[i].sizes(), " and its direction ",
                direction[i].sizes(), " differ in shape");
  }
  if (block.empty()) return;
  torch::NoGradGuard no_grad;
  torch::Tensor step, length;  // |p1 - p0| and |d| over the block, summed in order (as Python's sum())
  for (size_t i = 0; i < block.size(); ++i) {
    const auto s = (block[i].detach() - start[i]).to(torch::kFloat64).pow(2).sum();
    const auto l = direction[i].to(torch::kFloat64).pow(2).sum();
    step = i == 0 ? s : step + s;
    length = i == 0 ? l : length + l;
  }
  step = step.sqrt();
  length = length.sqrt();
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
