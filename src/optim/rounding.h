// Stochastic rounding of float32 values to bfloat16: the low-precision weights' update.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace frugal::optim::detail {

/// Two rounds of xorshift and multiply, then a last xorshift: the shape of the integer
/// finalizers below.
template <typename T>
inline T xorshift_multiply(T x, int first, T by_first, int second, T by_second, int last) {
  x ^= x >> first;
  x *= by_first;
  x ^= x >> second;
  x *= by_second;
  return x ^ (x >> last);
}

/// lowbias32's shifts and multipliers, for its scalar and vector copies.
struct Lowbias32 {
  static constexpr int kFirst = 16, kSecond = 15, kLast = 16;
  static constexpr std::uint32_t kByFirst = 0x7FEB352DU, kBySecond = 0x846CA68BU;
};

/// A 32-bit integer hash with good avalanche ("lowbias32").
inline std::uint32_t mix32(std::uint32_t x) {
  using L = Lowbias32;
  return xorshift_multiply<std::uint32_t>(x, L::kFirst, L::kByFirst, L::kSecond, L::kBySecond,
                                          L::kLast);
}

/// splitmix64's finalizer.
inline std::uint64_t mix64(std::uint64_t x) {
  return xorshift_multiply<std::uint64_t>(x, 30, 0xBF58476D1CE4E5B9ULL, 27, 0x94D049BB133111EBULL,
                                          31);
}

/// The two halves of a key for elements from index `first` on: indices past 2^32 elements
/// reuse a key's stream with the high half of the key changed.
struct SplitKey {
  SplitKey(std::uint64_t key, std::int64_t first)
      : low(static_cast<std::uint32_t>(key)),
        high(static_cast<std::uint32_t>(key >> 32) ^
             static_cast<std::uint32_t>(static_cast<std::uint64_t>(first) >> 32)) {}
  std::uint32_t low, high;
};

/// The hash of pair `pair` (elements 2 pair and 2 pair + 1, whose 16 random bits are its
/// low and high halves) under a key's two halves.
inline std::uint32_t pair_hash(std::uint32_t pair, std::uint32_t low_key, std::uint32_t high_key) {
  return mix32(mix32(pair + low_key) ^ high_key);
}

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
/// other bits than the CPU's; on CUDA they also follow the launch configuration, so the GPU
/// model: the same bits on the same model and LibTorch only).
void round_stochastic(const at::Tensor& x, at::Tensor bits, std::uint64_t key, std::int64_t first);
/// round_stochastic's tensor operations, on any device (the CPU's for tests): a NaN becomes
/// bfloat16's quiet NaN (0x7FC0), whatever its payload and sign.
void round_stochastic_ops(const at::Tensor& x, at::Tensor bits, std::uint64_t key,
                          std::int64_t first);

}  // namespace frugal::optim::detail
