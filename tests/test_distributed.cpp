// Data-parallel training over Gloo on the loopback: ranks are children of this test binary,
// started with the variables torchrun sets.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "children.h"
#include "dist_launch.h"
#include "frugal/compose/mixed_precision.h"
#include "frugal/distributed/data_parallel.h"
#include "frugal/distributed/shard.h"
#include "frugal/distributed/zero.h"
#include "frugal/memory/ledger.h"
#include "frugal/optim/adam.h"
#include "frugal/optim/sgd.h"
#include "frugal/policy/checkpoint_policy.h"
#include "frugal/policy/grad_scaler.h"
#include "frugal/policy/leak_guard.h"
#include "frugal/policy/oom_recovery.h"
#include "frugal/train/trainer.h"
#include "resume_setup.h"

namespace {

namespace fs = std::filesystem;
using frugal::distributed::DataParallel;
using frugal::distributed::Group;
using frugal::testing::launch;

constexpr std::int64_t kDistSteps = 20;
constexpr std::int64_t kGlobal = 64;
constexpr std::int64_t kIgnore = -100;

torch::Tensor cross_entropy(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
}
// micro: micro-batches, an accumulation window, checkpointing and the leak guard; bf16:
// autocast (compared within bf16's rounding); nan: a NaN in the last rank's share, which
// every rank must skip (the engine's guard, no GradScaler) as one process does. zeroS-MODE:
// MODE (adam when absent) with a ZeroOptimizer of stage S around its optimizer; zero3i:
// stepping in backward, with frugal's optimizers.
const std::vector<std::string> kModes{"sgd",    "adam",       "micro",       "tokens",
                                      "scaler", "bf16",       "zero1",       "zero2",
                                      "zero3",  "zero3-sgd",  "zero3-micro", "zero3-bf16",
                                      "nan",    "zero3i-nan", "zero3i-micro"};

// The ZeRO stage of a mode (0: none) and the mode it wraps.
std::pair<int, std::string> zero_of(const std::string& mode) {
  if (mode.rfind("zero", 0) != 0) {
    return {0, mode};
  }
  const auto dash = mode.find('-');
  return {mode[4] - '0', dash == std::string::npos ? "adam" : mode.substr(dash + 1)};
}

// The global batches of every step: class targets, or per-position targets (tokens) of
// which a random share is padding, so ranks hold different token counts.
struct Data {
  torch::Tensor x, y;
};

Data make_data(const std::string& mode) {
  torch::manual_seed(7);
  Data d;
  if (mode == "tokens") {
    d.x = torch::randn({kDistSteps, kGlobal, 4, 8});
    d.y = torch::randint(0, 4, {kDistSteps, kGlobal, 4});
    d.y.masked_fill_(torch::rand({kDistSteps, kGlobal, 4}) < 0.4, kIgnore);
  } else {
    d.x = torch::randn({kDistSteps, kGlobal, 8});
    d.y = torch::randint(0, 4, {kDistSteps, kGlobal});
  }
  if (mode == "scaler") {
    d.x[5][kGlobal - 1][0] = std::numeric_limits<float>::infinity();  // on the last rank
  }
  if (mode == "nan") {
    d.x[5][kGlobal - 1][0] = std::numeric_limits<float>::quiet_NaN();  // on the last rank
  }
  return d;
}

// Trains `mode` for kDistSteps on this rank's share of each global batch (all of it in a group
// of one); returns the parameters and, last, the skipped steps, the reported losses and
// the ledger's gradient and weights bytes just before the optimizer step, and its optimizer
// and weights bytes after it.
std::vector<torch::Tensor> train(const std::string& zero_mode, const std::shared_ptr<Group>& group,
                                 torch::Device device = torch::kCPU) {
  const auto [stage, mode] = zero_of(zero_mode);
  auto data = make_data(mode);
  data.x = data.x.to(device);
  data.y = data.y.to(device);
  torch::manual_seed(100 + group->rank());  // ranks start apart: DataParallel copies rank 0's
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::Tanh(),
                              torch::nn::Linear(16, 4));
  model->to(device);
  const bool sgd = mode == "sgd" || mode == "scaler" || mode == "bf16" || mode == "nan";
  const bool in_backward = zero_mode.rfind("zero3i", 0) == 0;
  auto make = [sgd, in_backward](
                  std::vector<torch::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
    if (in_backward && sgd) {
      return std::make_unique<frugal::optim::SGD>(params,
                                                  torch::optim::SGDOptions(0.1).momentum(0.9));
    }
    if (in_backward) {
      return std::make_unique<frugal::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
    }
    if (sgd) {
      return std::make_unique<torch::optim::SGD>(params,
                                                 torch::optim::SGDOptions(0.1).momentum(0.9));
    }
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
  };
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (stage > 0) {
    // Stages 2 and 3 also gather in pieces of 64 bytes: many pieces, uneven at the end.
    optimizer = std::make_unique<frugal::distributed::ZeroOptimizer>(
        model->parameters(), group, make,
        frugal::distributed::ZeroOptimizerOptions()
            .stage(stage)
            .gather_bytes(stage == 1 ? 8 << 20 : 64)
            .step_in_backward(in_backward));
  } else {
    optimizer = make(model->parameters());
  }
  auto options = frugal::TrainerOptions().device(device);
  if (mode == "micro") {
    options.micro_batch(5).accumulate(2);
  }
  frugal::Trainer::LossFn loss = cross_entropy;
  if (mode == "tokens") {
    options.reduction(frugal::LossReduction::SumOverCount)
        .micro_batch(7)
        .count([](const frugal::Batch& b) {
          return b.targets.ne(kIgnore).sum().item<std::int64_t>();
        });
    loss = [](const torch::Tensor& out, const torch::Tensor& y) {
      namespace F = torch::nn::functional;
      return F::cross_entropy(
          out.reshape({-1, 4}), y.reshape({-1}),
          F::CrossEntropyFuncOptions().ignore_index(kIgnore).reduction(torch::kSum));
    };
  }
  frugal::Trainer trainer(model, *optimizer, loss, options);
  trainer.add_policy(std::make_shared<DataParallel>(group));
  if (mode == "scaler") {
    trainer.add_policy(
        std::make_shared<frugal::GradScalerPolicy>(std::make_shared<frugal::GradScaler>()));
  }
  if (mode == "bf16") {
    frugal::use_mixed_precision(trainer, torch::kBFloat16);
  }
  if (mode == "micro") {
    trainer.add_policy(
        std::make_shared<frugal::CheckpointPolicy>(frugal::CheckpointSelect().names({"0", "2"})));
    trainer.add_policy(std::make_shared<frugal::LeakGuard>());
  }
  trainer.add_policy(std::make_shared<frugal::OomRecovery>());
  std::int64_t grad_bytes = 0;
  std::int64_t weights_at_step = 0;
  trainer.add_hook(frugal::Phase::BeforeOptimizerStep, [&](frugal::StepContext& c) {
    const auto ledger = frugal::measure_ledger(c.probe, c.module, &c.optimizer);
    grad_bytes = ledger.gradients;
    weights_at_step = ledger.weights;
  });
  std::int64_t optimizer_bytes = 0;
  std::int64_t weights_bytes = 0;
  const auto share = frugal::distributed::share_of(kGlobal, group->rank(), group->size());
  const std::int64_t start = share.start;
  const std::int64_t length = share.length;
  // With accumulation each step() gets half of the rank's share.
  const std::int64_t parts = options.accumulate();
  std::vector<double> losses;
  for (std::int64_t s = 0; s < kDistSteps; ++s) {
    for (std::int64_t k = 0; k < parts; ++k) {
      const auto from = start + k * length / parts;
      const auto to = start + (k + 1) * length / parts;
      const auto report =
          trainer.step({data.x[s].slice(0, from, to), data.y[s].slice(0, from, to)});
      losses.push_back(report.loss);
      optimizer_bytes = report.ledger.optimizer;
      weights_bytes = report.ledger.weights;
    }
  }
  std::vector<torch::Tensor> out;
  {
    std::unique_ptr<frugal::optim::GatheredParameters> whole;  // stage 3: the whole weights
    if (auto* sharded = dynamic_cast<frugal::optim::ShardedOptimizer*>(optimizer.get())) {
      whole = std::make_unique<frugal::optim::GatheredParameters>(*sharded);
    }
    for (const auto& p : model->parameters()) {
      out.push_back(p.detach().cpu().clone());
    }
  }
  out.push_back(torch::tensor({trainer.skipped_steps()}));
  out.push_back(torch::tensor(losses, torch::kDouble));
  out.push_back(torch::tensor({grad_bytes, optimizer_bytes, weights_bytes, weights_at_step}));
  return out;
}

