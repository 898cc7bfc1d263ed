// The 8-bit optimizer's arithmetic: without quantization it is Adam's step bit for bit, one step
// from the same state is float32 Adam's within the codes' spacing, small moments never round to
// zero, the fused CPU step agrees with the tensor-ops one, and its states take the bytes the
// formula says (a quarter of Adam's on the CNN).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>
#include <sstream>

#include "compat.h"
#include "fashion_mnist/models.h"
#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/ledger.h"
#include "frugal/memory/probe.h"
#include "frugal/optim/adam.h"
#include "frugal/optim/adam8bit.h"
#include "frugal/optim/blockwise.h"
#include "helpers.h"
#include "optim/codebook.h"
#include "optim8bit_setup.h"

namespace {

namespace to = torch::optim;
namespace fo = frugal::optim;
using frugal::testing::clone_params;
using frugal::testing::nearest_distance;
using frugal::testing::step_overhead;
using namespace frugal::testing::optim8bit;

TEST(Optim8bit, WithoutQuantizationTheStepIsFrugalAdamsBitForBit) {
  // Same arithmetic as Adam: with float32 states the two agree exactly, so the 8-bit
  // optimizer differs from Adam by its quantization only.
  for (const double decay : {0.0, 0.01}) {
    auto a = make_8bit_params(), b = clone_params(a), c = clone_params(a), d = clone_params(a);
    fo::Adam adam(a, to::AdamOptions(1e-2).weight_decay(decay), kChunks);
    fo::Adam8bit adam8(b, to::AdamOptions(1e-2).weight_decay(decay), {}, kChunks);
    fo::AdamW adamw(c, to::AdamWOptions(1e-2).weight_decay(decay), kChunks);
    fo::AdamW8bit adamw8(d, to::AdamWOptions(1e-2).weight_decay(decay), {}, kChunks);
    adam8.set_quantized(false);
    adamw8.set_quantized(false);
    for (int step = 0; step < 20; ++step) {
      for (auto* params : {&a, &b, &c, &d}) {
        set_growing_grads(*params, step);
      }
      adam.step();
      adam8.step();
      adamw.step();
      adamw8.step();
    }
    EXPECT_EQ(max_abs_diff(a, b), 0) << "decay " << decay;
    EXPECT_EQ(max_abs_diff(c, d), 0) << "decay " << decay;
  }
}

TEST(Optim8bit, OneStepFromTheSameStateIsFloat32AdamsStep) {
  // Run 8-bit Adam for a while, give float32 Adam the states it stands for, and take one
  // step with each from the same parameters and gradient: the parameter updates agree up to
  // float rounding (the 8-bit step's fused loop rounds a little differently from LibTorch's
  // vectorised kernels; tolerance 1e-4 of the largest update), and the new 8-bit states
  // are the new float32 ones rounded to the nearest code.
  auto params8 = make_8bit_params();
  fo::Adam8bit adam8(params8, to::AdamOptions(1e-2).weight_decay(1e-3),
                     fo::QuantizedStateOptions().min_elements(0), kChunks);
  for (int step = 0; step < 5; ++step) {
    set_growing_grads(params8, step);
    adam8.step();
  }
  auto params32 = clone_params(params8);
  fo::Adam adam32(params32, to::AdamOptions(1e-2).weight_decay(1e-3), kChunks);
  set_growing_grads(params32, 99);
  adam32.step();  // makes the states, then overwritten with the 8-bit ones' values
  const auto map_s = fo::moment_map(true), map_u = fo::moment_map(false);
  const auto float_state = [&](std::size_t i) -> to::AdamParamState& {
    return static_cast<to::AdamParamState&>(
        *adam32.state().at(frugal::compat::optimizer_state_key(params32[i])));
  };
  for (std::size_t i = 0; i < params8.size(); ++i) {
    params32[i].detach().copy_(params8[i].detach());
    auto& s8 = state_of(adam8, params8[i]);
    float_state(i).step(s8.step());
    float_state(i).exp_avg().copy_(
        fo::dequantize_blockwise({s8.exp_avg(), s8.exp_avg_scales(), 256}, map_s));
    float_state(i).exp_avg_sq().copy_(
        fo::dequantize_blockwise({s8.exp_avg_sq(), s8.exp_avg_sq_scales(), 256}, map_u));
  }
  const auto before = clone_params(params8);
  set_growing_grads(params8, 5);
  set_growing_grads(params32, 5);
  adam8.step();
  adam32.step();
  double worst = 0, worst_state = 0;
  for (std::size_t i = 0; i < params8.size(); ++i) {
    const auto update8 = params8[i] - before[i], update32 = params32[i] - before[i];
    worst =
        std::max(worst, ((update8 - update32).abs().max() / update32.abs().max()).item<double>());
    auto& s8 = state_of(adam8, params8[i]);
    for (const auto& [codes, scales, exact, map] :
         {std::make_tuple(s8.exp_avg(), s8.exp_avg_scales(), float_state(i).exp_avg(), map_s),
          std::make_tuple(s8.exp_avg_sq(), s8.exp_avg_sq_scales(), float_state(i).exp_avg_sq(),
                          map_u)}) {
      // Each scale is the block's largest magnitude, and each value the nearest code to the
      // float32 state's (up to the rounding above).
      const auto flat = exact.contiguous().view(-1);
      const auto blocks = (flat.numel() + 255) / 256;
      const auto padded = torch::cat({flat.abs(), torch::zeros({blocks * 256 - flat.numel()})});
      EXPECT_TRUE(torch::allclose(scales, std::get<0>(padded.view({blocks, 256}).max(1)), 1e-5, 0));
      const auto scale = scales.repeat_interleave(256).narrow(0, 0, flat.numel());
      const auto error =
          (fo::dequantize_blockwise({codes, scales, 256}, map).view(-1) - flat).abs() / scale;
      const auto excess = error - nearest_distance(flat / scale, map);
      worst_state = std::max(worst_state, excess.max().item<double>());
    }
  }
  std::cout << "[ 8-bit    ] one step from the same state: largest update difference " << worst
            << " of the update; states at most " << worst_state
            << " (of the scale) beyond the nearest code\n";
  EXPECT_LE(worst, 1e-4);
  EXPECT_LE(worst_state, 1e-5);
}

TEST(Optim8bit, ASmallSecondMomentNeverRoundsToZero) {
  // One large gradient beside small ones in a block: the small elements' second moments
  // are 1e-10 of the block's largest. Rounded to zero, the next step's denominator would
  // be the fresh gradient's share alone and their updates some 30x Adam's; the map
  // without zero keeps every update within Adam's.
  for (const bool fused : {true, false}) {
    auto p8 = fused ? torch::zeros({4096}) : torch::zeros({64, 64}).t();
    std::vector<torch::Tensor> params8{p8.requires_grad_()},
        params32{torch::zeros({4096}).requires_grad_()};
    fo::Adam8bit adam8(params8, to::AdamOptions(1e-3), {}, kChunks);
    fo::Adam adam32(params32, to::AdamOptions(1e-3));
    auto grad = torch::full({4096}, 1e-2);
    grad[0] = 1e3;
    for (int step = 0; step < 10; ++step) {
      params8[0].mutable_grad() = grad.view(params8[0].sizes()).clone();
      params32[0].mutable_grad() = grad.clone();
      adam8.step();
      adam32.step();
    }
    const auto small8 = params8[0].reshape(-1).narrow(0, 1, 4095).abs().max().item<double>();
    const auto small32 = params32[0].narrow(0, 1, 4095).abs().max().item<double>();
    EXPECT_LE(small8, small32 * 1.01) << (fused ? "fused" : "tensor ops");
  }
}

TEST(Optim8bit, TheFusedCpuStepAgreesWithTheTensorOpsStep) {
  // float32 contiguous parameters on the CPU take the fused loop; the same values in a
  // transposed layout take the tensor-ops step that other devices (CUDA) and dtypes use.
  torch::manual_seed(12);
  auto fused = std::vector<torch::Tensor>{torch::randn({150, 60}).requires_grad_()};
  auto strided =
      std::vector<torch::Tensor>{fused[0].detach().t().contiguous().t().requires_grad_()};
  ASSERT_FALSE(strided[0].is_contiguous());
  fo::AdamW8bit a(fused, to::AdamWOptions(1e-2).weight_decay(0.01), {}, kChunks);
  fo::AdamW8bit b(strided, to::AdamWOptions(1e-2).weight_decay(0.01), {}, kChunks);
  for (int step = 0; step < 20; ++step) {
    set_growing_grads(fused, step);
    strided[0].mutable_grad() = fused[0].grad().t().contiguous().t();
    a.step();
    b.step();
  }
  const double diff = ((fused[0] - strided[0]).abs().max() / fused[0].abs().max()).item<double>();
  const auto codes_a = state_of(a, fused[0]).exp_avg(), codes_b = state_of(b, strided[0]).exp_avg();
  const auto apart = (codes_a.to(torch::kInt) - codes_b.to(torch::kInt)).abs();
  std::cout << "[ 8-bit    ] fused vs tensor ops after 20 steps: parameters " << diff
            << " apart (of the largest), " << (apart > 0).sum().item<int64_t>() << " of "
            << apart.numel() << " first-moment codes differ\n";
  EXPECT_LE(diff, 1e-5);
  EXPECT_LE(apart.max().item<int64_t>(), 1);
  EXPECT_LE((apart > 0).sum().item<int64_t>(), apart.numel() / 100);
}

// Bytes of 8-bit Adam's state, from the format: codes (1 byte an element) and scales
// (4 bytes a block) for both moments of parameters of at least `min` elements, float32
// moments (8 bytes an element) for the others, and the two code books (511 float32 each).
std::int64_t formula_bytes(const std::vector<torch::Tensor>& params, std::int64_t min) {
  std::int64_t bytes = 2 * 511 * 4;
  for (const auto& p : params) {
    const auto n = p.numel();
    bytes += n >= min ? 2 * n + 2 * 4 * ((n + 255) / 256) : 8 * n;
  }
  return bytes;
}

TEST(Optim8bit, TheLedgerCountsTheFormulasBytes) {
  frugal::CountingAllocator::install();
  frugal::MemoryProbe probe(torch::kCPU);
  auto params = make_8bit_params();
  ParamsModule holder(params);
  fo::Adam8bit adam8(params, to::AdamOptions(1e-3));
  const auto expected = formula_bytes(params, 4096);
  EXPECT_EQ(adam8.pending_state_bytes(true), expected);
  std::int64_t numel = 0;
  for (const auto& p : params) {
    numel += p.numel();
  }
  EXPECT_EQ(adam8.pending_state_bytes(false), 8 * numel);
  set_growing_grads(params, 0);
  const auto before = probe.allocated();
  adam8.step();
  EXPECT_EQ(probe.allocated() - before, expected);  // the step keeps nothing else
  EXPECT_EQ(frugal::measure_ledger(probe, holder, &adam8).optimizer, expected);
  EXPECT_EQ(adam8.pending_state_bytes(true), 0);
  EXPECT_THROW(adam8.set_quantized(false), c10::Error);
}

TEST(Optim8bit, TheCnnsStatesTakeAQuarterOfAdams) {
  frugal::CountingAllocator::install();
  frugal::MemoryProbe probe(torch::kCPU);
  auto cnn = fashion::make_cnn(0.0);
  const auto x = torch::randn({8, 1, 28, 28});
  std::int64_t adam_bytes = 0, adam8_bytes = 0;
  {
    fo::Adam adam(cnn->parameters(), to::AdamOptions(1e-3));
    cnn->zero_grad();
    cnn->forward(x).sum().backward();
    adam.step();
    adam_bytes = frugal::measure_ledger(probe, *cnn, &adam).optimizer;
  }
  {
    fo::Adam8bit adam8(cnn->parameters(), to::AdamOptions(1e-3));
    adam8.step();
    adam8_bytes = frugal::measure_ledger(probe, *cnn, &adam8).optimizer;
    EXPECT_EQ(adam8_bytes, formula_bytes(cnn->parameters(), 4096));
  }
  const double ratio = static_cast<double>(adam8_bytes) / static_cast<double>(adam_bytes);
  std::cout << "[ 8-bit    ] CNN optimizer state: Adam " << adam_bytes << " B, Adam8bit "
            << adam8_bytes << " B (" << ratio << "x)\n";
  EXPECT_LE(ratio, 0.27);
}

}  // namespace

