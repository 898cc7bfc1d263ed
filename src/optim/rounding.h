// Stochastic rounding of float32 values to bfloat16: the low-precision weights' update.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace frugal::optim::detail {

/// The key of one parameter update's random bits: from the optimizer's seed and the count
/// of updates before it.
std::uint64_t rounding_key(std::uint64_t seed, std::uint64_t update);

/// Rounds each of `x[0..n)` (float32, in place) to one of the two bfloat16 values around
/// it, up with probability (x - down) / (up - down), so each result is a bfloat16 value held
/// exactly in float32 and equals x in expectation. The random bits of element i (its index
/// in the parameter is `first + i`) are one half of a hash of `key` and that index divided
/// by 2, a hash drawing the bits of two neighbours; the same whatever the chunks.
/// Infinities and NaN stay as they are.
void round_stochastic_cpu(float* x, std::int64_t n, std::uint64_t key, std::int64_t first);

/// The 16 random bits of elements [first, first + n) under `key` (as round_stochastic_cpu
/// draws them: element i's from `key` and its index alone), into `out`; on this thread.
void draw_bits16(std::uint64_t key, std::int64_t first, std::int64_t n, std::uint16_t* out);

/// `out` (float32, contiguous) filled with random multiples of 2^-16 in [0, 1): on the CPU
/// draw_bits16's bits of elements from `first` on under `key`, times 2^-16; elsewhere from
/// a generator of that device seeded from `key` and `first` (other bits than the CPU's).
void uniform16(const at::Tensor& out, std::uint64_t key, std::int64_t first);

/// bfloat16's bits of x[0..n) rounded to nearest, ties to even (as a cast rounds; a NaN
/// stays a NaN), into `out`.
void to_bfloat16_bits(const float* x, std::int64_t n, std::uint16_t* out);

/// round_stochastic_cpu and then to_bfloat16_bits in one pass on this thread alone, for a
/// caller that shares out the work itself: the same bits out, and x left as it was.
void to_bfloat16_bits_stochastic(const float* x, std::int64_t n, std::uint64_t key,
                                 std::int64_t first, std::uint16_t* out);

/// x[0..n), bfloat16's bits, widened to float32 (exactly) into `out`.
void from_bfloat16_bits(const std::uint16_t* x, std::int64_t n, float* out);

/// The same for a contiguous float32 tensor `x`: round_stochastic_cpu on the CPU; elsewhere
/// tensor operations, with `bits` an int32 buffer of x's element count on x's device for
/// the random bits (drawn from a generator of that device seeded from `key` and `first`,
/// other bits than the CPU's).
void round_stochastic(const at::Tensor& x, at::Tensor bits, std::uint64_t key, std::int64_t first);

}  // namespace frugal::optim::detail
