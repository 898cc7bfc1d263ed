// The timeline's PNG, decoded here: a valid file whose stacked columns are the recording's
// bytes, coloured by category, with the refusals marked.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <zlib.h>

#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/memory_cap.h"
#include "frugal/memory/recorder.h"
#include "frugal/train/trainer.h"
#include "helpers.h"

namespace {
namespace png_check {  // apart from its unity-build neighbours' helpers

using Rgb = std::array<std::uint8_t, 3>;

// The page's colours, by category: weights, gradients, optimizer state, activations, other.
constexpr std::array<Rgb, 5> kCategoryColours{{{0x4e, 0x79, 0xa7},
                                               {0xf2, 0x8e, 0x2b},
                                               {0x59, 0xa1, 0x4f},
                                               {0xe1, 0x57, 0x59},
                                               {0xba, 0xb0, 0xac}}};
constexpr Rgb kRed{221, 0, 0};

std::uint32_t u32(const std::string& s, std::size_t at) {
  std::uint32_t v = 0;
  for (std::size_t i = 0; i < 4; ++i) {
    v = (v << 8) | static_cast<std::uint8_t>(s[at + i]);
  }
  return v;
}

struct Image {
  int width = 0, height = 0;
  std::vector<Rgb> pixels;
  Rgb at(int x, int y) const {
    return pixels[static_cast<std::size_t>(y) * static_cast<std::size_t>(width) +
                  static_cast<std::size_t>(x)];
  }
};

// Reads the PNG as a decoder would, checking each chunk's CRC and the scanlines' filters.
Image decode(const std::string& png) {
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  Image image;
  std::string packed;
  std::size_t at = 8;
  std::vector<std::string> types;
  while (at + 12 <= png.size()) {
    const auto length = u32(png, at);
    const auto type = png.substr(at + 4, 4);
    const auto data = png.substr(at + 8, length);
    const auto crc = crc32(crc32(0L, Z_NULL, 0),
                           reinterpret_cast<const Bytef*>(png.data() + at + 4), length + 4);
    EXPECT_EQ(u32(png, at + 8 + length), crc) << type;
    types.push_back(type);
    if (type == "IHDR") {
      image.width = static_cast<int>(u32(data, 0));
      image.height = static_cast<int>(u32(data, 4));
      EXPECT_EQ(data.substr(8), std::string("\x08\x02\x00\x00\x00", 5));  // RGB, 8 bits
    } else if (type == "IDAT") {
      packed += data;
    }
    at += 12 + length;
  }
  EXPECT_EQ(at, png.size());
  EXPECT_EQ(types.front(), "IHDR");
  EXPECT_EQ(types.back(), "IEND");
  const auto row = 1 + 3 * static_cast<std::size_t>(image.width);
  std::vector<std::uint8_t> raw(row * static_cast<std::size_t>(image.height));
  uLongf size = raw.size();
  EXPECT_EQ(
      uncompress(raw.data(), &size, reinterpret_cast<const Bytef*>(packed.data()), packed.size()),
      Z_OK);
  EXPECT_EQ(size, raw.size());
  for (int y = 0; y < image.height; ++y) {
    const auto* line = raw.data() + row * static_cast<std::size_t>(y);
    EXPECT_EQ(line[0], 0);
    for (int x = 0; x < image.width; ++x) {
      image.pixels.push_back({line[1 + 3 * x], line[2 + 3 * x], line[3 + 3 * x]});
    }
  }
  return image;
}

int category_of(const Rgb& p) {
  for (std::size_t c = 0; c < kCategoryColours.size(); ++c) {
    if (p == kCategoryColours[c]) {
      return static_cast<int>(c);
    }
  }
  return -1;
}

torch::Tensor ce(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(out, target);
}

std::string png_of(const frugal::MemoryRecorder& recorder) {
  std::stringstream out;
  recorder.write_to(out, ".png");
  return out.str();
}

}  // namespace png_check

TEST(MemoryTimelinePng, ColumnsStackEachCategorysBytesToThePeak) {
  auto net = frugal::testing::deep_narrow(8);
  torch::optim::SGD sgd(net->parameters(), 0.05);  // no state: its colour must not appear
  frugal::Trainer trainer(net, sgd, png_check::ce);
  torch::manual_seed(2);
  const frugal::Batch batch{torch::randn({64, 256}), torch::randint(0, 10, {64})};
  trainer.step(batch);
  frugal::MemoryRecorder recorder;
  recorder.watch(*net, &sgd);
  trainer.step(batch);
  recorder.stop();
  const auto image = png_check::decode(png_check::png_of(recorder));
  ASSERT_GT(image.width, 0);
  // The plot's columns: category pixels below the legend (the legend's swatches sit above
  // the plot, in its first 60 rows).
  constexpr int kBelowLegend = 60;
  std::array<std::int64_t, 5> pixels{};
  std::vector<int> height(static_cast<std::size_t>(image.width), 0);
  for (int x = 0; x < image.width; ++x) {
    for (int y = kBelowLegend; y < image.height; ++y) {
      const int c = png_check::category_of(image.at(x, y));
      if (c >= 0) {
        ++pixels[static_cast<std::size_t>(c)];
        ++height[static_cast<std::size_t>(x)];
      }
    }
  }
  const auto peak = recorder.peak();
  for (const auto& g : peak.groups) {
    EXPECT_GT(pixels[static_cast<std::size_t>(g.category)], 0) << to_string(g.category);
  }
  EXPECT_EQ(pixels[static_cast<std::size_t>(frugal::MemoryCategory::OptimizerState)], 0);
  EXPECT_GT(pixels[static_cast<std::size_t>(frugal::MemoryCategory::Activations)], 0);
  // Fewer events than columns: the first column stands at the bytes after the first event,
  // the tallest at the peak.
  std::stringstream json;
  recorder.write_to(json, ".json");
  const auto events = nlohmann::json::parse(json.str()).at("events");
  ASSERT_LT(events.size(), 800u);
  std::size_t first = 0;
  while (first < height.size() && height[first] == 0) {
    ++first;
  }
  ASSERT_LT(first, height.size());
  const int tallest = *std::max_element(height.begin(), height.end());
  const double drawn = static_cast<double>(height[first]) / tallest;
  const double bytes =
      events.front().at("allocated").get<double>() / static_cast<double>(recorder.peak_bytes());
  EXPECT_NEAR(drawn, bytes, 1.5 / tallest);
  EXPECT_LT(drawn, 0.9);  // the step rose visibly above its start
  for (const auto& p : image.pixels) {
    EXPECT_NE(p, png_check::kRed) << "a refusal drawn where none was recorded";
    if (p == png_check::kRed) {
      break;
    }
  }
}

TEST(MemoryTimelinePng, ARefusedAllocationIsARedLine) {
  frugal::MemoryRecorder recorder;
  auto kept = torch::ones({1 << 16});
  {
    frugal::ScopedMemoryCap cap(torch::kCPU, frugal::CountingAllocator::stats().allocated + 1024);
    EXPECT_THROW(torch::empty({1 << 16}), c10::OutOfMemoryError);
  }
  recorder.stop();
  const auto image = png_check::decode(png_check::png_of(recorder));
  // A line down the plot: a column with red in many rows.
  int longest = 0;
  for (int x = 0; x < image.width; ++x) {
    int red = 0;
    for (int y = 0; y < image.height; ++y) {
      red += image.at(x, y) == png_check::kRed ? 1 : 0;
    }
    longest = std::max(longest, red);
  }
  EXPECT_GT(longest, image.height / 2);
}

}  // namespace
