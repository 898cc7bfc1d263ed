// The trainer's policies, in the order they were added, and the calls that reach them.
#pragma once

#include <torch/types.h>

#include <exception>
#include <memory>
#include <vector>

#include "frugal/train/policy.h"
#include "frugal/traits.h"

namespace frugal::detail {

/// Keeps a trainer's policies: checks each new one's traits against the optimizer's and
/// every earlier policy's (the compatibility table), and calls a phase's hook on each, in
/// the order they were added. What to arrange for the traits (gradient-ready calls, the
/// non-finite guard) is the trainer's.
class PolicySet {
 public:
  /// `optimizer_traits`: what the optimizer does to the step (a sharded optimizer's).
  explicit PolicySet(Traits optimizer_traits) : optimizer_traits_(optimizer_traits) {}

  /// Refuses `policy` (an error naming both parties and the rule) where its traits cannot
  /// meet those present; else calls its on_add(`port`) and, if that returns, keeps it.
  /// Returns its traits, read once.
  Traits add(std::shared_ptr<Policy> policy, PolicyPort& port);

  const std::vector<std::shared_ptr<Policy>>& all() const { return policies_; }
  /// Every policy's traits together.
  Traits traits() const { return traits_; }
  Traits optimizer_traits() const { return optimizer_traits_; }

  /// Calls `hook` on each policy, in order.
  void run(void (Policy::*hook)(StepContext&), StepContext& ctx) const;
  /// Whether a policy asks for the batch to run again after `error` (the first that does).
  bool retry(StepContext& ctx, const std::exception& error) const;
  /// Tells each policy the optimizer phase failed; a policy may raise an error of its own.
  /// `quietly`: what the policies raise is dropped (`error` is what the caller must hear).
  void optimizer_failed(StepContext& ctx, const std::exception& error, bool quietly) const;
  /// `param`'s gradient is final: each policy that declared Trait::GradReady hears of it.
  void grad_ready(StepContext& ctx, const torch::Tensor& param) const;

  /// The policies' evaluation scopes, begun in order and ended in reverse however the
  /// evaluation ends.
  class Evaluation {
   public:
    Evaluation(const PolicySet& set, PolicyPort& port);
    ~Evaluation();
    Evaluation(const Evaluation&) = delete;
    Evaluation& operator=(const Evaluation&) = delete;

   private:
    void end();
    const PolicySet& set_;
    PolicyPort& port_;
    std::size_t begun_ = 0;
  };
  /// Whether a policy lets the evaluation go on after a chunk of `batch_size` failed.
  bool eval_retry(PolicyPort& port, std::int64_t batch_size, const std::exception& error) const;

 private:
  Traits optimizer_traits_;
  std::vector<std::shared_ptr<Policy>> policies_;
  std::vector<Traits> policy_traits_;  // each policy's, read when it was added
  std::vector<Policy*> grad_ready_;    // those that declared Trait::GradReady
  Traits traits_;
};

}  // namespace frugal::detail
