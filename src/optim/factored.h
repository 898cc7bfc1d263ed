// Adam's step on a factored second moment: Adafactor's row and column statistics (Shazeer
// and Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", 2018) in
// place of a moment per element, with an 8-bit first moment or none.
#pragma once

#include <torch/types.h>

#include <cstdint>

#include "adam8bit_kernel.h"
#include "adam_chunk.h"
#include "codebook.h"
#include "frugal/optim/adam8bit.h"
#include "frugal/optim/in_place.h"

namespace frugal::optim::detail {

/// A parameter as its factored moment sees it: its first dimension's rows by the rest.
struct FactoredShape {
  std::int64_t rows = 0, cols = 0;
};
FactoredShape factored_shape(const torch::Tensor& param);

/// Whether a factored second moment of `param` takes fewer bytes than 8-bit codes would:
/// a matrix (2+ dimensions) with 4 (rows + columns) < elements.
bool worth_factoring(const torch::Tensor& param);

/// Chunk-sized float32 buffers factored_adam_update uses, with the first moment's codes
/// rounded stochastically or not (then float32 copies of a gradient of another dtype, and
/// of a float64 parameter, as Adam8bit's other steps).
constexpr int factored_buffers(bool stochastic) { return stochastic ? 6 : 5; }

/// One step of `u`'s parameter (contiguous: chunks of whole rows; or whole), allocating no
/// tensor. The squared gradient's row and column means join `s`'s moving averages first
/// (one pass), then each element's second moment is taken as row x column / mean of the
/// rows, and the parameter moves as Adam moves it. `m_book`: the first moment's code book,
/// or null when the state keeps no first moment (beta1 0: the gradient stands for it);
/// its codes round as `codes` says.
void factored_adam_update(ParamUpdate& u, Adam8bitParamState& s, const AdamChunkStep& step,
                          const CodeBook* m_book, const CodeRounding& codes);

}  // namespace frugal::optim::detail
