// The fused CPU steps share their blocks out among LibTorch's threads (at::parallel_for):
// the bits they write must not depend on how many threads there are. The suites run their
// tests at one intra-op thread (several tests run side by side), so the shared-out path is
// pinned here, at one thread and at two, on parameters large enough to be split.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "frugal/optim/adam.h"
#include "frugal/optim/adam8bit.h"
#include "helpers.h"

namespace {

namespace fo = frugal::optim;
namespace to = torch::optim;

using MakeOptimizer =
    std::function<std::unique_ptr<to::Optimizer>(const std::vector<torch::Tensor>&)>;

// Three steps on a 512 x 600 parameter (1200 blocks of 256, chunks of 2^18 elements: every
// kernel's grain is exceeded) at `threads` threads; the weights and every state tensor after.
std::vector<torch::Tensor> three_steps(torch::ScalarType dtype, const MakeOptimizer& make,
                                       int threads) {
  const frugal::testing::ThreadCount count(threads);
  auto generator = torch::make_generator<torch::CPUGeneratorImpl>(11);
  auto weight = torch::randn({512, 600}, generator).to(dtype).requires_grad_();
  auto optimizer = make({weight});
  for (int step = 0; step < 3; ++step) {
    weight.mutable_grad() = torch::randn({512, 600}, generator).to(dtype);
    optimizer->step();
  }
  std::vector<torch::Tensor> out{weight.detach().clone()};
  for (const auto& [key, state] : optimizer->state()) {
    if (const auto* q = dynamic_cast<const fo::Adam8bitParamState*>(state.get())) {
      for (const auto& t : {q->exp_avg(), q->exp_avg_scales(), q->exp_avg_sq(),
                            q->exp_avg_sq_scales(), q->exp_avg_sq_row(), q->exp_avg_sq_col()}) {
        if (t.defined()) {
          out.push_back(t.clone());
        }
      }
    } else if (const auto* a = dynamic_cast<const to::AdamWParamState*>(state.get())) {
      out.push_back(a->exp_avg().clone());
      out.push_back(a->exp_avg_sq().clone());
    }
  }
  return out;
}

void expect_same_bits_on_one_and_two_threads(torch::ScalarType dtype, const MakeOptimizer& make) {
  const auto one = three_steps(dtype, make, 1);
  const auto two = three_steps(dtype, make, 2);
  ASSERT_EQ(one.size(), two.size());
  ASSERT_GE(one.size(), 3u) << "the weights and at least two state tensors";
  for (std::size_t i = 0; i < one.size(); ++i) {
    EXPECT_TRUE(torch::equal(one[i], two[i]))
        << "tensor " << i << " (0: the weights): "
        << (one[i] != two[i]).sum().item<std::int64_t>() << " elements differ";
  }
}

const auto kOptions = to::AdamWOptions(1e-2).weight_decay(0.1);
const auto kInPlace = fo::InPlaceOptions().chunk(1 << 18).seed(3);

TEST(KernelThreads, EightBitStatesOnBfloat16WeightsGiveTheSameBitsOnOneAndTwoThreads) {
  expect_same_bits_on_one_and_two_threads(torch::kBFloat16, [](const auto& params) {
    return std::make_unique<fo::AdamW8bit>(params, kOptions, fo::QuantizedStateOptions(), kInPlace);
  });
}

TEST(KernelThreads, FourBitStatesGiveTheSameBitsOnOneAndTwoThreads) {
  for (const bool factored : {false, true}) {
    SCOPED_TRACE(factored ? "factored" : "codes");
    for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
      SCOPED_TRACE(dtype == torch::kFloat32 ? "float32 weights" : "bfloat16 weights");
      expect_same_bits_on_one_and_two_threads(dtype, [factored](const auto& params) {
        return std::make_unique<fo::AdamW4bit>(
            params, kOptions, fo::four_bit_states().factored(factored), kInPlace);
      });
    }
  }
}

TEST(KernelThreads, AdamOnBfloat16WeightsGivesTheSameBitsOnOneAndTwoThreads) {
  expect_same_bits_on_one_and_two_threads(torch::kBFloat16, [](const auto& params) {
    return std::make_unique<fo::AdamW>(params, kOptions, kInPlace);
  });
}

}  // namespace
