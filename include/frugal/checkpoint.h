// Activation checkpointing for LibTorch C++: drop a block's activations in forward and
// recompute them in backward.
#pragma once

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace frugal {

struct CheckpointOptions {
  /// Save the CPU generator's state (and the CUDA generators' of the devices involved) in
  /// forward and restore it for the recompute, so dropout masks match. The caller's RNG
  /// stream afterwards is as if no recompute had happened.
  TORCH_ARG(bool, preserve_rng_state) = true;
  /// Tensors the block uses besides its inputs, usually its module's parameters. They get
  /// gradients even when no input requires grad.
  TORCH_ARG(std::vector<torch::Tensor>, params) = {};
  /// Tensors the block changes in place during its forward, as BatchNorm's running
  /// statistics and batch counter: copied aside before the recompute and put back after it,
  /// so they change once per forward, as without checkpointing. frugal::nn::call,
  /// nn::Checkpoint and checkpoint_sequential name the block's buffers themselves (those
  /// of its modules in training mode).
  TORCH_ARG(std::vector<torch::Tensor>, buffers) = {};
  /// The block's name, as errors and measurements give it (CheckpointPolicy sets the
  /// module's qualified name, e.g. "blocks.3").
  TORCH_ARG(std::string, name) = "";
};

/// The function of a checkpointed block over tensors.
using TensorsFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

/// Runs `fn(inputs)` without keeping its activations and recomputes it during backward,
/// under the autocast state and (by default) the RNG state that forward saw, leaving the
/// options' buffers as the recompute found them. Inputs may
/// be undefined or not require grad; outputs are the block's tensors.
///
/// Errors: a second backward through a checkpoint whose saved inputs were freed; backward
/// with create_graph=true (double backward is not supported); a block none of whose outputs
/// requires grad in the recompute while some input or parameter does.
std::vector<torch::Tensor> checkpoint_tensors(TensorsFn fn,
                                              const std::vector<torch::Tensor>& inputs,
                                              const CheckpointOptions& options = {});

/// How a checkpointed block's result splits into tensors (the block's outputs, recomputed in
/// backward) and the rest (kept from the forward run): for a Tensor, a std::vector of
/// Tensors and a std::tuple mixing Tensors with other values. Specialize it for a result
/// type of your own with the same two functions: `tensors(r)`, the result's tensors in
/// order, and `rebuild(r, t)`, the result `r` with its tensors replaced by `t`'s.
///
/// Example:
///   struct Scored { torch::Tensor y; double score; };
///   template <>
///   struct frugal::CheckpointResult<Scored> {
///     static std::vector<torch::Tensor> tensors(const Scored& r) { return {r.y}; }
///     static Scored rebuild(const Scored& r, const std::vector<torch::Tensor>& t) {
///       return {t.at(0), r.score};
///     }
///   };
template <typename R>
struct CheckpointResult {
  static_assert(std::is_same_v<R, torch::Tensor>,
                "a checkpointed function returns a Tensor, a std::vector of Tensors, a "
                "std::tuple, or a type that frugal::CheckpointResult is specialized for");
  static std::vector<torch::Tensor> tensors(const R& r) { return {r}; }
  static R rebuild(const R&, const std::vector<torch::Tensor>& t) { return t.at(0); }
};

template <>
struct CheckpointResult<std::vector<torch::Tensor>> {
  using R = std::vector<torch::Tensor>;
  static R tensors(const R& r) { return r; }
  static R rebuild(const R&, const R& t) { return t; }
};

template <typename... Ts>
struct CheckpointResult<std::tuple<Ts...>> {
  using R = std::tuple<Ts...>;
  static std::vector<torch::Tensor> tensors(const R& r) {
    std::vector<torch::Tensor> out;
    std::apply([&out](const auto&... x) { (push(out, x), ...); }, r);
    return out;
  }
  static R rebuild(const R& r, const std::vector<torch::Tensor>& t) {
    std::size_t next = 0;
    // A braced list runs its elements in order, so tensors are taken in order.
    return std::apply([&](const auto&... x) { return R{pick(x, t, next)...}; }, r);
  }

 private:
  template <typename X>
  static void push(std::vector<torch::Tensor>& out, const X& x) {
    if constexpr (std::is_same_v<X, torch::Tensor>) {
      out.push_back(x);
    }
  }
  template <typename X>
  static X pick(const X& x, const std::vector<torch::Tensor>& t, std::size_t& next) {
    if constexpr (std::is_same_v<X, torch::Tensor>) {
      return t.at(next++);
    } else {
      return x;
    }
  }
};

/// Checkpoints `fn(args...)`. Tensor arguments are the block's inputs; other arguments are
/// copied and passed through to the forward and the recompute. `fn` returns a Tensor, a
/// std::vector of Tensors, a std::tuple mixing Tensors and other values (the others are
/// those of the forward run), or a type CheckpointResult is specialized for.
///
/// Example:
///   auto y = frugal::checkpoint([&](const torch::Tensor& x, double scale) {
///     return block->forward(x) * scale;
///   }, frugal::CheckpointOptions().params(block->parameters()), x, 0.5);
template <typename Fn, typename... Args>
auto checkpoint(Fn fn, const CheckpointOptions& options, const Args&... args) {
  using R = std::decay_t<std::invoke_result_t<Fn&, const Args&...>>;
  using Result = CheckpointResult<R>;
  std::vector<torch::Tensor> inputs;
  auto collect = [&inputs](const auto& a) {
    if constexpr (std::is_same_v<std::decay_t<decltype(a)>, torch::Tensor>) {
      inputs.push_back(a);
    }
  };
  (collect(args), ...);
  // Non-tensor arguments are kept for the recompute; tensor slots are left empty here, the
  // inputs travel through the autograd function.
  auto kept = [](const auto& a) {
    if constexpr (std::is_same_v<std::decay_t<decltype(a)>, torch::Tensor>) {
      return torch::Tensor();
    } else {
      return a;
    }
  };
  auto stored = std::make_shared<std::tuple<std::decay_t<Args>...>>(kept(args)...);
  // The forward's non-tensor results, kept to rebuild the result. Its tensors are dropped:
  // the autograd node owns this closure, and an output held here would own the node back.
  auto first = std::make_shared<std::optional<R>>();
  TensorsFn run = [fn, stored, first](const std::vector<torch::Tensor>& ins) mutable {
    std::size_t next = 0;
    auto argument = [&ins, &next](const auto& a) -> decltype(auto) {
      if constexpr (std::is_same_v<std::decay_t<decltype(a)>, torch::Tensor>) {
        return ins.at(next++);
      } else {
        return a;
      }
    };
    // A braced list runs its elements in order: the tensor inputs are taken in order.
    R r = std::apply(
        [&](const auto&... a) {
          return std::apply(fn, std::tuple<decltype(argument(a))...>{argument(a)...});
        },
        *stored);
    auto tensors = Result::tensors(r);
    if (!first->has_value()) {
      first->emplace(Result::rebuild(r, std::vector<torch::Tensor>(tensors.size())));
    }
    return tensors;
  };
  const auto outs = checkpoint_tensors(std::move(run), inputs, options);
  return Result::rebuild(**first, outs);
}

/// checkpoint(fn, args...) with the default options (no parameters named).
template <
    typename Fn, typename... Args,
    typename = std::enable_if_t<!std::is_same_v<
        std::decay_t<std::tuple_element_t<0, std::tuple<Args..., void*>>>, CheckpointOptions>>>
auto checkpoint(Fn fn, const Args&... args) {
  return checkpoint(std::move(fn), CheckpointOptions(), args...);
}

/// The buffers of `module` and its descendants that are in training mode: what a
/// recompute of it would change a second time (BatchNorm's running statistics), for
/// CheckpointOptions::buffers. Not the codes of weights stored in 8 bits (nn::Int8Weights):
/// the step in backward writes them while the block's backward runs.
std::vector<torch::Tensor> training_buffers(const torch::nn::Module& module);

/// Runs a Sequential in `segments` parts, PyTorch's rule: segments-1 checkpointed chunks of
/// size(seq) / segments modules each, then the rest run plainly. Under no_grad the whole
/// Sequential runs plainly.
torch::Tensor checkpoint_sequential(torch::nn::Sequential& seq, std::int64_t segments,
                                    const torch::Tensor& input, CheckpointOptions options = {});

}  // namespace frugal
