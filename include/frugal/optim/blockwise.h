// Block-wise 8-bit quantization with the dynamic (non-linear) map of Dettmers et al.,
// "8-bit Optimizers via Block-wise Quantization" (2021): what frugal's 8-bit optimizer
// states are stored in.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace frugal::optim {

/// The 256 values an 8-bit code stands for, sorted, in [-1, 1] (`is_signed`) or [0, 1].
/// Dynamic: a decimal exponent from 10^-6 to 10^0 and a linear fraction whose bits shrink
/// as the exponent grows, so small magnitudes keep their relative precision. Both maps
/// hold 1 exactly, and 0 unless `with_zero` is false: then the unsigned map's zero becomes
/// half its smallest positive value, so that nothing rounds to zero. (Adam's second
/// moment is stored that way: a small second moment rounded to zero makes the next update
/// of its parameter explode; Li et al., "Memory Efficient Optimizers with 4-bit States",
/// 2023, call it the zero-point problem.) The signed map's most negative value is about
/// -0.993.
///
/// Example:
///   auto map = frugal::optim::dynamic_map(/*is_signed=*/true);  // 256 float32 values
torch::Tensor dynamic_map(bool is_signed, bool with_zero = true);

/// A tensor stored as 8-bit codes: `codes[i]` indexes `map`, and each block of `block`
/// consecutive elements (in the flattened order; the last may be shorter) is scaled by its
/// absolute maximum, `scales[b]`.
struct BlockwiseCodes {
  torch::Tensor codes;   ///< uint8, the input's shape
  torch::Tensor scales;  ///< float32, one per block: ceil(numel / block)
  std::int64_t block = 0;
};

/// Quantizes `x` (floating point, any shape) block by block: each element divided by its
/// block's absolute maximum and rounded to the nearest value of `map` (a dynamic_map).
/// The error of an element is at most half the gap between the two map values around it,
/// times its block's scale; a block's largest magnitude is exact where the map holds it.
///
/// Example:
///   auto q = frugal::optim::quantize_blockwise(x, frugal::optim::dynamic_map(true), 256);
///   auto y = frugal::optim::dequantize_blockwise(q, frugal::optim::dynamic_map(true));
BlockwiseCodes quantize_blockwise(const torch::Tensor& x, const torch::Tensor& map,
                                  std::int64_t block);

/// The float32 values `q` stands for under `map`, shaped like the quantized tensor.
torch::Tensor dequantize_blockwise(const BlockwiseCodes& q, const torch::Tensor& map);

}  // namespace frugal::optim
