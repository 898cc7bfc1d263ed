#include "frugal/nn/linear_cross_entropy.h"

#include <torch/autograd.h>

#include "compat.h"
#include "frugal/autocast_guard.h"
#include "frugal/error.h"

namespace frugal::nn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Needs {
  bool hidden = false, weight = false, bias = false;
  bool any() const { return hidden || weight || bias; }
};

// The loss summed over the tokens (and, where `needs` says, the gradients of that sum),
// one chunk of tokens at a time.
struct ChunkedSums {
  torch::Tensor loss;                  // float32 scalar
  torch::Tensor hidden, weight, bias;  // gradients of the summed loss
};

// Refuses targets that are neither a class nor ignored and returns the tokens counted (not
// ignored): one host read a call, before any chunk runs, not three a chunk (each a device
// sync on CUDA); a recompute in backward reads nothing.
std::int64_t check_targets(const torch::Tensor& t, std::int64_t classes, std::int64_t ignore) {
  const auto valid = t.ne(ignore);
  const auto bad = (t.lt(0) | t.ge(classes)) & valid;
  const auto counts = torch::stack({bad.sum(), valid.sum()}).cpu();
  if (counts[0].item<std::int64_t>() > 0) {
    FRUGAL_CHECK(false, "frugal: linear_cross_entropy: target ",
                 t.masked_select(bad)[0].item<std::int64_t>(), " is not a class in [0, ", classes,
                 ") nor the ignore_index ", ignore);
  }
  return counts[1].item<std::int64_t>();
}

// `grad_scale` (a float32 scalar, or undefined for 1): the loss's gradient over its divisor,
// applied to the logits' gradient in float32 before it is cast to a float16 product, so that
// a GradScaler's scale keeps small gradients from underflowing there, as it is meant to.
ChunkedSums chunked_sums(const torch::Tensor& h, const torch::Tensor& w, const torch::Tensor& b,
                         const torch::Tensor& t, const LinearCrossEntropyOptions& o, Needs needs,
                         const torch::Tensor& grad_scale = {}) {
  const auto n = h.size(0);
  const auto classes = w.size(0);
  const double s = o.label_smoothing();
  const auto f32 = h.options().dtype(torch::kFloat);
  ChunkedSums out;
  out.loss = torch::zeros({}, f32);
  if (needs.hidden) {
    out.hidden = torch::empty_like(h);
  }
  if (needs.weight) {
    out.weight = torch::zeros(w.sizes(), f32);
  }
  if (needs.bias) {
    out.bias = torch::zeros({classes}, f32);
  }
  // The products in autocast's dtype, as autocast would run them, with the head's weight
  // cast once for every chunk and both products (autocast itself is off inside).
  const auto device = h.device().type();
  const bool autocast = compat::autocast_enabled(device) && h.scalar_type() != torch::kDouble;
  const auto low = autocast ? compat::autocast_dtype(device) : h.scalar_type();
  const auto w_low = autocast ? w.to(low) : w;
  const auto b_low = autocast && b.defined() ? b.to(low) : b;
  c10::optional<AutocastGuard> plain;
  if (autocast) {
    plain.emplace(device, low, false);
  }
  for (std::int64_t start = 0; start < n; start += o.chunk()) {
    const auto len = std::min(o.chunk(), n - start);
    const auto hc = h.narrow(0, start, len).to(autocast ? low : h.scalar_type());
    const auto tc = t.narrow(0, start, len);
    const auto valid = tc.ne(o.ignore_index());
    const auto target = tc.masked_fill(valid.logical_not(), 0);
    // The chunk's logits (under autocast a bf16/fp16 product), then float32 for the rest.
    auto z = b_low.defined() ? torch::addmm(b_low, hc, w_low.t()) : torch::mm(hc, w_low.t());
    z = z.to(torch::kFloat);
    const auto lse = z.logsumexp(1);
    auto token = lse - z.gather(1, target.unsqueeze(1)).squeeze(1);
    if (s > 0) {
      token = (1 - s) * token + s * (lse - z.mean(1));
    }
    const auto kept = valid.to(torch::kFloat);
    out.loss += (token * kept).sum();
    if (!needs.any()) {
      continue;
    }
    // d(token loss)/d(logits) = softmax - (1 - s) one-hot - s / classes, zero where ignored.
    auto g = z.sub_(lse.unsqueeze(1)).exp_();
    g.scatter_add_(1, target.unsqueeze(1), torch::full({len, 1}, -(1 - s), f32));
    if (s > 0) {
      g.sub_(s / static_cast<double>(classes));
    }
    g.mul_(kept.unsqueeze(1));
    if (grad_scale.defined()) {
      g.mul_(grad_scale);
    }
    if (needs.bias) {
      out.bias += g.sum(0);
    }
    const auto g_low = g.to(hc.scalar_type());  // as the forward's product
    if (needs.hidden) {
      out.hidden.narrow(0, start, len).copy_(torch::mm(g_low, w_low.to(hc.scalar_type())));
    }
    if (needs.weight) {
      out.weight += torch::mm(g_low.t(), hc).to(torch::kFloat);
    }
  }
  return out;
}

