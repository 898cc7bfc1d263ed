#include "frugal/policy/lr_schedule.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

#include "frugal/error.h"
#include "frugal/state/archive.h"

namespace frugal {

double lr_factor(const LrScheduleOptions& o, std::int64_t t) {
  FRUGAL_CHECK(t >= 0, "frugal: lr_factor needs a step count >= 0, got ", t);
  if (t < o.warmup_steps()) {
    return static_cast<double>(t + 1) / static_cast<double>(o.warmup_steps());
  }
  const auto s = static_cast<double>(t - o.warmup_steps());
  const auto n = static_cast<double>(o.total_steps() - o.warmup_steps());
  switch (o.decay()) {
    case LrDecay::Constant:
      return 1.0;
    case LrDecay::Linear:
      return 1.0 - (1.0 - o.min_factor()) * std::min(s / n, 1.0);
    case LrDecay::Cosine:
      return o.min_factor() +
             (1.0 - o.min_factor()) * (1.0 + std::cos(M_PI * std::min(s / n, 1.0))) / 2.0;
    case LrDecay::Step:
      return std::pow(o.gamma(), std::floor(s / static_cast<double>(o.step_size())));
  }
  return 1.0;
}

LrSchedule::LrSchedule(LrScheduleOptions options) : options_(options) {
  const auto& o = options_;
  detail::check_at_least(o.warmup_steps(), 0, "LrSchedule warmup_steps");
  const bool to_total = o.decay() == LrDecay::Linear || o.decay() == LrDecay::Cosine;
  FRUGAL_CHECK(!to_total || o.total_steps() > o.warmup_steps(), "frugal: LrSchedule total_steps (",
               o.total_steps(), ") must be greater than warmup_steps (", o.warmup_steps(), ")");
  FRUGAL_CHECK(o.min_factor() >= 0.0 && o.min_factor() <= 1.0,
               "frugal: LrSchedule min_factor must be in [0, 1], got ", o.min_factor());
  FRUGAL_CHECK(o.decay() != LrDecay::Step || o.step_size() >= 1,
               "frugal: LrSchedule step_size must be >= 1, got ", o.step_size());
  FRUGAL_CHECK(o.decay() != LrDecay::Step || (o.gamma() > 0.0 && o.gamma() <= 1.0),
               "frugal: LrSchedule gamma must be in (0, 1], got ", o.gamma());
}

void LrSchedule::on_add(PolicyPort& port) {
  port_ = &port;
  base_lrs_.clear();
  for (const auto& group : port.optimizer().param_groups()) {
    base_lrs_.push_back(group.options().get_lr());
  }
}

void LrSchedule::on_step_begin(StepContext& ctx) {
  // Every batch of a window sets the rate of the step that ends it.
  const double factor = lr_factor(options_, port_->steps());
  auto& groups = ctx.optimizer.param_groups();
  FRUGAL_CHECK(groups.size() == base_lrs_.size(), "frugal: LrSchedule knows ", base_lrs_.size(),
               " param groups, the optimizer now has ", groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g) {
    groups[g].options().set_lr(base_lrs_[g] * factor);
  }
}

namespace {

// The options as (name, value) pairs: saved, and compared when a state is loaded.
std::vector<std::pair<std::string, double>> option_values(const LrScheduleOptions& o) {
  return {{"decay", static_cast<double>(o.decay())},
          {"warmup_steps", static_cast<double>(o.warmup_steps())},
          {"total_steps", static_cast<double>(o.total_steps())},
          {"min_factor", o.min_factor()},
          {"step_size", static_cast<double>(o.step_size())},
          {"gamma", o.gamma()}};
}

}  // namespace

void LrSchedule::save_state(torch::serialize::OutputArchive& archive) const {
  for (const auto& [name, value] : option_values(options_)) {
    state::write_double(archive, name, value);
  }
  state::write_int(archive, "groups", static_cast<std::int64_t>(base_lrs_.size()));
  for (std::size_t g = 0; g < base_lrs_.size(); ++g) {
    state::write_double(archive, "base_lr/" + std::to_string(g), base_lrs_[g]);
  }
}

void LrSchedule::load_state(torch::serialize::InputArchive& archive) {
  // Another schedule is another run: its rates would not continue the saved ones.
  for (const auto& [name, value] : option_values(options_)) {
    const double saved = state::read_double(archive, name);
    FRUGAL_CHECK(saved == value, "frugal: the saved LrSchedule has ", name, " ", saved,
                 ", this one ", value);
  }
  const auto groups = state::read_int(archive, "groups");
  FRUGAL_CHECK(groups == static_cast<std::int64_t>(base_lrs_.size()),
               "frugal: the saved "
               "LrSchedule has ",
               groups, " param groups, this one ", base_lrs_.size());
  std::vector<double> lrs;
  for (std::int64_t g = 0; g < groups; ++g) {
    lrs.push_back(state::read_double(archive, "base_lr/" + std::to_string(g)));
  }
  base_lrs_ = std::move(lrs);
}

}  // namespace frugal
