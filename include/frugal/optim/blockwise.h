// Block-wise 8-bit (and 4-bit) quantization with the dynamic (non-linear) map of Dettmers
// et al., "8-bit Optimizers via Block-wise Quantization" (2021): what frugal's 8-bit
// optimizer states are stored in.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace frugal::optim {

/// The 256 values an 8-bit code stands for (16 for `bits` 4), sorted, in [-1, 1]
/// (`is_signed`) or [0, 1]. Dynamic: a decimal exponent from 10^-6 to 10^0 (10^-2 to 10^0
/// with 4 bits: one level fewer for each bit fewer) and a linear fraction whose bits shrink
/// as the exponent grows, so small magnitudes keep their relative precision. Both maps
/// hold 1 exactly, and 0 unless `with_zero` is false: then the unsigned map's zero becomes
/// half its smallest positive value, so that nothing rounds to zero. (Adam's second
/// moment is stored that way: a small second moment rounded to zero makes the next update
/// of its parameter explode; Li et al., "Memory Efficient Optimizers with 4-bit States",
/// 2023, call it the zero-point problem.) The signed map's most negative value is about
/// -0.993 (-0.8875 with 4 bits).
///
/// Example:
///   auto map = frugal::optim::dynamic_map(/*is_signed=*/true);  // 256 float32 values
///   auto map4 = frugal::optim::dynamic_map(true, true, 4);       // 16
torch::Tensor dynamic_map(bool is_signed, bool with_zero = true, int bits = 8);

/// A tensor stored as 8-bit or 4-bit codes: code i indexes `map`, and each block of `block`
/// consecutive elements (in the flattened order; the last may be shorter) is scaled by its
/// absolute maximum, `scales[b]`. With a map of 16 values the codes are 4 bits, two to a
/// byte: element 2k in the low half of byte k, element 2k + 1 in the high half.
struct BlockwiseCodes {
  BlockwiseCodes() = default;
  BlockwiseCodes(torch::Tensor codes, torch::Tensor scales, std::int64_t block,
                 std::vector<std::int64_t> sizes = {})
      : codes(std::move(codes)), scales(std::move(scales)), block(block), sizes(std::move(sizes)) {}

  torch::Tensor codes;   ///< uint8: the input's shape (8-bit), or ceil(numel / 2) bytes (4-bit)
  torch::Tensor scales;  ///< float32, one per block: ceil(numel / block)
  std::int64_t block = 0;
  /// The input's shape; empty: the codes' shape (8-bit codes).
  std::vector<std::int64_t> sizes;
};

/// Quantizes `x` (floating point, any shape) block by block: each element divided by its
/// block's absolute maximum and rounded to the nearest value of `map` (a dynamic_map of 8
/// or 4 bits; 4-bit codes are packed two to a byte).
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