struct LinearCrossEntropyFunction : torch::autograd::Function<LinearCrossEntropyFunction> {
  // `b`: the bias, or an empty tensor for none (apply takes defined tensors only).
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& h, const torch::Tensor& w,
                               const torch::Tensor& b, const torch::Tensor& t,
                               const LinearCrossEntropyOptions& o, Needs needs,
                               std::int64_t counted) {
    const auto bias = b.numel() > 0 ? b : torch::Tensor();
    auto sums = chunked_sums(h, w, bias, t, o, o.recompute() ? Needs{} : needs);
    const double divisor =
        o.reduction() == LinearCrossEntropyReduction::Mean ? static_cast<double>(counted) : 1.0;
    ctx->saved_data["divisor"] = divisor;
    if (o.recompute()) {
      // The inputs, and what backward needs to run the chunks again.
      ctx->save_for_backward({h, w, b, t});
      ctx->saved_data["chunk"] = o.chunk();
      ctx->saved_data["ignore_index"] = o.ignore_index();
      ctx->saved_data["label_smoothing"] = o.label_smoothing();
      ctx->saved_data["needs"] = std::vector<bool>{needs.hidden, needs.weight, needs.bias};
      const auto device = h.device().type();
      ctx->saved_data["autocast"] = compat::autocast_enabled(device);
      ctx->saved_data["autocast_dtype"] = static_cast<std::int64_t>(compat::autocast_dtype(device));
    } else {
      ctx->save_for_backward({sums.hidden, sums.weight, sums.bias});
    }
    return sums.loss / divisor;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // A mean over no counted token (every target ignored, or no token) is NaN, as
    // cross_entropy's; its gradient sums are zeros, and stay zeros, as cross_entropy's do.
    const double divisor = ctx->saved_data["divisor"].toDouble();
    const auto scale = grads[0].to(torch::kFloat) / (divisor == 0 ? 1.0 : divisor);
    auto saved = ctx->get_saved_variables();
    bool scaled_already = false;
    if (ctx->saved_data.count("chunk") > 0) {
      const auto o = LinearCrossEntropyOptions()
                         .chunk(ctx->saved_data["chunk"].toInt())
                         .ignore_index(ctx->saved_data["ignore_index"].toInt())
                         .label_smoothing(ctx->saved_data["label_smoothing"].toDouble());
      const auto flags = ctx->saved_data["needs"].toBoolList();
      const auto& b = saved[2];
      // The chunks run again under the forward's autocast state, the loss's gradient (a
      // loss scale among it) applied before the products.
      AutocastGuard autocast(saved[0].device().type(),
                             static_cast<torch::Dtype>(ctx->saved_data["autocast_dtype"].toInt()),
                             ctx->saved_data["autocast"].toBool());
      auto sums = chunked_sums(saved[0], saved[1], b.numel() > 0 ? b : torch::Tensor(), saved[3], o,
                               Needs{flags.get(0), flags.get(1), flags.get(2)}, scale);
      saved = {sums.hidden, sums.weight, sums.bias};
      scaled_already = true;
    }
    // The scale stays a float32 scalar: cast to float16, a loss scale of 65536 is infinite.
    auto scaled = [&](const torch::Tensor& g, bool needed) {
      if (!g.defined() || !needed) {
        return torch::Tensor();
      }
      return scaled_already ? g : g * scale;
    };
    return {scaled(saved[0], ctx->needs_input_grad(0)),
            scaled(saved[1], ctx->needs_input_grad(1)),
            scaled(saved[2], ctx->needs_input_grad(2)),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace

torch::Tensor linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                   const torch::Tensor& bias, const torch::Tensor& targets,
                                   const LinearCrossEntropyOptions& options) {
  frugal::detail::check_at_least(options.chunk(), 1, "linear_cross_entropy: chunk");
  FRUGAL_CHECK(options.label_smoothing() >= 0 && options.label_smoothing() <= 1,
               "frugal: linear_cross_entropy: label_smoothing must be in [0, 1], got ",
               options.label_smoothing());
  FRUGAL_CHECK(hidden.defined() && hidden.dim() >= 1 && weight.defined() && weight.dim() == 2 &&
                   hidden.size(-1) == weight.size(1),
               "frugal: linear_cross_entropy: hidden [..., H] and weight [classes, H] do not "
               "match: hidden ",
               hidden.defined() ? hidden.sizes() : torch::IntArrayRef{}, ", weight ",
               weight.defined() ? weight.sizes() : torch::IntArrayRef{});
  FRUGAL_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)),
               "frugal: linear_cross_entropy: bias of shape ", bias.sizes(), " for ",
               weight.size(0), " classes");
  const auto h = hidden.reshape({-1, hidden.size(-1)});
  FRUGAL_CHECK(
      targets.defined() && targets.numel() == h.size(0) && targets.scalar_type() == torch::kLong,
      "frugal: linear_cross_entropy: targets must be ", h.size(0), " class indices (int64), got ",
      targets.defined() ? targets.numel() : 0, " of type ",
      targets.defined() ? c10::toString(targets.scalar_type()) : "none");
  const auto t = targets.reshape({-1});
  Needs needs;
  if (torch::GradMode::is_enabled()) {
    needs = {hidden.requires_grad(), weight.requires_grad(),
             bias.defined() && bias.requires_grad()};
  }
  const auto counted = check_targets(t, weight.size(0), options.ignore_index());
  if (!needs.any()) {  // no graph: the loss alone
    const auto sums = chunked_sums(h, weight, bias, t, options, needs);
    return options.reduction() == LinearCrossEntropyReduction::Mean
               ? sums.loss / static_cast<double>(counted)
               : sums.loss;
  }
  return LinearCrossEntropyFunction::apply(
      h, weight, bias.defined() ? bias : torch::empty({0}, weight.options()), t, options, needs,
      counted);
}

}  // namespace frugal::nn
