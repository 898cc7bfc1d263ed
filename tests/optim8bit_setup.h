// What the 8-bit optimizer's tests share: parameters of several shapes, gradients that
// change size from step to step, the chunking and the state of one parameter.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <iostream>
#include <sstream>
#include <tuple>
#include <vector>

#include "compat.h"
#include "frugal/optim/adam.h"
#include "frugal/optim/adam8bit.h"
#include "frugal/optim/blockwise.h"
#include "helpers.h"
#include "optim/codebook.h"

namespace frugal::testing::optim8bit {

namespace to = torch::optim;
namespace fo = frugal::optim;
// The helpers every optimizer test file takes, with `using namespace` on this namespace.
using frugal::testing::clone_params;
using frugal::testing::expect_error_contains;
using frugal::testing::set_grads;
using frugal::testing::step_overhead;

// Parameters of several shapes: large ones of several chunks and blocks (one with a short
// last block), a small one (float32 states), one not contiguous (stepped whole).
inline std::vector<torch::Tensor> make_8bit_params() {
  torch::manual_seed(11);
  auto strided = torch::randn({100, 50}).t();
  return {torch::randn({64, 75}).requires_grad_(), torch::randn({9000}).requires_grad_(),
          torch::randn({75}).requires_grad_(), strided.detach().requires_grad_()};
}

// Gradients of a size that changes from step to step.
inline void set_growing_grads(std::vector<torch::Tensor>& params, int step) {
  frugal::testing::set_grads(params, step, 1 + step % 3);
}

// Runs steps [from, to) of every optimizer in `optimizers`, each after growing gradients
// (set_growing_grads) on every list in `params`.
template <typename... Optimizers>
void step_together(int from, int to, std::initializer_list<std::vector<torch::Tensor>*> params,
                   Optimizers&... optimizers) {
  for (int step = from; step < to; ++step) {
    for (auto* p : params) {
      set_growing_grads(*p, step);
    }
    (optimizers.step(), ...);
  }
}

inline double max_abs_diff(const std::vector<torch::Tensor>& a,
                           const std::vector<torch::Tensor>& b) {
  double most = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    most = std::max(most, (a[i] - b[i]).abs().max().item<double>());
  }
  return most;
}

// Chunks of three blocks: the 9000-element parameter takes four, the last one partial.
inline const fo::InPlaceOptions kChunks = fo::InPlaceOptions().chunk(768);

// The factored second moment on every matrix, however small.
inline const auto kFactored = fo::QuantizedStateOptions().factored(true).min_elements(0);

// A module holding `params`, for the ledger (p0, p1, ...).
struct ParamsModule : torch::nn::Module {
  explicit ParamsModule(const std::vector<torch::Tensor>& params) {
    for (std::size_t i = 0; i < params.size(); ++i) {
      std::ostringstream name;
      name << "p" << i;
      register_parameter(name.str(), params[i]);
    }
  }
};

inline fo::Adam8bitParamState& state_of(to::Optimizer& o, const torch::Tensor& p) {
  return static_cast<fo::Adam8bitParamState&>(
      *o.state().at(frugal::compat::optimizer_state_key(p)));
}

// The float32 values a quantized state's first (`first`) or second moment stands for,
// shaped like `param`.
inline torch::Tensor moment_values(const fo::Adam8bitParamState& s, bool first,
                                   const torch::Tensor& param) {
  const fo::BlockwiseCodes q(first ? s.exp_avg() : s.exp_avg_sq(),
                             first ? s.exp_avg_scales() : s.exp_avg_sq_scales(), s.block(),
                             param.sizes().vec());
  return fo::dequantize_blockwise(q, fo::moment_map(first, static_cast<int>(s.bits())));
}

// One code per element, as int32: 8-bit codes as they are, 4-bit ones out of their bytes.
inline torch::Tensor code_per_element(const torch::Tensor& codes, std::int64_t bits,
                                      std::int64_t n) {
  const auto flat = codes.reshape(-1).to(torch::kInt);
  if (bits == 8) {
    return flat;
  }
  return torch::stack({flat.bitwise_and(15), flat.bitwise_right_shift(4)}, 1)
      .reshape(-1)
      .narrow(0, 0, n);
}

// How far one quantized step is from float32 Adam's from the same state (see
// Optim8bit.OneStepFromTheSameStateIsFloat32AdamsStep): the largest update difference, over
// the largest update, and how far any new state lies beyond its nearest code (with
// stochastic codes: beyond the nearer of the two codes around it), over its block's scale.
struct OneStepGap {
  double update = 0, state = 0;
};