// dp-train OUT_PREFIX [cuda [nccl]]: joins the group from the environment and trains every
// mode (on the GPU, over Gloo or NCCL), writing OUT_PREFIX-<mode>-<rank>.pt.
int dp_train(const std::vector<std::string>& args) {
  torch::set_num_threads(1);
  const auto env = frugal::distributed::LaunchEnv::from_environment();
  const bool cuda = args.size() > 1 && args[1] == "cuda";
  const bool nccl = args.size() > 2 && args[2] == "nccl";
  auto group = Group::join(env, frugal::distributed::GroupOptions()
                                    .timeout(std::chrono::seconds(60))
                                    .backend(nccl ? frugal::distributed::Backend::Nccl
                                                  : frugal::distributed::Backend::Gloo));
  const torch::Device device =
      cuda ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank %
                                                                       torch::cuda::device_count()))
           : torch::Device(torch::kCPU);
  for (const auto& mode : kModes) {
    auto result = train(mode, group, device);
    torch::save(result, args.at(0) + "-" + mode + "-" + std::to_string(env.rank) + ".pt");
  }
  return 0;
}
const frugal::testing::RegisterChild register_train("dp-train", dp_train);

// dp-fail: rank 1 throws at its fourth step; the others go on until the group fails them.
int dp_fail(const std::vector<std::string>&) {
  torch::set_num_threads(1);
  const auto env = frugal::distributed::LaunchEnv::from_environment();
  auto group =
      Group::join(env, frugal::distributed::GroupOptions().timeout(std::chrono::seconds(30)));
  torch::nn::Linear model(8, 4);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  frugal::Trainer trainer(model, sgd, cross_entropy);
  trainer.add_policy(std::make_shared<DataParallel>(group));
  for (int s = 0; s < 10; ++s) {
    TORCH_CHECK(!(env.rank == 1 && s == 3), "rank 1 fails on purpose at step ", s);
    trainer.step({torch::randn({8, 8}), torch::randint(0, 4, {8})});
  }
  return 0;
}
const frugal::testing::RegisterChild register_fail("dp-fail", dp_fail);

