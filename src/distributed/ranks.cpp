#include "frugal/distributed/ranks.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <csignal>

#include "frugal/distributed/shard.h"
#include "frugal/error.h"
#include "frugal/optim/sharded.h"
#include "frugal/state/save_dir.h"
#include "frugal/train/trainer.h"
#include "gather.h"

namespace frugal::distributed {
namespace {

// A sharded optimizer's state differs by rank: every rank keeps its own saves then.
bool sharded(const torch::optim::Optimizer& optimizer) {
  return dynamic_cast<const optim::ShardedOptimizer*>(&optimizer) != nullptr;
}

// Every rank's list of numbers (of any length), by rank: the lengths, then the lists padded
// to the longest.
std::vector<std::vector<std::int64_t>> gather_lists(Group& group, std::vector<std::int64_t> mine) {
  const auto n = static_cast<std::int64_t>(mine.size());
  const auto lengths = detail::gather_numbers(group, {n});
  std::int64_t longest = 1;
  for (const auto& length : lengths) {
    longest = std::max(longest, length.front());
  }
  mine.resize(static_cast<std::size_t>(longest), -1);
  auto lists = detail::gather_numbers(group, mine);
  for (std::size_t r = 0; r < lists.size(); ++r) {
    lists[r].resize(static_cast<std::size_t>(lengths[r].front()));
  }
  return lists;
}

// The largest step in every rank's list (each newest first), or -1.
std::int64_t newest_common(const std::vector<std::vector<std::int64_t>>& held) {
  for (const auto step : held.front()) {
    if (std::all_of(held.begin(), held.end(), [step](const auto& h) {
          return std::find(h.begin(), h.end(), step) != h.end();
        })) {
      return step;
    }
  }
  return -1;
}

// "rank 0 holds steps 10, 5; rank 1 holds none".
std::string describe(const std::vector<std::vector<std::int64_t>>& held) {
  std::string out;
  for (std::size_t r = 0; r < held.size(); ++r) {
    out += (r ? "; rank " : "rank ") + std::to_string(r) + " holds ";
    if (held[r].empty()) {
      out += "no whole save";
    } else {
      out += held[r].size() == 1 ? "step " : "steps ";
      for (std::size_t i = 0; i < held[r].size(); ++i) {
        out += (i ? ", " : "") + std::to_string(held[r][i]);
      }
    }
  }
  return out;
}

}  // namespace

GroupRanks::GroupRanks(std::shared_ptr<Group> group) : group_(std::move(group)) {
  FRUGAL_CHECK(group_ != nullptr, "frugal: GroupRanks needs a process group, got a null one");
}

torch::Tensor GroupRanks::share(const torch::Tensor& indices) const {
  if (indices.size(0) < group_->size()) {
    return {};
  }
  const auto part = share_of(indices.size(0), group_->rank(), group_->size());
  return indices.narrow(0, part.start, part.length);
}

std::string GroupRanks::save_dir(const std::string& base,
                                 const torch::optim::Optimizer& optimizer) const {
  return sharded(optimizer) ? base + "/rank-" + std::to_string(group_->rank()) : base;
}

bool GroupRanks::writes_saves(const torch::optim::Optimizer& optimizer) const {
  return group_->rank() == 0 || sharded(optimizer);
}

std::optional<UserState> GroupRanks::resume(
    SaveDir& saves, Trainer& trainer, const std::function<void(const std::string&)>& warn) const {
  const auto mine = saves.whole_steps(warn);
  const auto held = gather_lists(*group_, mine);
  const auto chosen = newest_common(held);
  if (chosen < 0) {
    FRUGAL_CHECK(std::all_of(held.begin(), held.end(), [](const auto& h) { return h.empty(); }),
                 "frugal: the ranks hold no save of one step to resume from together (",
                 saves.dir(), " on rank ", group_->rank(), "): ", describe(held));
    return std::nullopt;
  }
  if (warn && chosen != mine.front()) {
    warn(fmt::format("rank {} resumes from step {}, the newest that every rank holds whole ({})",
                     group_->rank(), chosen, describe(held)));
  }
  std::optional<UserState> user;
  std::string failure;
  try {
    user = saves.resume_at(trainer, chosen);
  } catch (const std::exception& error) {
    failure = error_message(error);
  }
  // Every rank learns which ones loaded it: none goes on alone.
  const auto loaded = detail::gather_numbers(*group_, {failure.empty() ? trainer.steps() : -1});
  std::string failed;
  for (std::size_t r = 0; r < loaded.size(); ++r) {
    if (loaded[r].front() != chosen) {
      failed += (failed.empty() ? "" : ", ") + std::to_string(r);
    }
  }
  FRUGAL_CHECK(failure.empty(), failure, " (rank ", group_->rank(), "; no rank goes on from step ",
               chosen, ")");
  FRUGAL_CHECK(failed.empty(), "frugal: rank(s) ", failed, " could not resume from step ", chosen,
               ", which rank ", group_->rank(), " loaded from '", saves.resumed_from(),
               "' (see their errors); no rank goes on");
  return user;
}

int GroupRanks::agree_on_stop(int caught) const {
  const double seen = group_->sum(caught);
  return seen > 0 ? (caught != 0 ? caught : SIGTERM) : 0;
}

EvalReport GroupRanks::evaluate(Trainer& trainer, const Batch& data) const {
  return distributed::evaluate(trainer, *group_, data);
}

}  // namespace frugal::distributed
