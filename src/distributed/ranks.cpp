#include "frugal/distributed/ranks.h"

#include <c10/util/Exception.h>

#include <csignal>

#include "frugal/distributed/shard.h"
#include "frugal/error.h"
#include "frugal/optim/sharded.h"

namespace frugal::distributed {
namespace {

// A sharded optimizer's state differs by rank: every rank keeps its own saves then.
bool sharded(const torch::optim::Optimizer& optimizer) {
  return dynamic_cast<const optim::ShardedOptimizer*>(&optimizer) != nullptr;
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

void GroupRanks::check_resumed(std::int64_t steps) const {
  const auto mine = static_cast<double>(steps);
  FRUGAL_CHECK(group_->sum(mine) == mine * group_->size(), "frugal: rank ", group_->rank(),
               " resumed at step ", steps,
               " but not every rank did; the ranks' saves differ "
               "(remove the newer ones)");
}

int GroupRanks::agree_on_stop(int caught) const {
  const double seen = group_->sum(caught);
  return seen > 0 ? (caught != 0 ? caught : SIGTERM) : 0;
}

EvalReport GroupRanks::evaluate(Trainer& trainer, const Batch& data) const {
  return distributed::evaluate(trainer, *group_, data);
}

}  // namespace frugal::distributed
