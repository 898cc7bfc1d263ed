#include "codes4_kernel.h"

#include <cstring>

#include "rounding.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(FRUGAL_NO_CLONES)
#define FRUGAL_AVX2_CODES4 1
#include <immintrin.h>
#endif

// Compiled without FMA contraction: y - below and u * gap round as the tensor-ops step's.

namespace frugal::optim::detail {
namespace {

constexpr float kUnit = 1.0F / 65536.0F;  // 16 random bits to a fraction in [0, 1)

// One element's code: the plain arithmetic every copy follows.
inline std::uint8_t code_of(float x, float scale, const float* values, const float* gaps,
                            std::uint32_t bits) {
  const float y = x / scale;
  std::int32_t below = 0;
  for (int k = 1; k < 15; ++k) {
    below += values[k] <= y ? 1 : 0;
  }
  const float u = static_cast<float>(bits) * kUnit;
  return static_cast<std::uint8_t>(below + (y - values[below] > u * gaps[below] ? 1 : 0));
}

// Elements [from, count) one pair at a time (`from` even): the pair's hash gives the even
// element its low 16 bits and the odd one its high 16.
void codes_from(const float* x, float scale, const float* values, const float* gaps,
                const SplitKey& key, std::uint32_t first_pair, std::int64_t from,
                std::int64_t count, std::uint8_t* packed) {
  for (std::int64_t i = from; i < count; i += 2) {
    const std::uint32_t hash =
        pair_hash(first_pair + static_cast<std::uint32_t>(i / 2), key.low, key.high);
    const std::uint8_t low = code_of(x[i], scale, values, gaps, hash & 0xFFFFU);
    const std::uint8_t high =
        i + 1 < count ? code_of(x[i + 1], scale, values, gaps, hash >> 16) : 0;
    packed[i / 2] = static_cast<std::uint8_t>(low | (high << 4));
  }
}

#ifdef FRUGAL_AVX2_CODES4

#define FRUGAL_AVX2 __attribute__((target("avx2"))) inline

// mix32 (rounding.h) of eight lanes.
FRUGAL_AVX2 __m256i mix32x8(__m256i x) {
  using L = Lowbias32;
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, L::kFirst));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(L::kByFirst)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, L::kSecond));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(L::kBySecond)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, L::kLast));
}

// All-ones lanes where threshold <= y.
FRUGAL_AVX2 __m256i at_or_below(__m256 threshold, __m256 y) {
  return _mm256_castps_si256(_mm256_cmp_ps(threshold, y, _CMP_LE_OQ));
}

// The map's tables in registers.
struct Tables {
  __m256 v8, v4, v12;          // the first two thresholds of the search
  __m256 quarters;             // values[2, 6, 10, 14]
  __m256 evens, odds;          // values[0, 2, ..., 14] and values[1, 3, ..., 13], then infinity
  __m256 even_gaps, odd_gaps;  // gaps[0, 2, ..., 14] and gaps[1, 3, ..., 13], then 0
};

FRUGAL_AVX2 Tables tables_of(const float* values, const float* gaps) {
  const float inf = __builtin_inff();
  Tables t;
  t.v8 = _mm256_set1_ps(values[8]);
  t.v4 = _mm256_set1_ps(values[4]);
  t.v12 = _mm256_set1_ps(values[12]);
  t.quarters = _mm256_setr_ps(values[2], values[6], values[10], values[14], 0, 0, 0, 0);
  t.evens = _mm256_setr_ps(values[0], values[2], values[4], values[6], values[8], values[10],
                           values[12], values[14]);
  t.odds = _mm256_setr_ps(values[1], values[3], values[5], values[7], values[9], values[11],
                          values[13], inf);
  t.even_gaps =
      _mm256_setr_ps(gaps[0], gaps[2], gaps[4], gaps[6], gaps[8], gaps[10], gaps[12], gaps[14]);
  t.odd_gaps = _mm256_setr_ps(gaps[1], gaps[3], gaps[5], gaps[7], gaps[9], gaps[11], gaps[13], 0);
  return t;
}

