// The one table of traits that cannot meet in a trainer, and its check.
#pragma once

#include <string>
#include <vector>

#include "frugal/traits.h"

namespace frugal::detail {

/// A party to the step whose traits the table checks: a policy ("'clip-grad'") or the
/// trainer's optimizer ("the optimizer").
struct Party {
  std::string name;  ///< as errors show it, quoted where it is a policy's name
  Traits traits;
};

/// Two traits that cannot meet: `first` in a party, `second` in another added after it
/// (or in either order). `why` names them {a} (the party with `first`) and {b}.
struct CompatibilityRule {
  Trait first;
  Trait second;
  bool either_order;
  const char* why;
};

/// Every refused pair.
const std::vector<CompatibilityRule>& compatibility_rules();

/// Throws, naming both parties and the rule, when `added` cannot join `present` (the
/// parties already there, in the order they came: the optimizer first).
void check_compatible(const std::vector<Party>& present, const Party& added);

}  // namespace frugal::detail
