#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <memory>
#include <sstream>

#include "compat.h"
#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/probe.h"
#include "frugal/optim/adam.h"
#include "frugal/optim/sgd.h"
#include "helpers.h"
#include "optim/chunk_size.h"

namespace {

namespace to = torch::optim;
namespace fo = frugal::optim;
using frugal::testing::clone_params;
using frugal::testing::set_grads;
using frugal::testing::step_overhead;
using Factory = std::function<std::unique_ptr<to::Optimizer>(std::vector<torch::Tensor>)>;

// Parameters of several shapes: one larger than the chunk (several chunks and a tail),
// one smaller, one non-contiguous (stepped whole).
std::vector<torch::Tensor> make_params() {
  torch::manual_seed(11);
  auto strided = torch::randn({40, 30}).t();  // a transposed view: not contiguous
  return {torch::randn({64, 75}).requires_grad_(), torch::randn({75}).requires_grad_(),
          strided.detach().requires_grad_()};
}

// Largest relative difference between two sets of tensors; 0 when bitwise equal.
double max_relative_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double most = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto diff = (a[i] - b[i]).abs() / b[i].abs().clamp_min(1e-12);
    most = std::max(most, diff.max().item<double>());
  }
  return most;
}

struct Case {
  const char* name;
  Factory torch_optimizer;
  Factory frugal_optimizer;
};

// Chunks of 1000 elements: the 4800-element parameter takes five, the last one partial.
const fo::InPlaceOptions kSmallChunks = fo::InPlaceOptions().chunk(1000);

template <typename Torch, typename Frugal, typename Options>
Case make_case(const char* name, Options options) {
  return {name,
          [options](std::vector<torch::Tensor> p) { return std::make_unique<Torch>(p, options); },
          [options](std::vector<torch::Tensor> p) {
            return std::make_unique<Frugal>(p, options, kSmallChunks);
          }};
}

std::vector<Case> all_cases() {
  return {
      make_case<to::SGD, fo::SGD>("sgd", to::SGDOptions(0.1)),
      make_case<to::SGD, fo::SGD>("sgd-momentum", to::SGDOptions(0.1).momentum(0.9)),
      make_case<to::SGD, fo::SGD>(
          "sgd-momentum-dampening-decay",
          to::SGDOptions(0.05).momentum(0.9).dampening(0.1).weight_decay(1e-2)),
      make_case<to::SGD, fo::SGD>(
          "sgd-nesterov-decay",
          to::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3)),
      make_case<to::Adam, fo::Adam>("adam", to::AdamOptions(1e-2)),
      make_case<to::Adam, fo::Adam>("adam-decay", to::AdamOptions(1e-2).weight_decay(1e-2)),
      make_case<to::Adam, fo::Adam>("adam-amsgrad-decay",
                                    to::AdamOptions(1e-2).amsgrad(true).weight_decay(1e-3)),
      make_case<to::AdamW, fo::AdamW>("adamw", to::AdamWOptions(1e-2)),
      make_case<to::AdamW, fo::AdamW>("adamw-amsgrad",
                                      to::AdamWOptions(1e-2).amsgrad(true).weight_decay(0.1)),
  };
}

TEST(Optim, EveryOptimizerMatchesLibTorchOver100Steps) {
  for (const auto& c : all_cases()) {
    auto torch_params = make_params();
    auto frugal_params = clone_params(torch_params);
    auto reference = c.torch_optimizer(torch_params);
    auto ours = c.frugal_optimizer(frugal_params);
    for (int step = 0; step < 100; ++step) {
      set_grads(torch_params, step);
      set_grads(frugal_params, step);
      reference->step();
      ours->step();
    }
    const double diff = max_relative_diff(frugal_params, torch_params);
    EXPECT_LE(diff, 1e-6) << c.name;
    // Not a requirement (vectorised and scalar tails may round differently), but shown.
    std::cout << "[ optim    ] " << c.name << ": largest relative difference after 100 steps "
              << diff << (diff == 0 ? " (bitwise equal)" : "") << "\n";
    ASSERT_EQ(ours->state().size(), reference->state().size()) << c.name;
  }
}

