#include "adam8bit_kernel.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "codebook.h"
#include "frugal/optim/blockwise.h"
#include "vector_clones.h"

// The loops are written to vectorize; on x86-64 a second copy is built for AVX2 and chosen
// at load time. Both round alike: the file is compiled without FMA contraction (and without
// errno for sqrt, which would keep the loops scalar), and element-wise IEEE arithmetic,
// sqrt and division included, is exact in either.

namespace frugal::optim::detail {
namespace {

// The largest magnitude of x[0..n), NaN if any is NaN: on the bit patterns, where the
// order of non-negative floats is that of integers and NaNs sort above infinity.
inline float max_magnitude(const float* x, std::int64_t n) {
  std::int32_t most = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    std::int32_t bits;
    std::memcpy(&bits, &x[i], sizeof bits);
    most = std::max(most, bits & 0x7FFFFFFF);
  }
  float out;
  std::memcpy(&out, &most, sizeof out);
  return out;
}

// One block's new moments (into `mn`, `vn`) and its parameters' update.
FRUGAL_VECTOR_CLONES
void update_block(float* __restrict p, const float* __restrict g, const std::uint8_t* __restrict mc,
                  const std::uint8_t* __restrict vc, const float* __restrict m_map,
                  const float* __restrict v_map, float* __restrict mn, float* __restrict vn,
                  std::int64_t count, float m_scale, float v_scale, AdamScalars a) {
  // Adam's L2 decay joins the gradient; AdamW's scales the parameter (1: none).
  const float l2 = a.decoupled ? 0.0F : a.weight_decay;
  const float shrink = a.decoupled ? a.decay_factor : 1.0F;
  const float beta1 = a.beta1, one_minus_beta1 = a.one_minus_beta1, beta2 = a.beta2,
              one_minus_beta2 = a.one_minus_beta2, neg_step_size = a.neg_step_size,
              bias_correction2_sqrt = a.bias_correction2_sqrt, eps = a.eps;
  for (std::int64_t i = 0; i < count; ++i) {
    const float grad = g[i] + l2 * p[i];  // exact when l2 is 0 (p finite)
    const float m = m_map[mc[i]] * m_scale * beta1 + one_minus_beta1 * grad;
    const float v = v_map[vc[i]] * v_scale * beta2 + one_minus_beta2 * grad * grad;
    p[i] = p[i] * shrink + neg_step_size * (m / (std::sqrt(v) / bias_correction2_sqrt + eps));
    mn[i] = m;
    vn[i] = v;
  }
}

// The codes of x[0..count) over `scale` (divided, as the tensor-ops step divides), as int32
// (a loop that mixes bytes with the float tables does not vectorize).
FRUGAL_VECTOR_CLONES
void encode_block(const float* __restrict x, float scale, std::int32_t* __restrict codes,
                  const std::int32_t* __restrict base, const float* __restrict bound,
                  std::int64_t count) {
  for (std::int64_t i = 0; i < count; ++i) {
    codes[i] = NearestCode::code(x[i] / scale, base, bound);
  }
}

FRUGAL_VECTOR_CLONES
void narrow_codes(const std::int32_t* __restrict wide, std::uint8_t* __restrict codes,
                  std::int64_t count) {
  for (std::int64_t i = 0; i < count; ++i) {
    codes[i] = static_cast<std::uint8_t>(wide[i]);
  }
}

// Blocks [first, last) of the step; `m_new`, `v_new` and `wide` hold a block each.
void step_blocks(float* p, const float* g, std::uint8_t* m_codes, float* m_scales,
                 std::uint8_t* v_codes, float* v_scales, std::int64_t n, std::int64_t block,
                 const AdamScalars& a, std::int64_t first, std::int64_t last, float* m_new,
                 float* v_new, std::int32_t* wide) {
  const auto& m_book = nearest_code(true);
  const auto& v_book = nearest_code(false);
  for (std::int64_t b = first; b < last; ++b) {
    const std::int64_t begin = b * block, count = std::min(n, begin + block) - begin;
    if (a.fresh) {  // no moments yet: zero scales make every code stand for 0
      std::memset(m_codes + begin, 0, static_cast<std::size_t>(count));
      std::memset(v_codes + begin, 0, static_cast<std::size_t>(count));
    }
    update_block(p + begin, g + begin, m_codes + begin, v_codes + begin, m_book.values(),
                 v_book.values(), m_new, v_new, count, a.fresh ? 0.0F : m_scales[b],
                 a.fresh ? 0.0F : v_scales[b], a);
    const float m_max = max_magnitude(m_new, count), v_max = max_magnitude(v_new, count);
    // An all-zero block encodes as zeros; a NaN block's codes do not matter, its scale is
    // NaN and so is every value it stands for.
    encode_block(m_new, m_max == 0 ? 1.0F : m_max, wide, m_book.bases(), m_book.bounds(), count);
    narrow_codes(wide, m_codes + begin, count);
    encode_block(v_new, v_max == 0 ? 1.0F : v_max, wide, v_book.bases(), v_book.bounds(), count);
    narrow_codes(wide, v_codes + begin, count);
    m_scales[b] = m_max;
    v_scales[b] = v_max;
  }
}

}  // namespace

void adam8bit_cpu(float* p, const float* g, std::uint8_t* m_codes, float* m_scales,
                  std::uint8_t* v_codes, float* v_scales, std::int64_t n, std::int64_t block,
                  const AdamScalars& a) {
  const std::int64_t blocks = (n + block - 1) / block;
  const std::int64_t grain = std::max<std::int64_t>(1, 16384 / block);
  // LibTorch's OpenMP threads (this file is compiled with OpenMP where the compiler has
  // it, and links the libgomp LibTorch loads; without it the loop runs on this thread).
  at::parallel_for(0, blocks, grain, [&](std::int64_t first, std::int64_t last) {
    // The new moments of one block, between the pass that finds their maxima and the pass
    // that encodes them, and their codes (host memory, three blocks per thread).
    thread_local std::vector<float> moments;
    thread_local std::vector<std::int32_t> wide;
    moments.resize(static_cast<std::size_t>(2 * block));
    wide.resize(static_cast<std::size_t>(block));
    step_blocks(p, g, m_codes, m_scales, v_codes, v_scales, n, block, a, first, last,
                moments.data(), moments.data() + block, wide.data());
  });
}

}  // namespace frugal::optim::detail
