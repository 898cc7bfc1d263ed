// The shared pointer behind the ways a LibTorch program holds a module.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

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
namespace detail {
template <typename T, typename = void>
struct IsModuleHolder : std::false_type {};
template <typename T>
struct IsModuleHolder<T, std::void_t<typename T::ContainedType>>
    : std::is_base_of<torch::nn::ModuleHolder<typename T::ContainedType>, T> {};
}  // namespace detail

template <typename T, typename = std::enable_if_t<!detail::IsModuleHolder<T>::value>>
void module_pointer(const T&) {
  static_assert(sizeof(T) == 0,
                "frugal: a model is a module holder (torch::nn::Linear, a TORCH_MODULE) or a "
                "std::shared_ptr to a class derived from torch::nn::Module "
                "(std::make_shared<Net>())");
}

}  // namespace frugal::nn
