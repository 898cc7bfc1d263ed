#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include "frugal/compose/mixed_precision.h"
#include "frugal/loop/loop.h"
#include "frugal/memory/ledger.h"
#include "frugal/memory/probe.h"
#include "frugal/nn/frozen_weights.h"
#include "frugal/nn/lora.h"
#include "frugal/optim/adam.h"
#include "frugal/policy/checkpoint_policy.h"
#include "frugal/policy/step_in_backward.h"
#include "frugal/state/training_state.h"
#include "frugal/train/trainer.h"
#include "helpers.h"
#include "lora_net.h"
#include "nn/nf4.h"
#include "optim/weight_codes.h"

namespace fd = frugal::nn::detail;
using frugal::testing::expect_error_contains;
using frugal::testing::kDim;
using frugal::testing::LoraBlockImpl;
using frugal::testing::LoraNet;
using frugal::testing::replace_block_weights;

namespace {

frugal::nn::LoraOptions qlora_options() {
  return frugal::nn::LoraOptions().rank(2).alpha(4).target_modules({"attn", "down"});
}

}  // namespace

TEST(FrozenWeights, StoresTheUnitsLinearWeightsFrozenAndRunsOnTheirDecodedValues) {
  for (const auto format : {frugal::nn::FrozenFormat::NF4, frugal::nn::FrozenFormat::Int8}) {
    LoraNet net, ref;
    const auto opts =
        frugal::nn::FrozenWeightsOptions().format(format).dtype(torch::kFloat).group(16);
    frugal::nn::FrozenWeights base(opts);
    for (auto& unit : net->units()) {
      base.add_module(unit);
    }
    auto block = net->list->ptr<LoraBlockImpl>(1);
    EXPECT_EQ(block->named_parameters(false).size(), 0U);
    EXPECT_EQ(block->up->named_parameters(false)["weight"].numel(), 0);
    EXPECT_FALSE(block->up->bias.requires_grad());
    EXPECT_EQ(base.stored_elements(), 3 * (kDim * kDim + 4 * kDim * kDim));
    std::int64_t buffers = 0;
    for (const auto& b : net->buffers()) {
      buffers += static_cast<std::int64_t>(b.nbytes());
    }
    EXPECT_EQ(base.stored_bytes(), buffers);
    // The reference: the same model with each weight replaced by its decoded value.
    replace_block_weights(ref, [&](const torch::Tensor& w) {
      if (format == frugal::nn::FrozenFormat::NF4) {
        return fd::nf4_dequantize(fd::nf4_quantize(w), torch::kFloat);
      }
      frugal::optim::detail::StoredWeights s;
      std::tie(s.codes, s.qparams) = frugal::optim::detail::quantize_weights(w, 16);
      s.group = 16;
      auto out = torch::empty_like(w);
      frugal::optim::detail::dequantize_into(s, out);
      return out;
    });
    torch::manual_seed(5);
    const auto x = torch::randn({4, kDim});
    EXPECT_TRUE(torch::equal(net->forward(x), ref->forward(x)));
    EXPECT_EQ(block->up->weight.numel(), 0) << "outside its unit";
  }
}

