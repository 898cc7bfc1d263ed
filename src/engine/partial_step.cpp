#include "partial_step.h"

#include <fmt/format.h>

#include "step_guard.h"

namespace frugal::detail {

PartialStepError partial_step_error(const torch::nn::Module& module, const std::string& failed,
                                    const std::vector<torch::Tensor>& changed,
                                    const std::exception& error, const std::string& after) {
  auto names = parameter_names(module, changed);
  std::string list;
  for (const auto& name : names) {
    list += (list.empty() ? "" : ", ") + name;
  }
  auto what = fmt::format(
      "frugal: {} failed after changing {} parameter(s): {}. Those (values or optimizer state) "
      "hold new values; {}. The error was: {}",
      failed, names.size(), list, after, error_message(error));
  return PartialStepError(what, std::move(names));
}

}  // namespace frugal::detail
