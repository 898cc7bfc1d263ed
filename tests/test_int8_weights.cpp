// Weights stored in 8 bits, materialised one unit at a time, updated in their codes.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <sstream>

#include "frugal/frugal.h"
#include "helpers.h"
#include "optim/weight_codes.h"

namespace {
namespace int8_weights_test {

namespace fo = frugal::optim;
using frugal::nn::Int8Weights;
using frugal::nn::Int8WeightsOptions;

// Two matrices (stored) and two biases (kept in bfloat16); records the stored bytes that
// are materialised while it runs, forward and backward.
// With `parts`, the two Linear layers are called through frugal::nn::call (each may be a
// unit of its own).
struct BlockImpl : torch::nn::Module {
  BlockImpl(std::int64_t dim, const Int8Weights* int8, bool parts = false)
      : up(register_module("up", torch::nn::Linear(dim, 4 * dim))),
        down(register_module("down", torch::nn::Linear(4 * dim, dim))),
        int8(int8),
        parts(parts) {}
  torch::Tensor forward(const torch::Tensor& x) {
    seen.push_back(materialised());
    auto h = parts ? frugal::nn::call(up, x) : up(x);
    if (h.requires_grad()) {
      h.register_hook([this](const torch::Tensor&) { seen.push_back(materialised()); });
    }
    const auto g = torch::gelu(h);
    return x + (parts ? frugal::nn::call(down, g) : down(g));
  }
  std::int64_t materialised() const { return int8 != nullptr ? int8->materialised_bytes() : 0; }
  torch::nn::Linear up, down;
  const Int8Weights* int8;
  bool parts;
  std::vector<std::int64_t> seen;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  // Built unit by unit: each block is stored as soon as it is made (when `int8` is given),
  // as one unit, or with `parts` as two (its layers).
  NetImpl(std::int64_t dim, int layers, Int8Weights* int8, bool parts = false)
      : blocks(register_module("blocks", torch::nn::ModuleList())),
        head(register_module("head", torch::nn::Linear(dim, 1))) {
    for (int i = 0; i < layers; ++i) {
      Block block(dim, int8, parts);
      if (int8 != nullptr && parts) {
        int8->add(block->up);
        int8->add(block->down);
      } else if (int8 != nullptr) {
        int8->add(block);
      }
      blocks->push_back(block);
    }
    head->to(torch::kBFloat16);
  }
  torch::Tensor forward(torch::Tensor x) {
    for (std::size_t i = 0; i < blocks->size(); ++i) {
      x = frugal::nn::call(blocks->ptr<BlockImpl>(i), x);
    }
    return head(x);
  }
  torch::nn::ModuleList blocks;
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

constexpr std::int64_t kDim = 64;

struct Model {
  // The blocks are made in float32 and run in bfloat16 unless `o` says otherwise.
  explicit Model(Int8WeightsOptions o = {}, int layers = 3, std::uint64_t seed = 11,
                 bool parts = false)
      : int8(o.dtype() ? o : Int8WeightsOptions(o).dtype(torch::kBFloat16)),
        net((torch::manual_seed(seed), Net(kDim, layers, &int8, parts))) {}
  Int8Weights int8;
  Net net;
};

// A regression batch in bfloat16.
std::pair<torch::Tensor, torch::Tensor> batch(std::uint64_t seed) {
  torch::manual_seed(seed);
  const auto x = torch::randn({32, kDim});
  const auto y = x.sum(1, true).sin();
  return {x.to(torch::kBFloat16), y};
}

torch::Tensor loss_of(Net& net, const torch::Tensor& x, const torch::Tensor& y) {
  return torch::mse_loss(net->forward(x).to(torch::kFloat), y);
}

// A Trainer of `net` by `optimizer` on the mean squared error (computed in float32).
std::unique_ptr<frugal::Trainer> mse_trainer(Net& net, torch::optim::Optimizer& optimizer) {
  return std::make_unique<frugal::Trainer>(net, optimizer,
                                           [](const torch::Tensor& out, const torch::Tensor& t) {
                                             return torch::mse_loss(out.to(torch::kFloat), t);
                                           });
}

std::vector<torch::Tensor> codes_of(Net& net) {
  std::vector<torch::Tensor> out;
  for (const auto& b : net->named_buffers()) {
    out.push_back(b.value().clone());
  }
  return out;
}

bool same(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) {
    return false;
  }
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i].view(torch::kUInt8), b[i].view(torch::kUInt8))) {
      std::cout << "buffer " << i << " of " << a.size() << " differs in "
                << a[i].view(torch::kUInt8).ne(b[i].view(torch::kUInt8)).sum().item<std::int64_t>()
                << " bytes\n";
      return false;
    }
  }
  return true;
}

