#include "frugal/optim/adam.h"

#include <torch/torch.h>

#include "adam_bf16_kernel.h"
#include "adam_chunk.h"

namespace frugal::optim {
namespace {

// Adam's state for `param`, of either kind (AdamParamState or AdamWParamState).
template <typename State>
std::unique_ptr<torch::optim::OptimizerParamState> adam_state(const torch::Tensor& param,
                                                              bool amsgrad) {
  auto state = std::make_unique<State>();
  state->step(0);
  state->exp_avg(torch::empty_like(param, torch::MemoryFormat::Preserve));
  state->exp_avg_sq(torch::empty_like(param, torch::MemoryFormat::Preserve));
  if (amsgrad) {
    state->max_exp_avg_sq(torch::empty_like(param, torch::MemoryFormat::Preserve));
  }
  return state;
}

// One step of Adam (coupled: L2 weight decay added to the gradient) or AdamW (decoupled:
// the parameter shrunk first), in LibTorch's order of operations, chunk by chunk.
template <typename State, typename Options>
void adam_update(ParamUpdate& u, const Options& o, bool decoupled) {
  auto& state = static_cast<State&>(*u.state);
  state.step(state.step() + 1);
  const auto step = detail::adam_chunk_step(o, state.step(), decoupled, u.fresh);
  // bfloat16 weights and moments on the CPU: one fused pass (AMSGrad: tensor operations).
  if (u.param.scalar_type() == torch::kBFloat16 && !o.amsgrad() &&
      detail::fused_cpu(u, detail::kAdamBf16Block) &&
      state.exp_avg().scalar_type() == torch::kBFloat16 && state.exp_avg().is_contiguous() &&
      state.exp_avg_sq().scalar_type() == torch::kBFloat16 && state.exp_avg_sq().is_contiguous()) {
    const auto bits = [](const torch::Tensor& t) {
      return reinterpret_cast<std::uint16_t*>(t.data_ptr<at::BFloat16>());
    };
    detail::adam_bf16_cpu(detail::fused_weights(u), bits(state.exp_avg()), bits(state.exp_avg_sq()),
                          u.numel(), detail::adam_scalars(step));
    return;
  }
  // Scratch: the denominator, and Adam's decayed gradient when it has weight decay.
  const std::size_t decayed = !decoupled && o.weight_decay() != 0 ? 1 : 0;
  for_each_chunk(u, [&](std::int64_t offset, std::int64_t n) {
    auto p = u.weights(offset, n);
    detail::adam_chunk(p, u.part(u.grad, offset, n), u.part(state.exp_avg(), offset, n),
                       u.part(state.exp_avg_sq(), offset, n),
                       o.amsgrad() ? u.part(state.max_exp_avg_sq(), offset, n) : torch::Tensor(),
                       u.scratch_part(decayed, n), u.scratch_part(0, n), step);
    u.store_weights(p, offset, n);
  });
}

}  // namespace

using torch::optim::AdamOptions;
using torch::optim::AdamParamState;
using torch::optim::AdamWOptions;
using torch::optim::AdamWParamState;

namespace detail {

struct AdamRule {
  static std::unique_ptr<torch::optim::OptimizerParamState> make_state(const torch::Tensor& param,
                                                                       const AdamOptions& o) {
    return adam_state<AdamParamState>(param, o.amsgrad());
  }
  static int scratch_buffers(const AdamOptions& o) { return o.weight_decay() != 0 ? 2 : 1; }
  static void update(ParamUpdate& u, const AdamOptions& o) {
    adam_update<AdamParamState>(u, o, false);
  }
};

struct AdamWRule {
  static std::unique_ptr<torch::optim::OptimizerParamState> make_state(const torch::Tensor& param,
                                                                       const AdamWOptions& o) {
    return adam_state<AdamWParamState>(param, o.amsgrad());
  }
  static int scratch_buffers(const AdamWOptions&) { return 1; }
  static void update(ParamUpdate& u, const AdamWOptions& o) {
    adam_update<AdamWParamState>(u, o, true);
  }
};

}  // namespace detail

template class InPlace<torch::optim::Adam, AdamOptions, detail::AdamRule>;
template class InPlace<torch::optim::AdamW, AdamWOptions, detail::AdamWRule>;

}  // namespace frugal::optim
