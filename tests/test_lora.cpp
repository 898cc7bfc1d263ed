#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "frugal/io/safetensors.h"
#include "frugal/memory/memory_cap.h"
#include "frugal/memory/probe.h"
#include "frugal/nn/checkpoint.h"
#include "frugal/nn/frozen_weights.h"
#include "frugal/nn/lora.h"
#include "frugal/optim/adam.h"
#include "frugal/policy/checkpoint_policy.h"
#include "frugal/train/trainer.h"
#include "helpers.h"
#include "lora_net.h"
#include "nn/nf4.h"

namespace fs = std::filesystem;
using frugal::testing::expect_error_contains;

namespace {

using frugal::testing::kDim;
using frugal::testing::LoraBlockImpl;
using frugal::testing::LoraNet;

frugal::nn::LoraOptions options() {
  return frugal::nn::LoraOptions().rank(2).alpha(4).target_modules({"attn", "down"});
}

torch::Tensor inputs() {
  torch::manual_seed(5);
  return torch::randn({4, kDim});
}

// Gives every B random values, so that the adapters change the output.
void perturb(frugal::nn::Lora& lora) {
  torch::manual_seed(9);
  torch::NoGradGuard no_grad;
  for (auto& p : lora.parameters()) {
    p.copy_(torch::randn(p.sizes()) * 0.3);
  }
}

// The adapted model written out as PEFT computes it: base(x) + s * B(A(dropout(x))) on each
// layer, the masks drawn in the layers' order (none when p is 0).
torch::Tensor reference(LoraNet& net, const torch::Tensor& x0, double s, double p = 0) {
  auto adapted = [s, p](torch::nn::Linear& l, const torch::Tensor& x) {
    auto base = torch::nn::functional::linear(x, l->named_parameters(false)["weight"], l->bias);
    const auto a = l->named_children()["lora_A"]->named_parameters()["weight"];
    const auto b = l->named_children()["lora_B"]->named_parameters()["weight"];
    const auto in = p > 0 ? torch::dropout(x, p, /*train=*/true) : x;
    return base + s * in.mm(a.t()).mm(b.t());
  };
  auto x = x0;
  for (std::size_t i = 0; i < net->list->size(); ++i) {
    auto blk = net->list->ptr<LoraBlockImpl>(i);
    auto h = x + torch::tanh(adapted(blk->attn, x));
    x = h + adapted(blk->down, torch::tanh(blk->up(h)));
  }
  return net->head(x);
}

}  // namespace

TEST(Lora, AdaptsTheChosenLayersFreezesTheRestAndStartsFromTheBaseOutput) {
  LoraNet net;
  const auto x = inputs();
  const auto before = net->forward(x).detach();
  frugal::nn::Lora lora(*net, net->units(), options());
  EXPECT_EQ(lora.adapted(),
            (std::vector<std::string>{"blocks.0.attn", "blocks.0.down", "blocks.1.attn",
                                      "blocks.1.down", "blocks.2.attn", "blocks.2.down"}));
  EXPECT_EQ(lora.parameters().size(), 12U);
  EXPECT_DOUBLE_EQ(lora.scaling(), 2.0);
  for (const auto& p : net->named_parameters()) {
    const bool adapter = p.key().find(".lora_") != std::string::npos;
    EXPECT_EQ(p.value().requires_grad(), adapter) << p.key();
  }
  const auto a = net->named_parameters()["blocks.1.down.lora_A.weight"];
  EXPECT_EQ(a.sizes(), (torch::IntArrayRef{2, 2 * kDim}));
  EXPECT_LE(a.abs().max().item<float>(),
            1 / std::sqrt(2.0 * kDim));  // Kaiming-uniform, a = sqrt(5)
  EXPECT_EQ(net->named_parameters()["blocks.1.down.lora_B.weight"].abs().sum().item<float>(), 0);
  // B is zero: the output is the base model's, bit for bit.
  EXPECT_TRUE(torch::equal(net->forward(x), before));
}

