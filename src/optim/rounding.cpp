#include "rounding.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "frugal/error.h"
#include "vector_clones.h"

// Written to vectorize: the hash is 32-bit multiplies and shifts.

namespace frugal::optim::detail {
namespace {

inline bool special(std::uint32_t b) {  // infinity or NaN
  return (b & 0x7F800000U) == 0x7F800000U;
}

// Rounded to nearest, ties to even; a NaN is bfloat16's quiet NaN.
inline std::uint16_t nearest_bits(std::uint32_t b) {
  const bool nan = (b & 0x7FFFFFFFU) > 0x7F800000U;
  const std::uint32_t rounded = (b + 0x7FFFU + ((b >> 16) & 1U)) >> 16;
  return static_cast<std::uint16_t>(nan ? 0x7FC0U : rounded);
}

// Elements are drawn for a chunk at a time, on the stack.
constexpr std::int64_t kChunk = 256;

// The hashes of pairs [pair, pair + count) under a key's two halves.
FRUGAL_VECTOR_CLONES
void hash_pairs(std::uint32_t pair, std::int64_t count, std::uint32_t low_key,
                std::uint32_t high_key, std::uint32_t* __restrict out) {
  for (std::int64_t j = 0; j < count; ++j) {
    out[j] = pair_hash(pair + static_cast<std::uint32_t>(j), low_key, high_key);
  }
}

// The 16 random bits of elements [first, first + n), n <= kChunk: elements 2j and 2j + 1
// take the low and the high half of pair j's hash (one hash for two elements), so that an
// element's bits depend on its index alone, not on where a chunk starts.
void draw_noise(std::uint32_t first, std::int64_t n, std::uint32_t low_key, std::uint32_t high_key,
                std::uint16_t* out) {
  std::uint32_t pairs[kChunk / 2 + 1];
  const std::uint32_t odd = first & 1U;
  hash_pairs(first >> 1, (odd + n + 1) / 2, low_key, high_key, pairs);
  // Byte order: the low half of a pair's hash is the element of even index wherever the
  // bytes put it, as each chunk reads them alike.
  std::memcpy(out, reinterpret_cast<const unsigned char*>(pairs) + 2 * odd,
              static_cast<std::size_t>(n) * sizeof(std::uint16_t));
}

FRUGAL_VECTOR_CLONES
void round_with(std::uint32_t* __restrict bits, std::int64_t n,
                const std::uint16_t* __restrict noise) {
  for (std::int64_t i = 0; i < n; ++i) {
    // Adding up to one unit of bfloat16's last place to the float32's bits and cutting the
    // 16 low bits rounds the magnitude up with probability (low bits) / 2^16.
    const std::uint32_t b = bits[i];
    const std::uint32_t rounded = (b + noise[i]) & 0xFFFF0000U;
    bits[i] = special(b) ? b : rounded;
  }
}

// round_with and then nearest_even in one pass: the stochastic result is a bfloat16 value,
// which rounding to nearest keeps, and an infinity or NaN is rounded to nearest as it is.
FRUGAL_VECTOR_CLONES
void narrow_with(const std::uint32_t* __restrict x, std::int64_t n,
                 const std::uint16_t* __restrict noise, std::uint16_t* __restrict out) {
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint32_t b = x[i];
    const std::uint32_t up = b + noise[i];
    out[i] = special(b) ? nearest_bits(b) : static_cast<std::uint16_t>(up >> 16);
  }
}

// `fn(offset, count, noise)` over elements [0, n) a chunk at a time, with the random bits
// of elements first + offset on.
template <typename Fn>
void by_chunks(std::int64_t n, std::uint32_t first, std::uint32_t low_key, std::uint32_t high_key,
               Fn fn) {
  std::uint16_t noise[kChunk];
  for (std::int64_t at = 0; at < n; at += kChunk) {
    const std::int64_t count = std::min(kChunk, n - at);
    draw_noise(first + static_cast<std::uint32_t>(at), count, low_key, high_key, noise);
    fn(at, count, noise);
  }
}

// by_chunks over elements [first, first + n) under `key`: `fn(offset, count, noise)`.
template <typename Fn>
void with_bits16(std::uint64_t key, std::int64_t first, std::int64_t n, Fn fn) {
  const SplitKey k(key, first);
  by_chunks(n, static_cast<std::uint32_t>(first), k.low, k.high, fn);
}

// A generator of `device`'s kind seeded from `key` and `first`: the random bits off the CPU.
at::Generator seeded_generator(const at::Device& device, std::uint64_t key, std::int64_t first) {
  const auto seed = mix64(key ^ static_cast<std::uint64_t>(first));
  if (device.is_cpu()) {  // made, not cloned: LibTorch 1.13 leaks a cloned CPU generator
    return at::make_generator<at::CPUGeneratorImpl>(seed);
  }
  auto generator = at::globalContext().defaultGenerator(device).clone();
  generator.set_current_seed(seed);
  return generator;
}

FRUGAL_VECTOR_CLONES
void nearest_even(const std::uint32_t* __restrict x, std::int64_t n,
                  std::uint16_t* __restrict out) {
  for (std::int64_t i = 0; i < n; ++i) {
    out[i] = nearest_bits(x[i]);
  }
}

FRUGAL_VECTOR_CLONES
void widen(const std::uint16_t* __restrict x, std::int64_t n, std::uint32_t* __restrict out) {
  for (std::int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<std::uint32_t>(x[i]) << 16;
  }
}

}  // namespace

