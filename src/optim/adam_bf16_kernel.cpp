#include "adam_bf16_kernel.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "rounding.h"
#include "vector_clones.h"

// Compiled as adam8bit_kernel.cpp is (no FMA contraction, no errno for sqrt): each float32
// operation rounds as the tensor operation of the same name would.

namespace frugal::optim::detail {
namespace {

constexpr std::int64_t kBlock = kAdamBf16Block;

FRUGAL_VECTOR_CLONES
void adam_block(float* __restrict p, const float* __restrict g, float* __restrict m,
                float* __restrict v, std::int64_t count, AdamScalars a) {
  // Adam's L2 decay joins the gradient; AdamW's scales the parameter (1: none).
  const float l2 = a.decoupled ? 0.0F : a.weight_decay;
  const float shrink = a.decoupled ? a.decay_factor : 1.0F;
  for (std::int64_t i = 0; i < count; ++i) {
    const float grad = g[i] + l2 * p[i];
    const float mi = m[i] * a.beta1 + a.one_minus_beta1 * grad;
    const float vi = v[i] * a.beta2 + a.one_minus_beta2 * grad * grad;
    p[i] =
        p[i] * shrink + a.neg_step_size * (mi / (std::sqrt(vi) / a.bias_correction2_sqrt + a.eps));
    m[i] = mi;
    v[i] = vi;
  }
}

}  // namespace

void adam_bf16_cpu(const FusedWeights& w, std::uint16_t* m, std::uint16_t* v, std::int64_t n,
                   const AdamScalars& a) {
  const std::int64_t blocks = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 8, [&](std::int64_t first, std::int64_t last) {
    thread_local std::vector<float> buffers;  // weights, gradient and moments of a block
    buffers.resize(4 * kBlock);
    float* p = buffers.data();
    float* g = p + kBlock;
    float* mf = g + kBlock;
    float* vf = mf + kBlock;
    for (std::int64_t b = first; b < last; ++b) {
      const std::int64_t begin = b * kBlock, count = std::min(n, begin + kBlock) - begin;
      load_weights(w, begin, count, p);
      from_bfloat16_bits(w.g16 + begin, count, g);
      if (a.fresh) {  // LibTorch starts the moments from zeros
        std::fill(mf, mf + count, 0.0F);
        std::fill(vf, vf + count, 0.0F);
      } else {
        from_bfloat16_bits(m + begin, count, mf);
        from_bfloat16_bits(v + begin, count, vf);
      }
      adam_block(p, g, mf, vf, count, a);
      to_bfloat16_bits(mf, count, m + begin);
      to_bfloat16_bits(vf, count, v + begin);
      store_weights(w, p, begin, count);
    }
  });
}

}  // namespace frugal::optim::detail
