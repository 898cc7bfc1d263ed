// Any loss a LibTorch program has, as a function of (output, targets).
#pragma once

#include <ATen/Functions.h>
#include <torch/types.h>

#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace frugal {

/// A loss of a forward's output and the targets.
using LossFn =
    std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& targets)>;

/// A torch::nn::functional loss, (input, target, const Options&), as a LossFn that calls it
/// with default options.
///
/// Example:
///   frugal::LossFn loss = frugal::loss_with_defaults(torch::nn::functional::cross_entropy);
template <typename Options>
LossFn loss_with_defaults(torch::Tensor (*fn)(const torch::Tensor&, const torch::Tensor&,
                                              const Options&)) {
  static_assert(std::is_default_constructible_v<Options>,
                "frugal: the loss's options have no default; pass a lambda that sets them");
  return [fn](const torch::Tensor& output, const torch::Tensor& targets) {
    return fn(output, targets, Options{});
  };
}

/// An ATen loss (torch::nll_loss, torch::mse_loss, torch::cross_entropy_loss, ...) as a
/// LossFn that calls it with its defaults. ATen's losses take their options as trailing
/// parameters with defaults, which a function pointer does not carry, so these are known by
/// name: nll_loss, cross_entropy_loss, mse_loss, l1_loss, smooth_l1_loss, huber_loss,
/// binary_cross_entropy, binary_cross_entropy_with_logits, kl_div, soft_margin_loss. Any
/// other function throws std::invalid_argument.
template <typename... Rest>
LossFn loss_with_defaults(torch::Tensor (*fn)(const torch::Tensor&, const torch::Tensor&,
                                              Rest...)) {
  using Fn = decltype(fn);
#define FRUGAL_ATEN_LOSS(name)                                               \
  if constexpr (std::is_same_v<Fn, decltype(&at::name)>) {                   \
    if (fn == &at::name) {                                                   \
      return [](const torch::Tensor& output, const torch::Tensor& targets) { \
        return at::name(output, targets);                                    \
      };                                                                     \
    }                                                                        \
  }
  FRUGAL_ATEN_LOSS(nll_loss)
  FRUGAL_ATEN_LOSS(cross_entropy_loss)
  FRUGAL_ATEN_LOSS(mse_loss)
  FRUGAL_ATEN_LOSS(l1_loss)
  FRUGAL_ATEN_LOSS(smooth_l1_loss)
  FRUGAL_ATEN_LOSS(huber_loss)
  FRUGAL_ATEN_LOSS(binary_cross_entropy)
  FRUGAL_ATEN_LOSS(binary_cross_entropy_with_logits)
  FRUGAL_ATEN_LOSS(kl_div)
  FRUGAL_ATEN_LOSS(soft_margin_loss)
#undef FRUGAL_ATEN_LOSS
  throw std::invalid_argument(
      "frugal: the loss function takes parameters after (output, targets) whose defaults a "
      "function pointer does not carry; pass a lambda that calls it, e.g. "
      "[](const torch::Tensor& o, const torch::Tensor& t) { return my_loss(o, t); }");
}

/// What make_loss says of anything else.
template <typename NotALoss>
LossFn loss_with_defaults(NotALoss) {
  static_assert(sizeof(NotALoss) == 0,
                "frugal: a loss is a callable of (const torch::Tensor& output, const "
                "torch::Tensor& targets) returning a Tensor, a torch::nn::functional loss "
                "(cross_entropy, nll_loss, ...) or an ATen loss (torch::nll_loss, ...)");
  return {};
}

/// Makes a LossFn of any loss a LibTorch program has: a callable of (output, targets)
/// (a lambda, a functor, a function), a torch::nn::functional loss called with its default
/// options (cross_entropy, nll_loss, mse_loss), or an ATen loss called with its defaults
/// (torch::nll_loss, torch::mse_loss, torch::cross_entropy_loss, ...).
///
/// Example:
///   frugal::LossFn loss = frugal::make_loss(torch::nll_loss);
template <typename Loss>
LossFn make_loss(Loss&& loss) {
  using L = std::decay_t<Loss>;
  if constexpr (std::is_invocable_r_v<torch::Tensor, L&, const torch::Tensor&,
                                      const torch::Tensor&>) {
    return LossFn(std::forward<Loss>(loss));
  } else {
    return loss_with_defaults(loss);
  }
}

}  // namespace frugal
