#include <ATen/ThreadLocalState.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <torch/torch.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "compat.h"
#include "frugal/error.h"
#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/ledger.h"
#include "frugal/memory/memory_cap.h"
#include "frugal/memory/memory_names.h"
#include "frugal/memory/probe.h"
#include "frugal/memory/recorder.h"
#include "frugal/nn/checkpoint.h"
#include "frugal/policy/checkpoint_policy.h"
#include "frugal/policy/memory_timeline.h"
#include "frugal/train/trainer.h"
#include "helpers.h"

namespace {

using frugal::MemoryCategory;
using frugal::MemoryPhase;

// Three units (Linear then ReLU) reached through frugal::nn::call, then a head.
struct StackImpl : torch::nn::Module {
  StackImpl() {
    for (int i = 0; i < 3; ++i) {
      blocks->push_back(torch::nn::Sequential(torch::nn::Linear(64, 64), torch::nn::ReLU()));
    }
    register_module("blocks", blocks);
    head = register_module("head", torch::nn::Linear(64, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (std::size_t i = 0; i < blocks->size(); ++i) {
      x = frugal::nn::call(blocks->ptr<torch::nn::SequentialImpl>(i), x);
    }
    return head(x);
  }
  torch::nn::ModuleList blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Stack);

torch::Tensor cross_entropy(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(out, target);
}

frugal::Batch batch_of(std::int64_t n) {
  torch::manual_seed(3);
  return {torch::randn({n, 64}), torch::randint(0, 10, {n})};
}

// What the recorder holds, as its JSON file says it.
nlohmann::json recorded(const frugal::MemoryRecorder& recorder) {
  std::stringstream out;
  recorder.write_to(out, ".json");
  return nlohmann::json::parse(out.str());
}

std::int64_t group_bytes(const frugal::MemoryPeak& peak, MemoryCategory category,
                         const std::string& module = "*") {
  std::int64_t sum = 0;
  for (const auto& g : peak.groups) {
    if (g.category == category && (module == "*" || g.module == module)) {
      sum += g.bytes;
    }
  }
  return sum;
}

TEST(MemoryRecorder, CountsEachBlockExactlyAndItsPeak) {
  frugal::MemoryProbe probe;
  frugal::MemoryRecorder recorder;
  probe.reset_peak();
  {
    auto a = torch::empty({1000}, torch::kFloat);  // 4000 bytes
    auto b = torch::empty({250}, torch::kDouble);  // 2000 bytes
  }
  recorder.stop();
  EXPECT_EQ(recorder.events(), 4);
  EXPECT_EQ(recorder.dropped(), 0);
  EXPECT_EQ(recorder.peak_bytes() - recorder.start_bytes(), 6000);
  const auto peak = recorder.peak();
  EXPECT_EQ(peak.bytes, recorder.peak_bytes());
  EXPECT_EQ(peak.bytes, probe.peak());
  // Nothing is allocated once it stops.
  { auto c = torch::empty({100}); }
  EXPECT_EQ(recorder.events(), 4);
}

TEST(MemoryRecorder, APhaseReachesTheThreadsThatWorkForTheMarkingThread) {
  // A CUDA backward runs on autograd's device thread, handed the calling thread's
  // at::ThreadLocalState; so does work given to at::launch. A block made there counts in the
  // phase of the thread it works for; a thread handed nothing is in none.
  frugal::MemoryRecorder recorder;
  torch::Tensor made;
  MemoryPhase seen = MemoryPhase::Other;
  {
    frugal::PhaseScope backward(MemoryPhase::Backward);
    const at::ThreadLocalState state;
    std::thread worker([&] {
      at::ThreadLocalStateGuard guard(state);
      seen = frugal::current_phase();
      made = torch::empty({1 << 20});  // 4 MiB: the recording's peak
    });
    worker.join();
  }
  MemoryPhase bare = MemoryPhase::Backward;
  std::thread([&] { bare = frugal::current_phase(); }).join();
  recorder.stop();
  EXPECT_EQ(seen, MemoryPhase::Backward);
  EXPECT_EQ(bare, MemoryPhase::Other);
  EXPECT_EQ(frugal::current_phase(), MemoryPhase::Other);  // the scope ended
  EXPECT_EQ(recorder.peak().phase, MemoryPhase::Backward);
  EXPECT_EQ(recorder.peak_bytes() - recorder.start_bytes(), 4 << 20);
}

TEST(MemoryRecorder, PhaseScopesEndedOutOfOrderEndWithoutAnError) {
  // A scope held by an object (the Loop holds one between its verbs) may end while a scope
  // made after it lives: nothing throws, and once both end no phase is left behind.
  auto outer = std::make_unique<frugal::PhaseScope>(MemoryPhase::Forward);
  {
    frugal::PhaseScope inner(MemoryPhase::Evaluation);
    EXPECT_EQ(frugal::current_phase(), MemoryPhase::Evaluation);
    EXPECT_NO_THROW(outer.reset());
  }
  EXPECT_EQ(frugal::current_phase(), MemoryPhase::Other);
}

TEST(MemoryRecorder, OneAtATime) {
  frugal::MemoryRecorder first;
  frugal::testing::expect_error_contains([] { frugal::MemoryRecorder second; },
                                         "a memory recorder is recording already");
  first.stop();
  frugal::MemoryRecorder after;  // the first one stopped: a new one may start
  EXPECT_TRUE(after.recording());
}

TEST(MemoryRecorder, APeakOfATrainerStepIsTheProbesPeakSplitByCategoryAndUnit) {
  Stack model;
  torch::optim::Adam adam(model->parameters(), 1e-3);
  frugal::Trainer trainer(model, adam, cross_entropy);
  const auto batch = batch_of(256);
  trainer.step(batch);  // Adam's state exists from here on
  frugal::MemoryProbe probe;
  const auto ledger = frugal::measure_ledger(probe, *model, &adam);
  frugal::MemoryRecorder recorder;
  recorder.watch(*model, &adam);
  probe.reset_peak();
  trainer.step(batch);
  recorder.stop();
  const auto peak = recorder.peak();
  EXPECT_EQ(peak.bytes, probe.peak());
  std::int64_t sum = 0;
  for (const auto& g : peak.groups) {
    sum += g.bytes;
  }
  EXPECT_EQ(sum, peak.bytes);
  // Weights and optimizer state are the ledger's to the byte; the batch of 256 x 64
  // activations of each unit are the unit's.
  EXPECT_EQ(group_bytes(peak, MemoryCategory::Weights), ledger.weights);
  EXPECT_EQ(group_bytes(peak, MemoryCategory::OptimizerState), ledger.optimizer);
  EXPECT_GE(group_bytes(peak, MemoryCategory::Activations, "blocks.1"), 256 * 64 * 4);
  EXPECT_EQ(
      peak.groups.front().bytes,
      std::max_element(peak.groups.begin(), peak.groups.end(), [](const auto& a, const auto& b) {
        return a.bytes < b.bytes;
      })->bytes);
  const auto text = peak.summary();
  EXPECT_NE(text.find("at the peak ("), std::string::npos) << text;
  EXPECT_NE(text.find("activations of blocks."), std::string::npos) << text;
}

TEST(MemoryRecorder, GradientsAreNamedAtTheEndOfBackwardAndFreedByZeroing) {
  Stack model;
  torch::optim::SGD sgd(model->parameters(), 0.1);
  frugal::Trainer trainer(model, sgd, cross_entropy);
  frugal::MemoryRecorder recorder;
  recorder.watch(*model, &sgd);
  trainer.step(batch_of(32));
  recorder.stop();
  const auto events = recorded(recorder).at("events");
  std::int64_t grads_allocated = 0, grads_freed = 0, zeroing_freed = 0;
  for (const auto& e : events) {
    if (e.at("category") != "gradients") {
      continue;
    }
    (e.at("action") == "alloc" ? grads_allocated : grads_freed) +=
        e.at("bytes").get<std::int64_t>();
    if (e.at("action") == "free" && e.at("at") == "zeroing") {
      zeroing_freed += e.at("bytes").get<std::int64_t>();
    }
  }
  std::int64_t param_bytes = 0;
  for (const auto& p : model->parameters()) {
    param_bytes += p.numel() * 4;
  }
  EXPECT_EQ(grads_allocated, param_bytes);
  EXPECT_EQ(grads_freed, param_bytes);
  EXPECT_EQ(zeroing_freed, param_bytes);  // set_to_none frees them when the step zeroes
}

TEST(MemoryRecorder, ACheckpointedUnitRecomputesInsideItsUnit) {
  Stack model;
  torch::optim::SGD sgd(model->parameters(), 0.1);
  frugal::Trainer trainer(model, sgd, cross_entropy);
  trainer.add_policy(std::make_shared<frugal::CheckpointPolicy>(
      frugal::CheckpointSelect().types({"torch::nn::SequentialImpl"})));
  frugal::MemoryRecorder recorder;
  recorder.watch(*model, &sgd);
  trainer.step(batch_of(32));
  recorder.stop();
  const auto recording = recorded(recorder);
  std::set<std::string> recomputed;
  for (const auto& e : recording.at("events")) {
    if (e.at("action") == "alloc" && e.at("phase") == "recompute") {
      recomputed.insert(e.at("unit").get<std::string>());
    }
  }
  EXPECT_EQ(recomputed, (std::set<std::string>{"blocks.0", "blocks.1", "blocks.2"}));
}

TEST(MemoryRecorder, ARefusedAllocationIsAnEventAtThePointItFailed) {
  frugal::MemoryRecorder recorder;
  const auto allocated = frugal::CountingAllocator::stats().allocated;
  {
    frugal::ScopedMemoryCap cap(torch::kCPU, allocated + (1 << 20));
    EXPECT_THROW(torch::empty({1 << 20}), c10::OutOfMemoryError);  // 4 MiB past a 1 MiB room
  }
  recorder.stop();
  const auto events = recorded(recorder).at("events");
  ASSERT_FALSE(events.empty());
  const auto& last = events.back();
  EXPECT_EQ(last.at("action"), "refused");
  EXPECT_EQ(last.at("bytes"), 4 << 20);
}

TEST(MemoryRecorder, TheRingKeepsTheNewestEventsAndCountsTheRest) {
  frugal::MemoryRecorder recorder(frugal::MemoryRecorderOptions().capacity(10));
  for (int i = 0; i < 20; ++i) {
    auto t = torch::empty({100});
  }
  recorder.stop();
  EXPECT_EQ(recorder.events(), 10);
  EXPECT_EQ(recorder.dropped(), 30);
  frugal::testing::expect_error_contains([] { frugal::MemoryRecorderOptions().capacity(0); },
                                         "keeps at least 1 event, got 0");
}

// The CUDA path: the caching allocator's blocks, through its trace hook, with the same
// context as on the CPU; the peak is the allocator's own.
TEST(CudaMemoryRecorder, AStepOnTheGpuIsTheAllocatorsPeakSplitByCategoryAndUnit) {
  FRUGAL_SKIP_WITHOUT_CUDA();
#ifdef FRUGAL_WITH_CUDA
  // The recording counts each block's request, as the allocator's trace gives it: its peak
  // is the allocator's peak of requested bytes (its allocated bytes round blocks up).
  const auto requested_peak = [] { return frugal::compat::cuda_allocator_stats(0).requested_peak; };
  const torch::Device cuda(torch::kCUDA, 0);
  Stack model;
  model->to(cuda);
  torch::optim::Adam adam(model->parameters(), 1e-3);
  frugal::Trainer trainer(model, adam, cross_entropy, frugal::TrainerOptions().device(cuda));
  const auto batch = batch_of(256);
  trainer.step(batch);  // Adam's state and cuBLAS's workspace exist from here on
  frugal::MemoryProbe probe(cuda);
  frugal::MemoryRecorder recorder(frugal::MemoryRecorderOptions().device(cuda));
  recorder.watch(*model, &adam);
  probe.reset_peak();
  trainer.step(batch);
  torch::cuda::synchronize();
  const auto step_peak = requested_peak();
  recorder.stop();
  const auto peak = recorder.peak();
  EXPECT_EQ(recorder.peak_bytes(), step_peak);
  EXPECT_EQ(peak.bytes, step_peak);
  EXPECT_LE(step_peak, probe.peak());  // the blocks hold their requests and more
  std::int64_t weights = 0;
  for (const auto& p : model->parameters()) {
    weights += static_cast<std::int64_t>(p.nbytes());
  }
  EXPECT_EQ(group_bytes(peak, MemoryCategory::Weights), weights);
  EXPECT_GT(group_bytes(peak, MemoryCategory::OptimizerState), 0);
  EXPECT_GT(group_bytes(peak, MemoryCategory::Activations, "blocks.1"), 0);
  // The step's peak is reached in its forward or its backward, which runs on autograd's
  // device thread: its blocks carry the step's phase all the same.
  EXPECT_NE(peak.phase, frugal::MemoryPhase::Other) << peak.summary();
  std::stringstream pickle;
  recorder.write_to(pickle, ".pickle");
  EXPECT_NE(pickle.str().find("CUDA caching allocator"), std::string::npos);
  // The MemoryTimeline policy records the trainer's device.
  auto timeline = std::make_shared<frugal::MemoryTimeline>(
      (std::filesystem::temp_directory_path() / "frugal_cuda_step.png").string());
  trainer.add_policy(timeline);
  probe.reset_peak();
  trainer.step(batch);
  torch::cuda::synchronize();
  ASSERT_NE(timeline->recorder(), nullptr);
  EXPECT_EQ(timeline->recorder()->peak_bytes(), requested_peak());
  EXPECT_GT(std::filesystem::file_size(timeline->written()), 1000u);
#endif
}

TEST(MemoryRecorder, ADeviceItCannotRecordIsRefusedAndNothingRecords) {
  frugal::testing::expect_error_contains(
      [] { frugal::MemoryRecorderOptions().device(torch::Device(torch::kMeta)); }, "not meta");
  if (!torch::cuda::is_available()) {
    frugal::testing::expect_error_contains(
        [] { frugal::MemoryRecorder(frugal::MemoryRecorderOptions().device(torch::kCUDA)); },
        "a memory recorder of cuda");
  }
  frugal::MemoryRecorder recorder;  // the refused one left no observer behind
  auto t = torch::empty({100});
  recorder.stop();
  EXPECT_EQ(recorder.events(), 1);
}

TEST(MemoryRecorder, AFileOfAnotherKindIsRefusedNamingIt) {
  frugal::MemoryRecorder recorder;
  recorder.stop();
  frugal::testing::expect_error_contains([&] { recorder.write("timeline.txt"); },
                                         "not 'timeline.txt'");
}

// A unit whose name is not UTF-8 (a module may be named with any bytes but '.').
struct OddNameImpl : torch::nn::Module {
  OddNameImpl() { block = register_module("caf\xe9", torch::nn::Linear(64, 64)); }
  torch::Tensor forward(const torch::Tensor& x) { return frugal::nn::call(block, x); }
  torch::nn::Linear block{nullptr};
};
TORCH_MODULE(OddName);

TEST(MemoryRecorder, UnitNamesThatAreNotUtf8AreWrittenReplacedInEveryFile) {
  OddName model;
  frugal::MemoryRecorder recorder;
  recorder.watch(*model);
  model->forward(torch::randn({8, 64}, torch::requires_grad())).sum().backward();
  recorder.stop();
  const auto dir = std::filesystem::temp_directory_path() /
                   ("frugal_recorder_utf8_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  for (const auto* name : {"step.pickle", "step.html", "step.png", "step.json"}) {
    recorder.write((dir / name).string());
    EXPECT_GT(std::filesystem::file_size(dir / name), 100u) << name;
  }
  std::ifstream in(dir / "step.json");
  const auto json = nlohmann::json::parse(in);  // valid UTF-8 JSON
  std::set<std::string> units;
  for (const auto& e : json.at("events")) {
    units.insert(e.at("unit").get<std::string>());
  }
  EXPECT_EQ(units.count("caf\xef\xbf\xbd"), 1U) << "the invalid byte as U+FFFD";
  std::ifstream pickle(dir / "step.pickle", std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(pickle)), {});
  EXPECT_NE(bytes.find("caf\xef\xbf\xbd"), std::string::npos);
  EXPECT_EQ(bytes.find("caf\xe9"), std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(MemoryRecorder, AWriteThatFailsLeavesTheOldFileAndSaysWhy) {
  Stack model;
  frugal::MemoryRecorder recorder;
  recorder.watch(*model);
  model->forward(batch_of(32).inputs).sum().backward();
  recorder.stop();
  const auto path = std::filesystem::temp_directory_path() /
                    ("frugal_recorder_full_" + std::to_string(::getpid()) + ".html");
  std::ofstream(path) << "the old file";
  // A file-size limit stands in for a full disk.
  struct rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 2048;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string what;
  try {
    recorder.write(path.string());
  } catch (const frugal::Error& e) {
    what = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_NE(what.find("File too large"), std::string::npos) << what;
  std::ifstream in(path);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(in)), {}), "the old file");
  EXPECT_FALSE(std::filesystem::exists(path.string() + ".partial"));
  std::filesystem::remove(path);
}

}  // namespace

// Writes one recorded step (an out-of-memory refusal at its end) as the four files, for
// tests/memory_recorder_viewers.py to open with PyTorch's memory tools and a browser: in
// $FRUGAL_RECORDER_DIR when set, else in a folder of its own.
TEST(MemoryRecorderFiles, AStepForTheViewers) {
  const char* where = std::getenv("FRUGAL_RECORDER_DIR");
  const std::filesystem::path dir =
      where != nullptr ? std::filesystem::path(where)
                       : std::filesystem::temp_directory_path() / "frugal_recorder_files";
  std::filesystem::create_directories(dir);
  Stack model;
  torch::optim::Adam adam(model->parameters(), 1e-3);
  frugal::Trainer trainer(model, adam, cross_entropy);
  const auto batch = batch_of(128);
  frugal::name_memory(batch.inputs, "data set");  // the page draws it as a part of its own
  frugal::name_memory(batch.targets, "data set");
  trainer.step(batch);
  frugal::MemoryProbe probe;
  frugal::MemoryRecorder recorder;
  recorder.watch(*model, &adam);
  probe.reset_peak();
  trainer.step(batch);
  const auto step_peak = probe.peak();
  {
    frugal::ScopedMemoryCap cap(torch::kCPU, probe.allocated() + (1 << 16));
    EXPECT_THROW(torch::empty({1 << 16}), c10::OutOfMemoryError);  // 256 KiB past 64 KiB
  }
  recorder.stop();
  EXPECT_EQ(recorder.peak().bytes, step_peak);
  for (const auto* name : {"step.pickle", "step.html", "step.png", "step.json"}) {
    recorder.write((dir / name).string());
    EXPECT_GT(std::filesystem::file_size(dir / name), 1000u) << name;
  }
  std::ifstream pickle(dir / "step.pickle", std::ios::binary);
  EXPECT_EQ(pickle.get(), 0x80);  // pickle's PROTO opcode, protocol 2
  EXPECT_EQ(pickle.get(), 2);
  std::ofstream(dir / "expected.json")
      << nlohmann::json{{"peak_bytes", step_peak}, {"refused_bytes", 4 << 16}}.dump();
}
