// The quantization tables and in-place kernels under the block-wise codes and the 8-bit states.
#pragma once

#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace frugal::optim {

/// Quantization tables on one device: the map, and the midpoints between its neighbours
/// that rounding to the nearest value searches; both views of one (2 size - 1)-float storage.
struct CodeBook {
  /// `map`: 256 sorted values (8-bit codes) or 16 (4-bit), e.g. a dynamic_map, on the
  /// device the codes live on.
  explicit CodeBook(const torch::Tensor& map);
  torch::Tensor values;      ///< float32 [size]
  torch::Tensor boundaries;  ///< float32 [size - 1]
  int bits = 8;              ///< 8, or 4: codes packed two to a byte
};

/// Blocks of `block` elements that hold `n`: ceil(n / block), one scale each.
inline std::int64_t blocks_of(std::int64_t n, std::int64_t block) {
  return (n + block - 1) / block;
}

/// Bytes of `n` codes of `bits` bits: n, or ceil(n / 2).
inline std::int64_t code_bytes(std::int64_t n, int bits) { return bits == 4 ? (n + 1) / 2 : n; }

/// In place, without allocating a tensor: `out` (float32, `n` elements, contiguous) gets
/// the values of `codes` (uint8: n codes, or ceil(n / 2) bytes of two 4-bit codes under a
/// 4-bit book) scaled by `scales` (one per block of `block`; the first element of `codes`
/// starts a block, and an even one under a 4-bit book). `index` is int32 scratch of n
/// elements.
void dequantize_into(const torch::Tensor& out, const torch::Tensor& codes,
                     const torch::Tensor& scales, const CodeBook& book, std::int64_t block,
                     const torch::Tensor& index);

/// Codes rounded stochastically (QuantizedStateOptions::stochastic_codes): the random bits
/// of elements from index `first` on under `key` (detail::uniform16), and two float32
/// scratch buffers of the elements' count.
struct StochasticCodes {
  std::uint64_t key = 0;
  std::int64_t first = 0;
  torch::Tensor scratch_a, scratch_b;
};

/// In place, without allocating a tensor: quantizes `x` (float32, n, contiguous) into
/// `codes` and `scales` as dequantize_into reads them. `work` (float32, n) and `index`
/// (int32, n) are scratch; `x` is left as it was. Each code is the nearest, or with
/// `stochastic` the one at or below the value or the one above, up with probability
/// (value - below) / (above - below) (16 random bits: u * 2^16 an integer, up when value -
/// below > u * (above - below)).
void quantize_into(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                   const CodeBook& book, std::int64_t block, const torch::Tensor& work,
                   const torch::Tensor& index, const StochasticCodes* stochastic = nullptr);

/// Rounding to the nearest code in O(1) on the host, as quantize_into rounds: a table
/// over the float32 bit pattern (sign, exponent from 2^-23 up, the mantissa's top 8
/// bits) gives each bucket's lowest code and the one rounding boundary inside it, if any.
class NearestCode {
 public:
  explicit NearestCode(const torch::Tensor& map);  ///< 256 or 16 sorted float32 values
  /// The code of the map value nearest to `y` (in [-1, 1]; NaN gives some code).
  std::uint8_t operator()(float y) const {
    return static_cast<std::uint8_t>(code(y, base_.data(), bound_.data()));
  }
  const float* values() const { return values_.data(); }
  /// values()[k + 1] - values()[k], in float32.
  const float* gaps() const { return gaps_.data(); }
  /// The highest code: 255 or 15.
  std::int32_t last() const { return static_cast<std::int32_t>(values_.size()) - 1; }
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
  static constexpr int kShift = 23 - 8;                // keep 8 mantissa bits
  static constexpr std::int32_t kFirstKey = 104 << 8;  // 2^-23
  static constexpr std::int32_t kBuckets = 32 << 8;    // 2^-23 up to 2^9: a power of 2
  std::vector<float> values_, gaps_, bound_;
  std::vector<std::int32_t> base_;
};

/// The codes of Adam's first moment (signed: dynamic_map(true, true, bits), whose lowest
/// value is -1 at 4 bits, as its highest is 1) or second moment (unsigned, without zero:
/// dynamic_map(false, false, bits), whose lowest value is a 32nd of the next at 4 bits) of
/// 8 or 4 bits, built once per process.
const NearestCode& nearest_code(bool is_signed, int bits = 8);
/// The map of Adam's first or second moment, as nearest_code rounds to it.
torch::Tensor moment_map(bool is_signed, int bits = 8);

}  // namespace frugal::optim
