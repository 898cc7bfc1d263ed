#include "factored.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <vector>

#include "adam8bit_kernel.h"

namespace frugal::optim::detail {

FactoredShape factored_shape(const torch::Tensor& param) {
  FactoredShape f;
  f.rows = param.dim() >= 1 ? param.size(0) : 1;
  f.cols = f.rows > 0 ? param.numel() / f.rows : 0;
  return f;
}

bool worth_factoring(const torch::Tensor& param) {
  const auto f = factored_shape(param);
  return param.dim() >= 2 && param.numel() > 0 && 4 * (f.rows + f.cols) < param.numel();
}

namespace {

// Views for a chunk of `k` whole rows of a parameter: the chunk itself (k, rest...), its
// rows' statistics (k, 1, ...) and the column statistics (1, rest...); the dimensions a row
// spans.
struct RowViews {
  RowViews(const torch::Tensor& param, std::int64_t k)
      : chunk(param.sizes().vec()),
        row(static_cast<std::size_t>(param.dim()), 1),
        col(param.sizes().vec()) {
    chunk[0] = k;
    row[0] = k;
    col[0] = 1;
    for (std::int64_t d = 1; d < param.dim(); ++d) {
      across.push_back(d);
    }
  }
  std::vector<std::int64_t> chunk, row, col, across;
};

}  // namespace

void factored_adam_update(ParamUpdate& u, Adam8bitParamState& s, const AdamChunkStep& step,
                          const CodeBook* m_book, const CodeRounding& codes) {
  const auto shape = factored_shape(u.param);
  const auto& row = s.exp_avg_sq_row();
  const auto col = s.exp_avg_sq_col().view(RowViews(u.param, 1).col);
  if (step.fresh) {  // torch starts the moments from zeros
    row.zero_();
    col.zero_();
  }
  const bool cast = u.grad.scalar_type() != torch::kFloat32;
  const bool wide = u.param.scalar_type() == torch::kFloat64;
  const bool l2 = !step.decoupled && step.weight_decay != 0;
  // Buffers: 0 the first moment, 1 the denominator, 2 work, 3 the codes' indices, 4 the
  // column statistics' sum, then the column statistics over the rows' mean; 5 with codes
  // rounded stochastically (and the denominator's, used by then); then copies.
  const int copies = factored_buffers(codes.stochastic);
  auto columns = u.scratch.at(4).narrow(0, 0, shape.cols).view(col.sizes());
  // Elements [offset, offset + n) in float32: the weights (`p`, written back into `out`
  // for a float64 parameter; undefined when the first pass needs none) and the gradient
  // with Adam's L2 decay (into `decayed`).
  struct Loaded {
    torch::Tensor p, out, grad;
  };
  const auto load = [&](std::int64_t offset, std::int64_t n, std::size_t decayed, bool weights) {
    Loaded x;
    x.grad = u.part(u.grad, offset, n);
    if (cast) {
      x.grad = u.scratch_part(copies, n).copy_(x.grad);
    }
    if (!weights) {
      return x;
    }
    x.p = x.out = u.weights(offset, n);
    if (wide) {
      x.p = u.scratch_part(copies + 1, n).copy_(x.p);
    }
    if (l2) {
      auto out = u.scratch_part(decayed, n);
      x.grad = at::add_out(out, x.grad, x.p, step.weight_decay);
    }
    return x;
  };

  // The squared gradient's means along each row and down each column.
  bool first = true;
  for_each_chunk(u, [&](std::int64_t offset, std::int64_t n) {
    const RowViews v(u.param, n / shape.cols);
    const auto x = load(offset, n, 0, l2);
    auto sq = u.scratch_part(2, n);
    at::mul_out(sq, x.grad, x.grad);
    sq = sq.view(v.chunk);
    auto means = u.scratch.at(3).narrow(0, 0, v.row[0]).view(v.row);
    at::mean_out(means, sq, v.across, /*keepdim=*/true);
    row.narrow(0, offset / shape.cols, v.row[0])
        .view(v.row)
        .mul_(step.beta2)
        .add_(means, 1 - step.beta2);
    auto sums = first ? columns : u.scratch.at(1).narrow(0, 0, shape.cols).view(v.col);
    at::sum_out(sums, sq, {0}, /*keepdim=*/true);
    if (!first) {
      columns.add_(sums);
    }
    first = false;
  });
  col.mul_(step.beta2).add_(columns, (1 - step.beta2) / static_cast<double>(shape.rows));
  // Rows that never had a gradient have a zero mean: their elements' moment is zero too.
  auto row_mean = u.scratch.at(2).narrow(0, 0, 1);
  at::mean_out(row_mean, row, {0}, /*keepdim=*/true);
  row_mean.clamp_min_(std::numeric_limits<float>::min());
  at::div_out(columns, col, row_mean);

  const bool has_m = m_book != nullptr;
  if (fused_cpu(u, s.block())) {
    // The second pass fused, as Adam8bit's step on the CPU.
    adam8bit_factored_cpu(fused_weights(u), has_m ? s.exp_avg().data_ptr<std::uint8_t>() : nullptr,
                          has_m ? s.exp_avg_scales().data_ptr<float>() : nullptr,
                          row.data_ptr<float>(), columns.data_ptr<float>(), shape.cols, u.numel(),
                          s.block(), s.bits(), adam_scalars(step, codes));
    return;
  }

  // Adam's step with the moment row x column / mean of the rows.
  const double bias_correction2_sqrt = std::sqrt(step.bias_correction2);
  for_each_chunk(u, [&](std::int64_t offset, std::int64_t n) {
    const RowViews v(u.param, n / shape.cols);
    const auto x = load(offset, n, 2, true);
    const auto m = u.scratch_part(0, n);
    const auto work = u.scratch_part(2, n);
    const auto index = u.scratch.at(3).narrow(0, 0, n).view(torch::kInt32);
    torch::Tensor m_codes, m_scales;
    if (has_m) {
      // (offset is a multiple of the block, even under 4-bit codes)
      const auto bits = static_cast<int>(s.bits());
      m_codes = s.exp_avg().view(-1).narrow(0, code_bytes(offset, bits), code_bytes(n, bits));
      m_scales = s.exp_avg_scales().narrow(0, offset / s.block(), (n + s.block() - 1) / s.block());
    }
    if (has_m && !step.fresh) {
      dequantize_into(m.view(-1), m_codes, m_scales, *m_book, s.block(), index);
    } else {
      m.zero_();
    }
    if (step.decoupled && step.weight_decay != 0) {
      x.p.mul_(1 - step.lr * step.weight_decay);
    }
    m.mul_(step.beta1).add_(x.grad, 1 - step.beta1);
    const auto denom = u.scratch_part(1, n);
    auto by_rows = denom.view(v.chunk);
    at::mul_out(by_rows, row.narrow(0, offset / shape.cols, v.row[0]).view(v.row), columns);
    denom.sqrt_().div_(bias_correction2_sqrt).add_(step.eps);
    auto p = x.p;
    p.addcdiv_(m, denom, -step.step_size);
    if (wide) {
      x.out.copy_(p);
    }
    u.store_weights(p, offset, n);
    if (has_m) {
      StochasticCodes stochastic;
      if (codes.stochastic) {
        stochastic = {codes.m_key, offset, denom.view(-1), u.scratch_part(5, n).view(-1)};
      }
      quantize_into(m.view(-1), m_codes, m_scales, *m_book, s.block(), work.view(-1), index,
                    codes.stochastic ? &stochastic : nullptr);
    }
  });
}

}  // namespace frugal::optim::detail
