// The engine's phase timer, alone and as the Trainer's step uses it on the CPU and on a GPU.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <thread>

#include "compat.h"
#include "engine/phase_timer.h"
#include "frugal/optim/adam.h"
#include "frugal/train/trainer.h"
#include "helpers.h"

namespace {
namespace phase_timer {  // helper names of its own in the unity build

void pause_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

// A Trainer step of a small MLP over `micro_batches` micro-batches of a batch of 64 on
// `device`, timed as `timing` says.
frugal::StepReport timed_step(torch::Device device, frugal::DeviceTiming timing,
                              std::int64_t micro_batches,
                              std::function<void(frugal::Trainer&)> hooks = nullptr) {
  torch::manual_seed(2);
  auto model = frugal::testing::make_mlp(10, 64, 3);
  model->to(device);
  frugal::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-3));
  frugal::Trainer trainer(
      model, adam, frugal::testing::mse,
      frugal::TrainerOptions().micro_batches(micro_batches).device(device).device_timing(timing));
  if (hooks) {
    hooks(trainer);
  }
  const frugal::Batch batch{torch::randn({64, 10}).to(device), torch::randn({64, 3}).to(device)};
  trainer.step(batch);  // the first step makes the optimizer's state
  return trainer.step(batch);
}

// The phases of a step lie inside it: their times add up to at most the step's.
void expect_phases_within_the_step(const frugal::StepReport& r, const char* what) {
  const auto& t = r.time;
  EXPECT_GT(t.forward_ms, 0) << what;
  EXPECT_GT(t.backward_ms, 0) << what;
  EXPECT_GT(t.optimizer_ms, 0) << what;
  EXPECT_GE(t.data_ms, 0) << what;
  EXPECT_LE(t.data_ms + t.forward_ms + t.backward_ms + t.optimizer_ms, t.total_ms * 1.001 + 1e-3)
      << what;
}

}  // namespace phase_timer

TEST(PhaseTimer, OnTheCpuALapIsTheClockSinceTheLastBoundaryAndDroppedLapsCountNowhere) {
  frugal::detail::PhaseTimer timer;
  timer.begin(torch::kCPU, /*events=*/true, /*wait=*/true);  // the CPU: the clock, whatever asked
  EXPECT_FALSE(timer.uses_events());
  double first = 0, second = 0;
  phase_timer::pause_ms(5);
  timer.lap(&first);
  phase_timer::pause_ms(30);
  timer.lap(nullptr);  // a boundary whose phase is dropped
  phase_timer::pause_ms(5);
  timer.lap(&second);
  phase_timer::pause_ms(5);
  timer.lap(&second);  // a second phase into the same figure adds to it
  const double total = timer.finish();
  EXPECT_GE(first, 5);
  EXPECT_GE(second, 10);
  EXPECT_GE(total, first + second + 30);  // the dropped 30 ms are the step's, no phase's
}

TEST(PhaseTimer, ATrainerStepOnTheCpuTimesEachPhaseWithinTheStepWhateverTheDeviceTiming) {
  for (const auto timing : {frugal::DeviceTiming::Events, frugal::DeviceTiming::Synchronize,
                            frugal::DeviceTiming::Launches}) {
    phase_timer::expect_phases_within_the_step(
        phase_timer::timed_step(torch::kCPU, timing, 4),
        timing == frugal::DeviceTiming::Events ? "events" : "other");
  }
}

TEST(CudaPhaseTimer, ATrainerStepOnTheGpuTimesEachPhaseWithinTheStepInEveryDeviceTiming) {
  FRUGAL_SKIP_WITHOUT_CUDA();
  frugal::detail::PhaseTimer timer;
  timer.begin(torch::Device(torch::kCUDA, 0), /*events=*/true, /*wait=*/false);
  EXPECT_EQ(timer.uses_events(),
            TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6));
  timer.finish();
  for (const auto timing : {frugal::DeviceTiming::Events, frugal::DeviceTiming::Synchronize,
                            frugal::DeviceTiming::Launches}) {
    const auto r = phase_timer::timed_step(torch::kCUDA, timing, 4);
    const char* name = timing == frugal::DeviceTiming::Events        ? "events"
                       : timing == frugal::DeviceTiming::Synchronize ? "synchronize"
                                                                     : "launches";
    phase_timer::expect_phases_within_the_step(r, name);
  }
}

TEST(CudaPhaseTimer, ATrainerStepLaunchesEveryBackwardBeforeItReadsAnythingFromTheGpu) {
  FRUGAL_SKIP_WITHOUT_CUDA();  // always so where LibTorch has no CUDA
#ifdef FRUGAL_WITH_CUDA
  // From the step's start to its last backward, any read back from the device throws; the
  // step's one read (its loss) comes after. One micro-batch and four.
  for (const std::int64_t micro_batches : {1, 4}) {
    std::unique_ptr<frugal::compat::CudaHostReadsForbidden> forbidden;
    std::int64_t backwards = 0;
    const auto r = phase_timer::timed_step(
        torch::kCUDA, frugal::DeviceTiming::Events, micro_batches, [&](frugal::Trainer& t) {
          t.add_hook(frugal::Phase::StepBegin, [&](frugal::StepContext&) {
            forbidden = std::make_unique<frugal::compat::CudaHostReadsForbidden>();
          });
          t.add_hook(frugal::Phase::AfterBackward, [&](frugal::StepContext& c) {
            ++backwards;
            if (c.micro_index + 1 == c.micro_count) {
              forbidden.reset();
            }
          });
        });
    EXPECT_EQ(backwards, 2 * micro_batches);  // two steps, each backward once a micro-batch
    EXPECT_TRUE(std::isfinite(r.loss));
    EXPECT_FALSE(r.skipped);
  }
#endif
}

}  // namespace
