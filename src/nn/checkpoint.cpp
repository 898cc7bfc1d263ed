#include "frugal/nn/checkpoint.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include "call_choice.h"
#include "frugal/error.h"
#include "module_registry.h"

namespace frugal::nn {
namespace detail {
namespace {

ModuleRegistry<CallChoice>& registry() {
  // Never destroyed: policies may outlive static teardown.
  static auto* r = new ModuleRegistry<CallChoice>();
  return *r;
}

}  // namespace

void add_call_choice(const torch::nn::Module* module, std::shared_ptr<CallChoice> choice) {
  registry().add(module, std::move(choice), "is already chosen by another CheckpointPolicy");
}

void remove_call_choice(const torch::nn::Module* module) { registry().remove(module); }

}  // namespace detail

std::shared_ptr<const CheckpointOptions> checkpoint_choice(const torch::nn::Module& module) {
  const auto choice = detail::registry().find(module);
  if (choice == nullptr) {
    return nullptr;
  }
  choice->calls.fetch_add(1);
  if (!choice->enabled.load()) {
    return nullptr;
  }
  return std::shared_ptr<const CheckpointOptions>(choice, &choice->options);
}

CheckpointImpl::CheckpointImpl(torch::nn::AnyModule module, CheckpointOptions options)
    : module_(std::move(module)), options_(std::move(options)) {
  FRUGAL_CHECK(!module_.is_empty(), "frugal: nn::Checkpoint needs a module");
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
             {input},
             CheckpointOptions(options_)
                 .params(module_.ptr()->parameters())
                 .buffers(training_buffers(*module_.ptr())))
      .at(0);
}

}  // namespace frugal::nn
