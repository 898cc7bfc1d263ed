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

// The codes of one group: t = (x - zero) / scale, rounded, clamped to [0, 255] (a NaN to 0).
FRUGAL_VECTOR_CLONES
void encode_group(const float* __restrict x, std::int64_t n, float zero, float scale,
                  const std::uint16_t* __restrict noise, std::uint8_t* __restrict codes) {
  constexpr float kUnit = 1.0F / 65536.0F;
  for (std::int64_t i = 0; i < n; ++i) {
    float t = (x[i] - zero) / scale;
    t = noise != nullptr ? std::floor(t + static_cast<float>(noise[i]) * kUnit) : std::nearbyint(t);
    t = t >= 0.0F ? t : 0.0F;  // a NaN too
    t = t <= 255.0F ? t : 255.0F;
    codes[i] = static_cast<std::uint8_t>(t);
  }
}

FRUGAL_VECTOR_CLONES
void decode_group(const std::uint8_t* __restrict codes, std::int64_t n, float zero, float scale,
                  float* __restrict out) {
  for (std::int64_t i = 0; i < n; ++i) {
    out[i] = zero + static_cast<float>(codes[i]) * scale;
  }
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
  std::uint16_t noise[kMaxGroup];
  for (std::int64_t at = 0; at < count; at += group) {
    const std::int64_t g = (begin + at) / group, n = std::min(group, count - at);
    const float* v = x + at;
    float lo = v[0], hi = v[0];
    bool finite = true;
    for (std::int64_t i = 0; i < n; ++i) {
      lo = std::min(lo, v[i]);
      hi = std::max(hi, v[i]);
      finite = finite && std::isfinite(v[i]);
    }
    const float zero = finite ? bfloat16_down(lo) : std::numeric_limits<float>::quiet_NaN();
    const float scale =
        bfloat16_up(std::max((hi - zero) / 255.0F, std::numeric_limits<float>::min()));
    if (stochastic) {
      for (std::int64_t done = 0; done < n; done += kMaxGroup) {
        draw_bits16(key, begin + at + done, std::min(kMaxGroup, n - done), noise);
        encode_group(v + done, std::min(kMaxGroup, n - done), zero, scale, noise,
                     codes + begin + at + done);
      }
    } else {
      encode_group(v, n, zero, scale, nullptr, codes + begin + at);
    }
    qparams[2 * g] = finite ? high_bits(zero) : std::uint16_t{0x7FC0};
    qparams[2 * g + 1] = high_bits(scale);
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
