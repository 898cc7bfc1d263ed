#include "frugal/optim/state_format.h"

#include <fmt/format.h>

namespace frugal::optim {

std::string StateFormat::describe() const {
  if (!quantized()) {
    return "float32";
  }
  return fmt::format("{}{}-bit{}", factored ? "factored " : "", bits,
                     stochastic ? " (stochastic codes)" : "");
}

}  // namespace frugal::optim
