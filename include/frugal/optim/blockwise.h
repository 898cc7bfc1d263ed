// Block-wise 8-bit quantization with the dynamic (non-linear) map of Dettmers et al.,
// "8-bit Optimizers via Block-wise Quantization" (2021): what frugal's 8-bit optimizer
// states are stored in.
#pragma once

#include <torch/types.h>

#include <cstdint>

namespace frugal::optim {

/// The 256 values an 8-bit code stands for, sorted, in [-1, 1] (`is_signed`) or [0, 1].
/// Dynamic: a decimal exponent from 10^-6 to 10^0 and a linear fraction whose bits shrink
/// as the exponent grows, so small magnitudes keep their relative precision. Both maps
/// hold 0 and 1 exactly; the signed one's most negative value is about -0.993.
///
/// Example:
///   auto map = frugal::optim::dynamic_map(/*is_signed=*/true);  // 256 float32 values
torch::Tensor dynamic_map(bool is_signed);

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

namespace detail {

/// Quantization tables on one device: the map, and the midpoints between its neighbours
/// that rounding to the nearest value searches; both views of one 511-float storage.
struct CodeBook {
  /// `map`: 256 sorted values, e.g. a dynamic_map, on the device the codes live on.
  explicit CodeBook(const torch::Tensor& map);
  torch::Tensor values;      ///< float32 [256]
  torch::Tensor boundaries;  ///< float32 [255]
};

/// In place, without allocating a tensor: `out` (float32, `n` elements, contiguous) gets
/// the values of `codes` (uint8, n) scaled by `scales` (one per block of `block`; the
/// first element of `codes` starts a block). `index` is int32 scratch of n elements.
void dequantize_into(const torch::Tensor& out, const torch::Tensor& codes,
                     const torch::Tensor& scales, const CodeBook& book, std::int64_t block,
                     const torch::Tensor& index);

/// In place, without allocating a tensor: quantizes `x` (float32, n, contiguous) into
/// `codes` and `scales` as dequantize_into reads them. `work` (float32, n) and `index`
/// (int32, n) are scratch; `x` is left as it was.
void quantize_into(const torch::Tensor& x, const torch::Tensor& codes,
                   const torch::Tensor& scales, const CodeBook& book, std::int64_t block,
                   const torch::Tensor& work, const torch::Tensor& index);

}  // namespace detail
}  // namespace frugal::optim