void expect_ranks_match_one_process(int world, const std::vector<std::string>& device = {}) {
  const auto dir = frugal::testing::fresh_temp_dir("frugal-dist");
  const auto prefix = (dir / "w").string();
  std::vector<std::string> args{prefix};
  args.insert(args.end(), device.begin(), device.end());
  const auto status = launch("dp-train", world, args);
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(status[r], 0) << "rank " << r;
  }
  std::vector<std::vector<torch::Tensor>> adam(world);  // unsharded, for the ZeRO runs
  for (const auto& mode : kModes) {
    SCOPED_TRACE(mode);
    const auto [stage, base] = zero_of(mode);
    // The one process runs on the ranks' device: on a GPU, its kernels and theirs alike.
    const auto one =
        train(base, Group::single(), device.empty() ? torch::Device(torch::kCPU) : torch::kCUDA);
    for (int r = 0; r < world; ++r) {
      std::vector<torch::Tensor> ranked;
      torch::load(ranked, prefix + "-" + mode + "-" + std::to_string(r) + ".pt");
      ASSERT_EQ(ranked.size(), one.size());
      const std::size_t params = one.size() - 3;
      // On CUDA the ranks' sums run in other orders than the one process's (halves of the
      // batch, NCCL's ring): float32 rounding of a few steps of Adam, whose updates of about
      // lr = 1e-2 carry relative errors of 1e-6 or so, stays well under 1e-4.
      const double tolerance = base == "bf16" ? 2e-3 : device.empty() ? 1e-5 : 1e-4;
      for (std::size_t i = 0; i < params; ++i) {
        EXPECT_TRUE(torch::allclose(ranked[i], one[i], tolerance, tolerance))
            << "rank " << r << " parameter " << i << " differs by "
            << (ranked[i] - one[i]).abs().max().item<float>();
      }
      EXPECT_EQ(ranked[params].item<std::int64_t>(), one[params].item<std::int64_t>())
          << "skipped steps, rank " << r;
      if (base != "micro") {  // with accumulation the ranks report the global half-batches
        EXPECT_TRUE(torch::allclose(ranked[params + 1], one[params + 1], tolerance, tolerance,
                                    /*equal_nan=*/true))
            << "reported losses, rank " << r;
      }
      const auto bytes = ranked[params + 2];
      // Each rank holds ceil(P / N) of the P elements' state (stage 2: and gradients; stage 3:
      // and weights between steps).
      std::int64_t elements = 0;
      for (std::size_t i = 0; i < params; ++i) {
        elements += one[i].numel();
      }
      const std::int64_t shard = (elements + world - 1) / world * 4;
      const std::int64_t weights = bytes[2].item<std::int64_t>();
      // Stages 1 and 2 hold the flat buffer, padded to N ranges.
      EXPECT_EQ(weights, stage == 3  ? shard
                         : stage > 0 ? world * shard
                                     : elements * 4)
          << "rank " << r;
      // Stage 3 frees the whole weights before the optimizer step, once the buckets are in.
      EXPECT_EQ(bytes[3].item<std::int64_t>(), weights) << "rank " << r;
      if (mode == "adam") {
        adam[r] = ranked;
      } else if (stage > 0 && base == "adam") {
        const auto unsharded = adam[r][params + 2];
        if (stage == 3) {
          EXPECT_LE(static_cast<double>(weights),
                    (world == 2 ? 0.55 : 0.4) * unsharded[2].item<double>())
              << "rank " << r;
        }
        const std::int64_t grads = bytes[0].item<std::int64_t>();
        const std::int64_t state = bytes[1].item<std::int64_t>();
        EXPECT_EQ(unsharded[0].item<std::int64_t>(), elements * 4) << "rank " << r;
        EXPECT_EQ(state, 2 * shard) << "rank " << r;  // Adam's two moments of the range
        EXPECT_LE(static_cast<double>(state),
                  (world == 2 ? 0.55 : 0.4) * unsharded[1].item<double>())
            << "rank " << r;
        EXPECT_EQ(grads, stage == 1 ? elements * 4 : shard) << "rank " << r;
      }
    }
    if (mode == "scaler" || mode == "nan") {
      EXPECT_EQ(one[one.size() - 3].item<std::int64_t>(), 1) << "the inf/NaN step is skipped";
    }
  }
}

