// The autograd hooks of compat.h, for each LibTorch version.
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <new>
#include <utility>
#include <vector>

#include "compat.h"
#include "frugal/error.h"

namespace frugal::compat {
namespace {

using torch::autograd::Variable;
using torch::autograd::variable_list;

void check_leaf(const at::Tensor& leaf) {
  FRUGAL_CHECK(leaf.defined() && leaf.requires_grad() && leaf.is_leaf(),
               "frugal: a gradient-ready hook needs a leaf tensor that requires grad");
}

#if FRUGAL_TORCH_AT_LEAST(2, 1)

// Autograd calls it with the leaf itself, so it holds no reference to the leaf. A tensor has
// one slot for such a hook; frugal's hooks on one tensor (the trainer's, a sharded
// optimizer's) share it as a list, in the order they were installed.
struct PostAccumulate : torch::autograd::PostAccumulateGradHook {
  void operator()(const Variable& leaf) override {
    for (std::size_t k = 0; k < fns.size(); ++k) {
      fns[k].second(leaf);
    }
  }
  std::vector<std::pair<std::uint64_t, GradAccumulatedHook::Fn>> fns;
};

class Installed : public GradAccumulatedHook {
 public:
  Installed(const at::Tensor& leaf, Fn fn) : leaf_(leaf) {
    auto& slot = torch::autograd::impl::post_acc_grad_hooks(leaf);
    if (slot == nullptr) {
      torch::autograd::impl::set_post_acc_grad_hooks(leaf, std::make_unique<PostAccumulate>());
    }
    auto* list =
        dynamic_cast<PostAccumulate*>(torch::autograd::impl::post_acc_grad_hooks(leaf).get());
    FRUGAL_CHECK(list != nullptr,
                 "frugal: the tensor has a post-accumulate-grad hook already "
                 "that is not frugal's (one slot per tensor)");
    static std::atomic<std::uint64_t> next_key{0};
    key_ = ++next_key;
    list->fns.emplace_back(key_, std::move(fn));
  }
  ~Installed() override {
    auto* list =
        dynamic_cast<PostAccumulate*>(torch::autograd::impl::post_acc_grad_hooks(leaf_).get());
    if (list == nullptr) {
      return;
    }
    auto& fns = list->fns;
    fns.erase(std::remove_if(fns.begin(), fns.end(),
                             [this](const auto& entry) { return entry.first == key_; }),
              fns.end());
    if (fns.empty()) {
      torch::autograd::impl::set_post_acc_grad_hooks(leaf_, nullptr);
    }
  }

 private:
  at::Tensor leaf_;
  std::uint64_t key_ = 0;
};

#else

// A post hook of the gradient accumulator, which runs after it has accumulated into the
// leaf's .grad. The accumulator holds the leaf, the hook holds the accumulator: the leaf
// itself refers to its accumulator only weakly, so there is no cycle.
struct AccumulatorPostHook : torch::autograd::FunctionPostHook {
  AccumulatorPostHook(at::Tensor leaf, GradAccumulatedHook::Fn fn)
      : leaf(std::move(leaf)), fn(std::move(fn)) {}
  variable_list operator()(const variable_list& outputs, const variable_list& inputs) override {
    // Given no gradient (a checkpoint that accumulated its parameters' gradients itself),
    // the accumulator added nothing: as LibTorch 2 does, the hook does not run.
    if (!inputs.empty() && inputs[0].defined()) {
      fn(leaf);
    }
    return outputs;
  }
  at::Tensor leaf;
  GradAccumulatedHook::Fn fn;
};

class Installed : public GradAccumulatedHook {
 public:
  Installed(const at::Tensor& leaf, Fn fn)
      : accumulator_(torch::autograd::impl::grad_accumulator(leaf)) {
    FRUGAL_CHECK(accumulator_ != nullptr, "frugal: the tensor has no gradient accumulator");
    key_ = accumulator_->add_post_hook(std::make_unique<AccumulatorPostHook>(leaf, std::move(fn)));
  }
  ~Installed() override { accumulator_->del_post_hook(key_); }

 private:
  std::shared_ptr<torch::autograd::Node> accumulator_;
  std::uintptr_t key_ = 0;
};

#endif

}  // namespace

void refresh_grad_accumulator(const at::Tensor& leaf) {
  const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(leaf);
  if (accumulator == nullptr || accumulator->num_inputs() != 1) {
    return;
  }
  // InputMetadata has a const member, so it is made again in place.
  auto& metadata = const_cast<torch::autograd::InputMetadata&>(accumulator->input_metadata(0));
  metadata.~InputMetadata();
  new (&metadata) torch::autograd::InputMetadata(leaf);
}

std::unique_ptr<GradAccumulatedHook> on_grad_accumulated(const at::Tensor& leaf,
                                                         GradAccumulatedHook::Fn fn) {
  check_leaf(leaf);
  FRUGAL_CHECK(fn != nullptr, "frugal: a gradient-ready hook needs a function");
  return std::make_unique<Installed>(leaf, std::move(fn));
}

}  // namespace frugal::compat
