// Where the reports go: frugal's two sinks and a caller's own, fed by a Trainer's reports and
// by a Loop's iterations alike, one JSON shape for the memory fields of both.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "frugal/loop/loop.h"
#include "frugal/report/sink.h"

namespace {

namespace fs = std::filesystem;

fs::path scratch(const std::string& name) {
  return fs::temp_directory_path() / ("frugal-sinks-" + std::to_string(::getpid()) + "-" + name);
}

std::vector<nlohmann::json> read_lines(const fs::path& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

struct Kept : frugal::ReportSink {
  void write(const frugal::LoopReport& r) override { loops.push_back(r); }
  std::vector<frugal::LoopReport> loops;
};

TEST(Sinks, ALoopHandsEveryIterationToItsSinks) {
  const auto path = scratch("loop.jsonl");
  torch::manual_seed(1);
  torch::nn::Linear model(4, 2);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  auto kept = std::make_shared<Kept>();
  auto jsonl = std::make_shared<frugal::JsonLinesSink>(path.string());
  jsonl->set("run", std::string("unit"));
  frugal::Loop loop;
  loop.add_sink(kept).add_sink(jsonl);
  auto& m = loop.prepare(model, sgd, "model");
  for (int i = 0; i < 3; ++i) {
    loop.backward(model->forward(torch::randn({3, 4})).square().mean(), m);
    if (i != 1) {  // the second iteration holds its gradients for the third's step
      loop.step(m);
    }
    loop.end();
  }
  const auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), 3u);
  ASSERT_EQ(kept->loops.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    const auto& line = lines[i];
    const auto& r = kept->loops[i];
    EXPECT_EQ(line["event"], "iteration");
    EXPECT_EQ(line["run"], "unit");
    EXPECT_EQ(line["iteration"], r.iteration);
    EXPECT_EQ(r.iteration, static_cast<std::int64_t>(i) + 1);
    EXPECT_EQ(line["models"][0]["name"], "model");
    EXPECT_DOUBLE_EQ(line["models"][0]["loss"].get<double>(), r.models[0].loss);
    EXPECT_EQ(line["models"][0]["stepped"], r.models[0].stepped);
    // The memory fields carry a StepReport's names and the probe's figures.
    EXPECT_EQ(line["allocated_bytes"], r.memory.allocated);
    EXPECT_EQ(line["peak_bytes"], r.peak);
    EXPECT_EQ(line["weights_bytes"], r.ledger.weights);
    EXPECT_EQ(line["grads_bytes"], r.ledger.gradients);
    EXPECT_EQ(line["optimizer_bytes"], r.ledger.optimizer);
    EXPECT_EQ(line["other_bytes"], r.ledger.other);
  }
  // Gradients held across the second iteration's end are counted there, not after steps.
  const auto param_bytes = static_cast<std::int64_t>((4 * 2 + 2) * sizeof(float));
  EXPECT_EQ(kept->loops[0].ledger.gradients, 0);
  EXPECT_EQ(kept->loops[1].ledger.gradients, param_bytes);
  EXPECT_EQ(kept->loops[2].ledger.gradients, 0);
  EXPECT_EQ(kept->loops[1].ledger.weights, param_bytes);
  fs::remove(path);
}

TEST(Sinks, TheConsoleSinkPrintsEveryNthIterationsSummary) {
  const auto path = scratch("console.txt");
  std::FILE* out = std::fopen(path.c_str(), "w");
  ASSERT_NE(out, nullptr);
  torch::nn::Linear model(4, 2);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  frugal::Loop loop;
  loop.add_sink(std::make_shared<frugal::ConsoleSink>(out, 2));
  auto& m = loop.prepare(model, sgd, "model");
  std::vector<std::string> printed;
  for (int i = 0; i < 5; ++i) {
    loop.backward(model->forward(torch::ones({1, 4})).sum(), m);
    loop.step(m);
    const auto r = loop.end();
    if (r.iteration % 2 == 0) {
      printed.push_back(r.summary());
    }
  }
  std::fclose(out);
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    lines.push_back(line);
  }
  EXPECT_EQ(lines, printed);  // iterations 2 and 4
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].rfind("iteration 2 | model loss ", 0), 0u) << lines[0];
  fs::remove(path);
}

TEST(Sinks, AJsonLineOfAStepHoldsTheReportsFieldsAndTheSinksOwn) {
  const auto path = scratch("step.jsonl");
  {
    frugal::JsonLinesSink sink(path.string());
    sink.set("epoch", std::int64_t{3});
    frugal::StepReport report;
    report.step = 7;
    report.loss = 0.25;
    report.memory.allocated = 4096;
    report.peak = 8192;
    report.ledger.gradients = 1024;
    sink.write(report);
    sink.write_event("done");
  }
  const auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["step"], 7);
  EXPECT_EQ(lines[0]["epoch"], 3);
  EXPECT_DOUBLE_EQ(lines[0]["loss"].get<double>(), 0.25);
  EXPECT_EQ(lines[0]["allocated_bytes"], 4096);
  EXPECT_EQ(lines[0]["peak_bytes"], 8192);
  EXPECT_EQ(lines[0]["grads_bytes"], 1024);
  EXPECT_EQ(lines[1], (nlohmann::json{{"event", "done"}, {"epoch", 3}}));
  fs::remove(path);
}

}  // namespace