namespace {

TEST(CudaOptim8bit, TheTensorOpsStepOnCudaAgreesWithTheFusedCpuStep) {
  FRUGAL_SKIP_WITHOUT_CUDA();
  torch::manual_seed(13);
  std::vector<torch::Tensor> cpu{torch::randn({150, 60}).requires_grad_()};
  std::vector<torch::Tensor> cuda{cpu[0].detach().to(torch::kCUDA).requires_grad_()};
  fo::AdamW8bit a(cpu, to::AdamWOptions(1e-2).weight_decay(0.01), {}, kChunks);
  fo::AdamW8bit b(cuda, to::AdamWOptions(1e-2).weight_decay(0.01), {}, kChunks);
  for (int step = 0; step < 20; ++step) {
    set_growing_grads(cpu, step);
    cuda[0].mutable_grad() = cpu[0].grad().to(torch::kCUDA);
    a.step();
    b.step();
  }
  const auto here = cuda[0].detach().cpu();
  EXPECT_LE(((cpu[0] - here).abs().max() / cpu[0].abs().max()).item<double>(), 1e-5);
  const auto apart = (state_of(a, cpu[0]).exp_avg().to(torch::kInt) -
                      state_of(b, cuda[0]).exp_avg().cpu().to(torch::kInt))
                         .abs();
  EXPECT_LE(apart.max().item<int64_t>(), 1);
  EXPECT_LE((apart > 0).sum().item<int64_t>(), apart.numel() / 100);
}

}  // namespace
