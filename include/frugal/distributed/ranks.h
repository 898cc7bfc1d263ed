// fit's work shared among the ranks of a process group.
#pragma once

#include <memory>
#include <string>

#include "frugal/distributed/group.h"
#include "frugal/fit/ranks.h"

namespace frugal::distributed {

/// The ranks of `group` as fit's processes: every rank takes its share of each batch
/// (share_of; a batch smaller than the group is left out), evaluation is shared
/// (distributed::evaluate), rank 0 writes the saves for all, except under a sharded
/// optimizer (optim::ShardedOptimizer, as ZeroOptimizer), whose state differs by rank:
/// each rank then saves in save_dir/rank-R. The ranks stop together after the step where
/// any of them caught a signal, and resume together from the newest step they all hold.
///
/// Example:
///   auto group =
///   frugal::distributed::Group::join(frugal::distributed::LaunchEnv::from_environment());
///   frugal::fit(trainer, data,
///               frugal::FitOptions().batch_size(64).ranks(std::make_shared<GroupRanks>(group)));
class GroupRanks : public Ranks {
 public:
  explicit GroupRanks(std::shared_ptr<Group> group);

  torch::Tensor share(const torch::Tensor& indices) const override;
  std::string save_dir(const std::string& base,
                       const torch::optim::Optimizer& optimizer) const override;
  bool writes_saves(const torch::optim::Optimizer& optimizer) const override;
  /// The newest step that every rank holds whole (a damaged or missing file on any rank
  /// passes that step over), loaded on every rank; throws naming what each rank holds where
  /// they hold saves but none of one step, and on every rank when one could not load it.
  std::optional<UserState> resume(
      SaveDir& saves, Trainer& trainer,
      const std::function<void(const std::string&)>& warn) const override;
  int agree_on_stop(int caught) const override;
  EvalReport evaluate(Trainer& trainer, const Batch& data) const override;

  Group& group() const { return *group_; }

 private:
  std::shared_ptr<Group> group_;
};

}  // namespace frugal::distributed
