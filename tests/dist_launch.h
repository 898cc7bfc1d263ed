// Starting ranks of this test binary as torchrun starts them, on the loopback.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "children.h"
#include "frugal/distributed/group.h"
#include "local_ranks.h"
#include "resume_setup.h"

namespace frugal::testing {

// Starts `world` ranks of child `name` as torchrun would; their exit statuses by rank.
inline std::vector<int> launch(const std::string& name, int world,
                               const std::vector<std::string>& args,
                               const std::string& stderr_prefix = "") {
  const auto port = std::to_string(examples::free_loopback_port());
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    pids.push_back(frugal::testing::spawn_child(
        name, args,
        {"RANK=" + std::to_string(r), "LOCAL_RANK=" + std::to_string(r),
         "WORLD_SIZE=" + std::to_string(world), "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port},
        stderr_prefix.empty() ? "" : stderr_prefix + std::to_string(r) + ".txt"));
  }
  std::vector<int> status;
  for (const auto pid : pids) {
    status.push_back(frugal::testing::wait_child(pid));
  }
  return status;
}

using RankTraining = std::function<std::vector<torch::Tensor>(
    const std::shared_ptr<frugal::distributed::Group>& group)>;

// A child rank of a test that compares ranks with one process: joins the group the launcher's
// variables describe (one thread, a 60 s timeout), trains, and saves what `train` returned
// to ARGS[0]-<rank>.pt.
inline int train_rank_and_save(const std::vector<std::string>& args, const RankTraining& train) {
  torch::set_num_threads(1);
  const auto env = frugal::distributed::LaunchEnv::from_environment();
  auto group = frugal::distributed::Group::join(
      env, frugal::distributed::GroupOptions().timeout(std::chrono::seconds(60)));
  torch::save(train(group), args.at(0) + "-" + std::to_string(env.rank) + ".pt");
  return 0;
}

// Registers child `name`: a rank that trains with `train` and saves what it returned.
inline RegisterChild register_rank_training(const std::string& name, RankTraining train) {
  return RegisterChild(name, [train](const std::vector<std::string>& args) {
    return train_rank_and_save(args, train);
  });
}

// Starts `world` ranks of child `name` (registered with train_rank_and_save) and returns what
// each saved, by rank; empty when a rank failed.
inline std::vector<std::vector<torch::Tensor>> launch_and_load(const std::string& name, int world) {
  const auto prefix = (fresh_temp_dir("frugal-" + name) / "w").string();
  const auto status = launch(name, world, std::vector<std::string>{prefix});
  std::vector<std::vector<torch::Tensor>> out;
  if (status != std::vector<int>(static_cast<std::size_t>(world), 0)) {
    return out;
  }
  for (int r = 0; r < world; ++r) {
    out.emplace_back();
    torch::load(out.back(), prefix + "-" + std::to_string(r) + ".pt");
  }
  return out;
}

// What `world` ranks of child `name` saved (empty when a rank failed), beside what one process
// returns from the same training (`train` on a group of one, at one thread as the ranks run).
struct RanksAndOne {
  std::vector<std::vector<torch::Tensor>> ranks;
  std::vector<torch::Tensor> one;
};
inline RanksAndOne ranks_and_one_process(const std::string& name, int world,
                                         const RankTraining& train) {
  RanksAndOne out;
  out.ranks = launch_and_load(name, world);
  torch::set_num_threads(1);
  out.one = train(frugal::distributed::Group::single());
  return out;
}

}  // namespace frugal::testing
