// Block-wise 8-bit quantization with the dynamic (non-linear) map of Dettmers et al.,
// "8-bit Optimizers via Block-wise Quantization" (2021): what frugal's 8-bit optimizer
// states are stored in.
#pragma once

#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
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

/// Rounding to the nearest code in O(1) on the host, as quantize_into rounds: a table
/// over the float32 bit pattern (sign, exponent from 2^-23 up, the mantissa's top 8
/// bits) gives each bucket's lowest code and the one rounding boundary inside it, if any.
class NearestCode {
 public:
  explicit NearestCode(const torch::Tensor& map);  ///< 256 sorted float32 values
  /// The code of the map value nearest to `y` (in [-1, 1]; NaN gives some code).
  std::uint8_t operator()(float y) const {
    return static_cast<std::uint8_t>(code(y, base_.data(), bound_.data()));
  }
  const float* values() const { return values_.data(); }
  const std::int32_t* bases() const { return base_.data(); }
  const float* bounds() const { return bound_.data(); }

  /// The rounding itself, from the tables; branch-free and in int32, so that loops of it
  /// vectorize.
  static std::int32_t code(float y, const std::int32_t* base, const float* bound) {
    const auto bits = __builtin_bit_cast(std::int32_t, y);  // (std::bit_cast in C++20)
    std::int32_t k = ((bits & 0x7FFFFFFF) >> kShift) - kFirstKey;
    k = std::min(std::max(k, 0), kBuckets - 1);
    const std::int32_t i = k + ((bits >> 31) & kBuckets);
    return base[i] + (y > bound[i] ? 1 : 0);
  }

 private:
  static constexpr int kShift = 23 - 8;               // keep 8 mantissa bits
  static constexpr std::int32_t kFirstKey = 104 << 8;  // 2^-23
  static constexpr std::int32_t kBuckets = 32 << 8;    // 2^-23 up to 2^9: a power of 2
  std::vector<float> values_, bound_;
  std::vector<std::int32_t> base_;
};

/// The codes of Adam's first moment (signed: dynamic_map(true)) or second moment (unsigned,
/// without zero: dynamic_map(false, false)), built once per process.
const NearestCode& nearest_code(bool is_signed);
/// The map of Adam's first or second moment, as nearest_code rounds to it.
torch::Tensor moment_map(bool is_signed);

}  // namespace detail
}  // namespace frugal::optim
