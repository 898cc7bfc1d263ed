// How fit shares its work among processes: one process by default, a group in distributed/.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "frugal/train/batch.h"
#include "frugal/train/step_report.h"

namespace frugal {

class SaveDir;
class Trainer;
struct UserState;

/// What fit asks of the processes it runs in: each one's share of a batch, where and
/// whether it saves, agreeing on a stop and on a resume, and evaluation. This default is
/// one process (the whole batch, saves in save_dir, evaluation by Trainer::evaluate);
/// frugal::distributed::GroupRanks is a process group's. fit knows no other.
///
/// Example:
///   frugal::fit(trainer, data, frugal::FitOptions().ranks(
///       std::make_shared<frugal::distributed::GroupRanks>(group)));
class Ranks {
 public:
  virtual ~Ranks() = default;
  /// This process's part of a batch's sample indices; undefined to leave the batch out
  /// (too small to give every process a sample).
  virtual torch::Tensor share(const torch::Tensor& indices) const { return indices; }
  /// Where this process keeps its saves, under fit's save_dir.
  virtual std::string save_dir(const std::string& base,
                               const torch::optim::Optimizer& /*optimizer*/) const {
    return base;
  }
  /// Whether this process writes its saves (false: another writes the same state).
  virtual bool writes_saves(const torch::optim::Optimizer& /*optimizer*/) const { return true; }
  /// Resumes `trainer` from `saves` (with fit's resume option): here the newest save that
  /// loads (SaveDir::resume); under a group, the newest step that every process holds whole,
  /// checked to have loaded on all. Empty when there is nothing to resume from; `warn` hears
  /// of each save passed over.
  virtual std::optional<UserState> resume(
      SaveDir& saves, Trainer& trainer, const std::function<void(const std::string&)>& warn) const;
  /// The signal this process caught (0: none), agreed over the processes: all stop
  /// after the same step.
  virtual int agree_on_stop(int caught) const { return caught; }
  /// Evaluates `data` (written to the trainer's sinks).
  virtual EvalReport evaluate(Trainer& trainer, const Batch& data) const;
};

}  // namespace frugal
