// 4-bit codes rounded stochastically on the CPU, packed two to a byte, in one pass: the
// fused step's encoder for QuantizedStateOptions::stochastic_codes at 4 bits.
#pragma once

#include <cstdint>

namespace frugal::optim::detail {

/// The codes of x[i] / scale (i < count) under a 16-value map (`values`, sorted; `gaps[k]`
/// = values[k + 1] - values[k]), each the code at or below the value or the one above (the
/// count of values[1..15] at or below y, at most 14, is the one below), up when y - below >
/// u * gap, u the element's 16 random bits (draw_bits16's under `key`, x[i] being element
/// first + i; `first` even) times 2^-16: quantize_into's stochastic arithmetic with its bits.
/// Packed two to a byte, element 2k in the low half of packed[k]; an odd count leaves the
/// last byte's high half zero. On x86-64 an AVX2 copy (the bits drawn and the tables looked
/// up in registers) is chosen at load time; both give the same codes.
void stochastic_codes4(const float* x, float scale, const float* values, const float* gaps,
                       std::uint64_t key, std::int64_t first, std::int64_t count,
                       std::uint8_t* packed);

}  // namespace frugal::optim::detail
