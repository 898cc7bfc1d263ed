// NF4 codes (QLoRA's 4-bit NormalFloat) with double-quantized block scales, computed as
// bitsandbytes computes them on the CPU, so that the codes agree bit for bit.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace frugal::nn::detail {

/// A tensor in NF4: blocks of 64 elements, each a 4-bit index into the 16 NF4 values
/// scaled by its block's absolute maximum; the absmaxes themselves in 8 bits (blocks of 256,
/// bitsandbytes' signed dynamic map, less their mean `offset`).
struct Nf4Tensor {
  std::vector<std::int64_t> shape;
  torch::Tensor packed;         ///< uint8, two codes a byte, the first in the high nibble
  torch::Tensor qabsmax;        ///< uint8, one a block of 64
  torch::Tensor absmax2;        ///< float32, one a block of 256 absmaxes
  torch::Tensor offset;         ///< float32 [1], the absmaxes' mean
  std::string name = "weight";  ///< what errors call the buffers: "<name>_nf4", ...
  std::int64_t bytes() const;
};

/// An error naming the buffer and both shapes unless `q`'s tensors are what its shape
/// needs (dtype, element count, contiguity, one device): checked before every decode, so a
/// state dict saved under another shape is refused, never read past its end.
void check_nf4(const Nf4Tensor& q);

constexpr std::int64_t kNf4Block = 64;
constexpr std::int64_t kNf4StatsBlock = 256;

/// The 16 NF4 values (float32), bitsandbytes' `get_4bit_type("nf4")`.
const torch::Tensor& nf4_values();
/// bitsandbytes' `create_dynamic_map(signed=True)`: 256 sorted float32 values in [-1, 1],
/// computed in float32 as bitsandbytes does (optim::dynamic_map computes the same table in
/// double and rounds once, which a bit-for-bit match cannot take).
const torch::Tensor& dynamic_map();

/// `w` (any floating dtype, any device; computed on the CPU) in NF4.
Nf4Tensor nf4_quantize(const torch::Tensor& w);
/// The float32 absmax of each block of 64, as the statistics decode.
torch::Tensor nf4_absmax(const Nf4Tensor& q);
/// The weights in `dtype` (float32 products of value and absmax, then cast, as bitsandbytes).
torch::Tensor nf4_dequantize(const Nf4Tensor& q, torch::Dtype dtype);

/// bitsandbytes' CPU blockwise 8-bit quantizer on `x` (float32) with dynamic_map(): per
/// block of `block`, the absolute maximum and each element's nearest map value found through
/// its 65536-entry lookup table. Returns the codes and the absmaxes.
std::pair<torch::Tensor, torch::Tensor> quantize_blockwise_lut(const torch::Tensor& x,
                                                               std::int64_t block);

}  // namespace frugal::nn::detail
