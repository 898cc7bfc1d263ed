// The halt after a partial update: the trainer refuses to step until the caller decides.
#pragma once

#include <string>

#include "frugal/error.h"

namespace frugal::detail {

/// Set when a step changed some parameters before failing (PartialStepError); step(),
/// trial() and flush() then refuse, until the caller accepts the model as it is or puts a
/// whole saved state back.
class StepHalt {
 public:
  void halt(std::string why) { why_ = std::move(why); }
  void lift() { why_.clear(); }
  /// Why the trainer refuses to step, or empty.
  const std::string& why() const { return why_; }
  /// Throws while halted, saying why and what lifts it.
  void check() const {
    FRUGAL_CHECK(why_.empty(), "frugal: the trainer refuses to go on after a partial update (",
                 why_,
                 "); load a saved model and optimizer state, or call "
                 "accept_partial_update() to train on from the model as it is");
  }

 private:
  std::string why_;
};

}  // namespace frugal::detail
