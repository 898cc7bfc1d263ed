#include "frugal/optim/adam8bit.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <cmath>
#include <numeric>
#include <set>
#include <tuple>
#include <type_traits>

#include "adam8bit_kernel.h"
#include "adam_chunk.h"
#include "codebook.h"
#include "compat.h"
#include "factored.h"
#include "frugal/error.h"
#include "rounding.h"
#include "weight_codes.h"

namespace frugal::optim {
namespace detail {

// What a new state holds: codes and scales (else float32 moments), the second moment as rows
// and columns, a first moment.
struct ParamLayout {
  bool quantized = false;
  bool factored = false;
  bool first_moment = true;
};

// The format a state made now for `param` takes under `options`, quantized if `quantize`.
template <typename Options>
ParamLayout new_state_format(const torch::Tensor& param,
                             const torch::optim::OptimizerOptions& options, bool quantize,
                             const QuantizedStateOptions& q) {
  ParamLayout f;
  f.quantized = quantize && param.numel() >= q.min_elements();
  f.factored = f.quantized && q.factored() && worth_factoring(param);
  f.first_moment = !f.quantized || std::get<0>(static_cast<const Options&>(options).betas()) != 0;
  return f;
}

}  // namespace detail

namespace {

using torch::optim::AdamOptions;
using torch::optim::AdamWOptions;

// Two CodeBook tables of float32 (2 size - 1 values each).
std::int64_t book_bytes(int bits) { return 2 * (2 * (std::int64_t{1} << bits) - 1) * 4; }

template <typename Options>
void check_options(const Options& o, const QuantizedStateOptions& q) {
  FRUGAL_CHECK(std::isfinite(o.lr()) && o.lr() >= 0, "frugal: invalid learning rate: ", o.lr(),
               " (needs a finite value >= 0)");
  FRUGAL_CHECK(o.eps() >= 0, "frugal: invalid epsilon: ", o.eps());
  const auto [beta1, beta2] = o.betas();
  FRUGAL_CHECK(0 <= beta1 && beta1 < 1, "frugal: invalid beta1 (needs 0 <= beta1 < 1): ", beta1);
  FRUGAL_CHECK(0 <= beta2 && beta2 < 1, "frugal: invalid beta2 (needs 0 <= beta2 < 1): ", beta2);
  FRUGAL_CHECK(o.weight_decay() >= 0, "frugal: invalid weight decay: ", o.weight_decay());
  FRUGAL_CHECK(!o.amsgrad(),
               "frugal: the 8-bit Adam optimizers do not offer AMSGrad "
               "(amsgrad must be false)");
  FRUGAL_CHECK(q.block() >= 1, "frugal: QuantizedStateOptions block must be >= 1 element, got ",
               q.block());
  FRUGAL_CHECK(q.bits() == 8 || q.bits() == 4,
               "frugal: QuantizedStateOptions bits must be 8 or 4, got ", q.bits());
  FRUGAL_CHECK(q.bits() == 8 || q.block() % 2 == 0,  // two codes a byte
               "frugal: 4-bit states need an even QuantizedStateOptions block, got ", q.block());
  frugal::detail::check_at_least(q.min_elements(), 0, "QuantizedStateOptions min_elements");
}

}  // namespace

template <typename Options>
struct Adam8bitBase<Options>::Books {
  CodeBook signed_book, unsigned_book;
};

template <typename Options>
struct Adam8bitBase<Options>::Format : detail::ParamLayout {};

template <typename Options>
typename Adam8bitBase<Options>::Format Adam8bitBase<Options>::format_of(
    const torch::Tensor& param, const torch::optim::OptimizerParamState* state,
    const torch::optim::OptimizerOptions& options) const {
  Format f;
  if (state != nullptr) {
    const auto& s = static_cast<const Adam8bitParamState&>(*state);
    f.quantized = s.quantized();
    f.factored = s.factored();
    f.first_moment = s.exp_avg().defined();
  } else {
    static_cast<detail::ParamLayout&>(f) =
        detail::new_state_format<Options>(param, options, enabled_, quantized_);
  }
  return f;
}

template <typename Options>
std::int64_t Adam8bitBase<Options>::chunk_multiple(
    const torch::Tensor& param, const torch::optim::OptimizerParamState* state,
    const torch::optim::OptimizerOptions& options) const {
  if (!format_of(param, state, options).factored) {
    return quantized_.block();
  }
  // Whole rows, and whole blocks of the first moment's codes.
  const auto cols = detail::factored_shape(param).cols;
  return cols / std::gcd(cols, quantized_.block()) * quantized_.block();
}

template <typename Options>
Adam8bitBase<Options>::Adam8bitBase(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                                    Options defaults, QuantizedStateOptions quantized,
                                    InPlaceOptions in_place)
    : torch::optim::Optimizer(groups, std::make_unique<Options>(defaults)),
      InPlaceOptimizer(in_place),
      quantized_(quantized) {
  check_options(defaults, quantized_);
}

template <typename Options>
Adam8bitBase<Options>::Adam8bitBase(std::vector<torch::Tensor> params, Options defaults,
                                    QuantizedStateOptions quantized, InPlaceOptions in_place)
    : torch::optim::Optimizer(std::move(params), std::make_unique<Options>(defaults)),
      InPlaceOptimizer(in_place),
      quantized_(quantized) {
  check_options(defaults, quantized_);
}

template <typename Options>
void Adam8bitBase<Options>::check_format_change(bool unchanged, const std::string& call) const {
  FRUGAL_CHECK(unchanged || state().empty(), "frugal: ", call, " after states exist (",
               state().size(), " parameters): the states' format is chosen before the first step");
}

template <typename Options>
StateFormat Adam8bitBase<Options>::state_format() const {
  return {enabled_ ? quantized_.bits() : 32, quantized_.factored(), quantized_.stochastic_codes()};
}

template <typename Options>
QuantizedStateOptions Adam8bitBase<Options>::options_for(const StateFormat& format) const {
  FRUGAL_CHECK(format.bits == 32 || format.bits == 8 || format.bits == 4,
               "frugal: a state format's bits are 32, 8 or 4, got ", format.bits);
  auto q = quantized_;
  if (format.quantized()) {
    q.bits(format.bits);  // float32 keeps the width the codes had
  }
  q.factored(format.factored).stochastic_codes(format.stochastic);
  check_options(static_cast<const Options&>(defaults()), q);
  return q;
}

template <typename Options>
void Adam8bitBase<Options>::set_state_format(const StateFormat& format) {
  check_format_change(format == state_format(),
                      fmt::format("set_state_format({})", format.describe()));
  quantized_ = options_for(format);
  enabled_ = format.quantized();
}

template <typename Options>
std::int64_t Adam8bitBase<Options>::pending_state_bytes(const StateFormat& format) const {
  const auto q = options_for(format);
  std::int64_t bytes = 0;
  std::set<std::tuple<c10::DeviceType, c10::DeviceIndex, int>> devices;
  for (auto& group : param_groups()) {
    for (const auto& param : group.params()) {
      if (state().count(compat::optimizer_state_key(param)) != 0) {
        continue;
      }
      const auto p = detail::update_target(param);
      const auto n = p.numel();
      const auto f = detail::new_state_format<Options>(p, group.options(), format.quantized(), q);
      if (f.quantized) {
        const auto codes =  // one moment's
            code_bytes(n, q.bits()) + 4 * blocks_of(n, q.block());
        const auto shape = detail::factored_shape(p);
        bytes += f.first_moment ? codes : 0;
        bytes += f.factored ? 4 * (shape.rows + shape.cols) : codes;
        const auto device = std::make_tuple(p.device().type(), p.device().index(), q.bits());
        if (books_.count(device) == 0 && devices.insert(device).second) {
          bytes += book_bytes(q.bits());
        }
      } else {
        bytes += 8 * n;
      }
    }
  }
  return bytes;
}

template <typename Options>
const typename Adam8bitBase<Options>::Books& Adam8bitBase<Options>::books(torch::Device device,
                                                                          int bits) const {
  const auto key = std::make_tuple(device.type(), device.index(), bits);
  auto it = books_.find(key);
  if (it == books_.end()) {
    it = books_
             .emplace(key, std::make_shared<const Books>(
                               Books{CodeBook(moment_map(true, bits).to(device)),
                                     CodeBook(moment_map(false, bits).to(device))}))
             .first;
  }
  return *it->second;
}

template <typename Options>
void Adam8bitBase<Options>::attach_books(Adam8bitParamState& s, torch::Device device) const {
  const auto& b = books(device, static_cast<int>(s.bits()));
  s.signed_map(b.signed_book.values).unsigned_map(b.unsigned_book.values);
}

template <typename Options>
std::unique_ptr<torch::optim::OptimizerParamState> Adam8bitBase<Options>::make_state(
    const torch::Tensor& param, const torch::optim::OptimizerOptions& options) const {
  check_options(static_cast<const Options&>(options), quantized_);
  auto state = std::make_unique<Adam8bitParamState>();
  const auto f32 = torch::TensorOptions().device(param.device()).dtype(torch::kFloat32);
  const auto format = format_of(param, nullptr, options);
  if (format.quantized) {
    const auto blocks = blocks_of(param.numel(), quantized_.block());
    const auto u8 = f32.dtype(torch::kUInt8);
    // 8-bit codes shaped like the parameter; 4-bit ones two to a byte.
    const auto codes = [&] {
      return quantized_.bits() == 8 ? torch::empty(param.sizes(), u8)
                                    : torch::empty({code_bytes(param.numel(), 4)}, u8);
    };
    state->block(quantized_.block()).bits(quantized_.bits());
    attach_books(*state, param.device());
    if (format.first_moment) {
      state->exp_avg(codes()).exp_avg_scales(torch::empty({blocks}, f32));
    }
    if (format.factored) {
      const auto shape = detail::factored_shape(param);
      state->exp_avg_sq_row(torch::empty({shape.rows}, f32))
          .exp_avg_sq_col(torch::empty({shape.cols}, f32));
    } else {
      state->exp_avg_sq(codes()).exp_avg_sq_scales(torch::empty({blocks}, f32));
    }
  } else {
    state->exp_avg(torch::empty(param.sizes(), f32)).exp_avg_sq(torch::empty(param.sizes(), f32));
  }
  return state;
}

template <typename Options>
int Adam8bitBase<Options>::scratch_buffers(const torch::optim::OptimizerOptions&) const {
  // The two moments in float32, the denominator, the codes' indices; and two for codes
  // rounded stochastically.
  return quantized_.stochastic_codes() ? 6 : 4;
}

// The fused CPU loop needs no scratch; float32 states need the denominator only; gradients
// of other dtypes are read from float32 copies.
template <typename Options>
int Adam8bitBase<Options>::scratch_buffers(const torch::Tensor& param, bool flat,
                                           const torch::optim::OptimizerParamState* state,
                                           const torch::optim::OptimizerOptions& options) const {
  // Without a state yet (the planner asks before the first step): as make_state would.
  const auto format = format_of(param, state, options);
  const double beta1 = std::get<0>(static_cast<const Options&>(options).betas());
  FRUGAL_CHECK(format.first_moment || beta1 == 0,
               "frugal: the 8-bit state of a parameter of "
               "shape ",
               param.sizes(),
               " keeps no first moment (it was made with beta1 0), "
               "but beta1 is now ",
               beta1);
  const bool quantized = format.quantized;
  const bool is_float = param.scalar_type() == torch::kFloat32;
  // Float32 copies: the gradient, and a float64 parameter (bfloat16 and float16 weights
  // come in float32 from the base, ParamUpdate::weights).
  const int copies = is_float ? 0 : (param.scalar_type() == torch::kFloat64 ? 2 : 1);
  if (!quantized) {
    return 1 + copies;
  }
  if (format.factored) {
    return detail::factored_buffers(quantized_.stochastic_codes()) + copies;
  }
  const bool fused =
      detail::fused_cpu(param, flat, this->in_place_options().rounding(), quantized_.block());
  return fused ? 0 : scratch_buffers(options) + copies;
}

template <typename Options>
void Adam8bitBase<Options>::update(ParamUpdate& u) const {
  const auto& o = static_cast<const Options&>(u.options);
  auto& s = static_cast<Adam8bitParamState&>(*u.state);
  s.step(s.step() + 1);
  const auto step =
      detail::adam_chunk_step(o, s.step(), std::is_same_v<Options, AdamWOptions>, u.fresh);
  const auto bits = static_cast<int>(s.bits());
  const Books* b = s.quantized()
                       ? books_.at({u.param.device().type(), u.param.device().index(), bits}).get()
                       : nullptr;
  // Stochastic codes: this step's random bits, from the parameter's stream and the step.
  detail::CodeRounding codes;
  if (b != nullptr && quantized_.stochastic_codes()) {
    const auto key = detail::rounding_key(u.stream, static_cast<std::uint64_t>(s.step()));
    codes = {true, detail::rounding_key(key, 0), detail::rounding_key(key, 1)};
  }
  if (s.factored()) {
    detail::factored_adam_update(u, s, step, s.exp_avg().defined() ? &b->signed_book : nullptr,
                                 codes);
    return;
  }
  const bool first_moment = s.exp_avg().defined();  // else beta1 is 0: m is the gradient
  // float32 and bfloat16 on the CPU: the fused loop; elsewhere (CUDA, other dtypes,
  // strided, compensated rounding) tensor ops.
  const bool fused = b != nullptr && detail::fused_cpu(u, s.block());
  if (fused) {  // the whole parameter at once: it needs no scratch
    detail::adam8bit_cpu(
        detail::fused_weights(u), first_moment ? s.exp_avg().data_ptr<std::uint8_t>() : nullptr,
        first_moment ? s.exp_avg_scales().data_ptr<float>() : nullptr,
        s.exp_avg_sq().data_ptr<std::uint8_t>(), s.exp_avg_sq_scales().data_ptr<float>(), u.numel(),
        s.block(), bits, detail::adam_scalars(step, codes));
    return;
  }
  const bool cast = u.grad.scalar_type() != torch::kFloat32;
  const bool wide = u.param.scalar_type() == torch::kFloat64;
  for_each_chunk(u, [&](std::int64_t offset, std::int64_t n) {
    // Weights of another dtype than float32 are computed on in float32, as the states are:
    // bfloat16 and float16 ones by the base (ParamUpdate::weights), float64 ones here.
    auto p = u.weights(offset, n);
    const auto param_out = p;
    auto grad = u.part(u.grad, offset, n);
    // Buffers: the moments, the work buffer and the indices when quantized, the work buffer
    // alone when not; then float32 copies of a gradient and a float64 parameter.
    auto work = u.scratch_part(b != nullptr ? 2 : 0, n);
    const std::size_t first = b != nullptr ? static_cast<std::size_t>(scratch_buffers(o)) : 1;
    if (cast) {
      grad = u.scratch_part(first, n).copy_(grad);
    }
    if (wide) {
      p = u.scratch_part(first + 1, n).copy_(p);
    }
    torch::Tensor m, v, index, m_codes, v_codes, m_scales, v_scales;
    if (b != nullptr) {
      m = u.scratch_part(0, n);
      v = u.scratch_part(1, n);
      index = u.scratch.at(3).narrow(0, 0, n).view(torch::kInt32);
      // (offset is a multiple of the block, even under 4-bit codes)
      const auto first = offset / s.block();
      const auto at = code_bytes(offset, bits), bytes = code_bytes(n, bits);
      v_codes = s.exp_avg_sq().view(-1).narrow(0, at, bytes);
      v_scales = s.exp_avg_sq_scales().narrow(0, first, blocks_of(n, s.block()));
      if (first_moment) {
        m_codes = s.exp_avg().view(-1).narrow(0, at, bytes);
        m_scales = s.exp_avg_scales().narrow(0, first, blocks_of(n, s.block()));
      }
      if (!u.fresh) {
        if (first_moment) {
          dequantize_into(m.view(-1), m_codes, m_scales, b->signed_book, s.block(), index);
        } else {
          m.zero_();  // times beta1 0: the gradient alone
        }
        dequantize_into(v.view(-1), v_codes, v_scales, b->unsigned_book, s.block(), index);
      }
    } else {
      m = u.part(s.exp_avg(), offset, n);
      v = u.part(s.exp_avg_sq(), offset, n);
    }
    detail::adam_chunk(p, grad, m, v, torch::Tensor(), work, work, step);
    if (wide) {
      param_out.copy_(p);
    }
    u.store_weights(p, offset, n);
    if (b != nullptr) {
      StochasticCodes m_rounding, v_rounding;
      if (codes.stochastic) {
        m_rounding = {codes.m_key, offset, u.scratch_part(4, n).view(-1),
                      u.scratch_part(5, n).view(-1)};
        v_rounding = {codes.v_key, offset, m_rounding.scratch_a, m_rounding.scratch_b};
      }
      const auto* m_stochastic = codes.stochastic ? &m_rounding : nullptr;
      const auto* v_stochastic = codes.stochastic ? &v_rounding : nullptr;
      if (first_moment) {
        quantize_into(m.view(-1), m_codes, m_scales, b->signed_book, s.block(), work.view(-1),
                      index, m_stochastic);
      }
      quantize_into(v.view(-1), v_codes, v_scales, b->unsigned_book, s.block(), work.view(-1),
                    index, v_stochastic);
    }
  });
}

template class Adam8bitBase<AdamOptions>;
template class Adam8bitBase<AdamWOptions>;

}  // namespace frugal::optim
