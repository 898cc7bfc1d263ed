#include "compatibility.h"

#include <fmt/format.h>

#include "frugal/error.h"

namespace frugal {

const char* trait_name(Trait trait) {
  switch (trait) {
    case Trait::GradReady:
      return "grad-ready";
    case Trait::AllGradients:
      return "all-gradients";
    case Trait::Retries:
      return "retries";
    case Trait::UpdatesInBackward:
      return "updates-in-backward";
    case Trait::OwnsNonFinite:
      return "owns-non-finite";
    case Trait::SharesGradients:
      return "shares-gradients";
    case Trait::KeepsGradients:
      return "keeps-gradients";
    case Trait::ShardsParameters:
      return "shards-parameters";
    case Trait::UpdatesSharesInBackward:
      return "updates-shares-in-backward";
  }
  return "unknown";
}

namespace detail {

const std::vector<CompatibilityRule>& compatibility_rules() {
  static const std::vector<CompatibilityRule> rules = {
      {Trait::AllGradients, Trait::UpdatesInBackward, true,
       "{a} needs every gradient of a step before any parameter changes, but {b} updates "
       "parameters during backward; use one of them"},
      {Trait::SharesGradients, Trait::UpdatesInBackward, true,
       "{a} averages gradients over the processes during backward, but {b} updates "
       "parameters with them before they are averaged; use one of them"},
      {Trait::AllGradients, Trait::SharesGradients, false,
       "{b} shares gradients among the processes and comes first: add DataParallel before "
       "{a}, which reads every gradient and must see them averaged over the ranks"},
      {Trait::Retries, Trait::SharesGradients, false,
       "{b} shares gradients among the processes and comes first: add DataParallel before "
       "{a}, which retries steps and must do so after the gradients are shared"},
      {Trait::AllGradients, Trait::KeepsGradients, true,
       "{a} reads every gradient, but under {b} each rank keeps only its share of them "
       "(ZeRO stage 2); use stage 1"},
  };
  return rules;
}

namespace {

[[noreturn]] void refuse(const CompatibilityRule& rule, const Party& a, const Party& b) {
  const auto why =
      fmt::format(fmt::runtime(rule.why), fmt::arg("a", a.name), fmt::arg("b", b.name));
  throw Error(fmt::format("frugal: {} and {} cannot work together (rule {} / {}): {}", a.name,
                          b.name, trait_name(rule.first), trait_name(rule.second), why));
}

}  // namespace

void check_compatible(const std::vector<Party>& present, const Party& added) {
  for (const auto& rule : compatibility_rules()) {
    for (const auto& earlier : present) {
      if (earlier.traits.has(rule.first) && added.traits.has(rule.second)) {
        refuse(rule, earlier, added);
      }
      if (rule.either_order && added.traits.has(rule.first) && earlier.traits.has(rule.second)) {
        refuse(rule, added, earlier);
      }
    }
  }
}

}  // namespace detail
}  // namespace frugal
