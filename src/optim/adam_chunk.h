// One chunk of Adam's update in tensor operations, in LibTorch's order: shared by frugal's
// Adam and AdamW and by the tensor-ops step of their 8-bit versions.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>

namespace frugal::optim::detail {

/// The step's constants.
struct AdamChunkStep {
  double beta1 = 0, beta2 = 0, lr = 0, weight_decay = 0, eps = 0;
  double bias_correction2 = 1, step_size = 0;
  bool decoupled = false;  ///< AdamW: the parameter shrunk first; Adam: L2 decay joins the gradient
  bool fresh = false;      ///< the moments hold no values yet: they start from zeros
};

/// The constants of step `step` (counted from 1) under Adam's or AdamW's options.
template <typename Options>
AdamChunkStep adam_chunk_step(const Options& o, std::int64_t step, bool decoupled, bool fresh) {
  AdamChunkStep s;
  std::tie(s.beta1, s.beta2) = o.betas();
  s.lr = o.lr();
  s.weight_decay = o.weight_decay();
  s.eps = o.eps();
  s.bias_correction2 = 1 - std::pow(s.beta2, step);
  s.step_size = o.lr() / (1 - std::pow(s.beta1, step));
  s.decoupled = decoupled;
  s.fresh = fresh;
  return s;
}

/// Updates the moments `m`, `v` (and AMSGrad's running maximum `v_max`, if defined) and
/// the parameter `p` in place, allocating no tensor. `decayed` receives the L2-decayed
/// gradient and `denom` the denominator; they may be one buffer (the decayed gradient is
/// used up before the denominator is made).
inline void adam_chunk(at::Tensor p, at::Tensor grad, const at::Tensor& m, const at::Tensor& v,
                       at::Tensor v_max, at::Tensor decayed, at::Tensor denom,
                       const AdamChunkStep& s) {
  if (s.weight_decay != 0) {
    if (s.decoupled) {
      p.mul_(1 - s.lr * s.weight_decay);
    } else {
      at::add_out(decayed, grad, p, s.weight_decay);
      grad = decayed;
    }
  }
  if (s.fresh) {  // torch starts the moments from zeros
    m.zero_();
    v.zero_();
  }
  m.mul_(s.beta1).add_(grad, 1 - s.beta1);
  v.mul_(s.beta2).addcmul_(grad, grad, 1 - s.beta2);
  if (v_max.defined()) {
    if (s.fresh) {
      v_max.zero_();
    }
    at::max_out(v_max, v, v_max);
    at::sqrt_out(denom, v_max);
  } else {
    at::sqrt_out(denom, v);
  }
  denom.div_(std::sqrt(s.bias_correction2)).add_(s.eps);
  p.addcdiv_(m, denom, -s.step_size);
}

}  // namespace frugal::optim::detail
