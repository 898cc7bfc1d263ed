// frugal's exception types: clean messages, still catchable as c10::Error.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <string>
#include <vector>

namespace frugal {

/// Every error frugal raises itself: bad values (the message names them, e.g.
/// `micro_batch must be >= 1, got 0`), refused combinations, files that do not fit. It derives from
/// c10::Error (and so from std::exception): code that catches LibTorch's errors catches frugal's
/// too. Unlike TORCH_CHECK's errors, what() is the message alone, without LibTorch's C++ backtrace.
/// Errors raised inside LibTorch (a shape mismatch in the model, an out-of-memory error)
/// pass through frugal with their own types; `frugal::error_message` strips their backtrace.
///
/// Example:
///   try { trainer.step(batch); } catch (const frugal::Error& e) { fmt::print("{}\n", e.what()); }
class Error : public c10::Error {
 public:
  explicit Error(std::string message);
  /// The message as frugal wrote it (LibTorch 1.13 would add a newline).
  const char* what() const noexcept override { return msg().c_str(); }
};

/// A step failed after some parameters had been changed: by a policy during backward (the
/// optimizer step in backward), or by a LibTorch optimizer that failed midway through its
/// step. Those parameters (values or optimizer state) hold new values, all others the old
/// ones. The trainer's counters are as before the step and the accumulation window's
/// gradients are dropped. The trainer then refuses to step until the caller decides: load
/// a saved state, or call Trainer::accept_partial_update(). `updated` names the parameters.
class PartialStepError : public Error {
 public:
  PartialStepError(const std::string& what, std::vector<std::string> updated)
      : Error(what), updated(std::move(updated)) {}
  std::vector<std::string> updated;
};

/// An exception's message without LibTorch's C++ backtrace.
std::string error_message(const std::exception& error);

}  // namespace frugal

/// Throws frugal::Error with the arguments after the condition, concatenated as
/// c10::str does, when `cond` is false.
#define FRUGAL_CHECK(cond, ...)                       \
  do {                                                \
    if (C10_UNLIKELY(!(cond))) {                      \
      throw ::frugal::Error(::c10::str(__VA_ARGS__)); \
    }                                                 \
  } while (false)

namespace frugal::detail {

/// Throws frugal::Error "frugal: <what> must be >= <least>, got <value>" when `value` is
/// below `least`: the check of a count or a size in options.
template <typename T, typename U>
void check_at_least(const T& value, const U& least, const char* what) {
  FRUGAL_CHECK(value >= least, "frugal: ", what, " must be >= ", least, ", got ", value);
}

}  // namespace frugal::detail
