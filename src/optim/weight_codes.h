// Weights stored in 8 bits: each group of consecutive elements as uint8 codes with a zero
// point and a scale (both bfloat16), the value of code c being zero + c * scale in float32.
// The codec, on the CPU (one pass, no temporaries) and as tensor operations (any device),
// and the registry through which an optimizer finds the codes of a parameter.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace frugal::optim::detail {

/// A group's code step is its range times this float: a multiplication, as CUDA's division
/// by a scalar is, so that the CPU's kernel and the tensor operations agree bit for bit.
inline constexpr float kInverse255 = 1.0F / 255.0F;

/// One parameter stored in 8 bits.
struct StoredWeights {
  at::Tensor codes;    ///< uint8, one per element, flat
  at::Tensor qparams;  ///< bfloat16 [groups, 2]: each group's zero point and scale
  /// The parameter as the forward sees it when materialised: its shape and dtype; its
  /// storage holds bytes only while materialised (the optimizer reads its shape alone).
  at::Tensor whole;
  std::int64_t group = 128;
  /// Set by the optimizer when it wrote new codes; the unit materialises from them again.
  bool written = false;
  /// What errors call the buffers: "<name>_codes" and "<name>_qparams".
  std::string name = "weight";
};

/// An error, naming the buffer and both shapes, unless `stored`'s codes and qparams are
/// what `numel` weights in groups of stored.group need: uint8 codes, one an element;
/// bfloat16 qparams [groups, 2]; both contiguous, on one device. Every read and write of
/// codes checks first: buffers replaced by a state dict or torch::load saved under other
/// groups or shapes are refused, never read or written past their end.
void check_codes(const StoredWeights& stored, std::int64_t numel);

/// Registers `stored` under the TensorImpls of `param` and of stored->whole; an error when
/// one is registered already.
void add_stored_weights(const at::Tensor& param, std::shared_ptr<StoredWeights> stored);
void remove_stored_weights(const at::Tensor& param, const StoredWeights& stored);
/// The codes of `t` (a parameter stored in 8 bits, or the `whole` of one), or null.
std::shared_ptr<StoredWeights> stored_weights(const at::Tensor& t);
/// Whether `buffer` holds a stored parameter's codes or group statistics.
bool holds_stored_weights(const at::Tensor& buffer);

/// `param` as an update sees it: the `whole` of a parameter stored in 8 bits (its shape and
/// dtype whether or not it is materialised), else `param` itself.
inline at::Tensor update_target(const at::Tensor& param) {
  const auto stored = stored_weights(param);
  return stored != nullptr ? stored->whole : param;
}

/// Groups of `n` elements (the last may be shorter).
inline std::int64_t weight_groups(std::int64_t n, std::int64_t group) {
  return (n + group - 1) / group;
}

/// Elements [begin, begin + count) of the weights, `begin` a multiple of `group`, widened to
/// float32 into `out`.
void dequantize_weights_cpu(const std::uint8_t* codes, const std::uint16_t* qparams,
                            std::int64_t group, std::int64_t begin, std::int64_t count, float* out);

/// Elements [begin, begin + count) of the weights, from their float32 values `x` (`begin` a
/// multiple of `group`, count a multiple of it unless the range ends the parameter): each
/// group's zero point is its minimum rounded down to bfloat16, its scale (max - zero) / 255
/// rounded up to bfloat16 (at least the smallest normal float), so codes 0..255 span the
/// group. Codes round to nearest (ties to even) or, `stochastic`, down or up with
/// probability equal to the fraction, from 16 random bits of element begin + i under `key`
/// (round_stochastic_cpu's bits), so that each weight is its float32 value in expectation.
/// A group holding an infinity or a NaN dequantizes to values that are not finite.
void quantize_weights_cpu(const float* x, std::int64_t group, std::int64_t begin,
                          std::int64_t count, bool stochastic, std::uint64_t key,
                          std::uint8_t* codes, std::uint16_t* qparams);

/// dequantize_weights_cpu as tensor operations on any device: `codes` (uint8) and `qparams`
/// (bfloat16 [groups, 2]) of the range, into `out` (float32, same elements). No allocation.
void dequantize_weights_ops(const at::Tensor& codes, const at::Tensor& qparams, std::int64_t group,
                            const at::Tensor& out);

/// quantize_weights_cpu as tensor operations on any device, `x` (float32, overwritten) of
/// the range starting at element `begin`, into `codes` and `qparams` (the whole parameter's);
/// `noise` and `stats`: float32 buffers of at least x's elements (the random fractions, off the CPU
/// drawn from a generator of the device; each group's statistics). No allocation. On the CPU the
/// same codes as the CPU kernel.
void quantize_weights_ops(const at::Tensor& x, std::int64_t group, std::int64_t begin,
                          bool stochastic, std::uint64_t key, const at::Tensor& codes,
                          const at::Tensor& qparams, const at::Tensor& noise,
                          const at::Tensor& stats);

/// Elements [offset, offset + length) of `stored`'s weights decoded into `out` (float32,
/// contiguous, `length` elements): the CPU kernel on the CPU, tensor operations elsewhere.
void decode_range(const StoredWeights& stored, std::int64_t offset, std::int64_t length,
                  const at::Tensor& out);

/// Elements [offset, offset + length) of `stored`'s weights encoded from `w` (float32,
/// contiguous, overwritten off the CPU), rounded as quantize_weights_cpu says; `noise` and
/// `stats` as quantize_weights_ops takes them (unused on the CPU). Marks `stored` written.
void encode_range(StoredWeights& stored, const at::Tensor& w, std::int64_t offset, bool stochastic,
                  std::uint64_t key, const at::Tensor& noise, const at::Tensor& stats);

/// The codes and qparams of a whole tensor `w` (any floating dtype, any device), rounded to
/// nearest: new tensors on w's device.
std::pair<at::Tensor, at::Tensor> quantize_weights(const at::Tensor& w, std::int64_t group);

/// The weights of `stored` dequantized into `out` (stored->whole's shape and dtype, holding
/// bytes), through float32 a group at a time on the CPU.
void dequantize_into(const StoredWeights& stored, const at::Tensor& out);

}  // namespace frugal::optim::detail