// The codes (int32) of y[0..8) with random bits `bits` (int32, 16 bits each). The code
// below, the count of values[1..14] at or below y, is a binary search of four comparisons
// (values[8]; [4] or [12]; one of [2, 6, 10, 14]; one of the odd ones, values[15] standing
// as infinity): first the quarter q, then the pair h (codes 2h and 2h + 1), then which of
// the two, and the pair's values and gaps are then looked up in tables of eight.
FRUGAL_AVX2 __m256i codes8(const Tables& t, __m256 y, __m256i bits) {
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i half = at_or_below(t.v8, y);
  const __m256i quarter_bit =
      at_or_below(_mm256_blendv_ps(t.v4, t.v12, _mm256_castsi256_ps(half)), y);
  const __m256i q = _mm256_or_si256(_mm256_and_si256(half, _mm256_set1_epi32(2)),
                                    _mm256_and_si256(quarter_bit, one));
  const __m256i pair_bit = at_or_below(_mm256_permutevar8x32_ps(t.quarters, q), y);
  const __m256i h = _mm256_or_si256(_mm256_add_epi32(q, q), _mm256_and_si256(pair_bit, one));
  const __m256 odd = _mm256_permutevar8x32_ps(t.odds, h);
  const __m256 upper = _mm256_cmp_ps(odd, y, _CMP_LE_OQ);  // the odd code of the pair
  const __m256i below = _mm256_sub_epi32(_mm256_add_epi32(h, h), _mm256_castps_si256(upper));
  const __m256 low_value = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.evens, h), odd, upper);
  const __m256 gap = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.even_gaps, h),
                                      _mm256_permutevar8x32_ps(t.odd_gaps, h), upper);
  const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(bits), _mm256_set1_ps(kUnit));
  const __m256 up = _mm256_cmp_ps(_mm256_sub_ps(y, low_value), _mm256_mul_ps(u, gap), _CMP_GT_OQ);
  return _mm256_sub_epi32(below, _mm256_castps_si256(up));  // up is -1
}

// Eight codes (int32) packed into four bytes: code 2k + 1 beside code 2k in one byte
// (`gather_bytes` picks byte 0 of each 64-bit lane), then the bytes together.
FRUGAL_AVX2 std::uint32_t pack4(__m256i codes, __m256i gather_bytes) {
  const __m256i pairs = _mm256_or_si256(codes, _mm256_srli_epi64(codes, 28));
  const __m256i bytes = _mm256_shuffle_epi8(pairs, gather_bytes);
  return static_cast<std::uint32_t>(_mm_cvtsi128_si32(
      _mm_or_si128(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1))));
}

// Sixteen elements at a time: eight pairs' hashes, then two groups of eight codes packed
// into eight bytes.
__attribute__((target("avx2"))) void codes_avx2(const float* x, float scale, const float* values,
                                                const float* gaps, const SplitKey& key,
                                                std::uint32_t first_pair, std::int64_t count,
                                                std::uint8_t* packed) {
  const Tables t = tables_of(values, gaps);
  const __m256 by = _mm256_set1_ps(scale);
  const __m256i low_key = _mm256_set1_epi32(static_cast<int>(key.low)),
                high_key = _mm256_set1_epi32(static_cast<int>(key.high));
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  // Byte 0 of each 64-bit lane (codes 2k and 2k + 1) to bytes 0-1 of the low 128 bits and
  // 2-3 of the high 128.
  const __m256i gather_bytes =
      _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                       -1, -1, 0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  std::int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const auto pair = static_cast<int>(first_pair + static_cast<std::uint32_t>(i / 2));
    const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(pair), lanes);
    const __m256i hash =
        mix32x8(_mm256_xor_si256(mix32x8(_mm256_add_epi32(index, low_key)), high_key));
    // Elements i..i+7 take the 16-bit halves of pairs 0-3, in order; i+8..i+15 of 4-7.
    const __m256i bits_a = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(hash));
    const __m256i bits_b = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(hash, 1));
    const __m256i a = codes8(t, _mm256_div_ps(_mm256_loadu_ps(x + i), by), bits_a);
    const __m256i b = codes8(t, _mm256_div_ps(_mm256_loadu_ps(x + i + 8), by), bits_b);
    const std::uint64_t word =
        pack4(a, gather_bytes) | (static_cast<std::uint64_t>(pack4(b, gather_bytes)) << 32);
    std::memcpy(packed + i / 2, &word, sizeof word);
  }
  codes_from(x, scale, values, gaps, key, first_pair, i, count, packed);
}

#undef FRUGAL_AVX2

bool has_avx2() {
  static const bool has = (__builtin_cpu_init(), __builtin_cpu_supports("avx2"));
  return has;
}

#endif

}  // namespace

void stochastic_codes4(const float* x, float scale, const float* values, const float* gaps,
                       std::uint64_t key, std::int64_t first, std::int64_t count,
                       std::uint8_t* packed) {
  TORCH_INTERNAL_ASSERT(first % 2 == 0, "4-bit codes start at an even element, got ", first);
  const SplitKey split(key, first);
  // As draw_bits16 counts pairs: from the element's index cut to 32 bits.
  const std::uint32_t first_pair = static_cast<std::uint32_t>(first) >> 1;
#ifdef FRUGAL_AVX2_CODES4
  if (has_avx2()) {
    codes_avx2(x, scale, values, gaps, split, first_pair, count, packed);
    return;
  }
#endif
  codes_from(x, scale, values, gaps, split, first_pair, 0, count, packed);
}

}  // namespace frugal::optim::detail
