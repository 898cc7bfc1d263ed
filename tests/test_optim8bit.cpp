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
#include "optim8bit_setup.h"

namespace {

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
    adam8.set_state_format(fo::StateFormat{});  // float32
    adamw8.set_state_format(fo::StateFormat{});
    step_together(0, 20, {&a, &b, &c, &d}, adam, adam8, adamw, adamw8);
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
  expect_one_step_is_adams(fo::QuantizedStateOptions().min_elements(0), "[ 8-bit    ]");
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
  const auto agree = fused_against_tensor_ops({});
  std::cout << "[ 8-bit    ] fused vs tensor ops after 20 steps: parameters " << agree.weights
            << " apart (of the largest), " << agree.codes_differing << " of " << agree.codes
            << " first-moment codes differ\n";
  EXPECT_LE(agree.weights, 1e-5);
  EXPECT_LE(agree.codes_apart, 1);
  EXPECT_LE(agree.codes_differing, agree.codes / 100);
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
  EXPECT_EQ(adam8.pending_state_bytes(adam8.state_format()), expected);
  std::int64_t numel = 0;
  for (const auto& p : params) {
    numel += p.numel();
  }
  EXPECT_EQ(adam8.pending_state_bytes(fo::StateFormat{}), 8 * numel);
  set_growing_grads(params, 0);
  const auto before = probe.allocated();
  adam8.step();
  EXPECT_EQ(probe.allocated() - before, expected);  // the step keeps nothing else
  EXPECT_EQ(frugal::measure_ledger(probe, holder, &adam8).optimizer, expected);
  EXPECT_EQ(adam8.pending_state_bytes(adam8.state_format()), 0);
  EXPECT_THROW(adam8.set_state_format(fo::StateFormat{}), c10::Error);
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
  const auto agree = cuda_against_fused_cpu({});
  expect_cuda_agrees(agree);
}

}  // namespace
