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

namespace {

namespace to = torch::optim;
namespace fo = frugal::optim;
using frugal::testing::nearest_distance;
using frugal::testing::clone_params;
using frugal::testing::step_overhead;

// Parameters of several shapes: large ones of several chunks and blocks (one with a short
// last block), a small one (float32 states), one not contiguous (stepped whole).
std::vector<torch::Tensor> make_8bit_params() {
  torch::manual_seed(11);
  auto strided = torch::randn({100, 50}).t();
  return {torch::randn({64, 75}).requires_grad_(), torch::randn({9000}).requires_grad_(),
          torch::randn({75}).requires_grad_(), strided.detach().requires_grad_()};
}

// Gradients of a size that changes from step to step.
void set_growing_grads(std::vector<torch::Tensor>& params, int step) {
  frugal::testing::set_grads(params, step, 1 + step % 3);
}

double max_abs_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double most = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    most = std::max(most, (a[i] - b[i]).abs().max().item<double>());
  }
  return most;
}

// Chunks of three blocks: the 9000-element parameter takes four, the last one partial.
const fo::InPlaceOptions kChunks = fo::InPlaceOptions().chunk(768);

fo::Adam8bitParamState& state_of(to::Optimizer& o, const torch::Tensor& p) {
  return static_cast<fo::Adam8bitParamState&>(*o.state().at(frugal::compat::optimizer_state_key(p)));
}

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
    worst = std::max(worst, ((update8 - update32).abs().max() / update32.abs().max()).item<double>());
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
      const auto error = (fo::dequantize_blockwise({codes, scales, 256}, map).view(-1) - flat)
                             .abs() / scale;
      const auto excess = error - nearest_distance(flat / scale, map);
      worst_state = std::max(worst_state, excess.max().item<double>());
    }
  }
  std::cout << "[ 8-bit    ] one step from the same state: largest update difference "
            << worst << " of the update; states at most " << worst_state
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
    std::vector<torch::Tensor> params8{p8.requires_grad_()}, params32{torch::zeros({4096}).requires_grad_()};
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
  auto strided = std::vector<torch::Tensor>{
      fused[0].detach().t().contiguous().t().requires_grad_()};
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

struct Holder : torch::nn::Module {
  explicit Holder(const std::vector<torch::Tensor>& params) {
    for (std::size_t i = 0; i < params.size(); ++i) {
      std::ostringstream name;
      name << "p" << i;
      register_parameter(name.str(), params[i]);
    }
  }
};

