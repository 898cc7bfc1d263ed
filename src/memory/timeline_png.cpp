// A recording's timeline as a PNG: the page's stacked areas drawn into pixels, with its
// title, legend, axis, peak and refusals, for docs and CI logs where no browser runs.
#include <fmt/format.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "frugal/error.h"
#include "frugal/memory/format.h"
#include "pixel_font.h"
#include "recorder_impl.h"
#include "timeline.h"

namespace frugal::detail {
namespace {

using Rgb = std::array<std::uint8_t, 3>;

constexpr int kWidth = 960;
constexpr int kHeight = 460;
constexpr int kLeft = 84, kRight = 12, kTop = 70, kBottom = 30;
constexpr Rgb kWhite{255, 255, 255}, kInk{34, 34, 34}, kGrid{228, 228, 228}, kAxis{85, 85, 85},
    kRed{221, 0, 0};
// The page's colours, by MemoryCategory.
constexpr std::array<Rgb, kCategories> kColours{{{0x4e, 0x79, 0xa7},
                                                 {0xf2, 0x8e, 0x2b},
                                                 {0x59, 0xa1, 0x4f},
                                                 {0xe1, 0x57, 0x59},
                                                 {0xba, 0xb0, 0xac},
                                                 {0x76, 0xb7, 0xb2}}};

class Canvas {
 public:
  Canvas(int width, int height) : width_(width), height_(height) {
    pixels_.resize(static_cast<std::size_t>(width) * static_cast<std::size_t>(height), kWhite);
  }
  void set(int x, int y, Rgb colour) {
    if (x >= 0 && x < width_ && y >= 0 && y < height_) {
      pixels_[static_cast<std::size_t>(y) * static_cast<std::size_t>(width_) +
              static_cast<std::size_t>(x)] = colour;
    }
  }
  void fill(int x0, int y0, int x1, int y1, Rgb colour) {  // [x0, x1) x [y0, y1)
    for (int y = y0; y < y1; ++y) {
      for (int x = x0; x < x1; ++x) {
        set(x, y, colour);
      }
    }
  }
  /// Text with its top-left corner at (x, y); returns the x after it.
  int text(int x, int y, const std::string& s, Rgb colour, int scale = 1) {
    for (const char c : s) {
      const auto* rows = glyph(c);
      for (int r = 0; r < kGlyphHeight; ++r) {
        for (int b = 0; b < kGlyphWidth; ++b) {
          if ((rows[r] >> (kGlyphWidth - 1 - b)) & 1) {
            fill(x + b * scale, y + r * scale, x + (b + 1) * scale, y + (r + 1) * scale, colour);
          }
        }
      }
      x += (kGlyphWidth + 1) * scale;
    }
    return x;
  }
  static int text_width(const std::string& s, int scale = 1) {
    return static_cast<int>(s.size()) * (kGlyphWidth + 1) * scale;
  }
  /// The rows as PNG's scanlines: each led by its filter type (0, none).
  std::vector<std::uint8_t> scanlines() const {
    std::vector<std::uint8_t> out;
    out.reserve(static_cast<std::size_t>(height_) * (1 + 3 * static_cast<std::size_t>(width_)));
    for (int y = 0; y < height_; ++y) {
      out.push_back(0);
      for (int x = 0; x < width_; ++x) {
        const auto& p = pixels_[static_cast<std::size_t>(y) * static_cast<std::size_t>(width_) +
                                static_cast<std::size_t>(x)];
        out.insert(out.end(), p.begin(), p.end());
      }
    }
    return out;
  }
  int width() const { return width_; }
  int height() const { return height_; }