TEST(FrozenWeights, QloraAdaptersGetTheGradientsOfTheDecodedBaseAndTheWeightsWaitForBackward) {
  for (const bool checkpointed : {false, true}) {
    LoraNet net, ref;
    frugal::nn::FrozenWeights base(frugal::nn::FrozenWeightsOptions().dtype(torch::kFloat));
    for (auto& unit : net->units()) {
      base.add_module(unit);
    }
    replace_block_weights(ref, [](const torch::Tensor& w) {
      return fd::nf4_dequantize(fd::nf4_quantize(w), torch::kFloat);
    });
    frugal::nn::Lora lora(*net, net->units(), qlora_options());
    frugal::nn::Lora ref_lora(*ref, ref->units(), qlora_options());
    torch::manual_seed(9);
    {
      torch::NoGradGuard no_grad;
      for (std::size_t i = 0; i < lora.parameters().size(); ++i) {
        const auto v = torch::randn(lora.parameters()[i].sizes()) * 0.3;
        lora.parameters()[i].copy_(v);
        ref_lora.parameters()[i].copy_(v);
      }
    }
    std::shared_ptr<frugal::CheckpointPolicy> policy;
    if (checkpointed) {
      policy = std::make_shared<frugal::CheckpointPolicy>(frugal::CheckpointSelect().every(1));
      policy->apply(*net);
    }
    torch::manual_seed(5);
    const auto x =
        torch::randn({4, kDim}).requires_grad_();  // every layer's backward needs its weight
    auto out = net->forward(x);
    frugal::testing::expect_weights_wait_for_backward(net, checkpointed);
    out.pow(2).sum().backward();
    auto ref_out = ref->forward(x);
    ref_out.pow(2).sum().backward();
    EXPECT_TRUE(torch::allclose(out, ref_out, 1e-6, 1e-7));
    for (std::size_t i = 0; i < lora.parameters().size(); ++i) {
      EXPECT_TRUE(
          torch::allclose(lora.parameters()[i].grad(), ref_lora.parameters()[i].grad(), 1e-5, 1e-6))
          << i;
    }
    expect_error_contains([&] { lora.merge(); }, "has its base in a FrozenWeights store");
  }
}

TEST(FrozenWeights, BetweenStepsTheLedgerCountsTheCodesAsTheWeightsAndTheAdaptersAlone) {
  frugal::MemoryProbe probe(torch::kCPU);
  LoraNet net;
  frugal::nn::FrozenWeights base(frugal::nn::FrozenWeightsOptions().dtype(torch::kFloat));  // NF4
  for (auto& unit : net->units()) {
    base.add_module(unit);
  }
  frugal::nn::Lora lora(*net, net->units(), qlora_options());
  frugal::optim::AdamW adamw(lora.parameters(), torch::optim::AdamWOptions(1e-2));
  frugal::Trainer trainer(net, adamw, [](const torch::Tensor& out, const torch::Tensor& t) {
    return torch::mse_loss(out.to(torch::kFloat), t);
  });
  trainer.add_policy(std::make_shared<frugal::StepInBackward>());
  torch::manual_seed(5);
  const auto x = torch::randn({4, kDim});
  const auto y = torch::ones({4, 2});
  const auto first = trainer.step(frugal::Batch(x, y)).loss;
  double last = first;
  for (int i = 0; i < 5; ++i) {
    last = trainer.step(frugal::Batch(x, y)).loss;
  }
  EXPECT_LT(last, first);
  std::int64_t params = 0, adapters = 0;
  for (const auto& p : net->parameters()) {
    params += static_cast<std::int64_t>(p.nbytes());
  }
  for (const auto& p : lora.parameters()) {
    adapters += static_cast<std::int64_t>(p.nbytes());
  }
  const auto ledger = frugal::measure_ledger(probe, *net, &adamw);
  EXPECT_EQ(ledger.weights, base.stored_bytes() + params);  // codes, vectors, adapters
  EXPECT_EQ(ledger.gradients, 0);
  EXPECT_EQ(ledger.optimizer, 2 * adapters);  // AdamW's two float32 moments of the adapters alone
}

TEST(FrozenWeights, RefusesUnitsOfOtherKindsAndUnitsStoredTwice) {
  LoraNet net;
  frugal::nn::FrozenWeights base;
  base.add_module(net->units()[0]);
  expect_error_contains([&] { base.add_module(net->units()[0]); }, "is stored already");
  frugal::nn::FrozenWeights other;
  expect_error_contains([&] { other.add_module(net->units()[0]); }, "is stored already");
  expect_error_contains([&] { base.add_module(nullptr); }, "null module");
}

TEST(FrozenWeights, AUnitIsMadeWholeInTheDtypeItsWeightsHadWhenAdded) {
  LoraNet net;  // float32
  frugal::nn::FrozenWeights base;
  for (auto& unit : net->units()) {
    base.add_module(unit);
  }
  const auto out = net->forward(torch::randn({2, kDim}));  // no dtype mismatch
  EXPECT_EQ(out.scalar_type(), torch::kFloat);
  EXPECT_EQ(net->list->ptr<LoraBlockImpl>(0)->up->bias.scalar_type(), torch::kFloat);
}

