#include "frugal/error.h"

#include "compat.h"

namespace frugal {

// No backtrace: what() is the message, as a user should read it.
Error::Error(std::string message) : c10::Error(std::move(message), compat::no_backtrace()) {}

std::string error_message(const std::exception& error) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&error);
  return c10_error != nullptr ? c10_error->what_without_backtrace() : error.what();
}

}  // namespace frugal
