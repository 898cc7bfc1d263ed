// The micro-batch plan: sizes, parts, counts and the global count.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <numeric>

#include "engine/micro_batch_plan.h"
#include "frugal/error.h"

namespace {

using frugal::detail::MicroBatchPlan;

std::int64_t sum_of(const std::vector<std::int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), std::int64_t{0});
}

TEST(MicroBatchPlan, ASizeCutsTheBatchWithTheLastPartSmaller) {
  const MicroBatchPlan plan(c10::nullopt, nullptr);
  EXPECT_EQ(plan.sizes(10, 4), (std::vector<std::int64_t>{4, 4, 2}));
  EXPECT_EQ(plan.sizes(10, 0), (std::vector<std::int64_t>{10}));  // no size: the whole batch
  EXPECT_EQ(plan.sizes(3, 16), (std::vector<std::int64_t>{3}));   // a size above the batch
  for (std::int64_t samples = 1; samples <= 20; ++samples) {
    for (std::int64_t size = 1; size <= 7; ++size) {
      const auto sizes = plan.sizes(samples, size);
      EXPECT_EQ(sum_of(sizes), samples);
      EXPECT_EQ(static_cast<std::int64_t>(sizes.size()), (samples + size - 1) / size);
    }
  }
}

TEST(MicroBatchPlan, PartsAreNearEqualAsTensorSplitCutsThem) {
  const MicroBatchPlan plan(4, nullptr);
  for (std::int64_t samples = 1; samples <= 20; ++samples) {
    const auto sizes = plan.sizes(samples, 0);
    const auto pieces = torch::arange(samples).tensor_split(std::min<std::int64_t>(4, samples));
    ASSERT_EQ(sizes.size(), pieces.size());
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      EXPECT_EQ(sizes[i], pieces[i].size(0)) << samples << " samples, part " << i;
    }
  }
  EXPECT_EQ(plan.sizes(10, 3), (std::vector<std::int64_t>{3, 3, 3, 1}));  // a size set wins
}

TEST(MicroBatchPlan, CountsAreSamplesOrWhatTheCountFunctionSays) {
  const frugal::Batch batch{torch::randn({6, 2}), torch::tensor({1, -100, 2, -100, -100, 3})};
  const auto by_samples = MicroBatchPlan(c10::nullopt, nullptr).split(batch, 4);
  EXPECT_EQ(by_samples.counts, (std::vector<std::int64_t>{4, 2}));
  EXPECT_EQ(by_samples.total, 6);
  const MicroBatchPlan tokens(c10::nullopt, [](const frugal::Batch& b) {
    return b.targets.ne(-100).sum().item<std::int64_t>();
  });
  const auto by_tokens = tokens.split(batch, 4);
  EXPECT_EQ(by_tokens.counts, (std::vector<std::int64_t>{2, 1}));
  EXPECT_EQ(by_tokens.total, 3);
  EXPECT_TRUE(by_tokens.micros[1].targets.equal(batch.targets.slice(0, 4, 6)));
}

TEST(MicroBatchPlan, SplitIntoKeepsItsRoomAndIsLeftEmptyWhenRefused) {
  const MicroBatchPlan tokens(c10::nullopt, [](const frugal::Batch& b) {
    return b.targets.ne(-100).sum().item<std::int64_t>();
  });
  const frugal::Batch batch{torch::randn({6, 2}), torch::tensor({1, -100, 2, -100, -100, 3})};
  MicroBatchPlan::Split out;
  tokens.split_into(batch, 2, out);
  const auto fresh = tokens.split(batch, 2);
  EXPECT_EQ(out.counts, fresh.counts);
  EXPECT_EQ(out.total, fresh.total);
  ASSERT_EQ(out.micros.size(), 3U);
  const auto* room = out.micros.data();
  tokens.split_into(batch, 4, out);  // fewer parts: the same lists, nothing left of before
  EXPECT_EQ(out.micros.data(), room);
  EXPECT_EQ(out.counts, (std::vector<std::int64_t>{2, 1}));
  EXPECT_EQ(out.total, 3);
  EXPECT_TRUE(out.micros[1].targets.equal(batch.targets.slice(0, 4, 6)));
  const frugal::Batch padding{torch::randn({4, 2}), torch::full({4}, -100)};
  EXPECT_THROW(tokens.split_into(padding, 2, out), frugal::Error);
  EXPECT_TRUE(out.micros.empty());
  EXPECT_TRUE(out.counts.empty());
  EXPECT_EQ(out.total, 0);
}

TEST(MicroBatchPlan, TheWholeBatchInOnePartIsTheBatchItself) {
  const frugal::Batch batch{torch::randn({5, 2}), torch::randn({5})};
  const auto split = MicroBatchPlan(c10::nullopt, nullptr).split(batch, 0);
  ASSERT_EQ(split.micros.size(), 1u);
  EXPECT_TRUE(split.micros[0].inputs.is_same(batch.inputs));
}

TEST(MicroBatchPlan, ANegativeOrZeroCountIsRefusedNamingIt) {
  const frugal::Batch batch{torch::randn({4, 2}), torch::randn({4})};
  const MicroBatchPlan negative(c10::nullopt, [](const frugal::Batch&) { return -2; });
  try {
    negative.split(batch, 2);
    FAIL() << "a negative count was accepted";
  } catch (const frugal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("returned -2"), std::string::npos) << e.what();
  }
  const MicroBatchPlan nothing(c10::nullopt, [](const frugal::Batch&) { return 0; });
  try {
    nothing.split(batch, 2);
    FAIL() << "a zero global count was accepted";
  } catch (const frugal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("global count is 0"), std::string::npos) << e.what();
  }
}

}  // namespace