TEST(FrozenWeights, CodesOfAnotherShapeOrGroupAreRefusedNamingTheBufferBeforeAnyRead) {
  const auto x = torch::randn({2, kDim});
  // NF4 codes of another length in a state dict: refused naming the layer's buffer.
  {
    LoraNet net;
    frugal::nn::FrozenWeights base(frugal::nn::FrozenWeightsOptions().dtype(torch::kFloat));
    for (auto& unit : net->units()) {
      base.add_module(unit);
    }
    auto packed = net->list->ptr<LoraBlockImpl>(1)->up->named_buffers()["weight_nf4"];
    {
      torch::NoGradGuard no_grad;
      packed.set_(torch::zeros({16}, torch::kUInt8));
    }
    expect_error_contains([&] { net->forward(x); },
                          c10::str("the NF4 weights 'up.weight' (shape [", 2 * kDim, ", ", kDim,
                                   "]) cannot use their buffer 'up.weight_nf4': it is Byte [16]"));
    expect_error_contains([&] { net->forward(x); },
                          c10::str("where they need Byte [", kDim * kDim, "]"));
  }
  // 8-bit codes saved under groups of 4096, loaded into groups of 16.
  const auto path = (std::filesystem::temp_directory_path() /
                     ("frugal_frozen_groups_" + std::to_string(::getpid()) + ".pt"))
                        .string();
  auto stored = [](LoraNet& net, std::int64_t group) {
    auto base =
        std::make_unique<frugal::nn::FrozenWeights>(frugal::nn::FrozenWeightsOptions()
                                                        .format(frugal::nn::FrozenFormat::Int8)
                                                        .dtype(torch::kFloat)
                                                        .group(group));
    for (auto& unit : net->units()) {
      base->add_module(unit);
    }
    return base;
  };
  LoraNet from, into;
  const auto saved = stored(from, 4096);
  const auto loaded = stored(into, 16);
  torch::save(from, path);
  torch::load(into, path);
  expect_error_contains([&] { into->forward(x); },
                        c10::str("the 8-bit weights 'attn.weight' (", kDim * kDim,
                                 " elements in groups of 16) cannot use their buffer "
                                 "'attn.weight_qparams': it is BFloat16 [1, 2]"));
  std::remove(path.c_str());
}

TEST(FrozenWeights, QloraInAFrugalLoopOfMicroBatchesTrainsAsTheTrainerOnWholeBatches) {
  auto make = [](LoraNet& net, frugal::nn::FrozenWeights& base) {
    for (auto& unit : net->units()) {
      base.add_module(unit);
    }
    return std::make_unique<frugal::nn::Lora>(*net, net->units(), qlora_options());
  };
  const auto options = frugal::nn::FrozenWeightsOptions().dtype(torch::kFloat);
  LoraNet a, b;
  frugal::nn::FrozenWeights base_a(options), base_b(options);
  auto lora_a = make(a, base_a);
  auto lora_b = make(b, base_b);
  {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < lora_a->parameters().size(); ++i) {
      lora_b->parameters()[i].copy_(lora_a->parameters()[i]);
    }
  }
  frugal::optim::AdamW adam_a(lora_a->parameters(), torch::optim::AdamWOptions(1e-2));
  frugal::optim::AdamW adam_b(lora_b->parameters(), torch::optim::AdamWOptions(1e-2));
  auto mse = [](const torch::Tensor& out, const torch::Tensor& t) {
    return torch::mse_loss(out, t);
  };
  frugal::Trainer trainer(a, adam_a, mse);
  frugal::Loop loop(frugal::LoopOptions().micro_batch(2));
  auto& model = loop.prepare(b, adam_b, "qlora");
  torch::manual_seed(5);
  const auto x = torch::randn({4, kDim});
  const auto y = torch::ones({4, 2});
  for (int step = 0; step < 3; ++step) {
    const auto whole = trainer.step(frugal::Batch(x, y)).loss;
    const auto micro = loop.accumulate(frugal::Batch(x, y), model, [&](const frugal::Batch& m) {
      return mse(b->forward(m.inputs), m.targets);
    });
    loop.step(model);
    loop.end();
    EXPECT_NEAR(micro, whole, 1e-6) << step;
  }
  for (std::size_t i = 0; i < lora_a->parameters().size(); ++i) {
    EXPECT_TRUE(torch::allclose(lora_a->parameters()[i], lora_b->parameters()[i], 1e-5, 1e-6)) << i;
  }
}

