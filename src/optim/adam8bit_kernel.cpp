#include "adam8bit_kernel.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "codebook.h"
#include "codes4_kernel.h"
#include "frugal/optim/blockwise.h"
#include "rounding.h"
#include "vector_clones.h"
#include "weight_codes.h"

// The loops are written to vectorize; on x86-64 a second copy is built for AVX2 and chosen
// at load time. Both round alike: the file is compiled without FMA contraction (and without
// errno for sqrt, which would keep the loops scalar), and element-wise IEEE arithmetic,
// sqrt and division included, is exact in either.

namespace frugal::optim::detail {
namespace {

// The largest magnitude of x[0..n), NaN if any is NaN: on the bit patterns, where the
// order of non-negative floats is that of integers and NaNs sort above infinity.
FRUGAL_VECTOR_CLONES
float max_magnitude(const float* __restrict x, std::int64_t n) {
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

// One block's new moments (into `mn`, `vn`) and its parameters' update. Without a first
// moment (kFirst false, beta1 0) the gradient stands for it; with a factored second moment
// (kCodedV false) `vn` holds it on entry, already updated.
template <bool kFirst, bool kCodedV>
inline __attribute__((always_inline)) void update_block_body(
    float* __restrict p, const float* __restrict g, const std::uint8_t* __restrict mc,
    const std::uint8_t* __restrict vc, const float* __restrict m_map, const float* __restrict v_map,
    float* __restrict mn, float* __restrict vn, std::int64_t count, float m_scale, float v_scale,
    const AdamScalars& a) {
  // Adam's L2 decay joins the gradient; AdamW's scales the parameter (1: none).
  const float l2 = a.decoupled ? 0.0F : a.weight_decay;
  const float shrink = a.decoupled ? a.decay_factor : 1.0F;
  const float beta1 = a.beta1, one_minus_beta1 = a.one_minus_beta1, beta2 = a.beta2,
              one_minus_beta2 = a.one_minus_beta2, neg_step_size = a.neg_step_size,
              bias_correction2_sqrt = a.bias_correction2_sqrt, eps = a.eps;
  for (std::int64_t i = 0; i < count; ++i) {
    const float grad = g[i] + l2 * p[i];  // exact when l2 is 0 (p finite)
    // (beta1 0 without a first moment: 1 * grad, as the tensor-ops step computes it.)
    const float m =
        kFirst ? m_map[mc[i]] * m_scale * beta1 + one_minus_beta1 * grad : one_minus_beta1 * grad;
    const float v =
        kCodedV ? v_map[vc[i]] * v_scale * beta2 + one_minus_beta2 * grad * grad : vn[i];
    p[i] = p[i] * shrink + neg_step_size * (m / (std::sqrt(v) / bias_correction2_sqrt + eps));
    mn[i] = m;
    if (kCodedV) {
      vn[i] = v;
    }
  }
}

#define FRUGAL_UPDATE_BLOCK(name, first, coded)                                                  \
  FRUGAL_VECTOR_CLONES                                                                           \
  void name(float* p, const float* g, const std::uint8_t* mc, const std::uint8_t* vc,            \
            const float* m_map, const float* v_map, float* mn, float* vn, std::int64_t count,    \
            float m_scale, float v_scale, AdamScalars a) {                                       \
    update_block_body<first, coded>(p, g, mc, vc, m_map, v_map, mn, vn, count, m_scale, v_scale, \
                                    a);                                                          \
  }
FRUGAL_UPDATE_BLOCK(update_block, true, true)
FRUGAL_UPDATE_BLOCK(update_block_no_first, false, true)
FRUGAL_UPDATE_BLOCK(update_block_factored, true, false)
FRUGAL_UPDATE_BLOCK(update_block_factored_no_first, false, false)
#undef FRUGAL_UPDATE_BLOCK

// A factored second moment for elements [begin, begin + count) of a matrix of `cols`
// columns: rows[r] * col_hat[c], as the tensor-ops step multiplies them.
void factored_moments(const float* rows, const float* col_hat, std::int64_t cols,
                      std::int64_t begin, std::int64_t count, float* v) {
  std::int64_t r = begin / cols, c = begin % cols;
  for (std::int64_t i = 0; i < count;) {
    const std::int64_t run = std::min(count - i, cols - c);  // to the end of the row
    const float row = rows[r];
    for (std::int64_t k = 0; k < run; ++k) {
      v[i + k] = row * col_hat[c + k];
    }
    i += run;
    c = 0;
    ++r;
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

// Moves each nearest code in codes[0..count) (of x[i] / scale) to the code at or below the
// value or the one above, up with probability (y - below) / (above - below) (16 random bits
// an element, `noise`): the code stands for y in expectation. `gaps[k]` is values[k + 1] -
// values[k]; `last` the highest code. The same arithmetic as quantize_into's with noise.
FRUGAL_VECTOR_CLONES
void round_codes_stochastically(const float* __restrict x, float scale,
                                std::int32_t* __restrict codes, const float* __restrict values,
                                const float* __restrict gaps, std::int32_t last,
                                const std::uint16_t* __restrict noise, std::int64_t count) {
  for (std::int64_t i = 0; i < count; ++i) {
    const float y = x[i] / scale;
    const std::int32_t c = codes[i];
    const std::int32_t below = std::min(std::max(c - (values[c] > y ? 1 : 0), 0), last - 1);
    const float u = static_cast<float>(noise[i]) * (1.0F / 65536.0F);
    codes[i] = below + (y - values[below] > u * gaps[below] ? 1 : 0);
  }
}

FRUGAL_VECTOR_CLONES
void narrow_codes(const std::int32_t* __restrict wide, std::uint8_t* __restrict codes,
                  std::int64_t count) {
  for (std::int64_t i = 0; i < count; ++i) {
    codes[i] = static_cast<std::uint8_t>(wide[i]);
  }
}

// 4-bit codes two to a byte, element 2k in the low half of byte k; an odd count leaves the
// last byte's high half zero, as quantize_into does.
FRUGAL_VECTOR_CLONES
void pack_codes(const std::int32_t* __restrict wide, std::uint8_t* __restrict codes,
                std::int64_t count) {
  const std::int64_t pairs = count / 2;
  for (std::int64_t k = 0; k < pairs; ++k) {
    codes[k] = static_cast<std::uint8_t>(wide[2 * k] | (wide[2 * k + 1] << 4));
  }
  if (count % 2 != 0) {
    codes[pairs] = static_cast<std::uint8_t>(wide[count - 1]);
  }
}

// The 4-bit codes of `count` elements, one to a byte.
FRUGAL_VECTOR_CLONES
void unpack_codes(const std::uint8_t* __restrict codes, std::uint8_t* __restrict out,
                  std::int64_t count) {
  const std::int64_t pairs = count / 2;
  for (std::int64_t k = 0; k < pairs; ++k) {
    out[2 * k] = codes[k] & 15;
    out[2 * k + 1] = codes[k] >> 4;
  }
  if (count % 2 != 0) {
    out[count - 1] = codes[pairs] & 15;
  }
}

// What a parameter's step reads beside the parameter, its gradient and the scalars: the first
// moment's codes (null: none kept), and the second moment's codes or, factored, its rows
// and columns (`rows` not null).
struct Moments {
  std::uint8_t* m_codes = nullptr;
  float* m_scales = nullptr;
  std::uint8_t* v_codes = nullptr;
  float* v_scales = nullptr;
  const float* rows = nullptr;
  const float* col_hat = nullptr;
  std::int64_t cols = 0;
  int bits = 8;  ///< the codes' width: 8, or 4 (two to a byte)
};

// The codes of x[0..count) (elements begin.. of the parameter) under `book`, into `codes`,
// and their scale (the largest magnitude): the nearest, or stochastically rounded with the
// random bits of `key` (`noise`: a block's buffer for them at 8 bits).
void encode(const float* x, std::int64_t begin, std::int64_t count, const NearestCode& book,
            int bits, bool stochastic, std::uint64_t key, std::int32_t* wide, std::uint16_t* noise,
            std::uint8_t* codes, float* scale) {
  const float most = max_magnitude(x, count);
  *scale = most;
  // An all-zero block encodes as zeros; a NaN block's codes do not matter, its scale is
  // NaN and so is every value it stands for.
  const float by = most == 0 ? 1.0F : most;
  if (stochastic && bits == 4) {
    stochastic_codes4(x, by, book.values(), book.gaps(), key, begin, count, codes);
    return;
  }
  encode_block(x, by, wide, book.bases(), book.bounds(), count);
  if (stochastic) {
    draw_bits16(key, begin, count, noise);
    round_codes_stochastically(x, by, wide, book.values(), book.gaps(), book.last(), noise, count);
  }
  if (bits == 4) {
    pack_codes(wide, codes, count);
  } else {
    narrow_codes(wide, codes, count);
  }
}

// The thread's buffers of a block each: the new moments, the codes, bfloat16 weights and
// gradients widened to float32, and 4-bit codes one to a byte.
struct BlockBuffers {
  float* m_new;
  float* v_new;
  std::int32_t* wide;
  float* p;
  float* g;
  std::uint8_t* m_codes;
  std::uint8_t* v_codes;
  std::uint16_t* noise;
};

// Blocks [first, last) of the step.
void step_blocks(const FusedWeights& w, const Moments& s, std::int64_t n, std::int64_t block,
                 const AdamScalars& a, std::int64_t first, std::int64_t last,
                 const BlockBuffers& buf) {
  const auto& m_book = nearest_code(true, s.bits);
  const auto& v_book = nearest_code(false, s.bits);
  const bool has_m = s.m_codes != nullptr, factored = s.rows != nullptr;
  const bool wide = w.widened(), wide_grad = w.g16 != nullptr, packed = s.bits == 4;
  const auto update = factored ? (has_m ? update_block_factored : update_block_factored_no_first)
                               : (has_m ? update_block : update_block_no_first);
  for (std::int64_t b = first; b < last; ++b) {
    const std::int64_t begin = b * block, count = std::min(n, begin + block) - begin;
    // The block's codes: from byte `begin` (8-bit), or `begin / 2` (4-bit; blocks are even).
    const std::int64_t at = packed ? begin / 2 : begin;
    const auto bytes = static_cast<std::size_t>(code_bytes(count, s.bits));
    std::uint8_t* m_codes = has_m ? s.m_codes + at : nullptr;
    std::uint8_t* v_codes = factored ? nullptr : s.v_codes + at;
    // No moments yet: zero scales make every code stand for 0.
    if (a.fresh && has_m) {
      std::memset(m_codes, 0, bytes);
    }
    if (a.fresh && !factored) {
      std::memset(v_codes, 0, bytes);
    }
    const std::uint8_t* m_read = m_codes;
    const std::uint8_t* v_read = v_codes;
    if (packed && has_m) {
      unpack_codes(m_codes, buf.m_codes, count);
      m_read = buf.m_codes;
    }
    if (packed && !factored) {
      unpack_codes(v_codes, buf.v_codes, count);
      v_read = buf.v_codes;
    }
    if (factored) {
      factored_moments(s.rows, s.col_hat, s.cols, begin, count, buf.v_new);
    }
    float* p = wide ? buf.p : w.p + begin;
    const float* g = wide_grad ? buf.g : w.g + begin;
    if (wide) {
      load_weights(w, begin, count, buf.p);
    }
    if (wide_grad) {
      from_bfloat16_bits(w.g16 + begin, count, buf.g);
    }
    update(p, g, m_read, v_read, m_book.values(), v_book.values(), buf.m_new, buf.v_new, count,
           a.fresh || !has_m ? 0.0F : s.m_scales[b], a.fresh || factored ? 0.0F : s.v_scales[b], a);
    if (wide) {
      store_weights(w, buf.p, begin, count);
    }
    if (has_m) {
      encode(buf.m_new, begin, count, m_book, s.bits, a.codes.stochastic, a.codes.m_key, buf.wide,
             buf.noise, m_codes, &s.m_scales[b]);
    }
    if (!factored) {
      encode(buf.v_new, begin, count, v_book, s.bits, a.codes.stochastic, a.codes.v_key, buf.wide,
             buf.noise, v_codes, &s.v_scales[b]);
    }
  }
}

// The step over all blocks, shared out among LibTorch's OpenMP threads (this file is
// compiled with OpenMP where the compiler has it, and links the libgomp LibTorch loads;
// without it the loop runs on this thread).
void step_all(const FusedWeights& w, const Moments& s, std::int64_t n, std::int64_t block,
              const AdamScalars& a) {
  const std::int64_t blocks = (n + block - 1) / block;
  const std::int64_t grain = std::max<std::int64_t>(1, 16384 / block);
  at::parallel_for(0, blocks, grain, [&](std::int64_t first, std::int64_t last) {
    // Host memory of a few blocks a thread, kept between steps.
    thread_local std::vector<float> floats;
    thread_local std::vector<std::int32_t> wide;
    thread_local std::vector<std::uint8_t> codes;
    thread_local std::vector<std::uint16_t> noise;
    const auto size = static_cast<std::size_t>(block);
    floats.resize(4 * size);
    wide.resize(size);
    codes.resize(2 * size);
    noise.resize(a.codes.stochastic && s.bits == 8 ? size : 0);
    const BlockBuffers buf{floats.data(),
                           floats.data() + size,
                           wide.data(),
                           floats.data() + 2 * size,
                           floats.data() + 3 * size,
                           codes.data(),
                           codes.data() + size,
                           noise.data()};
    step_blocks(w, s, n, block, a, first, last, buf);
  });
}

}  // namespace

bool fused_cpu(const at::Tensor& param, bool flat, Rounding rounding, std::int64_t block) {
  const auto dtype = param.scalar_type();
  if (!flat || !param.device().is_cpu()) {
    return false;
  }
  if (const auto stored = stored_weights(param)) {
    return block % stored->group == 0 && rounding != Rounding::Compensated;
  }
  return dtype == at::kFloat || (dtype == at::kBFloat16 && rounding != Rounding::Compensated);
}

bool fused_cpu(const ParamUpdate& u, std::int64_t block) {
  if (u.low != nullptr && u.low->stored != nullptr) {
    return u.flat && u.param.device().is_cpu() && block % u.low->stored->group == 0;
  }
  return fused_cpu(u.param, u.flat, u.low != nullptr ? u.low->rounding : Rounding::Nearest, block);
}

FusedWeights fused_weights(ParamUpdate& u) {
  FusedWeights w;
  w.stochastic = u.low != nullptr && u.low->rounding == Rounding::Stochastic;
  w.key = u.low != nullptr ? u.low->key : 0;
  const bool float_grad = u.grad.scalar_type() == at::kFloat;
  if (float_grad) {
    w.g = u.grad.data_ptr<float>();
  } else {  // bfloat16's bits, as 16-bit integers
    w.g16 = reinterpret_cast<const std::uint16_t*>(u.grad.data_ptr<at::BFloat16>());
  }
  if (u.low != nullptr && u.low->stored != nullptr) {
    auto& s = *u.low->stored;
    w.codes = s.codes.data_ptr<std::uint8_t>();
    w.qparams = reinterpret_cast<std::uint16_t*>(s.qparams.data_ptr<at::BFloat16>());
    w.group = s.group;
    s.written = true;
  } else if (float_grad) {  // (the gradient's dtype is the parameter's)
    w.p = u.param.data_ptr<float>();
  } else {
    w.p16 = reinterpret_cast<std::uint16_t*>(u.param.data_ptr<at::BFloat16>());
  }
  return w;
}

void load_weights(const FusedWeights& w, std::int64_t begin, std::int64_t count, float* p) {
  if (w.codes != nullptr) {
    dequantize_weights_cpu(w.codes, w.qparams, w.group, begin, count, p);
  } else {
    from_bfloat16_bits(w.p16 + begin, count, p);
  }
}

void store_weights(const FusedWeights& w, const float* p, std::int64_t begin, std::int64_t count) {
  if (w.codes != nullptr) {
    quantize_weights_cpu(p, w.group, begin, count, w.stochastic, w.key, w.codes, w.qparams);
  } else if (w.stochastic) {
    to_bfloat16_bits_stochastic(p, count, w.key, begin, w.p16 + begin);
  } else {
    to_bfloat16_bits(p, count, w.p16 + begin);
  }
}

void adam8bit_cpu(const FusedWeights& w, std::uint8_t* m_codes, float* m_scales,
                  std::uint8_t* v_codes, float* v_scales, std::int64_t n, std::int64_t block,
                  int bits, const AdamScalars& a) {
  Moments s{m_codes, m_scales};
  s.bits = bits;
  s.v_codes = v_codes;
  s.v_scales = v_scales;
  step_all(w, s, n, block, a);
}

void adam8bit_factored_cpu(const FusedWeights& w, std::uint8_t* m_codes, float* m_scales,
                           const float* rows, const float* col_hat, std::int64_t cols,
                           std::int64_t n, std::int64_t block, int bits, const AdamScalars& a) {
  Moments s{m_codes, m_scales};
  s.bits = bits;
  s.rows = rows;  // the second moment factored
  s.col_hat = col_hat;
  s.cols = cols;
  step_all(w, s, n, block, a);
}

}  // namespace frugal::optim::detail
