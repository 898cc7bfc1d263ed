// Trainers on several threads: each reports its own memory figures, independent of the
// others, and none of them trips over the others' peak regions.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <thread>
#include <vector>

#include "frugal/policy/leak_guard.h"
#include "frugal/train/trainer.h"
#include "helpers.h"

namespace {

namespace F = torch::nn::functional;
constexpr int kSteps = 40;

struct Record {
  std::vector<std::int64_t> peaks, forward_peaks, allocated;
  std::int64_t steps = 0;
  std::string error;
};

// Everything a trainer owns is made on the thread that trains, as thread scope expects.
Record train(int width) {
  Record run;
  try {
    auto net = frugal::testing::make_mlp(64, width, 10, 5);
    torch::optim::Adam adam(net->parameters(), 1e-3);
    frugal::Trainer trainer(net, adam, [](const torch::Tensor& o, const torch::Tensor& t) {
      return F::cross_entropy(o, t);
    }, frugal::TrainerOptions().micro_batch(16));
    trainer.add_policy(std::make_shared<frugal::LeakGuard>());
    torch::manual_seed(9);
    const frugal::Batch batch{torch::randn({64, 64}), torch::randint(0, 10, {64}, torch::kLong)};
    for (int i = 0; i < kSteps; ++i) {
      const auto report = trainer.step(batch);
      run.peaks.push_back(report.peak);
      run.forward_peaks.push_back(report.forward_peak);
      run.allocated.push_back(report.memory.allocated);
    }
    run.steps = trainer.steps();
  } catch (const std::exception& e) {
    run.error = e.what();
  }
  return run;
}

Record on_a_thread(int width) {
  Record run;
  std::thread([&] { run = train(width); }).join();
  return run;
}

TEST(ConcurrentTrainers, TwoThreadsReportWhatEachReportsAlone) {
  frugal::MemoryProbe probe;  // counts from here on, models included
  const auto alone_a = on_a_thread(256);
  const auto alone_b = on_a_thread(512);
  ASSERT_TRUE(alone_a.error.empty()) << alone_a.error;
  // Both at once, beside a thread that holds 64 MiB for the whole time.
  std::atomic<bool> done{false};
  std::thread bystander([&] {
    auto held = torch::empty({16 << 20});
    while (!done) {
      std::this_thread::yield();
    }
  });
  Record a, b;
  std::thread ta([&] { a = train(256); });
  std::thread tb([&] { b = train(512); });
  ta.join();
  tb.join();
  done = true;
  bystander.join();
  for (const auto* pair : {&a, &b}) {
    EXPECT_TRUE(pair->error.empty()) << pair->error;
    EXPECT_EQ(pair->steps, kSteps);
  }
  EXPECT_EQ(a.peaks, alone_a.peaks);
  EXPECT_EQ(a.forward_peaks, alone_a.forward_peaks);
  EXPECT_EQ(a.allocated, alone_a.allocated);
  EXPECT_EQ(b.peaks, alone_b.peaks);
  EXPECT_EQ(b.allocated, alone_b.allocated);
  // The process-wide peak is fine to reset afterwards.
  EXPECT_NO_THROW(probe.reset_peak());
}

}  // namespace
