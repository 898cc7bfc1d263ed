#include "frugal/error.h"

#include "frugal/compat.h"

namespace frugal {

// No backtrace: what() is the message, as a user should read it.
Error::Error(std::string message) : c10::Error(std::move(message), compat::no_backtrace()) {}

}  // namespace frugal
