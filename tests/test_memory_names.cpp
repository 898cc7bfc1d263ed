#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/memory_names.h"
#include "frugal/memory/recorder.h"
#include "helpers.h"

namespace memory_names_test {

// The bytes the recorder's peak gives a group whose module is `module`, or -1.
std::int64_t group_bytes(const frugal::MemoryPeak& peak, const std::string& module) {
  for (const auto& g : peak.groups) {
    if (g.module == module) {
      return g.bytes;
    }
  }
  return -1;
}

// The timeline page's data: its categories and, per point, the bytes of each.
nlohmann::json page_data(const frugal::MemoryRecorder& recorder) {
  std::ostringstream out;
  recorder.write_to(out, ".html");
  const auto page = out.str();
  const std::string begin = "const DATA = ";
  const auto from = page.find(begin) + begin.size();
  return nlohmann::json::parse(page.substr(from, page.find(";\n", from) - from));
}

std::size_t column_of(const nlohmann::json& data, const std::string& name) {
  const auto& c = data["categories"];
  for (std::size_t i = 0; i < c.size(); ++i) {
    if (c[i] == name) {
      return i;
    }
  }
  return c.size();
}

TEST(MemoryNames, ANamedTensorAliveBeforeTheRecordingIsCountedUnderItsName) {
  frugal::CountingAllocator::install();
  auto images = torch::zeros({256, 1024}, torch::kUInt8);  // 256 KiB
  auto labels = torch::zeros({256}, torch::kLong);         // 2 KiB
  auto loose = torch::zeros({512});                        // alive before, unnamed
  frugal::name_memory(images, "data set");
  frugal::name_memory(labels, "data set");
  frugal::MemoryRecorder recorder;
  auto step = torch::ones({4096}) * 2;  // something recorded
  recorder.stop();
  const auto peak = recorder.peak();
  const auto named = images.storage().nbytes() + labels.storage().nbytes();
  EXPECT_EQ(group_bytes(peak, "(data set)"), static_cast<std::int64_t>(named));
  // The unnamed tensor stays "alive before the recording", and the groups add up to the peak.
  EXPECT_GE(group_bytes(peak, "(alive before the recording)"),
            static_cast<std::int64_t>(loose.storage().nbytes()));
  std::int64_t sum = 0;
  for (const auto& g : peak.groups) {
    sum += g.bytes;
  }
  EXPECT_EQ(sum, peak.bytes);
  EXPECT_NE(peak.summary().find("other (data set)"), std::string::npos) << peak.summary();

  // The page draws the name as a part of its own, out of `other`, at every point.
  const auto data = page_data(recorder);
  const auto column = column_of(data, "data set");
  ASSERT_LT(column, data["categories"].size()) << data["categories"].dump();
  for (const auto& point : data["points"]) {
    EXPECT_EQ(point[2][column].get<std::int64_t>(), static_cast<std::int64_t>(named));
  }
}

TEST(MemoryNames, ANamedBlockFreedWhileRecordedLeavesItsPart) {
  frugal::CountingAllocator::install();
  auto cache = torch::zeros({64, 1024});  // 256 KiB
  const auto bytes = static_cast<std::int64_t>(cache.storage().nbytes());
  frugal::name_memory(cache, "cache");
  frugal::MemoryRecorder recorder;
  auto before = torch::ones({1024});
  cache = torch::Tensor();  // freed while recorded
  auto after = torch::ones({1024});
  recorder.stop();
  const auto data = page_data(recorder);
  const auto column = column_of(data, "cache");
  ASSERT_LT(column, data["categories"].size());
  const auto& points = data["points"];
  ASSERT_GE(points.size(), 3U);
  EXPECT_EQ(points.front()[2][column].get<std::int64_t>(), bytes);
  EXPECT_EQ(points.back()[2][column].get<std::int64_t>(), 0);
  // The free event is named: the page's hover says whose block it was.
  bool freed = false;
  for (const auto& p : points) {
    freed = freed || (p[3] == "free" && p[5] == "cache" && p[4].get<std::int64_t>() == bytes);
  }
  EXPECT_TRUE(freed);
}

TEST(MemoryNames, ANameDiesWithItsStorageAndANewNameReplacesIt) {
  frugal::CountingAllocator::install();
  {
    auto gone = torch::zeros({4096});
    frugal::name_memory(gone, "old");
  }
  auto kept = torch::zeros({4096});  // may reuse the freed block's address
  frugal::name_memory(kept, "first");
  frugal::name_memory(kept, "second");
  frugal::MemoryRecorder recorder;
  recorder.stop();
  const auto peak = recorder.peak();
  EXPECT_EQ(group_bytes(peak, "(old)"), -1) << peak.summary();
  EXPECT_EQ(group_bytes(peak, "(first)"), -1) << peak.summary();
  EXPECT_EQ(group_bytes(peak, "(second)"), static_cast<std::int64_t>(kept.storage().nbytes()));
}

TEST(MemoryNames, BadNamesAreRefusedByName) {
  frugal::testing::expect_error_contains([] { frugal::name_memory(torch::zeros({2}), ""); },
                                         "needs a name, got an empty one");
  frugal::testing::expect_error_contains([] { frugal::name_memory(torch::Tensor(), "data set"); },
                                         "name_memory('data set'): the tensor is undefined");
}

}  // namespace memory_names_test