TEST(Lora, OutputsAndAdapterGradientsArePeftsWithPlainOrCheckpointedUnits) {
  for (const bool checkpointed : {false, true}) {
    LoraNet net;
    frugal::nn::Lora lora(*net, net->units(), options());
    perturb(lora);
    std::shared_ptr<frugal::CheckpointPolicy> policy;
    if (checkpointed) {
      policy = std::make_shared<frugal::CheckpointPolicy>(frugal::CheckpointSelect().every(1));
      policy->apply(*net);
    }
    const auto x = inputs().requires_grad_();  // every layer's backward needs its weight
    auto out = net->forward(x);
    frugal::testing::expect_weights_wait_for_backward(net, checkpointed);
    for (std::size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(net->list->ptr<LoraBlockImpl>(i)->attn->weight.numel(), 0) << "outside its unit";
    }
    out.pow(2).sum().backward();
    const auto grads = frugal::testing::clone_all(frugal::testing::grads_of(*net));
    policy.reset();
    for (auto& p : lora.parameters()) {
      p.mutable_grad() = torch::Tensor();
    }
    auto ref = reference(net, x, lora.scaling());
    EXPECT_TRUE(torch::allclose(out, ref, 1e-5, 1e-6)) << (checkpointed ? "checkpointed" : "plain");
    ref.pow(2).sum().backward();
    const auto ref_grads = frugal::testing::grads_of(*net);
    ASSERT_EQ(grads.size(), ref_grads.size());
    for (std::size_t i = 0; i < grads.size(); ++i) {
      ASSERT_EQ(grads[i].defined(), ref_grads[i].defined()) << i;
      if (grads[i].defined()) {
        EXPECT_TRUE(torch::allclose(grads[i], ref_grads[i], 1e-5, 1e-6)) << i;
      }
    }
  }
}

namespace {

// LoRA with dropout on `device` against the hand-written reference, from one seed, for a plain
// and an NF4 base, plain and checkpointed units.
void expect_dropout_as_peft(const torch::Device& device) {
  constexpr double p = 0.25;
  const double rtol = device.is_cuda() ? 1e-3 : 1e-5;  // the device's own product kernels
  const double atol = device.is_cuda() ? 1e-5 : 1e-6;
  for (const bool stored : {false, true}) {
    for (const bool checkpointed : {false, true}) {
      SCOPED_TRACE(std::string(stored ? "NF4 base" : "plain base") +
                   (checkpointed ? ", checkpointed" : ""));
      // The reference: a model of plain weights (the store's decoded values), its adapters
      // applied by hand.
      LoraNet net(3, /*own_calls=*/true), ref;
      net->to(device);
      ref->to(device);
      std::unique_ptr<frugal::nn::FrozenWeights> store;
      if (stored) {
        store = std::make_unique<frugal::nn::FrozenWeights>(
            frugal::nn::FrozenWeightsOptions().dtype(torch::kFloat));
        for (auto& unit : net->units()) {
          store->add_module(unit);
        }
        frugal::testing::replace_block_weights(ref, [](const torch::Tensor& w) {
          namespace fd = frugal::nn::detail;
          return fd::nf4_dequantize(fd::nf4_quantize(w), torch::kFloat);
        });
      }
      frugal::nn::Lora lora(*net, net->units(), options().dropout(p));
      frugal::nn::Lora ref_lora(*ref, ref->units(), options());
      perturb(lora);
      {
        torch::NoGradGuard no_grad;
        for (std::size_t i = 0; i < lora.parameters().size(); ++i) {
          ref_lora.parameters()[i].copy_(lora.parameters()[i]);
        }
      }
      std::shared_ptr<frugal::CheckpointPolicy> policy;
      if (checkpointed) {
        policy = std::make_shared<frugal::CheckpointPolicy>(frugal::CheckpointSelect().every(1));
        policy->apply(*net);
      }
      const auto x = inputs().to(device).requires_grad_();
      torch::manual_seed(21);
      auto out = net->forward(x);
      out.pow(2).sum().backward();  // a checkpointed block draws its masks again here
      torch::manual_seed(21);
      auto expected = reference(ref, x, lora.scaling(), p);
      EXPECT_TRUE(torch::allclose(out, expected, rtol, atol));
      expected.pow(2).sum().backward();
      for (std::size_t i = 0; i < lora.parameters().size(); ++i) {
        EXPECT_TRUE(torch::allclose(lora.parameters()[i].grad(), ref_lora.parameters()[i].grad(),
                                    rtol, atol))
            << i;
      }
      // The masks mattered; in eval mode nothing is dropped.
      torch::NoGradGuard no_grad;
      const auto whole = reference(ref, x, lora.scaling());
      EXPECT_FALSE(torch::allclose(out, whole, 1e-3, 1e-4));
      net->eval();
      EXPECT_TRUE(torch::allclose(net->forward(x), whole, rtol, atol));
    }
  }
}

}  // namespace