// A unit's stored bytes when materialised in bfloat16.
std::int64_t unit_bytes() { return 2 * (kDim * 4 * kDim) * 2; }

TEST(Int8Weights, StoresMatricesAsCodesAndKeepsVectorsInBfloat16) {
  Model m;
  EXPECT_EQ(m.int8.stored_elements(), 3 * 2 * kDim * 4 * kDim);
  // 1 byte a code, 4 bytes (zero point, scale) a group of 128.
  EXPECT_EQ(m.int8.stored_bytes(), m.int8.stored_elements() + m.int8.stored_elements() / 128 * 4);
  auto block = m.net->blocks->ptr<BlockImpl>(0);
  EXPECT_EQ(block->up->weight.numel(), 0);  // released: no bytes, same tensor
  EXPECT_EQ(block->up->weight.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(block->up->bias.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(block->up->bias.numel(), 4 * kDim);
  EXPECT_TRUE(block->named_buffers().contains("up.weight_codes"));
  EXPECT_TRUE(block->named_buffers().contains("up.weight_qparams"));
  EXPECT_EQ(m.int8.materialised_bytes(), 0);
}

TEST(Int8Weights, AUnitIsMaterialisedOnlyWhileItRunsForwardAndBackward) {
  for (const bool checkpointed : {false, true}) {
    Model m;
    fo::SGD none(m.net->parameters(), torch::optim::SGDOptions(0.0));
    const auto [x, y] = batch(1);
    frugal::Trainer trainer(m.net, none, [](const torch::Tensor& out, const torch::Tensor& t) {
      return torch::mse_loss(out.to(torch::kFloat), t);
    });
    if (checkpointed) {
      trainer.add_policy(std::make_shared<frugal::CheckpointPolicy>(
          frugal::CheckpointSelect().names({"blocks.0", "blocks.1", "blocks.2"})));
    }
    trainer.step(frugal::Batch(x, y));
    for (std::size_t i = 0; i < 3; ++i) {
      const auto& seen = m.net->blocks->ptr<BlockImpl>(i)->seen;
      // forward, its recompute when checkpointed, and the hook in backward
      ASSERT_EQ(seen.size(), checkpointed ? 3U : 2U) << i;
      for (const auto bytes : seen) {
        EXPECT_EQ(bytes, unit_bytes()) << "block " << i << (checkpointed ? " checkpointed" : "");
      }
    }
    EXPECT_EQ(m.int8.materialised_bytes(), 0);
  }
}

TEST(Int8Weights, BetweenStepsTheLedgerCountsCodesAndStatisticsAsTheWeights) {
  frugal::MemoryProbe probe(torch::kCPU);
  Model m;
  fo::AdamW adamw(m.net->parameters(), torch::optim::AdamWOptions(1e-3));
  frugal::Trainer trainer(m.net, adamw, [](const torch::Tensor& out, const torch::Tensor& t) {
    return torch::mse_loss(out.to(torch::kFloat), t);
  });
  trainer.add_policy(std::make_shared<frugal::StepInBackward>());
  const auto [x, y] = batch(2);
  trainer.step(frugal::Batch(x, y));
  std::int64_t vectors = 0;  // the parameters kept in bfloat16 (released ones hold nothing)
  for (const auto& p : m.net->parameters()) {
    vectors += static_cast<std::int64_t>(p.nbytes());
  }
  const auto ledger = frugal::measure_ledger(probe, *m.net, &adamw);
  EXPECT_EQ(ledger.weights, m.int8.stored_bytes() + vectors);
  EXPECT_EQ(ledger.gradients, 0);  // stepped in backward: each went at once
  // AdamW's two bfloat16 moments of every element, stored or not.
  EXPECT_EQ(ledger.optimizer, 2 * 2 * (m.int8.stored_elements() + vectors / 2));
}

TEST(Int8Weights, ARecordedStepCountsAWholeUnitAsMaterialisedWeights) {
  Model m;
  fo::AdamW adamw(m.net->parameters(), torch::optim::AdamWOptions(1e-3));
  auto trainer = mse_trainer(m.net, adamw);
  trainer->add_policy(std::make_shared<frugal::StepInBackward>());
  const auto [x, y] = batch(2);
  trainer->step(frugal::Batch(x, y));  // the optimizer's state exists
  frugal::MemoryRecorder recorder;
  recorder.watch(*m.net, &adamw);
  trainer->step(frugal::Batch(x, y));
  recorder.stop();
  const auto peak = recorder.peak();
  std::int64_t materialised = 0, weights = 0;
  for (const auto& g : peak.groups) {
    materialised += g.category == frugal::MemoryCategory::MaterialisedWeights ? g.bytes : 0;
    weights += g.category == frugal::MemoryCategory::Weights ? g.bytes : 0;
  }
  std::int64_t vectors = 0;
  for (const auto& p : m.net->parameters()) {
    vectors += static_cast<std::int64_t>(p.nbytes());
  }
  // One block is whole at the step's peak, and only its bytes are materialised weights;
  // the weights are the codes, statistics and vectors.
  EXPECT_EQ(materialised, unit_bytes()) << peak.summary();
  EXPECT_EQ(weights, m.int8.stored_bytes() + vectors) << peak.summary();
  EXPECT_NE(peak.summary().find("weights (materialised)"), std::string::npos);
}

// Trains `m` for `steps` steps of AdamW stepped in backward; the losses.
std::vector<float> train(Net& net, fo::Rounding rounding, int steps, double lr = 3e-3) {
  fo::AdamW adamw(net->parameters(), torch::optim::AdamWOptions(lr),
                  fo::InPlaceOptions().rounding(rounding).seed(3));
  frugal::Trainer trainer(net, adamw, [](const torch::Tensor& out, const torch::Tensor& t) {
    return torch::mse_loss(out.to(torch::kFloat), t);
  });
  trainer.add_policy(std::make_shared<frugal::StepInBackward>());
  std::vector<float> losses;
  for (int s = 0; s < steps; ++s) {
    const auto [x, y] = batch(100 + s % 4);
    losses.push_back(static_cast<float>(trainer.step(frugal::Batch(x, y)).loss));
  }
  return losses;
}

TEST(Int8Weights, TrainsAsBfloat16WeightsDo) {
  Model m;
  torch::manual_seed(11);
  Net plain(kDim, 3, nullptr);
  plain->to(torch::kBFloat16);
  const auto coded = train(m.net, fo::Rounding::Stochastic, 60);
  const auto reference = train(plain, fo::Rounding::Stochastic, 60);
  const auto tail = [](const std::vector<float>& l) {
    return (l[l.size() - 1] + l[l.size() - 2] + l[l.size() - 3] + l[l.size() - 4]) / 4;
  };
  EXPECT_LT(tail(coded), 0.3 * coded.front());
  EXPECT_LT(tail(coded), 1.5 * tail(reference)) << tail(coded) << " vs " << tail(reference);
}

TEST(Int8Weights, StochasticRoundingKeepsUpdatesTooSmallForAStep) {
  // SGD on the sum of the first block's weights: every element moves by -lr a step, a
  // tenth of a code's step or less; nearest rounding loses what stochastic rounding keeps.
  std::vector<double> moved;
  double lr = 0;
  for (const auto rounding : {fo::Rounding::Stochastic, fo::Rounding::Nearest}) {
    Model m;
    auto block = m.net->blocks->ptr<BlockImpl>(0);
    const auto& stored = *fo::detail::stored_weights(block->up->weight);
    lr = stored.qparams.select(1, 1).to(torch::kFloat).min().item<double>() / 10;
    const auto mean = [&] {
      auto decoded = torch::empty({4 * kDim, kDim});
      fo::detail::dequantize_into(stored, decoded);
      return decoded.to(torch::kDouble).mean().item<double>();
    };
    const double before = mean();
    fo::SGD sgd(std::vector<torch::Tensor>{block->up->weight}, torch::optim::SGDOptions(lr),
                fo::InPlaceOptions().rounding(rounding));
    for (int s = 0; s < 20; ++s) {
      block->up->weight.mutable_grad() = torch::ones({4 * kDim, kDim}, torch::kBFloat16);
      sgd.step();
    }
    moved.push_back(mean() - before);
  }
  const double expected = -20 * lr;
  EXPECT_NEAR(moved[0], expected, 0.1 * std::abs(expected)) << moved[0];
  EXPECT_GT(std::abs(moved[1] - expected), 3 * std::abs(moved[0] - expected)) << moved[1];
}

enum class Stepping { AfterBackward, InBackward, LoopBackwardStep, InBackwardCheckpointed };

// The codes after three steps of AdamW8bit (nearest rounding) taken as `how` says.
std::vector<torch::Tensor> codes_after_three_steps(Stepping how) {
  Model m;
  fo::AdamW8bit adamw(m.net->parameters(), torch::optim::AdamWOptions(1e-3),
                      fo::QuantizedStateOptions(),
                      fo::InPlaceOptions().rounding(fo::Rounding::Nearest));
  auto trainer = mse_trainer(m.net, adamw);
  if (how == Stepping::InBackward || how == Stepping::InBackwardCheckpointed) {
    trainer->add_policy(std::make_shared<frugal::StepInBackward>());
  }
  if (how == Stepping::InBackwardCheckpointed) {
    trainer->add_policy(std::make_shared<frugal::CheckpointPolicy>(
        frugal::CheckpointSelect().names({"blocks.0", "blocks.1", "blocks.2"})));
  }
  frugal::Loop loop;
  auto& model = loop.prepare(m.net, adamw, "net");
  for (int s = 0; s < 3; ++s) {
    const auto [x, y] = batch(200 + s);
    if (how == Stepping::LoopBackwardStep) {
      EXPECT_TRUE(loop.backward_step(loss_of(m.net, x, y), model));
    } else {
      trainer->step(frugal::Batch(x, y));
    }
  }
  EXPECT_EQ(m.int8.materialised_bytes(), 0);
  return codes_of(m.net);
}

TEST(Int8Weights, TheStepInBackwardWritesTheCodesTheStepAfterBackwardWrites) {
  EXPECT_TRUE(same(codes_after_three_steps(Stepping::AfterBackward),
                   codes_after_three_steps(Stepping::InBackward)));
}

// The checkpoint keeps what the recompute would change twice (running statistics), not
// the codes, which the step writes during the block's backward.
TEST(Int8Weights, CheckpointedBlocksKeepTheCodesTheStepInBackwardWrites) {
  const auto plain = codes_after_three_steps(Stepping::InBackward);
  Model untrained;
  EXPECT_FALSE(same(plain, codes_of(untrained.net)));  // the steps moved them
  EXPECT_TRUE(same(codes_after_three_steps(Stepping::InBackwardCheckpointed), plain));
}

TEST(Int8Weights, TheLoopsBackwardStepWritesTheCodesOfTheTrainersStepInBackward) {
  EXPECT_TRUE(same(codes_after_three_steps(Stepping::InBackward),
                   codes_after_three_steps(Stepping::LoopBackwardStep)));
}

TEST(Int8Weights, MicroBatchesMaterialiseOneUnitAtATimeAndTrain) {
  Model m;
  fo::AdamW adamw(m.net->parameters(), torch::optim::AdamWOptions(3e-3));
  frugal::Trainer trainer(
      m.net, adamw,
      [](const torch::Tensor& out, const torch::Tensor& t) {
        return torch::mse_loss(out.to(torch::kFloat), t);
      },
      frugal::TrainerOptions().micro_batches(4));
  trainer.add_policy(std::make_shared<frugal::StepInBackward>());
  std::vector<double> losses;
  for (int s = 0; s < 30; ++s) {
    const auto [x, y] = batch(500 + s % 4);
    losses.push_back(trainer.step(frugal::Batch(x, y)).loss);
  }
  for (std::size_t i = 0; i < 3; ++i) {
    for (const auto bytes : m.net->blocks->ptr<BlockImpl>(i)->seen) {
      ASSERT_EQ(bytes, unit_bytes()) << "block " << i;
    }
  }
  EXPECT_LT(losses.back(), 0.5 * losses.front());
}

// A checkpointed block whose layers are units: in the recompute's backward each layer is
// released as soon as its gradient is in (taken by the step), so when the gradient reaches
// the first layer's output only that layer is whole; and the codes are those of blocks
// that are units.
TEST(Int8Weights, LayersOfACheckpointedBlockAreUnitsOneWholeAtATime) {
  const auto codes_after = [](bool parts) {
    Model m(Int8WeightsOptions(), 3, 11, parts);
    fo::AdamW8bit adamw(m.net->parameters(), torch::optim::AdamWOptions(1e-3),
                        fo::QuantizedStateOptions(),
                        fo::InPlaceOptions().rounding(fo::Rounding::Nearest));
    auto trainer = mse_trainer(m.net, adamw);
    trainer->add_policy(std::make_shared<frugal::StepInBackward>());
    trainer->add_policy(std::make_shared<frugal::CheckpointPolicy>(
        frugal::CheckpointSelect().names({"blocks.0", "blocks.1", "blocks.2"})));
    for (int s = 0; s < 3; ++s) {
      const auto [x, y] = batch(300 + s);
      trainer->step(frugal::Batch(x, y));
    }
    for (std::size_t i = 0; i < 3; ++i) {
      const auto& seen = m.net->blocks->ptr<BlockImpl>(i)->seen;
      // each step: the forward (nothing whole yet when parts), the recompute, the hook
      EXPECT_EQ(seen.size(), 3U * 3U) << i;
      for (std::size_t k = 0; k < seen.size(); ++k) {
        const auto expected = !parts ? unit_bytes() : k % 3 == 2 ? unit_bytes() / 2 : 0;
        EXPECT_EQ(seen[k], expected) << "block " << i << " record " << k;
      }
    }
    EXPECT_EQ(m.int8.materialised_bytes(), 0);
    return codes_of(m.net);
  };
  EXPECT_TRUE(same(codes_after(true), codes_after(false)));
}

TEST(Int8Weights, TheFusedAdam8bitStepIsTheFloat32StepOfTheDecodedWeightsEncodedAgain) {
  Model m(Int8WeightsOptions(), 1);
  auto block = m.net->blocks->ptr<BlockImpl>(0);
  const auto [x, y] = batch(3);
  loss_of(m.net, x, y).backward();
  auto& w = block->up->weight;
  const auto& stored = *fo::detail::stored_weights(w);
  // The reference: float32 weights decoded from the codes, the bfloat16 gradient widened.
  auto reference = torch::empty({4 * kDim, kDim});
  fo::detail::dequantize_into(stored, reference);
  reference.set_requires_grad(true);
  reference.mutable_grad() = w.grad().to(torch::kFloat);
  for (int s = 0; s < 2; ++s) {
    fo::AdamW8bit coded(std::vector<torch::Tensor>{w}, torch::optim::AdamWOptions(1e-2),
                        fo::QuantizedStateOptions().min_elements(1),
                        fo::InPlaceOptions().rounding(fo::Rounding::Nearest));
    fo::AdamW8bit wide(std::vector<torch::Tensor>{reference}, torch::optim::AdamWOptions(1e-2),
                       fo::QuantizedStateOptions().min_elements(1));
    coded.step();
    wide.step();
    const auto [codes, qparams] = fo::detail::quantize_weights(reference.detach(), 128);
    EXPECT_TRUE(torch::equal(codes, stored.codes)) << "step " << s;
    EXPECT_TRUE(torch::equal(qparams.view(torch::kInt16), stored.qparams.view(torch::kInt16)));
    fo::detail::dequantize_into(stored, reference.detach());
  }
}

TEST(Int8Weights, SgdWritesTheCodesOfItsFloat32Result) {
  Model m(Int8WeightsOptions().group(96), 1);  // groups that divide no kernel's block
  auto block = m.net->blocks->ptr<BlockImpl>(0);
  const auto [x, y] = batch(4);
  loss_of(m.net, x, y).backward();
  auto& w = block->down->weight;
  const auto& stored = *fo::detail::stored_weights(w);
  auto expected = torch::empty({kDim, 4 * kDim});
  fo::detail::dequantize_into(stored, expected);
  expected.sub_(w.grad().to(torch::kFloat), 0.5);
  fo::SGD sgd(std::vector<torch::Tensor>{w}, torch::optim::SGDOptions(0.5),
              fo::InPlaceOptions().rounding(fo::Rounding::Nearest).chunk(200));
  sgd.step();
  const auto [codes, qparams] = fo::detail::quantize_weights(expected, 96);
  EXPECT_TRUE(torch::equal(codes, stored.codes));
  EXPECT_TRUE(torch::equal(qparams.view(torch::kInt16), stored.qparams.view(torch::kInt16)));
}

TEST(Int8Weights, ResumingFromASavedTrainingStateContinuesBitForBit) {
  const auto path = ::testing::TempDir() + "int8_weights_resume.pt";
  // `first` steps, a save, `second` steps; batches from number 300 + `skip` on.
  const auto run = [&](int first, int second, int skip, bool save, bool load) {
    Model m;
    fo::AdamW8bit adamw(m.net->parameters(), torch::optim::AdamWOptions(1e-3),
                        fo::QuantizedStateOptions().min_elements(1), fo::InPlaceOptions().seed(4));
    frugal::Trainer trainer(m.net, adamw, [](const torch::Tensor& out, const torch::Tensor& t) {
      return torch::mse_loss(out.to(torch::kFloat), t);
    });
    trainer.add_policy(std::make_shared<frugal::StepInBackward>());
    if (load) {
      frugal::load_training_state(trainer, path);
    }
    for (int s = 0; s < first + second; ++s) {
      if (s == first && save) {
        frugal::save_training_state(trainer, path);
      }
      const auto [x, y] = batch(300 + skip + s);
      trainer.step(frugal::Batch(x, y));
    }
    return codes_of(m.net);
  };
  const auto straight = run(3, 3, 0, true, false);
  const auto resumed = run(0, 3, 3, false, true);  // batches 303.. as the straight run's
  EXPECT_TRUE(same(straight, resumed));
  std::remove(path.c_str());
}

TEST(Int8Weights, AStepThatFailsLeavesCodesStatisticsAndStatesAsTheyWere) {
  Model m;
  const auto [x, y] = batch(5);
  loss_of(m.net, x, y).backward();
  const auto before = codes_of(m.net);
  fo::AdamW adamw(m.net->parameters(), torch::optim::AdamWOptions(1e-2));
  {
    // Too little room for the moments: the step fails before it changes anything.
    frugal::MemoryProbe probe(torch::kCPU);
    frugal::ScopedMemoryCap cap(torch::kCPU, probe.allocated() + 4096);
    EXPECT_THROW(adamw.step(), c10::Error);
  }
  EXPECT_TRUE(same(before, codes_of(m.net)));
  EXPECT_TRUE(adamw.state().empty());
  adamw.step();  // and then it goes through
  EXPECT_FALSE(same(before, codes_of(m.net)));
}

TEST(Int8Weights, BadOptionsAndSecondAddsAreRefusedNamingThem) {
  frugal::testing::expect_error_contains([] { Int8Weights w(Int8WeightsOptions().group(0)); },
                                         "group must be 1 to 4096 elements, got 0");
  frugal::testing::expect_error_contains(
      [] { Int8Weights w(Int8WeightsOptions().dtype(torch::kHalf)); }, "got Half");
  Model m;
  Int8Weights other;
  frugal::testing::expect_error_contains([&] { other.add(m.net->blocks->ptr<BlockImpl>(0)); },
                                         "is a unit already");
  frugal::testing::expect_error_contains(
      [&] {
        Model cast;
        cast.net->to(torch::kFloat32);
        cast.net->forward(torch::zeros({1, kDim}));
      },
      "were cast to Float (Module::to(dtype) casts every buffer)");
  fo::AdamW adamw(m.net->parameters(), torch::optim::AdamWOptions(1e-3),
                  fo::InPlaceOptions().rounding(fo::Rounding::Compensated));
  const auto [x, y] = batch(6);
  loss_of(m.net, x, y).backward();
  const auto before = codes_of(m.net);
  frugal::testing::expect_error_contains([&] { adamw.step(); }, "not Compensated");
  EXPECT_TRUE(same(before, codes_of(m.net)));
}

TEST(Int8Weights, AUnitIsMaterialisedInTheDtypeItsWeightsHadWhenAdded) {
  torch::manual_seed(3);
  torch::nn::Linear f32(kDim, kDim);
  torch::nn::Linear bf16(nullptr);
  {
    frugal::nn::DefaultDtypeGuard made_in(torch::kBFloat16);
    bf16 = torch::nn::Linear(kDim, kDim);
  }
  Int8Weights int8;  // no dtype: each unit's own
  int8.add(f32);
  int8.add(bf16);
  const auto x = torch::randn({2, kDim});
  EXPECT_EQ(frugal::nn::call(f32, x).scalar_type(), torch::kFloat);
  EXPECT_EQ(frugal::nn::call(bf16, x.to(torch::kBFloat16)).scalar_type(), torch::kBFloat16);
  EXPECT_EQ(f32->bias.scalar_type(), torch::kFloat);
  // A dtype the codec does not make whole in is named, with the way out.
  torch::nn::Linear f64(torch::nn::LinearOptions(kDim, kDim));
  f64->to(torch::kDouble);
  frugal::testing::expect_error_contains([&] { int8.add(f64); },
                                         "has Double weights; Int8Weights makes them whole in "
                                         "bfloat16 or float32: say which with "
                                         "Int8WeightsOptions::dtype");
}

TEST(Int8Weights, CodesLoadedUnderOtherGroupsOrShapesAreRefusedNamingTheBuffer) {
  const auto path = (std::filesystem::temp_directory_path() /
                     ("frugal_int8_groups_" + std::to_string(::getpid()) + ".pt"))
                        .string();
  const auto [x, y] = batch(8);
  // Saved with groups of 4096 into groups of 16 (fewer statistics than the codes need: read
  // past their end before), and 64 into 128 (more: silently wrong weights before).
  for (const auto& [saved, loaded] : {std::pair<int, int>{4096, 16}, {64, 128}}) {
    Model from(Int8WeightsOptions().group(saved));
    Model into(Int8WeightsOptions().group(loaded));
    torch::save(from.net, path);
    torch::load(into.net, path);
    frugal::testing::expect_error_contains([&] { into.net->forward(x); },
                                           "cannot use their buffer 'weight_qparams'");
    frugal::testing::expect_error_contains(
        [&] { into.net->forward(x); }, c10::str("in groups of ", loaded,
                                                ") cannot use their buffer 'weight_qparams': it is "
                                                "BFloat16 [",
                                                4 * kDim * kDim / saved, ", 2]"));
  }
  // Codes of another length, set after backward: the optimizer's update refuses too, and
  // leaves the other parameters' codes as they were.
  Model m;
  loss_of(m.net, x, y).backward();
  fo::AdamW adamw(m.net->parameters(), torch::optim::AdamWOptions(1e-2));
  auto codes = m.net->blocks->ptr<BlockImpl>(2)->down->named_buffers()["weight_codes"];
  {
    torch::NoGradGuard no_grad;
    codes.set_(torch::zeros({10}, torch::kUInt8));
  }
  const auto before = codes_of(m.net);
  frugal::testing::expect_error_contains([&] { adamw.step(); },
                                         "cannot use their buffer 'weight_codes': it is Byte [10]");
  EXPECT_TRUE(same(before, codes_of(m.net)));
  std::remove(path.c_str());
}

TEST(Int8Weights, GoingUnderAMemoryCapKeepsTheCodesInsteadOfEndingTheProcess) {
  torch::manual_seed(11);
  Net net(kDim, 2, nullptr);
  auto int8 = std::make_unique<Int8Weights>();
  for (const auto& block : *net->blocks) {
    int8->add_module(block);
  }
  const auto codes = codes_of(net);
  {
    frugal::MemoryProbe probe(torch::kCPU);
    frugal::ScopedMemoryCap cap(torch::kCPU, probe.allocated() + 1024);
    int8.reset();  // no room to make the weights whole: a warning, not std::terminate
  }
  EXPECT_TRUE(same(codes, codes_of(net))) << "the codes stay in their buffers";
  EXPECT_EQ(net->blocks->ptr<BlockImpl>(0)->up->named_buffers()["weight_codes"].numel(),
            4 * kDim * kDim);
}

TEST(Int8Weights, ARefusedMaterialisedScopePinsNoUnit) {
  Model m;
  ASSERT_EQ(m.int8.materialised_bytes(), 0);
  {
    // Room for the first unit, not for the second.
    frugal::MemoryProbe probe(torch::kCPU);
    frugal::ScopedMemoryCap cap(torch::kCPU, probe.allocated() + unit_bytes() * 3 / 2);
    EXPECT_THROW(Int8Weights::Materialised whole(m.int8), c10::Error);
  }
  EXPECT_EQ(m.int8.materialised_bytes(), 0) << "the unit made whole before the refusal";
  // Training goes on one unit at a time.
  const auto [x, y] = batch(9);
  loss_of(m.net, x, y).backward();
  EXPECT_EQ(m.int8.materialised_bytes(), 0);
  EXPECT_EQ(m.net->blocks->ptr<BlockImpl>(0)->seen.back(), unit_bytes());
}

TEST(Int8Weights, WhenItGoesTheModelIsAnOrdinaryBfloat16OneWithItsTrainedWeights) {
  torch::Tensor expected, got;
  const auto [x, y] = batch(7);
  torch::manual_seed(11);
  Net net(kDim, 2, nullptr);
  {
    Int8Weights int8(Int8WeightsOptions().dtype(torch::kBFloat16));
    for (const auto& block : *net->blocks) {
      int8.add_module(block);
    }
    torch::NoGradGuard no_grad;
    expected = net->forward(x);
  }
  EXPECT_EQ(net->blocks->ptr<BlockImpl>(0)->up->weight.numel(), 4 * kDim * kDim);
  torch::NoGradGuard no_grad;
  got = net->forward(x);
  EXPECT_TRUE(torch::equal(expected, got));
}

}  // namespace int8_weights_test
}  // namespace

