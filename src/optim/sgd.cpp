#include "frugal/optim/sgd.h"

#include <torch/torch.h>

namespace frugal::optim {

using torch::optim::SGDOptions;
using torch::optim::SGDParamState;

namespace detail {

struct SGDRule {
  static std::unique_ptr<torch::optim::OptimizerParamState> make_state(const torch::Tensor& param,
                                                                       const SGDOptions& o);
  static int scratch_buffers(const SGDOptions& o);
  static void update(ParamUpdate& u, const SGDOptions& o);
};

std::unique_ptr<torch::optim::OptimizerParamState> SGDRule::make_state(const torch::Tensor& param,
                                                                       const SGDOptions& o) {
  if (o.momentum() == 0) {
    return nullptr;
  }
  auto state = std::make_unique<SGDParamState>();
  state->momentum_buffer(torch::empty_like(param, torch::MemoryFormat::Preserve));
  return state;
}

int SGDRule::scratch_buffers(const SGDOptions& o) {
  // 0: the gradient with weight decay; 1: the Nesterov direction.
  return o.momentum() != 0 && o.nesterov() ? 2 : (o.weight_decay() != 0 ? 1 : 0);
}

void SGDRule::update(ParamUpdate& u, const SGDOptions& o) {
  const auto* state = static_cast<SGDParamState*>(u.state);
  for_each_chunk(u, [&](std::int64_t offset, std::int64_t n) {
    auto p = u.weights(offset, n);
    auto d = u.part(u.grad, offset, n);
    if (o.weight_decay() != 0) {
      auto decayed = u.scratch_part(0, n);
      at::add_out(decayed, d, p, o.weight_decay());
      d = decayed;
    }
    if (o.momentum() != 0) {
      auto buf = u.part(state->momentum_buffer(), offset, n);
      if (u.fresh) {
        buf.copy_(d);
      } else {
        buf.mul_(o.momentum()).add_(d, 1 - o.dampening());
      }
      if (o.nesterov()) {
        auto ahead = u.scratch_part(1, n);
        at::add_out(ahead, d, buf, o.momentum());
        d = ahead;
      } else {
        d = buf;
      }
    }
    p.add_(d, -1 * o.lr());
    u.store_weights(p, offset, n);
  });
}

}  // namespace detail

template class InPlace<torch::optim::SGD, SGDOptions, detail::SGDRule>;

}  // namespace frugal::optim
