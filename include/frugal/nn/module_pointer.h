// The shared pointer behind the ways a LibTorch program holds a module.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <functional>
#include <memory>
#include <type_traits>

namespace frugal::nn {

/// The shared pointer of a module holder (torch::nn::Linear, a TORCH_MODULE), or the shared
/// pointer itself (`std::make_shared<Net>()` for `struct Net : torch::nn::Module`).
template <typename T>
std::shared_ptr<T> module_pointer(const std::shared_ptr<T>& p) {
  static_assert(std::is_base_of_v<torch::nn::Module, T>,
                "frugal: a model is a module holder or a std::shared_ptr to a class derived "
                "from torch::nn::Module");
  return p;
}
template <typename T>
std::shared_ptr<T> module_pointer(const torch::nn::ModuleHolder<T>& holder) {
  return holder.ptr();
}
/// Whether T is a LibTorch module holder (torch::nn::Linear, a TORCH_MODULE).
template <typename T, typename = void>
struct IsModuleHolder : std::false_type {};
template <typename T>
struct IsModuleHolder<T, std::void_t<typename T::ContainedType>>
    : std::is_base_of<torch::nn::ModuleHolder<typename T::ContainedType>, T> {};
template <typename T>
constexpr bool is_module_holder_v = IsModuleHolder<T>::value;

template <typename T, typename = std::enable_if_t<!is_module_holder_v<T>>>
void module_pointer(const T&) {
  static_assert(sizeof(T) == 0,
                "frugal: a model is a module holder (torch::nn::Linear, a TORCH_MODULE) or a "
                "std::shared_ptr to a class derived from torch::nn::Module "
                "(std::make_shared<Net>())");
}

/// Whether `p->forward(tensor)` compiles for a module pointer P.
template <typename P, typename = void>
struct HasTensorForward : std::false_type {};
template <typename P>
struct HasTensorForward<
    P, std::void_t<decltype(std::declval<P&>()->forward(std::declval<const torch::Tensor&>()))>>
    : std::true_type {};

/// The model's forward(Tensor) as a function that keeps the model alive; `model` is held as
/// module_pointer takes it. A forward that returns a module holder's output type other than
/// a Tensor is converted to one.
///
/// Example:
///   torch::nn::Linear linear(4, 2);
///   auto forward = frugal::nn::tensor_forward(linear);
///   torch::Tensor y = forward(torch::ones({3, 4}));
template <typename Model>
std::function<torch::Tensor(const torch::Tensor&)> tensor_forward(const Model& model) {
  auto ptr = module_pointer(model);
  static_assert(HasTensorForward<decltype(ptr)>::value,
                "frugal: the model has no forward(const torch::Tensor&); for a forward of "
                "other arguments give the Trainer a function of the batch (the constructor "
                "taking a BatchForwardFn)");
  return [ptr](const torch::Tensor& x) { return torch::Tensor(ptr->forward(x)); };
}

}  // namespace frugal::nn
