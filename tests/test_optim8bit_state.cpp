// The 8-bit optimizer's state and its step's guarantees: saved and loaded bit for bit, a
// file that does not fit refused, parameters without gradient skipped, one parameter's step
// equal to the whole step, no full-size copy of a state, a failed step changing nothing,
// bad options named.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>
#include <limits>
#include <sstream>

#include "compat.h"
#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/probe.h"
#include "frugal/optim/adam8bit.h"
#include "frugal/optim/blockwise.h"
#include "helpers.h"
#include "optim8bit_setup.h"

namespace {

using namespace frugal::testing::optim8bit;

TEST(Optim8bit, StateRoundTripsThroughTorchSaveBitForBit) {
  auto a = make_8bit_params();
  fo::AdamW8bit ours(a, to::AdamWOptions(1e-2).weight_decay(0.01), {}, kChunks);
  step_together(0, 3, {&a}, ours);
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
  step_together(3, 8, {&a, &b}, ours, loaded);
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
  step_together(0, 1, {&a}, saved, torch_adam);
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
  fo::Adam8bit adam8(params, to::AdamOptions(1e-2));
  set_growing_grads(params, 0);
  frugal::testing::expect_steps_around_missing_gradient(adam8, params, 1);
}

TEST(Optim8bit, ALearningRateThatIsNotFiniteIsRefusedAndStepsNothing) {
  auto params = make_8bit_params();
  frugal::testing::expect_error_contains(
      [&] { fo::Adam8bit(params, to::AdamOptions(std::numeric_limits<double>::infinity())); },
      "invalid learning rate: inf (needs a finite value >= 0)");
  fo::Adam8bit adam8(params, to::AdamOptions(1e-2), {}, kChunks);
  set_growing_grads(params, 0);
  adam8.step();
  const auto before = clone_params(params);
  const auto states = adam8.state().size();
  set_growing_grads(params, 1);
  // As a schedule or a user would set it, after construction.
  adam8.param_groups()[0].options().set_lr(std::numeric_limits<double>::quiet_NaN());
  frugal::testing::expect_error_contains([&] { adam8.step(); },
                                         "needs a finite learning rate >= 0, got nan");
  EXPECT_EQ(max_abs_diff(params, before), 0);
  EXPECT_EQ(adam8.state().size(), states);
}

TEST(Optim8bit, StepParameterEqualsTheWholeStep) {
  auto whole = make_8bit_params();
  auto one_by_one = clone_params(whole);
  fo::Adam8bit a(whole, to::AdamOptions(1e-2), {}, kChunks);
  fo::Adam8bit b(one_by_one, to::AdamOptions(1e-2), {}, kChunks);
  frugal::testing::expect_step_parameter_is_the_whole_step(
      a, whole, b, one_by_one, 4, [](auto& params, int step) { set_growing_grads(params, step); });
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
  EXPECT_NE(message([&] {
              fo::Adam8bit(params, to::AdamOptions(1e-3).amsgrad(true));
            }).find("amsgrad must be false"),
            std::string::npos);
  EXPECT_NE(message([&] {
              fo::Adam8bit(params, to::AdamOptions(1e-3), fo::QuantizedStateOptions().block(0));
            }).find("block must be >= 1 element, got 0"),
            std::string::npos);
  EXPECT_NE(message([&] {
              fo::AdamW8bit(params, to::AdamWOptions(-1));
            }).find("invalid learning rate: -1"),
            std::string::npos);
}

}  // namespace