TEST(Optim, StateDictRoundTripsThroughTorchSaveBothWays) {
  auto torch_params = make_params();
  auto frugal_params = clone_params(torch_params);
  to::Adam reference(torch_params, to::AdamOptions(1e-2).amsgrad(true));
  fo::Adam ours(frugal_params, to::AdamOptions(1e-2).amsgrad(true), kSmallChunks);
  for (int step = 0; step < 3; ++step) {
    set_grads(torch_params, step);
    set_grads(frugal_params, step);
    reference.step();
    ours.step();
  }
  // frugal's state into LibTorch's Adam, and LibTorch's into frugal's, on swapped params.
  std::stringstream from_ours, from_torch;
  torch::save(ours, from_ours);
  torch::save(reference, from_torch);
  auto torch_params2 = clone_params(frugal_params);
  auto frugal_params2 = clone_params(torch_params);
  // (LibTorch 1.13 loads the state but not the groups' options: pass the same ones.)
  to::Adam reference2(torch_params2, to::AdamOptions(1e-2).amsgrad(true));
  fo::Adam ours2(frugal_params2, to::AdamOptions(1e-2).amsgrad(true), kSmallChunks);
  torch::load(reference2, from_ours);
  torch::load(ours2, from_torch);
  ASSERT_EQ(ours2.state().size(), 3u);
  for (const auto& entry : ours2.state()) {
    EXPECT_EQ(static_cast<const to::AdamParamState&>(*entry.second).step(), 3);
  }
  for (int step = 3; step < 10; ++step) {
    for (auto* params : {&torch_params, &frugal_params, &torch_params2, &frugal_params2}) {
      set_grads(*params, step);
    }
    reference.step();
    ours.step();
    reference2.step();
    ours2.step();
  }
  EXPECT_LE(max_relative_diff(torch_params2, frugal_params), 1e-6);
  EXPECT_LE(max_relative_diff(frugal_params2, torch_params), 1e-6);
}

TEST(Optim, ParametersWithoutGradientAreSkippedAsLibTorchDoes) {
  auto params = make_params();
  fo::Adam adam(params, to::AdamOptions(1e-2));
  set_grads(params, 0);
  frugal::testing::expect_steps_around_missing_gradient(adam, params, 1);
}

TEST(Optim, StepParameterEqualsTheWholeStep) {
  auto whole = make_params();
  auto one_by_one = clone_params(whole);
  fo::Adam a(whole, to::AdamOptions(1e-2).weight_decay(1e-2), kSmallChunks);
  fo::Adam b(one_by_one, to::AdamOptions(1e-2).weight_decay(1e-2), kSmallChunks);
  frugal::testing::expect_step_parameter_is_the_whole_step(
      a, whole, b, one_by_one, 5, [](auto& params, int step) { set_grads(params, step); });
  EXPECT_THROW(b.step_parameter(torch::zeros({3}, torch::requires_grad())), c10::Error);
}

TEST(Optim, AFailedStepChangesNeitherParametersNorState) {
  frugal::CountingAllocator::install();
  frugal::MemoryProbe probe(torch::kCPU);
  auto params = make_params();
  fo::Adam adam(params, to::AdamOptions(1e-2));
  set_grads(params, 0);
  const auto before = clone_params(params);
  {
    // Room for part of the new state only: the step must fail before any update.
    std::int64_t state_bytes = 0;
    for (const auto& p : params) {
      state_bytes += 2 * p.numel() * static_cast<std::int64_t>(p.element_size());
    }
    frugal::ScopedCpuCap cap(probe.allocated() + state_bytes / 2);
    EXPECT_THROW(adam.step(), c10::OutOfMemoryError);
  }
  EXPECT_EQ(max_relative_diff(params, before), 0);
  EXPECT_TRUE(adam.state().empty());
  adam.step();  // with room, the same step goes through
  EXPECT_GT(max_relative_diff(params, before), 0);
  EXPECT_EQ(adam.state().size(), 3u);
}

TEST(Optim, TheStepAllocatesAChunkWhereLibTorchAllocatesWholeParameters) {
  frugal::CountingAllocator::install();
  frugal::MemoryProbe probe(torch::kCPU);
  torch::manual_seed(3);
  const std::int64_t big = 1 << 20;  // elements of the largest parameter
  auto make = [&] {
    return std::vector<torch::Tensor>{torch::randn({big}).requires_grad_(),
                                      torch::randn({1000}).requires_grad_()};
  };
  auto torch_params = make();
  auto frugal_params = make();
  to::Adam reference(torch_params, to::AdamOptions(1e-3).weight_decay(1e-2));
  fo::Adam ours(frugal_params, to::AdamOptions(1e-3).weight_decay(1e-2));
  const auto theirs = step_overhead(reference, torch_params, probe);
  const auto mine = step_overhead(ours, frugal_params, probe);
  const std::int64_t param_bytes = big * 4;
  // LibTorch: the decayed gradient and the denominator's two temporaries, each parameter-sized.
  EXPECT_GE(theirs, 2 * param_bytes);
  // frugal: the scratch it reports, two chunks here, and nothing else but the 0-d tensors
  // LibTorch wraps scalar operands in (a few bytes each).
  EXPECT_EQ(ours.scratch_bytes(), 2 * ours.in_place_options().chunk() * 4);
  EXPECT_GE(mine, ours.scratch_bytes());
  EXPECT_LE(mine, ours.scratch_bytes() + 64);
  std::cout << "[ optim    ] Adam step above its start: LibTorch " << theirs << " B, frugal "
            << mine << " B\n";
}

}  // namespace