TEST(Optim8bit, TheLedgerCountsTheFormulasBytes) {
  frugal::CountingAllocator::install();
  frugal::MemoryProbe probe(torch::kCPU);
  auto params = make_8bit_params();
  Holder holder(params);
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

TEST(Optim8bit, StateRoundTripsThroughTorchSaveBitForBit) {
  auto a = make_8bit_params();
  fo::AdamW8bit ours(a, to::AdamWOptions(1e-2).weight_decay(0.01), {}, kChunks);
  for (int step = 0; step < 3; ++step) {
    set_growing_grads(a, step);
    ours.step();
  }
  std::stringstream file;
  torch::save(ours, file);
  auto b = clone_params(a);
  fo::AdamW8bit loaded(b, to::AdamWOptions(1e-2).weight_decay(0.01), {}, kChunks);
  torch::load(loaded, file);
  ASSERT_EQ(loaded.state().size(), a.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto mine = state_of(ours, a[i]).state_tensors();
    const auto theirs = state_of(loaded, b[i]).state_tensors();
    EXPECT_EQ(state_of(loaded, b[i]).step(), 3);
    for (std::size_t t = 0; t < mine.size(); ++t) {
      ASSERT_EQ(mine[t].defined(), theirs[t].defined());
      if (mine[t].defined()) {
        EXPECT_TRUE(torch::equal(mine[t], theirs[t])) << "parameter " << i << " tensor " << t;
      }
    }
  }
  for (int step = 3; step < 8; ++step) {
    set_growing_grads(a, step);
    set_growing_grads(b, step);
    ours.step();
    loaded.step();
  }
  EXPECT_EQ(max_abs_diff(a, b), 0);
}

// torch::load into `optimizer` must fail with `message` and leave its state as it was.
void expect_refused(to::Optimizer& optimizer, std::stringstream& file, const std::string& message,
                    const std::vector<torch::Tensor>& params) {
  std::vector<std::vector<torch::Tensor>> before;
  for (const auto& p : params) {
    std::vector<torch::Tensor> copies;
    for (const auto& t : state_of(optimizer, p).state_tensors()) {
      copies.push_back(t.defined() ? t.clone() : t);
    }
    before.push_back(copies);
  }
  file.seekg(0);
  try {
    torch::load(optimizer, file);
    ADD_FAILURE() << "loaded; expected: " << message;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto now = state_of(optimizer, params[i]).state_tensors();
    for (std::size_t t = 0; t < now.size(); ++t) {
      if (now[t].defined()) {
        EXPECT_TRUE(torch::equal(now[t], before[i][t])) << "parameter " << i;
      }
    }
  }
}

TEST(Optim8bit, AFileThatDoesNotFitIsRefusedAndChangesNothing) {
  auto a = make_8bit_params();
  fo::Adam8bit saved(a, to::AdamOptions(1e-2), {}, kChunks);
  to::Adam torch_adam(a, to::AdamOptions(1e-2));
  set_growing_grads(a, 0);
  saved.step();
  torch_adam.step();
  std::stringstream ours, torchs;
  torch::save(saved, ours);
  torch::save(torch_adam, torchs);

  auto b = clone_params(a);
  fo::Adam8bit other_block(b, to::AdamOptions(1e-2), fo::QuantizedStateOptions().block(512),
                           kChunks);
  set_growing_grads(b, 1);
  other_block.step();
  expect_refused(other_block, ours, "but this optimizer's block is 512", b);
  expect_refused(other_block, torchs, "not saved by frugal's Adam8bit", b);

  auto c = clone_params(a);
  std::swap(c[0], c[1]);  // same count, other shapes
  fo::Adam8bit other_shapes(c, to::AdamOptions(1e-2), {}, kChunks);
  set_growing_grads(c, 1);
  other_shapes.step();
  expect_refused(other_shapes, ours, "the loaded state of parameter 0 (shape [9000])", c);
}

TEST(Optim8bit, ParametersWithoutGradientAreSkipped) {
  auto params = make_8bit_params();
  const auto before = params[1].detach().clone();
  fo::Adam8bit adam8(params, to::AdamOptions(1e-2));
  set_growing_grads(params, 0);
  params[1].mutable_grad().reset();
  adam8.step();
  EXPECT_TRUE(torch::equal(params[1], before));
  EXPECT_EQ(adam8.state().size(), params.size() - 1);
}

TEST(Optim8bit, StepParameterEqualsTheWholeStep) {
  auto whole = make_8bit_params();
  auto one_by_one = clone_params(whole);
  fo::Adam8bit a(whole, to::AdamOptions(1e-2), {}, kChunks);
  fo::Adam8bit b(one_by_one, to::AdamOptions(1e-2), {}, kChunks);
  for (int step = 0; step < 4; ++step) {
    set_growing_grads(whole, step);
    set_growing_grads(one_by_one, step);
    a.step();
    for (auto it = one_by_one.rbegin(); it != one_by_one.rend(); ++it) {
      b.step_parameter(*it);
    }
  }
  EXPECT_EQ(max_abs_diff(one_by_one, whole), 0);
}

TEST(Optim8bit, TheStepNeedsNoFullSizeCopyOfAState) {
  frugal::CountingAllocator::install();
  frugal::MemoryProbe probe(torch::kCPU);
  torch::manual_seed(3);
  const std::int64_t big = 1 << 20;
  // float32 and contiguous on the CPU: the fused loop, no scratch at all.
  std::vector<torch::Tensor> fused{torch::randn({big}).requires_grad_()};
  fo::Adam8bit a(fused, to::AdamOptions(1e-3).weight_decay(1e-2));
  EXPECT_EQ(a.scratch_bytes(), 0);
  const auto fused_overhead = step_overhead(a, fused, probe);
  EXPECT_LE(fused_overhead, 256);  // the 0-d tensors LibTorch wraps scalars in
  // Strided (as other devices and dtypes): tensor ops on four float32 buffers of one chunk,
  // a quarter of one float32 copy of a moment.
  std::vector<torch::Tensor> strided{torch::randn({1024, 1024}).t().requires_grad_()};
  const auto chunk = fo::InPlaceOptions().chunk(1 << 16);
  fo::Adam8bit b(strided, to::AdamOptions(1e-3).weight_decay(1e-2), {}, chunk);
  EXPECT_EQ(b.scratch_bytes(), 4 * big * 4);  // not flat: stepped whole
  std::vector<torch::Tensor> flat_ops{torch::randn({big}, torch::kFloat64).requires_grad_()};
  fo::Adam8bit c(flat_ops, to::AdamOptions(1e-3), {}, chunk);
  EXPECT_EQ(c.scratch_bytes(), 6 * chunk.chunk() * 4);  // and float32 copies of both
  const auto ops_overhead = step_overhead(c, flat_ops, probe);
  EXPECT_GE(ops_overhead, c.scratch_bytes());
  EXPECT_LE(ops_overhead, c.scratch_bytes() + 256);
  std::cout << "[ 8-bit    ] step of a 1 M-element parameter: " << fused_overhead
            << " B above its start (fused), " << ops_overhead << " B (tensor ops, float64)\n";
}

TEST(Optim8bit, AFailedStepChangesNeitherParametersNorState) {
  frugal::CountingAllocator::install();
  frugal::MemoryProbe probe(torch::kCPU);
  auto params = make_8bit_params();
  fo::Adam8bit adam8(params, to::AdamOptions(1e-2), {}, kChunks);
  set_growing_grads(params, 0);
  adam8.step();
  set_growing_grads(params, 1);
  const auto before = clone_params(params);
  std::vector<torch::Tensor> codes;
  for (const auto& p : params) {
    codes.push_back(state_of(adam8, p).exp_avg().clone());
  }
  {
    frugal::ScopedCpuCap cap(probe.allocated() + adam8.scratch_bytes() / 2);
    EXPECT_THROW(adam8.step(), c10::OutOfMemoryError);
  }
  EXPECT_EQ(max_abs_diff(params, before), 0);
  for (std::size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(torch::equal(state_of(adam8, params[i]).exp_avg(), codes[i]));
    EXPECT_EQ(state_of(adam8, params[i]).step(), 1);
  }
}

TEST(Optim8bit, BadOptionsNameTheValue) {
  auto params = make_8bit_params();
  const auto message = [&](auto make) {
    try {
      make();
    } catch (const c10::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { fo::Adam8bit(params, to::AdamOptions(1e-3).amsgrad(true)); })
                .find("amsgrad must be false"),
            std::string::npos);
  EXPECT_NE(message([&] {
              fo::Adam8bit(params, to::AdamOptions(1e-3), fo::QuantizedStateOptions().block(0));
            }).find("block must be >= 1 element, got 0"),
            std::string::npos);
  EXPECT_NE(message([&] { fo::AdamW8bit(params, to::AdamWOptions(-1)); })
                .find("invalid learning rate: -1"),
            std::string::npos);
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
                      state_of(b, cuda[0]).exp_avg().cpu().to(torch::kInt)).abs();
  EXPECT_LE(apart.max().item<int64_t>(), 1);
  EXPECT_LE((apart > 0).sum().item<int64_t>(), apart.numel() / 100);
}

}  // namespace
