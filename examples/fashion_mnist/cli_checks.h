// Checks of the example's command-line values, with messages that name the bad value.
#pragma once

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cmath>
#include <string>

namespace fashion {

// A number above (strictly or not) a bound, with a message that names the bad value.
inline CLI::Validator number_above(double bound, bool strict) {
  const std::string rule = (strict ? "> " : ">= ") + fmt::format("{}", bound);
  return CLI::Validator(
      [bound, strict, rule](const std::string& text) {
        try {
          const double v = std::stod(text);
          if (!std::isfinite(v)) {
            return "must be a finite number, got " + text;
          }
          return (strict ? v > bound : v >= bound) ? std::string()
                                                   : "must be " + rule + ", got " + text;
        } catch (const std::exception&) {
          return "must be a number, got '" + text + "'";
        }
      },
      rule);
}

// More intra-op threads than this is a typo; LibTorch would try to start them all.
inline constexpr int kMaxThreads = 256;

inline const CLI::Validator kPositive = number_above(0, true);
inline const CLI::Validator kNonNegative = number_above(0, false);

// A seed: decimal digits that fit 64 bits, so that no two spellings become one seed.
inline const CLI::Validator kSeed(
    [](const std::string& text) {
      const bool digits = !text.empty() && text.size() <= 20 &&
                          text.find_first_not_of("0123456789") == std::string::npos;
      if (digits && (text.size() < 20 || text <= "18446744073709551615")) {
        return std::string();
      }
      return "must be an integer from 0 to 2^64-1, got '" + text + "'";
    },
    "0..2^64-1");

}  // namespace fashion