// Under bf16 autocast the layers compute in bf16 from the weights the store made whole (in
// float32 or in bf16) with the adapters folded in: a QLoRA run gives, step for step, the
// losses and adapters of the same run on a model whose blocks hold those decoded weights in
// that dtype.
TEST(FrozenWeights, QloraUnderBf16AutocastTrainsAsTheModelOfItsDecodedWeights) {
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    LoraNet net, ref;
    frugal::nn::FrozenWeights base(frugal::nn::FrozenWeightsOptions().dtype(dtype));
    for (auto& unit : net->units()) {
      base.add_module(unit);
    }
    replace_block_weights(ref, [dtype](const torch::Tensor& w) {
      return fd::nf4_dequantize(fd::nf4_quantize(w), dtype).to(torch::kFloat);
    });
    for (auto& unit : ref->units()) {
      unit->to(dtype);  // as the store keeps them: weights made whole, and the biases, in dtype
    }
    frugal::nn::Lora lora(*net, net->units(), qlora_options());
    frugal::nn::Lora ref_lora(*ref, ref->units(), qlora_options());
    std::vector<torch::Tensor> initial;
    {
      torch::NoGradGuard no_grad;
      torch::manual_seed(9);
      for (std::size_t i = 0; i < lora.parameters().size(); ++i) {
        const auto v = torch::randn(lora.parameters()[i].sizes()) * 0.3;
        lora.parameters()[i].copy_(v);
        ref_lora.parameters()[i].copy_(v);
        initial.push_back(v);
      }
    }
    frugal::optim::AdamW adam(lora.parameters(), torch::optim::AdamWOptions(1e-2));
    frugal::optim::AdamW ref_adam(ref_lora.parameters(), torch::optim::AdamWOptions(1e-2));
    std::vector<c10::ScalarType> seen;  // the model's output dtype, each step
    auto mse = [&seen](const torch::Tensor& out, const torch::Tensor& t) {
      seen.push_back(out.scalar_type());
      return torch::mse_loss(out.to(torch::kFloat), t);
    };
    frugal::Trainer trainer(net, adam, mse), ref_trainer(ref, ref_adam, mse);
    frugal::use_mixed_precision(trainer, torch::kBFloat16);
    frugal::use_mixed_precision(ref_trainer, torch::kBFloat16);
    torch::manual_seed(5);
    const auto x = torch::randn({4, kDim});
    const auto y = torch::ones({4, 2});
    for (int step = 0; step < 3; ++step) {
      EXPECT_EQ(trainer.step(frugal::Batch(x, y)).loss, ref_trainer.step(frugal::Batch(x, y)).loss)
          << dtype << " step " << step;
    }
    ASSERT_EQ(seen.size(), 6U);
    for (const auto s : seen) {
      EXPECT_EQ(s, torch::kBFloat16);  // autocast ran the layers in bf16
    }
    for (std::size_t i = 0; i < lora.parameters().size(); ++i) {
      EXPECT_TRUE(torch::equal(lora.parameters()[i], ref_lora.parameters()[i]))
          << dtype << " " << i;
      EXPECT_FALSE(torch::equal(lora.parameters()[i], initial[i])) << i;  // it trained
    }
  }
}

