// Activation checkpointing for LibTorch C++: drop a block's activations in forward and
// recompute them in backward.
#pragma once

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <functional>
#include <memory>
#include <optional>
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
std::vector<torch::Tensor> checkpoint_tensors(TensorsFn fn, const std::vector<torch::Tensor>& inputs,
                                              const CheckpointOptions& options = {});

namespace detail {

template <typename T>
constexpr bool is_tensor_v = std::is_same_v<std::decay_t<T>, torch::Tensor>;

// Position of argument I among the tensor arguments.
template <std::size_t I, typename... Args>
constexpr std::size_t tensor_index() {
  constexpr bool flags[] = {is_tensor_v<Args>..., false};
  std::size_t n = 0;
  for (std::size_t i = 0; i < I; ++i) {
    n += flags[i] ? 1 : 0;
  }
  return n;
}

// How a block's result splits into tensors (checkpointed) and the rest (passed through).
template <typename R>
struct Outputs {
  static_assert(is_tensor_v<R>, "a checkpointed function returns a Tensor, a std::vector of "
                                "Tensors or a std::tuple");
  static std::vector<torch::Tensor> tensors(const R& r) { return {r}; }
  static R rebuild(const R&, const std::vector<torch::Tensor>& t) { return t.at(0); }
  static void strip(R& r) { r = torch::Tensor(); }
};

template <>
struct Outputs<std::vector<torch::Tensor>> {
  using R = std::vector<torch::Tensor>;
  static R tensors(const R& r) { return r; }
  static R rebuild(const R&, const R& t) { return t; }
  static void strip(R& r) { r.clear(); }
};

template <typename... Ts>
struct Outputs<std::tuple<Ts...>> {
  using R = std::tuple<Ts...>;
  static std::vector<torch::Tensor> tensors(const R& r) {
    std::vector<torch::Tensor> out;
    std::apply([&](const auto&... x) { (push(out, x), ...); }, r);
    return out;
  }
  static R rebuild(const R& first, const std::vector<torch::Tensor>& t) {
    return rebuild_impl(first, t, std::index_sequence_for<Ts...>{});
  }
  static void strip(R& r);

 private:
  template <typename X>
  static void push(std::vector<torch::Tensor>& out, const X& x) {
    if constexpr (is_tensor_v<X>) {
      out.push_back(x);
    }
  }
  template <std::size_t... I>
  static R rebuild_impl(const R& first, const std::vector<torch::Tensor>& t,
                        std::index_sequence<I...>) {
    return R{pick<I>(first, t)...};
  }
  template <std::size_t I>
  static auto pick(const R& first, const std::vector<torch::Tensor>& t) {
    using X = std::tuple_element_t<I, R>;
    if constexpr (is_tensor_v<X>) {
      return t.at(tensor_index<I, Ts...>());
    } else {
      return std::get<I>(first);
    }
  }
};

inline void clear_if_tensor(torch::Tensor& t) { t = torch::Tensor(); }
template <typename T>
void clear_if_tensor(T&) {}

template <typename... Ts>
void Outputs<std::tuple<Ts...>>::strip(R& r) {
  std::apply([](auto&... x) { (clear_if_tensor(x), ...); }, r);
}

// Argument I of a call: the recompute's input for a tensor, the stored value otherwise.
template <std::size_t I, typename... Ts>
decltype(auto) argument(const std::tuple<Ts...>& stored, const std::vector<torch::Tensor>& ins) {
  if constexpr (is_tensor_v<std::tuple_element_t<I, std::tuple<Ts...>>>) {
    return ins.at(tensor_index<I, Ts...>());
  } else {
    return std::get<I>(stored);
  }
}

template <typename Fn, typename... Ts, std::size_t... I>
auto call_with(Fn& fn, const std::tuple<Ts...>& stored, const std::vector<torch::Tensor>& ins,
               std::index_sequence<I...>) {
  return fn(argument<I>(stored, ins)...);
}

}  // namespace detail

/// Checkpoints `fn(args...)`. Tensor arguments are the block's inputs; other arguments are
/// copied and passed through to the forward and the recompute. `fn` returns a Tensor, a
/// std::vector of Tensors, or a std::tuple mixing Tensors and other values (the others are
/// those of the forward run).
///
/// Example:
///   auto y = frugal::checkpoint([&](const torch::Tensor& x, double scale) {
///     return block->forward(x) * scale;
///   }, frugal::CheckpointOptions().params(block->parameters()), x, 0.5);
template <typename Fn, typename... Args>
auto checkpoint(Fn fn, const CheckpointOptions& options, const Args&... args) {
  using R = std::decay_t<std::invoke_result_t<Fn&, const Args&...>>;
  std::vector<torch::Tensor> inputs;
  auto collect = [&inputs](const auto& a) {
    if constexpr (detail::is_tensor_v<decltype(a)>) {
      inputs.push_back(a);
    }
  };
  (collect(args), ...);
  // Non-tensor arguments are kept for the recompute; tensor slots are left empty here, the
  // inputs travel through the autograd function.
  auto stored = std::make_shared<std::tuple<std::decay_t<Args>...>>(args...);
  std::apply([](auto&... a) { (detail::clear_if_tensor(a), ...); }, *stored);
  // The forward's non-tensor results, kept to rebuild the result. Its tensors are dropped:
  // the autograd node owns this closure, and an output held here would own the node back.
  auto first = std::make_shared<std::optional<R>>();
  TensorsFn run = [fn, stored, first](const std::vector<torch::Tensor>& ins) mutable {
    R r = detail::call_with(fn, *stored, ins, std::index_sequence_for<Args...>{});
    auto tensors = detail::Outputs<R>::tensors(r);
    if (!first->has_value()) {
      detail::Outputs<R>::strip(r);
      first->emplace(std::move(r));
    }
    return tensors;
  };
  const auto outs = checkpoint_tensors(std::move(run), inputs, options);
  return detail::Outputs<R>::rebuild(**first, outs);
}

/// checkpoint(fn, args...) with the default options (no parameters named).
template <typename Fn, typename... Args,
          typename = std::enable_if_t<!std::is_same_v<
              std::decay_t<std::tuple_element_t<0, std::tuple<Args..., void*>>>, CheckpointOptions>>>
auto checkpoint(Fn fn, const Args&... args) {
  return checkpoint(std::move(fn), CheckpointOptions(), args...);
}

/// The buffers of `module` and its descendants that are in training mode: what a
/// recompute of it would change a second time (BatchNorm's running statistics), for
/// CheckpointOptions::buffers.
std::vector<torch::Tensor> training_buffers(const torch::nn::Module& module);

/// Runs a Sequential in `segments` parts, PyTorch's rule: segments-1 checkpointed chunks of
/// size(seq) / segments modules each, then the rest run plainly. Under no_grad the whole
/// Sequential runs plainly.
torch::Tensor checkpoint_sequential(torch::nn::Sequential& seq, std::int64_t segments,
                                    const torch::Tensor& input,
                                    CheckpointOptions options = {});

}  // namespace frugal