inline OneStepGap one_step_gap(const fo::QuantizedStateOptions& q) {
  auto params8 = make_8bit_params();
  fo::Adam8bit adam8(params8, to::AdamOptions(1e-2).weight_decay(1e-3), q, kChunks);
  for (int step = 0; step < 5; ++step) {
    set_growing_grads(params8, step);
    adam8.step();
  }
  auto params32 = frugal::testing::clone_params(params8);
  fo::Adam adam32(params32, to::AdamOptions(1e-2).weight_decay(1e-3), kChunks);
  set_growing_grads(params32, 99);
  adam32.step();  // makes the states, then overwritten with the quantized ones' values
  const auto float_state = [&](std::size_t i) -> to::AdamParamState& {
    return static_cast<to::AdamParamState&>(
        *adam32.state().at(frugal::compat::optimizer_state_key(params32[i])));
  };
  for (std::size_t i = 0; i < params8.size(); ++i) {
    params32[i].detach().copy_(params8[i].detach());
    auto& s8 = state_of(adam8, params8[i]);
    float_state(i).step(s8.step());
    float_state(i).exp_avg().copy_(moment_values(s8, true, params8[i]));
    float_state(i).exp_avg_sq().copy_(moment_values(s8, false, params8[i]));
  }
  const auto before = frugal::testing::clone_params(params8);
  set_growing_grads(params8, 5);
  set_growing_grads(params32, 5);
  adam8.step();
  adam32.step();
  OneStepGap gap;
  const auto block = q.block();
  for (std::size_t i = 0; i < params8.size(); ++i) {
    const auto update8 = params8[i] - before[i], update32 = params32[i] - before[i];
    gap.update = std::max(gap.update,
                          ((update8 - update32).abs().max() / update32.abs().max()).item<double>());
    auto& s8 = state_of(adam8, params8[i]);
    for (const auto& [first, scales, exact] :
         {std::make_tuple(true, s8.exp_avg_scales(), float_state(i).exp_avg()),
          std::make_tuple(false, s8.exp_avg_sq_scales(), float_state(i).exp_avg_sq())}) {
      // Each scale is the block's largest magnitude, and each value the nearest code to the
      // float32 state's, or one of the two around it (up to the rounding above).
      const auto flat = exact.contiguous().view(-1);
      const auto blocks = (flat.numel() + block - 1) / block;
      const auto padded = torch::cat({flat.abs(), torch::zeros({blocks * block - flat.numel()})});
      EXPECT_TRUE(
          torch::allclose(scales, std::get<0>(padded.view({blocks, block}).max(1)), 1e-5, 0));
      const auto scale = scales.repeat_interleave(block).narrow(0, 0, flat.numel());
      const auto values = moment_values(s8, first, params8[i]).contiguous().view(-1);
      const auto error = (values - flat).abs() / scale;
      const auto map = fo::moment_map(first, q.bits());
      const auto excess = q.stochastic_codes()
                              ? frugal::testing::bracket_distance(values / scale, flat / scale, map)
                              : error - frugal::testing::nearest_distance(flat / scale, map);
      gap.state = std::max(gap.state, excess.max().item<double>());
    }
  }
  return gap;
}

// one_step_gap under `q`, printed after `label` and held to float rounding: updates within
// 1e-4 of float32 Adam's, states within 1e-5 of a scale of their nearest codes.
inline void expect_one_step_is_adams(const fo::QuantizedStateOptions& q, const char* label) {
  const auto gap = one_step_gap(q);
  std::cout << label << " one step from the same state: largest update difference " << gap.update
            << " of the update; states at most " << gap.state << " (of the scale) beyond the "
            << (q.stochastic_codes() ? "two codes around it" : "nearest code") << "\n";
  EXPECT_LE(gap.update, 1e-4);
  EXPECT_LE(gap.state, 1e-5);
}

// The fused CPU step against the tensor-ops step (the same values in a transposed layout)
// after 20 AdamW steps on a 150 x 60 parameter: the weights' largest difference over their
// largest magnitude, and how the first moment's codes differ.
struct FusedAgreement {
  double weights = 0;  ///< the largest difference of the weights, over the largest weight
  /// Weights further apart than 1e-5 of the largest weight.
  std::int64_t weights_differing = 0;
  std::int64_t codes_apart = 0, codes_differing = 0, codes = 0;
};