TEST(Lora, DropoutMasksTheAdaptersInputAsPeftWithPlainStoredOrCheckpointedUnits) {
  expect_dropout_as_peft(torch::kCPU);
  // A model that calls its adapted layers directly finds no weight in them: it fails loudly
  // instead of leaving the adapters out.
  LoraNet direct;
  frugal::nn::Lora lora(*direct, direct->units(), options().dropout(0.25));
  EXPECT_ANY_THROW(direct->forward(inputs()));
}

TEST(CudaLora, DropoutMasksTheAdaptersInputOnTheDeviceAsPeft) {
  FRUGAL_SKIP_WITHOUT_CUDA();
  expect_dropout_as_peft(torch::kCUDA);
}

TEST(Lora, MergeRunsTheBaseAloneAndUnmergeRestoresItBitForBit) {
  LoraNet net;
  frugal::nn::Lora lora(*net, net->units(), options());
  perturb(lora);
  const auto x = inputs();
  const auto folded = net->forward(x).detach();
  const auto base = net->named_parameters()["blocks.0.attn.weight"].clone();
  lora.merge();
  EXPECT_TRUE(lora.merged());
  EXPECT_FALSE(torch::equal(net->named_parameters()["blocks.0.attn.weight"], base));
  EXPECT_TRUE(torch::allclose(net->forward(x), folded, 1e-5, 1e-6));
  lora.unmerge();
  EXPECT_TRUE(torch::equal(net->named_parameters()["blocks.0.attn.weight"], base));
  EXPECT_TRUE(torch::equal(net->forward(x), folded));
}

TEST(Lora, GoingWhileMergedUnderAMemoryCapPutsTheBaseBackWithoutAllocating) {
  LoraNet net;
  const auto base = net->named_parameters()["blocks.0.attn.weight"].clone();
  auto lora = std::make_unique<frugal::nn::Lora>(*net, net->units(), options());
  perturb(*lora);
  lora->merge();
  ASSERT_FALSE(torch::equal(net->named_parameters()["blocks.0.attn.weight"], base));
  {
    frugal::MemoryProbe probe(torch::kCPU);
    frugal::ScopedMemoryCap cap(torch::kCPU, probe.allocated() + 64);
    lora.reset();  // unmerging puts back the weights kept aside: no room is needed
  }
  EXPECT_TRUE(torch::equal(net->named_parameters()["blocks.0.attn.weight"], base));
}

TEST(Lora, TrainsTheAdaptersOnlyInTheTrainer) {
  LoraNet net;
  const auto frozen = frugal::testing::clone_all(net->parameters());
  frugal::nn::Lora lora(*net, net->units(), options());
  frugal::optim::AdamW adamw(lora.parameters(), torch::optim::AdamWOptions(0.05));
  frugal::Trainer trainer(net, adamw, [](const torch::Tensor& out, const torch::Tensor& t) {
    return torch::mse_loss(out, t);
  });
  const auto x = inputs();
  const auto y = torch::ones({4, 2});
  std::vector<double> losses;
  for (int i = 0; i < 8; ++i) {
    losses.push_back(trainer.step(frugal::Batch(x, y)).loss);
  }
  EXPECT_LT(losses.back(), 0.8 * losses.front());
  std::size_t i = 0;
  for (const auto& p : net->named_parameters()) {
    if (p.key().find(".lora_") == std::string::npos) {
      EXPECT_TRUE(torch::equal(p.value(), frozen[i++])) << p.key();
    }
  }
}