TEST(DataParallel, TwoRanksTrainAsOneProcessOnTheWholeBatch) { expect_ranks_match_one_process(2); }

TEST(DataParallel, ThreeRanksWithUnevenSharesTrainAsOneProcess) {
  expect_ranks_match_one_process(3);
}

// On the GPU runner: CUDA tensors over Gloo (two ranks may share a GPU), and over NCCL
// where there are two GPUs (NCCL refuses two ranks on one).
TEST(CudaDataParallel, TwoRanksOnTheGpuTrainAsOneProcessOverGloo) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "CUDA is not available";
  }
  expect_ranks_match_one_process(2, {"cuda"});
}

TEST(CudaDataParallel, TwoRanksTrainAsOneProcessOverNccl) {
  if (!torch::cuda::is_available() || torch::cuda::device_count() < 2) {
    GTEST_SKIP() << "NCCL needs a GPU a rank: " << torch::cuda::device_count() << " here";
  }
  expect_ranks_match_one_process(2, {"cuda", "nccl"});
}

TEST(DataParallel, OneRankFailingFailsEveryRankWithAMessage) {
  const auto dir = frugal::testing::fresh_temp_dir("frugal-dist-fail");
  const auto status = launch("dp-fail", 2, {}, (dir / "stderr-").string());
  for (int r = 0; r < 2; ++r) {
    std::ifstream in(dir / ("stderr-" + std::to_string(r) + ".txt"));
    std::stringstream text;
    text << in.rdbuf();
    EXPECT_NE(status[r], 0) << "rank " << r << " said: " << text.str();
    // The surviving rank names the one that is gone (both run on this host).
    EXPECT_NE(text.str().find(r == 1 ? "rank 1 fails on purpose"
                                     : "rank 0's all-reduce failed: rank 1 (process "),
              std::string::npos)
        << text.str();
  }
}

TEST(DataParallel, RefusedAfterAPolicyThatReadsEveryGradient) {
  torch::nn::Linear model(4, 2);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  frugal::Trainer trainer(model, sgd, cross_entropy);
  trainer.add_policy(
      std::make_shared<frugal::GradScalerPolicy>(std::make_shared<frugal::GradScaler>()));
  try {
    trainer.add_policy(std::make_shared<DataParallel>(Group::single()));
    FAIL() << "accepted after the GradScaler";
  } catch (const std::exception& e) {
    EXPECT_NE(frugal::error_message(e).find("add DataParallel before 'grad-scaler'"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
