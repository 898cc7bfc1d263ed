// The autograd hooks of compat.h, for each LibTorch version.
#include <c10/util/Exception.h>
#include <new>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

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

// Autograd calls it with the leaf itself, so it holds no reference to the leaf.
struct PostAccumulate : torch::autograd::PostAccumulateGradHook {
  explicit PostAccumulate(GradAccumulatedHook::Fn fn) : fn(std::move(fn)) {}
  void operator()(const Variable& leaf) override { fn(leaf); }
  GradAccumulatedHook::Fn fn;
};

class Installed : public GradAccumulatedHook {
 public:
  Installed(const at::Tensor& leaf, Fn fn) : leaf_(leaf) {
    auto& slot = torch::autograd::impl::post_acc_grad_hooks(leaf);
    FRUGAL_CHECK(slot == nullptr, "frugal: the tensor has a post-accumulate-grad hook already "
                 "(one per tensor): another Trainer or policy is hooked to it");
    torch::autograd::impl::set_post_acc_grad_hooks(leaf, std::make_unique<PostAccumulate>(std::move(fn)));
  }
  ~Installed() override { torch::autograd::impl::set_post_acc_grad_hooks(leaf_, nullptr); }

 private:
  at::Tensor leaf_;
};

#else

// A post hook of the gradient accumulator, which runs after it has accumulated into the
// leaf's .grad. The accumulator holds the leaf, the hook holds the accumulator: the leaf
// itself refers to its accumulator only weakly, so there is no cycle.
struct AccumulatorPostHook : torch::autograd::FunctionPostHook {
  AccumulatorPostHook(at::Tensor leaf, GradAccumulatedHook::Fn fn)
      : leaf(std::move(leaf)), fn(std::move(fn)) {}
  variable_list operator()(const variable_list& outputs, const variable_list&) override {
    fn(leaf);
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
#if FRUGAL_TORCH_AT_LEAST(2, 1)
  (void)leaf;
#else
  const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(leaf);
  if (accumulator == nullptr || accumulator->num_inputs() != 1) {
    return;
  }
  // InputMetadata has a const member, so it is made again in place.
  auto& metadata = const_cast<torch::autograd::InputMetadata&>(accumulator->input_metadata(0));
  metadata.~InputMetadata();
  new (&metadata) torch::autograd::InputMetadata(leaf);
#endif
}

std::unique_ptr<GradAccumulatedHook> on_grad_accumulated(const at::Tensor& leaf,
                                                         GradAccumulatedHook::Fn fn) {
  check_leaf(leaf);
  FRUGAL_CHECK(fn != nullptr, "frugal: a gradient-ready hook needs a function");
  return std::make_unique<Installed>(leaf, std::move(fn));
}

}  // namespace frugal::compat