std::uint64_t rounding_key(std::uint64_t seed, std::uint64_t update) {
  return mix64(mix64(seed + 0x9E3779B97F4A7C15ULL) ^ update);
}

void to_bfloat16_bits(const float* x, std::int64_t n, std::uint16_t* out) {
  nearest_even(reinterpret_cast<const std::uint32_t*>(x), n, out);
}

void to_bfloat16_bits_stochastic(const float* x, std::int64_t n, std::uint64_t key,
                                 std::int64_t first, std::uint16_t* out) {
  const auto* bits = reinterpret_cast<const std::uint32_t*>(x);
  with_bits16(key, first, n, [&](std::int64_t at, std::int64_t count, const std::uint16_t* noise) {
    narrow_with(bits + at, count, noise, out + at);
  });
}

void draw_bits16(std::uint64_t key, std::int64_t first, std::int64_t n, std::uint16_t* out) {
  with_bits16(key, first, n, [&](std::int64_t at, std::int64_t count, const std::uint16_t* noise) {
    std::memcpy(out + at, noise, static_cast<std::size_t>(count) * sizeof(*noise));
  });
}

void uniform16(const at::Tensor& out, std::uint64_t key, std::int64_t first) {
  FRUGAL_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous(),
               "frugal: random fractions need contiguous float32 values, got ", out.scalar_type(),
               " ", out.sizes());
  constexpr float kUnit = 1.0F / 65536.0F;
  if (out.device().is_cpu()) {
    float* values = out.data_ptr<float>();
    with_bits16(key, first, out.numel(),
                [&](std::int64_t at, std::int64_t count, const std::uint16_t* noise) {
                  for (std::int64_t i = 0; i < count; ++i) {
                    values[at + i] = static_cast<float>(noise[i]) * kUnit;
                  }
                });
    return;
  }
  auto flat = out.view(-1);
  at::randint_out(flat, 1 << 16, {out.numel()}, seeded_generator(out.device(), key, first));
  flat.mul_(kUnit);
}

void from_bfloat16_bits(const std::uint16_t* x, std::int64_t n, float* out) {
  widen(x, n, reinterpret_cast<std::uint32_t*>(out));
}

void round_stochastic_cpu(float* x, std::int64_t n, std::uint64_t key, std::int64_t first) {
  const SplitKey k(key, first);
  auto* bits = reinterpret_cast<std::uint32_t*>(x);
  at::parallel_for(0, n, 1 << 16, [&](std::int64_t begin, std::int64_t end) {
    by_chunks(end - begin, static_cast<std::uint32_t>(first + begin), k.low, k.high,
              [&](std::int64_t at, std::int64_t count, const std::uint16_t* noise) {
                round_with(bits + begin + at, count, noise);
              });
  });
}

void round_stochastic_ops(const at::Tensor& x, at::Tensor bits, std::uint64_t key,
                          std::int64_t first) {
  FRUGAL_CHECK(bits.defined() && bits.scalar_type() == at::kInt && bits.numel() == x.numel() &&
                   bits.is_contiguous() && bits.device() == x.device(),
               "frugal: stochastic rounding on ", x.device(), " needs an int32 buffer of ",
               x.numel(), " elements there");
  bits = bits.view(x.sizes());
  at::randint_out(bits, 1 << 16, x.sizes(), seeded_generator(x.device(), key, first));
  auto as_bits = x.view(at::kInt);
  // Infinity + noise, cut, is infinity. A NaN's bits plus noise may carry out of the payload
  // (CUDA's canonical NaN, 0x7FFFFFFF, wraps to -0.0) or cut a low payload to infinity: each
  // NaN becomes bfloat16's quiet NaN instead. In place, with no mask to allocate (an update
  // allocates nothing): x's own bits become the mask once the sum is taken. A magnitude m
  // (the bits less the sign) is a NaN's where m > 0x7F800000, so (m - 0x7F800001) >> 31 is
  // 0 for a NaN and all ones otherwise.
  bits.add_(as_bits).bitwise_and_(
      static_cast<std::int64_t>(static_cast<std::int32_t>(0xFFFF0000U)));
  as_bits.bitwise_and_(0x7FFFFFFF).sub_(0x7F800001).__irshift__(31);  // all ones: not a NaN
  bits.bitwise_and_(as_bits);
  as_bits.bitwise_not_().bitwise_and_(0x7FC00000);  // 0x7FC00000 where a NaN was, else 0
  as_bits.bitwise_or_(bits);
}

void round_stochastic(const at::Tensor& x, at::Tensor bits, std::uint64_t key, std::int64_t first) {
  FRUGAL_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(),
               "frugal: stochastic rounding needs contiguous float32 values, got ", x.scalar_type(),
               " ", x.sizes());
  if (x.device().is_cpu()) {
    round_stochastic_cpu(x.data_ptr<float>(), x.numel(), key, first);
    return;
  }
  round_stochastic_ops(x, std::move(bits), key, first);
}

}  // namespace frugal::optim::detail
