#include "frugal/nn/checkpoint.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <mutex>
#include <unordered_map>

#include "call_choice.h"
#include "frugal/error.h"

namespace frugal::nn {
namespace detail {
namespace {

struct Registry {
  std::mutex mutex;
  std::unordered_map<const torch::nn::Module*, std::shared_ptr<CallChoice>> chosen;
};

Registry& registry() {
  static auto* r = new Registry();  // never destroyed: policies may outlive static teardown
  return *r;
}

}  // namespace

void add_call_choice(const torch::nn::Module* module, std::shared_ptr<CallChoice> choice) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  FRUGAL_CHECK(r.chosen.emplace(module, std::move(choice)).second, "frugal: module '",
               module->name(), "' is already chosen by another CheckpointPolicy");
}

void remove_call_choice(const torch::nn::Module* module) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.chosen.erase(module);
}

}  // namespace detail

std::shared_ptr<const CheckpointOptions> checkpoint_choice(const torch::nn::Module& module) {
  auto& r = detail::registry();
  using detail::CallChoice;
  std::shared_ptr<CallChoice> choice;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (r.chosen.empty()) {
      return nullptr;
    }
    const auto found = r.chosen.find(&module);
    if (found == r.chosen.end()) {
      return nullptr;
    }
    choice = found->second;
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
