// The fit loop and learning-rate schedules.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>

#include "resume_setup.h"

namespace {

using frugal::testing::flat_state;
using frugal::testing::make_resume_setup;

TEST(LrSchedule, WarmsUpLinearlyThenDecaysToTheFloor) {
  for (const auto decay : {frugal::LrDecay::Cosine, frugal::LrDecay::Linear}) {
    const auto o =
        frugal::LrScheduleOptions().decay(decay).warmup_steps(4).total_steps(12).min_factor(0.1);
    for (int t = 0; t < 4; ++t) {  // the first step already moves: 1/4, not 0
      EXPECT_DOUBLE_EQ(frugal::lr_factor(o, t), (t + 1) / 4.0);
    }
    EXPECT_DOUBLE_EQ(frugal::lr_factor(o, 4), 1.0);
    EXPECT_NEAR(frugal::lr_factor(o, 8), (1.0 + 0.1) / 2, 1e-12);  // halfway, both shapes
    EXPECT_NEAR(frugal::lr_factor(o, 12), 0.1, 1e-12);
    EXPECT_NEAR(frugal::lr_factor(o, 100), 0.1, 1e-12);
    for (int t = 4; t < 20; ++t) {
      EXPECT_LE(frugal::lr_factor(o, t + 1), frugal::lr_factor(o, t)) << "t " << t;
    }
  }
  // Cosine stays above linear in the first half of the decay and below in the second.
  const auto cosine = frugal::LrScheduleOptions().decay(frugal::LrDecay::Cosine).total_steps(10);
  const auto linear = frugal::LrScheduleOptions().decay(frugal::LrDecay::Linear).total_steps(10);
  EXPECT_GT(frugal::lr_factor(cosine, 2), frugal::lr_factor(linear, 2));
  EXPECT_LT(frugal::lr_factor(cosine, 8), frugal::lr_factor(linear, 8));
}

TEST(LrSchedule, StepDecayMatchesLibTorchStepLR) {
  auto s = make_resume_setup("plain");
  s->trainer->add_policy(std::make_shared<frugal::LrSchedule>(
      frugal::LrScheduleOptions().decay(frugal::LrDecay::Step).step_size(3).gamma(0.5)));
  auto twin_param = torch::zeros({1}, torch::requires_grad());
  torch::optim::SGD twin({twin_param}, torch::optim::SGDOptions(1e-2));
  torch::optim::StepLR step_lr(twin, 3, 0.5);
  step_lr.step();  // as Python's constructor does: C++'s first step() changes nothing
  const auto data = frugal::testing::resume_data();
  for (int i = 0; i < 10; ++i) {
    const auto report = s->trainer->step(data.slice(i * 32, 32));
    EXPECT_DOUBLE_EQ(report.lr, twin.param_groups()[0].options().get_lr()) << "step " << i;
    step_lr.step();
  }
}

TEST(LrSchedule, RefusesOptionsThatCannotWork) {
  using O = frugal::LrScheduleOptions;
  EXPECT_THROW(
      frugal::LrSchedule(O().decay(frugal::LrDecay::Cosine).warmup_steps(5).total_steps(5)),
      c10::Error);
  EXPECT_THROW(frugal::LrSchedule(O().decay(frugal::LrDecay::Step).gamma(0.0)), c10::Error);
  EXPECT_THROW(frugal::LrSchedule(O().warmup_steps(-1)), c10::Error);
}

// The resume data set as a LibTorch dataset.
class PairDataset : public torch::data::datasets::Dataset<PairDataset> {
 public:
  explicit PairDataset(frugal::Batch all) : all_(std::move(all)) {}
  torch::data::Example<> get(std::size_t i) override {
    const auto index = static_cast<std::int64_t>(i);
    return {all_.inputs[index], all_.targets[index]};
  }
  c10::optional<std::size_t> size() const override { return static_cast<std::size_t>(all_.size()); }

