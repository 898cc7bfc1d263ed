#include "frugal/nn/checkpoint.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

namespace frugal::nn {

CheckpointImpl::CheckpointImpl(torch::nn::AnyModule module, CheckpointOptions options)
    : module_(std::move(module)), options_(std::move(options)) {
  TORCH_CHECK(!module_.is_empty(), "frugal: nn::Checkpoint needs a module");
  register_module("module", module_.ptr());
}

torch::Tensor CheckpointImpl::forward(const torch::Tensor& input) {
  if (!enabled_ || !torch::GradMode::is_enabled()) {
    return module_.forward(input);
  }
  auto module = module_;
  return checkpoint_tensors(
             [module](const std::vector<torch::Tensor>& in) mutable {
               return std::vector<torch::Tensor>{module.forward(in.at(0))};
             },
             {input}, CheckpointOptions(options_).params(module_.ptr()->parameters()))
      .at(0);
}

}  // namespace frugal::nn