TEST(CudaFrozenWeights, QloraRunsOnTheDeviceAsOnTheCpu) {
  FRUGAL_SKIP_WITHOUT_CUDA();
  LoraNet cpu, gpu;
  gpu->to(torch::kCUDA);
  const auto options = frugal::nn::FrozenWeightsOptions().dtype(torch::kFloat);
  frugal::nn::FrozenWeights base_cpu(options), base_gpu(options);
  for (std::size_t i = 0; i < cpu->units().size(); ++i) {
    base_cpu.add_module(cpu->units()[i]);
    base_gpu.add_module(gpu->units()[i]);
  }
  EXPECT_EQ(base_gpu.stored_bytes(), base_cpu.stored_bytes());
  frugal::nn::Lora lora_cpu(*cpu, cpu->units(), qlora_options());
  frugal::nn::Lora lora_gpu(*gpu, gpu->units(), qlora_options());
  {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < lora_cpu.parameters().size(); ++i) {
      lora_cpu.parameters()[i].fill_(0.01 * static_cast<double>(i + 1));
      lora_gpu.parameters()[i].copy_(lora_cpu.parameters()[i]);
    }
  }
  torch::manual_seed(5);
  const auto x = torch::randn({4, kDim});
  auto out_cpu = cpu->forward(x);
  auto out_gpu = gpu->forward(x.to(torch::kCUDA));
  EXPECT_TRUE(torch::allclose(out_gpu.cpu(), out_cpu, 1e-4, 1e-5));
  out_cpu.pow(2).sum().backward();
  out_gpu.pow(2).sum().backward();
  for (std::size_t i = 0; i < lora_cpu.parameters().size(); ++i) {
    EXPECT_TRUE(torch::allclose(lora_gpu.parameters()[i].grad().cpu(),
                                lora_cpu.parameters()[i].grad(), 1e-3, 1e-5))
        << i;
  }
}

namespace {

// A QLoRA run over a fresh LoraNet: NF4 base (float32 compute), adapters, AdamW, a Trainer.
struct QloraRun {
  QloraRun() : base(frugal::nn::FrozenWeightsOptions().dtype(torch::kFloat)) {
    for (auto& unit : net->units()) {
      base.add_module(unit);
    }
    lora = std::make_unique<frugal::nn::Lora>(*net, net->units(), qlora_options());
    adamw = std::make_unique<frugal::optim::AdamW>(lora->parameters(),
                                                   torch::optim::AdamWOptions(1e-2));
    trainer = std::make_unique<frugal::Trainer>(
        net, *adamw,
        [](const torch::Tensor& out, const torch::Tensor& t) { return torch::mse_loss(out, t); });
  }
  double step(const frugal::Batch& batch) { return trainer->step(batch).loss; }

  LoraNet net;
  frugal::nn::FrozenWeights base;
  std::unique_ptr<frugal::nn::Lora> lora;
  std::unique_ptr<frugal::optim::AdamW> adamw;
  std::unique_ptr<frugal::Trainer> trainer;
};

}  // namespace

TEST(FrozenWeights, AQloraRunSavedAndResumedEndsBitForBitAsOneThatWentOn) {
  const auto path = (std::filesystem::temp_directory_path() /
                     ("frugal_qlora_" + std::to_string(::getpid()) + ".frugal"))
                        .string();
  torch::manual_seed(5);
  const frugal::Batch batch(torch::randn({4, kDim}), torch::ones({4, 2}));
  QloraRun went_on;
  for (int i = 0; i < 3; ++i) {
    went_on.step(batch);
  }
  frugal::save_training_state(*went_on.trainer, path);
  std::vector<double> expected;
  for (int i = 0; i < 3; ++i) {
    expected.push_back(went_on.step(batch));
  }
  torch::manual_seed(77);  // other initial adapters: the load must bring the saved ones
  QloraRun resumed;
  frugal::load_training_state(*resumed.trainer, path);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(resumed.step(batch), expected[static_cast<std::size_t>(i)]) << i;
  }
  for (std::size_t i = 0; i < went_on.lora->parameters().size(); ++i) {
    EXPECT_TRUE(torch::equal(resumed.lora->parameters()[i], went_on.lora->parameters()[i])) << i;
  }
  std::filesystem::remove(path);
}