inline FusedAgreement fused_against_tensor_ops(const fo::QuantizedStateOptions& q) {
  torch::manual_seed(12);
  auto fused = std::vector<torch::Tensor>{torch::randn({150, 60}).requires_grad_()};
  auto strided =
      std::vector<torch::Tensor>{fused[0].detach().t().contiguous().t().requires_grad_()};
  EXPECT_FALSE(strided[0].is_contiguous());
  fo::AdamW8bit a(fused, to::AdamWOptions(1e-2).weight_decay(0.01), q, kChunks);
  fo::AdamW8bit b(strided, to::AdamWOptions(1e-2).weight_decay(0.01), q, kChunks);
  for (int step = 0; step < 20; ++step) {
    set_growing_grads(fused, step);
    strided[0].mutable_grad() = fused[0].grad().t().contiguous().t();
    a.step();
    b.step();
  }
  FusedAgreement out;
  out.weights = ((fused[0] - strided[0]).abs().max() / fused[0].abs().max()).item<double>();
  const auto n = fused[0].numel();
  const auto apart = (code_per_element(state_of(a, fused[0]).exp_avg(), q.bits(), n) -
                      code_per_element(state_of(b, strided[0]).exp_avg(), q.bits(), n))
                         .abs();
  out.codes_apart = apart.max().item<std::int64_t>();
  out.codes_differing = (apart > 0).sum().item<std::int64_t>();
  out.codes = apart.numel();
  return out;
}

// The tensor-ops step on CUDA against the fused CPU step after 20 AdamW steps on a 150 x 60
// parameter, as fused_against_tensor_ops compares them (a CUDA device must exist).
inline FusedAgreement cuda_against_fused_cpu(const fo::QuantizedStateOptions& q) {
  torch::manual_seed(13);
  std::vector<torch::Tensor> cpu{torch::randn({150, 60}).requires_grad_()};
  std::vector<torch::Tensor> cuda{cpu[0].detach().to(torch::kCUDA).requires_grad_()};
  fo::AdamW8bit a(cpu, to::AdamWOptions(1e-2).weight_decay(0.01), q, kChunks);
  fo::AdamW8bit b(cuda, to::AdamWOptions(1e-2).weight_decay(0.01), q, kChunks);
  for (int step = 0; step < 20; ++step) {
    set_growing_grads(cpu, step);
    cuda[0].mutable_grad() = cpu[0].grad().to(torch::kCUDA);
    a.step();
    b.step();
  }
  FusedAgreement out;
  const auto here = cuda[0].detach().cpu();
  const auto relative = (cpu[0] - here).abs() / cpu[0].abs().max();
  out.weights = relative.max().item<double>();
  out.weights_differing = (relative > 1e-5).sum().item<std::int64_t>();
  const auto n = cpu[0].numel();
  const auto apart = (code_per_element(state_of(a, cpu[0]).exp_avg(), q.bits(), n) -
                      code_per_element(state_of(b, cuda[0]).exp_avg().cpu(), q.bits(), n))
                         .abs();
  out.codes_apart = apart.max().item<std::int64_t>();
  out.codes_differing = (apart > 0).sum().item<std::int64_t>();
  out.codes = apart.numel();
  return out;
}

// What the CUDA step must agree with the fused CPU step on. CUDA may contract a multiply and
// an add into one rounding (FMA) where the CPU rounds twice: a state's code then flips to its
// neighbour, which moves its weight by about 1e-4 of the largest over the remaining steps.
// Such weights are as rare as flipped codes; the others agree within float32 rounding.
inline void expect_cuda_agrees(const FusedAgreement& agree) {
  EXPECT_LE(agree.weights, 1e-3);
  EXPECT_LE(agree.weights_differing, agree.codes / 100);
  EXPECT_LE(agree.codes_apart, 1);
  EXPECT_LE(agree.codes_differing, agree.codes / 100);
}

// A linear model (64 inputs, `outputs` outputs, from zeros) fitted to noisy targets by
// `steps` full-batch steps of the optimizer `make(params)` returns: the mean squared error
// at the start and after the last step.
struct LeastSquares {
  float start = 0, loss = 0;
};

template <typename Make>
LeastSquares least_squares(Make make, std::int64_t outputs, int steps) {
  torch::manual_seed(5);
  const auto x = torch::randn({512, 64});
  const auto truth = torch::randn({64, outputs});
  const auto y = x.mm(truth) + 0.1 * torch::randn({512, outputs});
  torch::manual_seed(6);
  std::vector<torch::Tensor> w{torch::zeros({64, outputs}).requires_grad_()};
  auto optimizer = make(w);
  LeastSquares out;
  out.start = y.pow(2).mean().item<float>();
  for (int step = 0; step < steps; ++step) {
    w[0].mutable_grad() = torch::Tensor();
    auto l = (x.mm(w[0]) - y).pow(2).mean();
    l.backward();
    optimizer->step();
    out.loss = l.item<float>();
  }
  return out;
}

}  // namespace frugal::testing::optim8bit
