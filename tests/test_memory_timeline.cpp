#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>

#include "frugal/loop/loop.h"
#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/memory_cap.h"
#include "frugal/memory/probe.h"
#include "frugal/policy/memory_timeline.h"
#include "frugal/policy/oom_recovery.h"
#include "frugal/train/trainer.h"
#include "helpers.h"

namespace {

namespace fs = std::filesystem;

torch::Tensor ce(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(out, target);
}

torch::nn::Sequential deep() { return frugal::testing::deep_narrow(16); }

frugal::Batch batch() {
  torch::manual_seed(4);
  return {torch::randn({64, 256}), torch::randint(0, 10, {64})};
}

using frugal::testing::fresh_temp_dir;

std::string read(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(MemoryTimeline, RecordsTheChosenStepsAndWritesTheFileAfterTheLast) {
  const auto dir = fresh_temp_dir("timeline");
  auto net = deep();
  torch::optim::SGD sgd(net->parameters(), 0.05);
  frugal::Trainer trainer(net, sgd, ce);
  auto timeline = std::make_shared<frugal::MemoryTimeline>((dir / "steps.json").string(), 2, 3);
  trainer.add_policy(timeline);
  const auto b = batch();
  trainer.step(b);
  EXPECT_EQ(timeline->recorder(), nullptr);
  trainer.step(b);
  ASSERT_NE(timeline->recorder(), nullptr);
  EXPECT_TRUE(timeline->recorder()->recording());
  EXPECT_EQ(timeline->written(), "");
  trainer.step(b);
  EXPECT_FALSE(timeline->recorder()->recording());
  EXPECT_EQ(timeline->written(), (dir / "steps.json").string());
  const auto events = timeline->recorder()->events();
  trainer.step(b);  // not recorded
  EXPECT_EQ(timeline->recorder()->events(), events);
  const auto recording = nlohmann::json::parse(read(dir / "steps.json"));
  std::map<std::string, int> zeroings;
  for (const auto& e : recording.at("events")) {
    zeroings[e.at("at").get<std::string>()] += e.at("action") == "free" ? 1 : 0;
  }
  // Two steps: each frees its activations in backward and its gradients when zeroing.
  EXPECT_GT(zeroings["backward"], 0);
  EXPECT_EQ(zeroings["zeroing"], 2 * static_cast<int>(net->parameters().size()));
  fs::remove_all(dir);
}

TEST(MemoryTimeline, AnAllocationRefusedWhileRecordingIsWrittenBeforeTheRecovery) {
  const auto dir = fresh_temp_dir("timeline_oom");
  frugal::MemoryProbe probe;
  const auto b = batch();
  // A recorded first step with OomRecovery: once without a cap (its rise above the bytes
  // before it), then under a cap of three quarters of that rise.
  auto step = [&](std::int64_t room, const std::string& name) {
    auto net = deep();
    torch::optim::SGD sgd(net->parameters(), 0.05);
    frugal::Trainer trainer(net, sgd, ce);
    auto timeline = std::make_shared<frugal::MemoryTimeline>((dir / name).string(), 1);
    trainer.add_policy(timeline);
    trainer.add_policy(std::make_shared<frugal::OomRecovery>());
    const auto before = probe.allocated();
    std::unique_ptr<frugal::ScopedMemoryCap> cap;
    if (room > 0) {
      cap = std::make_unique<frugal::ScopedMemoryCap>(torch::kCPU, before + room);
    }
    probe.reset_peak();
    const auto report = trainer.step(b);
    return std::make_tuple(report.oom_retries, probe.peak() - before, timeline);
  };
  const auto [free_retries, rise, free_timeline] = step(0, "free.html");
  EXPECT_EQ(free_retries, 0);
  EXPECT_FALSE(fs::exists(free_timeline->oom_path()));
  const auto [retries, capped_rise, timeline] = step(rise * 3 / 4, "step.html");
  EXPECT_GT(retries, 0);
  EXPECT_LT(capped_rise, rise);
  EXPECT_EQ(timeline->oom_path(), (dir / "step.oom.pickle").string());
  const auto snapshot = read(timeline->oom_path());
  // The pickled string 'oom' (BINUNICODE, length 3): the trace holds the refusal.
  EXPECT_NE(snapshot.find(std::string("X\x03\x00\x00\x00oom", 8)), std::string::npos);
  EXPECT_TRUE(fs::exists(dir / "step.html"));  // the step went on, recovered, and ended
  fs::remove_all(dir);
}

TEST(MemoryTimeline, ALoopRecordsItsChosenIterationAndTheUsersForward) {
  const auto dir = fresh_temp_dir("timeline_loop");
  const auto path = (dir / "iteration.json").string();
  auto net = deep();
  torch::optim::SGD sgd(net->parameters(), 0.05);
  frugal::Loop loop(frugal::LoopOptions().memory_timeline(frugal::MemoryTimelineSpan(path, 2)));
  auto& model = loop.prepare(net, sgd, "net");  // watched once its iteration begins
  const auto b = batch();
  auto iteration = [&] {
    loop.backward(ce(net->forward(b.inputs), b.targets), model);  // the user's own forward
    loop.step(model);
    return loop.end();
  };
  iteration();
  // Iteration 2 is recorded from the end of iteration 1: its forward comes before any verb.
  const auto* recorder = loop.memory_timeline()->recorder();
  ASSERT_NE(recorder, nullptr);
  EXPECT_TRUE(recorder->recording());
  EXPECT_EQ(recorder->events(), 0);
  iteration();
  EXPECT_FALSE(recorder->recording());
  EXPECT_EQ(loop.memory_timeline()->written(), path);
  const auto events = recorder->events();
  iteration();  // not recorded
  EXPECT_EQ(recorder->events(), events);
  EXPECT_EQ(frugal::current_phase(), frugal::MemoryPhase::Other);  // put back after the span
  const auto recording = nlohmann::json::parse(read(path));
  std::map<std::string, std::int64_t> allocated;  // bytes by the phase they were made in
  std::map<std::string, std::int64_t> freed;
  for (const auto& e : recording.at("events")) {
    auto& into = e.at("action") == "alloc" ? allocated : freed;
    into[e.at("phase").get<std::string>() + "/" + e.at("category").get<std::string>()] +=
        e.at("bytes").get<std::int64_t>();
  }
  // The forward's activations, made between the Loop's verbs, are freed by its backward.
  EXPECT_GT(allocated["forward/activations"], 0);
  EXPECT_EQ(freed["forward/activations"], allocated["forward/activations"]);
  EXPECT_EQ(allocated["other/other"], 0);
  // The gradients were made in backward and freed when the step released them.
  EXPECT_EQ(freed["backward/gradients"], allocated["backward/gradients"]);
  EXPECT_GT(allocated["backward/gradients"], 0);
  // The Loop watched its model: its weights are known as weights at the peak.
  std::int64_t weights = 0;
  for (const auto& p : net->parameters()) {
    weights += static_cast<std::int64_t>(p.nbytes());
  }
  std::int64_t weights_at_peak = 0;
  for (const auto& g : recording.at("peak").at("groups")) {
    weights_at_peak += g.at("category") == "weights" ? g.at("bytes").get<std::int64_t>() : 0;
  }
  EXPECT_EQ(weights_at_peak, weights);
  frugal::testing::expect_error_contains(
      [] {
        frugal::Loop(
            frugal::LoopOptions().memory_timeline(frugal::MemoryTimelineSpan("x.html", 0)));
      },
      "records 0 to 0");
  fs::remove_all(dir);
}

TEST(MemoryTimeline, ABadRangeOrFileIsRefusedWhenMade) {
  frugal::testing::expect_error_contains([] { frugal::MemoryTimeline("t.html", 0); },
                                         "records 0 to 0: the first must be >= 1");
  frugal::testing::expect_error_contains([] { frugal::MemoryTimeline("t.html", 3, 2); },
                                         "records 3 to 2");
  frugal::testing::expect_error_contains([] { frugal::MemoryTimeline("t.svg", 1); }, "not 't.svg'");
}

}  // namespace
