// Adam through LibTorch's fused CPU kernel (at::_fused_adam_, LibTorch 2.4 and later): the
// kernel PyTorch-Python's torch.optim.Adam(fused=True) runs, one call for all parameters.
// For the benchmarks only, so that C++ and Python can be compared on the same kernel; the
// moments live in LibTorch's AdamParamState, where the ledger finds them.
#pragma once

#include <torch/torch.h>

#include <unordered_map>
#include <vector>

#define FRUGAL_BENCH_HAS_FUSED_ADAM \
  (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4))

#if FRUGAL_BENCH_HAS_FUSED_ADAM
namespace bench {

class FusedAdam : public torch::optim::Optimizer {
 public:
  FusedAdam(std::vector<torch::Tensor> params, torch::optim::AdamOptions options)
      : Optimizer(std::move(params), std::make_unique<torch::optim::AdamOptions>(options)) {}

  torch::Tensor step(LossClosure closure = nullptr) override {
    TORCH_CHECK(!closure, "FusedAdam takes no closure");
    torch::NoGradGuard no_grad;
    const auto& o = static_cast<const torch::optim::AdamOptions&>(param_groups_[0].options());
    std::vector<torch::Tensor> params, grads, avgs, avg_sqs, steps;
    for (auto& p : param_groups_[0].params()) {
      if (!p.grad().defined()) {
        continue;
      }
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto s = std::make_unique<torch::optim::AdamParamState>();
        s->exp_avg(torch::zeros_like(p));
        s->exp_avg_sq(torch::zeros_like(p));
        slot = std::move(s);
      }
      auto& s = static_cast<torch::optim::AdamParamState&>(*slot);
      auto& count = steps_[p.unsafeGetTensorImpl()];
      if (!count.defined()) {
        count = torch::zeros({}, torch::kFloat);  // PyTorch keeps the step as a tensor too
      }
      params.push_back(p);
      grads.push_back(p.grad());
      avgs.push_back(s.exp_avg());
      avg_sqs.push_back(s.exp_avg_sq());
      steps.push_back(count);
    }
    at::_foreach_add_(steps, 1);  // as PyTorch does before the kernel, which reads the count
    at::_fused_adam_(params, grads, avgs, avg_sqs, {}, steps, o.lr(), std::get<0>(o.betas()),
                     std::get<1>(o.betas()), o.weight_decay(), o.eps(), /*amsgrad=*/false,
                     /*maximize=*/false);
    return {};
  }

 private:
  std::unordered_map<const void*, torch::Tensor> steps_;
};

}  // namespace bench
#endif