TEST(Lora, SavesAndLoadsPeftsFilesAndRefusesAdaptersThatDoNotFit) {
  const auto dir = fs::temp_directory_path() / ("frugal_lora_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  LoraNet net;
  frugal::nn::Lora lora(*net, net->units(), options());
  perturb(lora);
  lora.save(dir.string());
  const frugal::io::SafetensorsFile file((dir / "adapter_model.safetensors").string());
  EXPECT_EQ(file.names().size(), 12U);
  EXPECT_TRUE(file.contains("base_model.model.blocks.2.down.lora_B.weight"));
  const auto config = frugal::nn::read_lora_config(dir.string());
  EXPECT_EQ(config.rank(), 2);
  EXPECT_EQ(config.alpha(), 4);
  EXPECT_EQ(config.target_modules(), (std::vector<std::string>{"attn", "down"}));

  LoraNet other;
  frugal::nn::Lora theirs(*other, other->units(), options());
  theirs.load(dir.string());
  for (std::size_t i = 0; i < lora.parameters().size(); ++i) {
    EXPECT_TRUE(torch::equal(theirs.parameters()[i], lora.parameters()[i])) << i;
  }
  EXPECT_TRUE(torch::equal(other->forward(inputs()), net->forward(inputs())));

  LoraNet third;
  frugal::nn::Lora wrong(*third, third->units(), options().rank(3));
  const auto before = frugal::testing::clone_all(wrong.parameters());
  expect_error_contains([&] { wrong.load(dir.string()); }, "r is 2 in the file and 3 here");
  LoraNet fourth;
  frugal::nn::Lora more(*fourth, fourth->units(), options().target_modules({"attn", "down", "up"}));
  expect_error_contains([&] { more.load(dir.string()); },
                        "the file has no 'base_model.model.blocks.0.up.lora_A.weight'");
  for (std::size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(wrong.parameters()[i], before[i]));
  }
  fs::remove_all(dir);
}

TEST(Lora, RefusesBadOptionsAndLayersOutsideEveryUnitChangingNothing) {
  LoraNet net;
  const auto x = inputs();
  const auto out = net->forward(x).detach();
  expect_error_contains([&] { frugal::nn::Lora l(*net, net->units(), options().rank(0)); },
                        "rank must be >= 1, got 0");
  expect_error_contains([&] { frugal::nn::Lora l(*net, net->units(), options().dropout(1)); },
                        "dropout must be in [0, 1), got 1");
  expect_error_contains([&] { frugal::nn::Lora l(*net, net->units(), options().dropout(-0.1)); },
                        "dropout must be in [0, 1), got -0.1");
  {
    std::vector<std::shared_ptr<torch::nn::Module>> layers;
    for (std::size_t i = 0; i < net->list->size(); ++i) {
      const auto block = net->list->ptr<LoraBlockImpl>(i);
      layers.push_back(block->attn.ptr());
      layers.push_back(block->down.ptr());
    }
    expect_error_contains(
        [&] { frugal::nn::Lora l(*net, layers, options().dropout(0.1)); },
        "layer 'blocks.0.attn' is a unit itself; with dropout its adapters run around its own");
  }
  expect_error_contains(
      [&] { frugal::nn::Lora l(*net, net->units(), options().target_modules({"nothing"})); },
      "target_modules nothing match no Linear layer");
  expect_error_contains(
      [&] {
        frugal::nn::Lora l(*net, net->units(), options().target_modules({"attn", "head"}));
      },
      "layer 'head' is chosen for LoRA but lies in none of the units");
  for (const auto& p : net->parameters()) {
    EXPECT_TRUE(p.requires_grad());
  }
  EXPECT_TRUE(torch::equal(net->forward(x), out));
  {
    frugal::nn::Lora lora(*net, net->units(), options());
    expect_error_contains([&] { frugal::nn::Lora again(*net, {}, options()); },
                          "has LoRA adapters already");
  }
  // Gone: the model is as it was.
  EXPECT_EQ(net->parameters().size(), 3U * 6U + 2U);
  for (const auto& p : net->parameters()) {
    EXPECT_TRUE(p.requires_grad());
  }
  EXPECT_TRUE(torch::equal(net->forward(x), out));
}