 private:
  frugal::Batch all_;
};

torch::Tensor fit_weights(const frugal::DataSource& data) {
  auto s = make_resume_setup("checkpoint");
  frugal::fit(*s->trainer, data, frugal::FitOptions().epochs(2).batch_size(48).seed(3));
  return flat_state(*s->model);
}

TEST(Fit, TorchDatasetsGiveTheRunOfTheSameTensors) {
  const auto all = frugal::testing::resume_data();
  const auto expected = fit_weights(frugal::TensorData(all));
  EXPECT_TRUE(
      torch::equal(fit_weights(frugal::TorchDataset<PairDataset>(PairDataset(all))), expected));
  auto stacked = PairDataset(all).map(torch::data::transforms::Stack<>());
  EXPECT_TRUE(
      torch::equal(fit_weights(frugal::TorchDataset<decltype(stacked)>(stacked)), expected));
}

TEST(Fit, ADataLoaderOrAVectorOfBatchesGivesTheRunOfTheSameBatches) {
  const auto all = frugal::testing::resume_data();
  auto in_order = [&](auto& train) {
    auto s = make_resume_setup("checkpoint");
    frugal::fit(*s->trainer, train, frugal::FitOptions().epochs(2).batch_size(48).shuffle(false));
    return flat_state(*s->model);
  };
  frugal::TensorData tensors(all);
  const auto expected = in_order(tensors);
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      PairDataset(all).map(torch::data::transforms::Stack<>()), 48);
  EXPECT_TRUE(torch::equal(in_order(*loader), expected));
  std::vector<frugal::Batch> batches;
  for (std::int64_t start = 0; start < all.size(); start += 48) {
    batches.push_back(all.slice(start, std::min<std::int64_t>(48, all.size() - start)));
  }
  EXPECT_TRUE(torch::equal(in_order(batches), expected));
  // Stopped inside the second epoch and resumed: the loader's batches of that epoch already
  // done are skipped, and the run ends where one never stopped does.
  const auto dir =
      std::filesystem::temp_directory_path() / ("frugal-fit-loader-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  auto options = frugal::FitOptions().epochs(2).shuffle(false).save_dir(dir.string());
  auto first = make_resume_setup("checkpoint");
  const auto stopped = frugal::fit(*first->trainer, *loader, options.max_steps(9));
  EXPECT_EQ(stopped.position.epoch, 2);
  auto second = make_resume_setup("checkpoint");
  const auto resumed = frugal::fit(*second->trainer, *loader, options.max_steps(0).resume(true));
  EXPECT_FALSE(resumed.resumed_from.empty());
  EXPECT_TRUE(torch::equal(flat_state(*second->model), expected));
  std::filesystem::remove_all(dir);
}

TEST(Fit, EvaluatesEveryNStepsAndStopsAtMaxSteps) {
  auto s = make_resume_setup("plain");
  const auto all = frugal::testing::resume_data();
  std::vector<std::int64_t> eval_steps;
  std::int64_t batches = 0;
  const auto result = frugal::fit(
      *s->trainer, frugal::TensorData(all),
      frugal::FitOptions()
          .epochs(5)
          .batch_size(64)  // 5 batches an epoch
          .max_steps(13)
          .eval_every(4)
          .on_step([&](const frugal::StepReport&, const frugal::FitPosition&) { ++batches; })
          .on_eval([&](const frugal::EvalReport& e, const frugal::FitPosition& p) {
            eval_steps.push_back(p.step);
            EXPECT_EQ(e.samples, 64);
          }),
      all.slice(0, 64));
  EXPECT_EQ(result.steps, 13);
  EXPECT_EQ(batches, 13);
  EXPECT_EQ(eval_steps, (std::vector<std::int64_t>{4, 8, 12}));
  EXPECT_EQ(result.position.epoch, 3);
  EXPECT_EQ(result.position.batch, 3);
}

TEST(Fit, AnEpochEndingInsideAWindowStepsIt) {
  auto s = make_resume_setup("micro");  // accumulate(2)
  std::vector<std::int64_t> evals;
  const auto all = frugal::testing::resume_data();
  const auto result = frugal::fit(*s->trainer, frugal::TensorData(all),
                                  frugal::FitOptions().epochs(2).batch_size(64).on_eval(
                                      [&](const frugal::EvalReport&, const frugal::FitPosition& p) {
                                        evals.push_back(p.step);
                                      }),
                                  all.slice(0, 32));
  // 5 batches an epoch: two windows of 2 and the fifth batch flushed alone.
  EXPECT_EQ(result.steps, 6);
  EXPECT_EQ(evals, (std::vector<std::int64_t>{3, 6}));
  EXPECT_FALSE(s->trainer->window_open());
}

TEST(Fit, RefusesOptionsThatNameBadValues) {
  auto s = make_resume_setup("plain");
  const frugal::TensorData data(frugal::testing::resume_data());
  try {
    frugal::fit(*s->trainer, data, frugal::FitOptions().batch_size(0));
    ADD_FAILURE() << "batch_size 0 accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("batch_size must be >= 1, got 0"), std::string::npos);
  }
  EXPECT_THROW(frugal::fit(*s->trainer, data, frugal::FitOptions().resume(true)), c10::Error);
  EXPECT_EQ(s->trainer->steps(), 0);
}

}  // namespace