 private:
  int width_, height_;
  std::vector<Rgb> pixels_;
};

void put_u32(std::string& out, std::uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) {
    out.push_back(static_cast<char>((v >> shift) & 0xff));
  }
}

void chunk(std::ostream& out, const char* type, const std::string& data) {
  std::string bytes;
  put_u32(bytes, static_cast<std::uint32_t>(data.size()));
  bytes.append(type, 4);
  bytes += data;
  // The CRC covers the type and the data, not the length.
  const auto crc = crc32(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(bytes.data() + 4),
                         static_cast<uInt>(bytes.size() - 4));
  put_u32(bytes, static_cast<std::uint32_t>(crc));
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void write_png(const Canvas& canvas, std::ostream& out) {
  const auto raw = canvas.scanlines();
  auto size = compressBound(static_cast<uLong>(raw.size()));
  std::string packed(size, '\0');
  FRUGAL_CHECK(compress2(reinterpret_cast<Bytef*>(packed.data()), &size, raw.data(),
                         static_cast<uLong>(raw.size()), 6) == Z_OK,
               "frugal: compressing the timeline's PNG failed");
  packed.resize(size);
  std::string header;
  put_u32(header, static_cast<std::uint32_t>(canvas.width()));
  put_u32(header, static_cast<std::uint32_t>(canvas.height()));
  header +=
      std::string("\x08\x02\x00\x00\x00", 5);  // 8 bits, RGB, deflate, no filter, no interlace
  out.write("\x89PNG\r\n\x1a\n", 8);
  chunk(out, "IHDR", header);
  chunk(out, "IDAT", packed);
  chunk(out, "IEND", "");
}

std::string fitted(std::string s, int width) {
  const auto most = static_cast<std::size_t>(width / (kGlyphWidth + 1));
  if (s.size() > most) {
    s = s.substr(0, most - 3) + "...";
  }
  return s;
}

}  // namespace

void write_timeline_png(const Recording& r, std::ostream& out) {
  Canvas canvas(kWidth, kHeight);
  const int plot_w = kWidth - kLeft - kRight;
  const int bottom = kHeight - kBottom;
  const int plot_h = bottom - kTop;
  const auto all = timeline_points(r);
  const auto points = thin(all, static_cast<std::size_t>(plot_w));
  canvas.text(8, 8,
              fitted(fmt::format("memory timeline: peak {}", format_bytes(r.peak.bytes)), kWidth),
              kInk, 2);
  canvas.text(8, 30,
              fitted(r.events.empty() ? std::string("nothing was recorded") : r.peak.summary(),
                     kWidth - 16),
              kInk);
  std::int64_t most = 1;
  for (const auto& p : points) {
    most = std::max(most, p.total());
  }
  // The legend: the categories that ever held a byte, in the page's order.
  int x = 8;
  for (std::size_t c = 0; c < kColours.size(); ++c) {
    const bool held = std::any_of(points.begin(), points.end(),
                                  [c](const TimelinePoint& p) { return p.bytes[c] > 0; });
    if (held) {
      canvas.fill(x, 46, x + 10, 56, kColours[c]);
      x = canvas.text(x + 14, 48, to_string(static_cast<MemoryCategory>(c)), kInk) + 12;
    }
  }
  auto row_of = [&](std::int64_t bytes) {
    return bottom -
           static_cast<int>(static_cast<double>(bytes) * plot_h / static_cast<double>(most) + 0.5);
  };
  for (int k = 0; k <= 4; ++k) {
    const auto bytes = most * k / 4;
    canvas.fill(kLeft, row_of(bytes), kWidth - kRight, row_of(bytes) + 1, kGrid);
    const auto label = format_bytes(bytes);
    canvas.text(kLeft - 6 - Canvas::text_width(label), row_of(bytes) - 3, label, kAxis);
  }
  canvas.text(kLeft, bottom + 12,
              fmt::format("{} events: allocations and frees, in order{}", r.events.size(),
                          r.dropped > 0 ? fmt::format(" ({} older ones dropped)", r.dropped) : ""),
              kAxis);
  if (points.empty()) {
    write_png(canvas, out);
    return;
  }
  // One column a pixel: each category stacked on those before it.
  auto column_of = [&](std::size_t index, std::size_t count) {
    return kLeft + static_cast<int>(index * static_cast<std::size_t>(plot_w) / count);
  };
  std::size_t peak = 0;
  for (std::size_t i = 0; i < points.size(); ++i) {
    peak = points[i].total() > points[peak].total() ? i : peak;
    const int x0 = column_of(i, points.size());
    const int x1 = std::max(x0 + 1, column_of(i + 1, points.size()));
    std::int64_t below = 0;
    for (std::size_t c = 0; c < kColours.size(); ++c) {
      const auto bytes = points[i].bytes[c];
      if (bytes > 0) {
        canvas.fill(x0, row_of(below + bytes), x1, row_of(below), kColours[c]);
      }
      below += bytes;
    }
  }
  const int peak_x = column_of(peak, points.size());
  for (int y = kTop; y < bottom; y += 7) {  // dashed
    canvas.fill(peak_x, y, peak_x + 1, std::min(y + 4, bottom), kInk);
  }
  const auto peak_label = "peak " + format_bytes(r.peak.bytes);
  canvas.text(std::min(peak_x + 4, kWidth - kRight - Canvas::text_width(peak_label)), kTop + 2,
              peak_label, kInk);
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (r.events[all[i].event].action == EventAction::Refused) {
      const int rx = column_of(i, all.size());
      canvas.fill(rx, kTop, rx + 2, bottom, kRed);
      const std::string label = "refused: out of memory";
      canvas.text(std::min(rx + 4, kWidth - kRight - Canvas::text_width(label)), kTop + 14, label,
                  kRed);
    }
  }
  write_png(canvas, out);
}

}  // namespace frugal::detail