namespace {
namespace int8_weights_cuda_test {

namespace fo = frugal::optim;
using int8_weights_test::batch;
using int8_weights_test::BlockImpl;
using int8_weights_test::Model;

TEST(CudaInt8Weights, NearestCodesOnTheGpuAreTheCpuKernels) {
  FRUGAL_SKIP_WITHOUT_CUDA();
  torch::manual_seed(6);
  const auto x = torch::cat({torch::randn({4096}) * 0.02, torch::randn({77}) * 3});
  const auto [codes, qparams] = fo::detail::quantize_weights(x, 128);
  const auto [gpu_codes, gpu_qparams] = fo::detail::quantize_weights(x.cuda(), 128);
  EXPECT_TRUE(torch::equal(codes, gpu_codes.cpu()));
  EXPECT_TRUE(torch::equal(qparams.view(torch::kInt16), gpu_qparams.cpu().view(torch::kInt16)));
  fo::detail::StoredWeights stored;
  stored.codes = gpu_codes;
  stored.qparams = gpu_qparams;
  auto wide = torch::empty({x.numel()}, torch::kCUDA);
  fo::detail::dequantize_into(stored, wide);
  stored.codes = codes;
  stored.qparams = qparams;
  auto cpu = torch::empty({x.numel()});
  fo::detail::dequantize_into(stored, cpu);
  EXPECT_TRUE(torch::equal(wide.cpu(), cpu));
}

TEST(CudaInt8Weights, UnitsTrainOnTheGpuMaterialisedOnlyWhileTheyRun) {
  FRUGAL_SKIP_WITHOUT_CUDA();
  Model m;
  m.net->to(torch::kCUDA);  // codes and statistics move; units materialise there
  fo::AdamW8bit adamw(m.net->parameters(), torch::optim::AdamWOptions(3e-3),
                      fo::QuantizedStateOptions().factored(true));
  frugal::Trainer trainer(
      m.net, adamw,
      [](const torch::Tensor& out, const torch::Tensor& t) {
        return torch::mse_loss(out.to(torch::kFloat), t);
      },
      frugal::TrainerOptions().device(torch::kCUDA));
  trainer.add_policy(std::make_shared<frugal::StepInBackward>());
  std::vector<double> losses;
  for (int s = 0; s < 30; ++s) {
    const auto [x, y] = batch(600 + s % 4);
    losses.push_back(trainer.step(frugal::Batch(x.cuda(), y.cuda())).loss);
  }
  for (std::size_t i = 0; i < 3; ++i) {
    for (const auto bytes : m.net->blocks->ptr<BlockImpl>(i)->seen) {
      ASSERT_EQ(bytes, int8_weights_test::unit_bytes()) << "block " << i;
    }
  }
  EXPECT_EQ(m.int8.materialised_bytes(), 0);
  EXPECT_LT(losses.back(), 0.5 * losses.front());
}

}  // namespace int8_weights_cuda_test
}  // namespace
