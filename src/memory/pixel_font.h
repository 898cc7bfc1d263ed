// A 5x7 pixel font (and two rows below the baseline) for the labels of a timeline's PNG: digits,
// lower-case letters (upper case drawn with them, but for a few capitals units need), and the
// punctuation numbers and module paths use. A character it lacks is drawn as '?'.
#pragma once

#include <cstdint>

namespace frugal::detail {

constexpr int kGlyphWidth = 5;
constexpr int kGlyphHeight = 9;  // 7 above the baseline, 2 below

/// The glyph of `c`: 9 rows of 5 bits, the leftmost pixel in bit 4.
const std::uint8_t* glyph(char c);

}  // namespace frugal::detail
