// The 8-bit weights' codec on the CPU: loops written to vectorize, compiled without FMA
// contraction so that each float32 operation rounds as the tensor operation of the same name.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "rounding.h"
#include "vector_clones.h"
#include "weight_codes.h"

namespace frugal::optim::detail {
namespace {

constexpr std::int64_t kMaxGroup = 4096;  // the random bits of a group are drawn on the stack

std::uint32_t bits_of(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

float float_of(std::uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

// x rounded to a bfloat16 value toward minus infinity: a negative value's magnitude is
// rounded up (its int32 view is negative), a positive one's cut.
float bfloat16_down(float x) {
  const auto b = static_cast<std::int32_t>(bits_of(x));
  const std::int32_t carry = (b >> 31) & 0xFFFF;
  return float_of(static_cast<std::uint32_t>(b + carry) & 0xFFFF0000U);
}

// A positive x rounded to a bfloat16 value toward plus infinity.
float bfloat16_up(float x) { return float_of((bits_of(x) + 0xFFFFU) & 0xFFFF0000U); }

std::uint16_t high_bits(float x) { return static_cast<std::uint16_t>(bits_of(x) >> 16); }

// t clamped to [0, 255] (a NaN to 0).
inline float clamp_code(float t) {
  t = t >= 0.0F ? t : 0.0F;
  return t <= 255.0F ? t : 255.0F;
}

// The codes of one group, t = (x - zero) / scale rounded to nearest (ties to even).
FRUGAL_VECTOR_CLONES
void encode_nearest(const float* __restrict x, std::int64_t n, float zero, float scale,
                    std::uint8_t* __restrict codes) {
  for (std::int64_t i = 0; i < n; ++i) {
    codes[i] = static_cast<std::uint8_t>(clamp_code(std::nearbyint((x[i] - zero) / scale)));
  }
}

// The codes of one group, t = (x - zero) / scale rounded down after adding noise[i] / 2^16.
// Clamped first, then cut toward zero: the floor of a value in [0, 255], and the same code
// as floor then clamp everywhere else (cut rather than floor: GCC vectorizes the conversion).
FRUGAL_VECTOR_CLONES
void encode_stochastic(const float* __restrict x, std::int64_t n, float zero, float scale,
                       const std::uint16_t* __restrict noise, std::uint8_t* __restrict codes) {
  constexpr float kUnit = 1.0F / 65536.0F;
  for (std::int64_t i = 0; i < n; ++i) {
    const float fraction = static_cast<float>(static_cast<std::int32_t>(noise[i])) * kUnit;
    const float t = clamp_code((x[i] - zero) / scale + fraction);
    codes[i] = static_cast<std::uint8_t>(static_cast<std::int32_t>(t));
  }
}

FRUGAL_VECTOR_CLONES
void decode_group(const std::uint8_t* __restrict codes, std::int64_t n, float zero, float scale,
                  float* __restrict out) {
  for (std::int64_t i = 0; i < n; ++i) {
    out[i] = zero + static_cast<float>(codes[i]) * scale;
  }
}

// The least and the greatest of v[0..n), n > 0, and whether all are finite (an infinity or
// a NaN makes the group's zero point a NaN, whatever the two are then).
struct Range {
  float lo, hi;
  bool finite;
};

// Eight floats (and their bits) as one vector: AVX2's register in the AVX2 copy.
typedef float Floats8 __attribute__((vector_size(32)));
typedef std::int32_t Ints8 __attribute__((vector_size(32)));

// Eight running minima and maxima, and the sum of v * 0, a NaN exactly when some v is an
// infinity or a NaN. The minimum keeps the earlier of two values unless the later one is
// less (a < lo), as the scalar loop for the last elements does.
FRUGAL_VECTOR_CLONES
Range group_range(const float* __restrict v, std::int64_t n) {
  constexpr std::int64_t kLanes = 8;
  Range r{v[0], v[0], true};
  std::int64_t i = 0;
  if (n >= kLanes) {
    Floats8 lo, hi, nonfinite = {};
    std::memcpy(&lo, v, sizeof lo);
    hi = lo;
    for (; i + kLanes <= n; i += kLanes) {
      Floats8 a;
      std::memcpy(&a, v + i, sizeof a);
      const Ints8 less = (a < lo);
      const Ints8 greater = (a > hi);
      lo = reinterpret_cast<Floats8>((reinterpret_cast<Ints8>(a) & less) |
                                     (reinterpret_cast<Ints8>(lo) & ~less));
      hi = reinterpret_cast<Floats8>((reinterpret_cast<Ints8>(a) & greater) |
                                     (reinterpret_cast<Ints8>(hi) & ~greater));
      nonfinite += a * 0.0F;
    }
    for (std::int64_t l = 0; l < kLanes; ++l) {
      r.lo = lo[l] < r.lo ? lo[l] : r.lo;
      r.hi = hi[l] > r.hi ? hi[l] : r.hi;
      r.finite = r.finite && nonfinite[l] == 0.0F;
    }
  }
  for (; i < n; ++i) {
    r.lo = v[i] < r.lo ? v[i] : r.lo;
    r.hi = v[i] > r.hi ? v[i] : r.hi;
    r.finite = r.finite && v[i] * 0.0F == 0.0F;
  }
  return r;
}

// One group of n elements, the first being element `first` of the weights, into its codes
// and statistics; `noise`: its elements' random bits, or null (drawn here when stochastic).
void encode_one_group(const float* v, std::int64_t n, std::int64_t first, std::int64_t group,
                      bool stochastic, std::uint64_t key, const std::uint16_t* noise,
                      std::uint8_t* codes, std::uint16_t* qparams) {
  const std::int64_t g = first / group;
  const Range r = group_range(v, n);
  // +0 for a least -0: which of two equal zeros a reduction keeps is not defined.
  const float zero =
      r.finite ? bfloat16_down(r.lo + 0.0F) : std::numeric_limits<float>::quiet_NaN();
  const float scale =
      r.finite
          ? bfloat16_up(std::max((r.hi - zero) * kInverse255, std::numeric_limits<float>::min()))
          : zero;
  if (!stochastic) {
    encode_nearest(v, n, zero, scale, codes + first);
  } else if (noise != nullptr) {
    encode_stochastic(v, n, zero, scale, noise, codes + first);
  } else {  // a group wider than the stack's bits
    std::uint16_t bits[kMaxGroup];
    for (std::int64_t done = 0; done < n; done += kMaxGroup) {
      const std::int64_t k = std::min(kMaxGroup, n - done);
      draw_bits16(key, first + done, k, bits);
      encode_stochastic(v + done, k, zero, scale, bits, codes + first + done);
    }
  }
  qparams[2 * g] = r.finite ? high_bits(zero) : std::uint16_t{0x7FC0};
  qparams[2 * g + 1] = r.finite ? high_bits(scale) : std::uint16_t{0x7FC0};
}

}  // namespace

void dequantize_weights_cpu(const std::uint8_t* codes, const std::uint16_t* qparams,
                            std::int64_t group, std::int64_t begin, std::int64_t count,
                            float* out) {
  for (std::int64_t at = 0; at < count; at += group) {
    const std::int64_t g = (begin + at) / group, n = std::min(group, count - at);
    const float zero = float_of(static_cast<std::uint32_t>(qparams[2 * g]) << 16);
    const float scale = float_of(static_cast<std::uint32_t>(qparams[2 * g + 1]) << 16);
    decode_group(codes + begin + at, n, zero, scale, out + at);
  }
}

void quantize_weights_cpu(const float* x, std::int64_t group, std::int64_t begin,
                          std::int64_t count, bool stochastic, std::uint64_t key,
                          std::uint8_t* codes, std::uint16_t* qparams) {
  // The random bits are drawn for whole pieces of up to kMaxGroup elements (a whole number
  // of groups where a group fits), each element's bits depending on its index alone.
  std::uint16_t noise[kMaxGroup];
  const std::int64_t piece = group <= kMaxGroup ? kMaxGroup / group * group : kMaxGroup;
  for (std::int64_t at = 0; at < count; at += piece) {
    const std::int64_t length = std::min(piece, count - at);
    if (stochastic && group <= kMaxGroup) {
      draw_bits16(key, begin + at, length, noise);
    }
    for (std::int64_t in = 0; in < length; in += group) {
      encode_one_group(x + at + in, std::min(group, length - in), begin + at + in, group,
                       stochastic, key, stochastic && group <= kMaxGroup ? noise + in : nullptr,
                       codes, qparams);
    }
  }
}

// Compiled here, with OpenMP where the compiler has it, so that at::parallel_for shares the
// work out among LibTorch's threads.

std::pair<at::Tensor, at::Tensor> quantize_weights(const at::Tensor& w, std::int64_t group) {
  const auto n = w.numel();
  auto codes = at::empty({n}, w.options().dtype(at::kByte));
  auto qparams = at::empty({weight_groups(n, group), 2}, w.options().dtype(at::kBFloat16));
  if (w.device().is_cpu()) {
    // A range of groups at a time in float32: no whole float32 copy of a wider tensor.
    const auto flat = w.detach().reshape(-1);
    const bool direct = flat.scalar_type() == at::kFloat && flat.is_contiguous();
    at::parallel_for(0, weight_groups(n, group), 64, [&](std::int64_t first, std::int64_t last) {
      const auto begin = first * group, count = std::min(n, last * group) - begin;
      thread_local std::vector<float> wide;
      const float* x = nullptr;
      if (direct) {
        x = flat.data_ptr<float>() + begin;
      } else {
        wide.resize(static_cast<std::size_t>(count));
        at::from_blob(wide.data(), {count}).copy_(flat.narrow(0, begin, count));
        x = wide.data();
      }
      quantize_weights_cpu(x, group, begin, count, false, 0, codes.data_ptr<std::uint8_t>(),
                           reinterpret_cast<std::uint16_t*>(qparams.data_ptr<at::BFloat16>()));
    });
    return {codes, qparams};
  }
  auto x = w.detach().reshape(-1).to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  auto stats = at::empty({3 * weight_groups(n, group)}, x.options());
  quantize_weights_ops(x, group, 0, false, 0, codes, qparams, at::Tensor(), stats);
  return {codes, qparams};
}

void dequantize_into(const StoredWeights& stored, const at::Tensor& out) {
  const auto n = out.numel();
  check_codes(stored, n);
  const auto group = stored.group;
  const auto type = out.scalar_type();
  if (!out.device().is_cpu() || (type != at::kFloat && type != at::kBFloat16)) {
    auto wide = at::empty({n}, out.options().dtype(at::kFloat));
    dequantize_weights_ops(stored.codes, stored.qparams, group, wide);
    out.view(-1).copy_(wide);
    return;
  }
  const auto* codes = stored.codes.data_ptr<std::uint8_t>();
  const auto* qparams =
      reinterpret_cast<const std::uint16_t*>(stored.qparams.data_ptr<at::BFloat16>());
  at::parallel_for(0, weight_groups(n, group), 64, [&](std::int64_t first, std::int64_t last) {
    const auto begin = first * group, count = std::min(n, last * group) - begin;
    if (type == at::kFloat) {
      dequantize_weights_cpu(codes, qparams, group, begin, count, out.data_ptr<float>() + begin);
      return;
    }
    thread_local std::vector<float> wide;
    wide.resize(static_cast<std::size_t>(count));
    dequantize_weights_cpu(codes, qparams, group, begin, count, wide.data());
    to_bfloat16_bits(wide.data(), count,
                     reinterpret_cast<std::uint16_t*>(out.data_ptr<at::BFloat16>()) + begin);
  });
}

}  // namespace frugal::optim::detail