namespace {

TEST(OptimizerStateKey, FindsTheStateLibTorchsOptimizersKeep) {
  // LibTorch keys each parameter's state by its TensorImpl (2.x) or that pointer's text
  // (1.13); frugal's key must be the same for every parameter, or no state is found.
  auto params = make_params();
  to::Adam adam(params, to::AdamOptions(1e-2));
  to::SGD sgd(clone_params(params), to::SGDOptions(0.1).momentum(0.9));
  for (torch::optim::Optimizer* optimizer : {static_cast<torch::optim::Optimizer*>(&adam),
                                             static_cast<torch::optim::Optimizer*>(&sgd)}) {
    auto& own = optimizer->param_groups()[0].params();
    set_grads(own, 0);
    optimizer->step();
    ASSERT_EQ(optimizer->state().size(), own.size());
    for (const auto& p : own) {
      EXPECT_EQ(optimizer->state().count(frugal::compat::optimizer_state_key(p)), 1u);
    }
  }
}

}  // namespace

namespace {

frugal::detail::ChunkRequest adam_request(c10::DeviceType device, std::int64_t numel) {
  frugal::detail::ChunkRequest r;
  r.device = device;
  r.chunk = fo::InPlaceOptions().chunk();
  r.device_scratch = fo::InPlaceOptions().device_scratch();
  r.bytes_per_element = 4;  // Adam's one float32 buffer
  r.numel = numel;
  return r;
}

TEST(InPlaceChunks, OnAGpuAChunkGrowsToTheScratchBudgetAndOnTheCpuStaysCacheSized) {
  const std::int64_t matrix = 4096 * 4096;
  const std::int64_t budget = fo::InPlaceOptions().device_scratch();
  // CPU: the chunk of the options, whatever the budget.
  EXPECT_EQ(chunk_elements(adam_request(c10::DeviceType::CPU, matrix)),
            fo::InPlaceOptions().chunk());
  // GPU: as many elements as the budget's bytes hold, so the matrix is one chunk (its
  // launches a step: one set, not one per 65,536 elements).
  EXPECT_EQ(chunk_elements(adam_request(c10::DeviceType::CUDA, matrix)), budget / 4);
  EXPECT_EQ(chunk_elements(adam_request(c10::DeviceType::CUDA, matrix)), matrix);
  // A larger parameter takes chunks of the budget: the scratch stays within it.
  auto big = adam_request(c10::DeviceType::CUDA, 4 * matrix);
  big.bytes_per_element = 6 * 4;  // 8-bit states' tensor-ops path: six float32 buffers
  big.multiple = 256;
  const auto elements = chunk_elements(big);
  EXPECT_LE(elements * big.bytes_per_element, budget);
  EXPECT_GT((elements + big.multiple) * big.bytes_per_element, budget);
  EXPECT_EQ(elements % big.multiple, 0);
  // Never below the CPU's chunk, never above the parameter, whole where not flat.
  auto tight = adam_request(c10::DeviceType::CUDA, matrix);
  tight.device_scratch = 1024;
  EXPECT_EQ(chunk_elements(tight), tight.chunk);
  tight.device_scratch = 0;  // the budget off: the CPU's chunk everywhere
  EXPECT_EQ(chunk_elements(tight), tight.chunk);
  EXPECT_EQ(chunk_elements(adam_request(c10::DeviceType::CUDA, 1000)), 1000);
  auto strided = adam_request(c10::DeviceType::CPU, matrix);
  strided.flat = false;
  EXPECT_EQ(chunk_elements(strided), matrix);
}

TEST(InPlaceChunks, ANegativeDeviceScratchIsRefusedNamingIt) {
  const auto params = std::vector<torch::Tensor>{torch::zeros({4}, torch::requires_grad())};
  frugal::testing::expect_error_contains(
      [&] { fo::Adam(params, to::AdamOptions(1e-3), fo::InPlaceOptions().device_scratch(-1)); },
      "device_scratch must be >= 0 bytes, got -1");
}

TEST(CudaInPlaceChunks, AnAdamStepOnTheGpuTakesAWholeMatrixAsOneChunkAndAgreesWithTheCpu) {
  FRUGAL_SKIP_WITHOUT_CUDA();
  torch::manual_seed(5);
  const auto weights = torch::randn({4096, 4096});
  const auto grad = torch::randn({4096, 4096});
  std::vector<torch::Tensor> on_cpu{weights.clone().requires_grad_()};
  std::vector<torch::Tensor> on_gpu{weights.to(torch::kCUDA).requires_grad_()};
  on_cpu[0].mutable_grad() = grad.clone();
  on_gpu[0].mutable_grad() = grad.to(torch::kCUDA);
  fo::Adam cpu(on_cpu, to::AdamOptions(1e-3));
  fo::Adam gpu(on_gpu, to::AdamOptions(1e-3));
  cpu.step();
  gpu.step();
  // One float32 buffer of the whole matrix on the GPU; the cache-sized chunk on the CPU.
  EXPECT_EQ(gpu.scratch_bytes(), 4096 * 4096 * 4);
  EXPECT_EQ(cpu.scratch_bytes(), cpu.in_place_options().chunk() * 4);
  // The same elementwise update: the two devices differ by float32 rounding only, a few
  // units in the last place of weights up to about 5 (2^-21 each).
  const double apart = (on_gpu[0].detach().cpu() - on_cpu[0].detach()).abs().max().item<double>();
  EXPECT_LE(apart, 4 * std::ldexp(1.0, -21));
}

}  // namespace
