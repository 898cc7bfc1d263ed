// The 8-bit Adam step on the CPU for float32 and bfloat16 parameters, fused: each element's
// moments are decoded, updated, used and encoded again in one pass over a block, with no
// scratch (and the second pass of the factored step, whose second moment comes from rows
// and columns).
#pragma once

#include <cmath>
#include <cstdint>

#include "adam_chunk.h"
#include "frugal/optim/in_place.h"

namespace frugal::optim::detail {

/// How a step rounds its new codes: to the nearest, or stochastically
/// (QuantizedStateOptions::stochastic_codes), the first moment's with the random bits of
/// `m_key`, the second's with those of `v_key` (each element's from its index).
struct CodeRounding {
  bool stochastic = false;
  std::uint64_t m_key = 0, v_key = 0;
};

/// The step's scalars, as the tensor-ops step uses them (float32 arithmetic).
struct AdamScalars {
  float beta1 = 0, one_minus_beta1 = 0, beta2 = 0, one_minus_beta2 = 0;
  float eps = 0, weight_decay = 0, decay_factor = 1;  ///< AdamW: p *= decay_factor
  float neg_step_size = 0, bias_correction2_sqrt = 1;
  bool decoupled = false;  ///< AdamW's decay (else L2 added to the gradient)
  bool fresh = false;      ///< no moments yet: start from zeros
  CodeRounding codes;      ///< how the new codes round
};

/// The scalars of a step whose constants are `step`, its codes rounded as `codes` says.
inline AdamScalars adam_scalars(const AdamChunkStep& step, const CodeRounding& codes = {}) {
  AdamScalars a;
  a.codes = codes;
  a.beta1 = static_cast<float>(step.beta1);
  a.one_minus_beta1 = static_cast<float>(1 - step.beta1);
  a.beta2 = static_cast<float>(step.beta2);
  a.one_minus_beta2 = static_cast<float>(1 - step.beta2);
  a.eps = static_cast<float>(step.eps);
  a.weight_decay = static_cast<float>(step.weight_decay);
  a.decay_factor = static_cast<float>(1 - step.lr * step.weight_decay);
  a.neg_step_size = static_cast<float>(-step.step_size);
  a.bias_correction2_sqrt = static_cast<float>(std::sqrt(step.bias_correction2));
  a.decoupled = step.decoupled;
  a.fresh = step.fresh;
  return a;
}

/// A parameter's weights and gradient as the fused loop reads and writes them: float32
/// (`p`, `g`), or bfloat16 (`p16`, `g16`, their bits) computed on in float32 a block at a
/// time and written back as ParamUpdate::store_weights would: rounded stochastically (the
/// random bits of round_stochastic_cpu under `key`, element k's from its index) or to
/// nearest, ties to even.
///
/// Weights stored in 8 bits (`codes` set, p and p16 null): each group of `group` elements
/// decoded from its codes, zero point and scale (`qparams`), and encoded again after the
/// update with fresh statistics, rounded as above; the gradient is `g` or `g16`.
struct FusedWeights {
  float* p = nullptr;
  const float* g = nullptr;
  std::uint16_t* p16 = nullptr;
  const std::uint16_t* g16 = nullptr;
  bool stochastic = false;
  std::uint64_t key = 0;
  std::uint8_t* codes = nullptr;
  std::uint16_t* qparams = nullptr;
  std::int64_t group = 0;
  /// The weights come widened into a buffer (bfloat16 or 8-bit ones).
  bool widened() const { return p16 != nullptr || codes != nullptr; }
};

/// Whether the fused loop, taking `block` elements at a time, takes a parameter of this
/// dtype, device and layout (flat: contiguous) whose low-precision weights round as
/// `rounding` says: float32 ones, and bfloat16 ones rounded stochastically or to nearest, on
/// the CPU; and weights stored in 8 bits whose groups divide the block.
bool fused_cpu(const at::Tensor& param, bool flat, Rounding rounding, std::int64_t block);

/// The same for one update.
bool fused_cpu(const ParamUpdate& u, std::int64_t block);

/// The fused loop's view of `u` (fused_cpu must hold for it).
FusedWeights fused_weights(ParamUpdate& u);

/// Elements [begin, begin + count) of `w`'s widened weights (bfloat16 or 8-bit) in float32,
/// into `p`.
void load_weights(const FusedWeights& w, std::int64_t begin, std::int64_t count, float* p);

/// Elements [begin, begin + count) of `w`'s widened weights (bfloat16 `p16`, or 8-bit codes)
/// from their updated float32 values `p`, rounded as `w` says.
void store_weights(const FusedWeights& w, const float* p, std::int64_t begin, std::int64_t count);

/// A parameter of `n` elements (`w`) and moments as codes (`m_codes`, `v_codes`: 8-bit, or
/// 4-bit two to a byte as quantize_into packs them, as `bits` says) with one scale per block
/// of `block` elements (even for 4-bit codes); blocks are shared out among
/// at::get_num_threads() threads. `m_codes` null: no first moment (beta1 0).
void adam8bit_cpu(const FusedWeights& w, std::uint8_t* m_codes, float* m_scales,
                  std::uint8_t* v_codes, float* v_scales, std::int64_t n, std::int64_t block,
                  int bits, const AdamScalars& a);

/// The same with a factored second moment, the update of factored_adam_update's second
/// pass: element k's second moment is rows[k / cols] * col_hat[k % cols] (the statistics
/// already updated, the columns divided by the rows' mean).
void adam8bit_factored_cpu(const FusedWeights& w, std::uint8_t* m_codes, float* m_scales,
                           const float* rows, const float* col_hat, std::int64_t cols,
                           std::int64_t n, std::int64_t block, int bits, const AdamScalars& a);

}  // namespace frugal::optim::detail
