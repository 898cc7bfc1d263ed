// A process group for data-parallel training: joined from torchrun's environment.
#pragma once

#include <torch/arg.h>
#include <torch/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace frugal::distributed {

/// What `torchrun --no-python` (or any launcher setting the same variables) tells a worker.
struct LaunchEnv {
  int rank = 0;        ///< RANK
  int world_size = 1;  ///< WORLD_SIZE
  int local_rank = 0;  ///< LOCAL_RANK (0 when unset)
  std::string master_addr;
  int master_port = 0;
  int restart_count = 0;         ///< TORCHELASTIC_RESTART_COUNT (0 when unset)
  bool use_agent_store = false;  ///< TORCHELASTIC_USE_AGENT_STORE=True: the agent hosts the store

  /// Reads the variables; throws an error naming the one that is missing or wrong.
  static LaunchEnv from_environment();
  /// Whether RANK and WORLD_SIZE are set, i.e. a launcher started this process.
  static bool launched();
};

/// c10d's backend: Gloo (CPU tensors, and CUDA ones through the host) or NCCL (CUDA tensors,
/// one GPU a rank: LOCAL_RANK's).
enum class Backend { Gloo, Nccl };

struct GroupOptions {
  TORCH_ARG(Backend, backend) = Backend::Gloo;
  /// How long a collective (and joining) may wait for the other ranks before it fails.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
  /// The network interface Gloo uses (GLOO_SOCKET_IFNAME when empty, else the host's).
  TORCH_ARG(std::string, interface);
};

/// A collective in flight; wait() returns when it is done on this rank (and throws its
/// error, e.g. a peer that went away or the timeout).
class Work {
 public:
  Work() = default;
  Work(std::function<void()> wait, std::function<bool()> done)
      : wait_(std::move(wait)), done_(std::move(done)) {}
  void wait();
  /// Whether wait() would return at once (without waiting).
  bool done() const { return !wait_ || !done_ || done_(); }

 private:
  std::function<void()> wait_;
  std::function<bool()> done_;
};

/// The ranks of one training run, over LibTorch's c10d process group (Gloo, on CPU
/// tensors). Collectives are issued in the same order on every rank.
///
/// Example:
///   auto group =
///   frugal::distributed::Group::join(frugal::distributed::LaunchEnv::from_environment()); auto
///   total = torch::tensor({local_count}); group->all_reduce(total).wait();  // the sum over all
///   ranks
class Group {
 public:
  /// Joins the group that `env` describes: a TCPStore client of the agent's store where
  /// torchrun shares it, else rank 0 hosts one at MASTER_ADDR:MASTER_PORT.
  static std::shared_ptr<Group> join(const LaunchEnv& env, GroupOptions options = {});
  /// A group of one process (no communication), for code that runs with or without a launcher.
  static std::shared_ptr<Group> single();
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  /// Where the group's own small tensors live: the CPU for Gloo, this rank's GPU for NCCL.
  torch::Device device() const;

  /// Sums `tensor` over the ranks, in place; asynchronous.
  Work all_reduce(torch::Tensor& tensor);
  /// The dtype the backend sums `dtype` in: `dtype` itself, except bfloat16 on Gloo before
  /// LibTorch 2.2, which is summed in float32 (all_reduce then makes a float32 copy while the
  /// sum is in flight; a caller that fills its own buffer can make it float32 instead).
  torch::ScalarType summed_dtype(torch::ScalarType dtype) const;
  /// Copies rank `root`'s `tensor` into every rank's, in place; waits.
  void broadcast(torch::Tensor& tensor, int root = 0);
  /// `out` receives every rank's `in` (same shape on every rank), in rank order; waits.
  void all_gather(std::vector<torch::Tensor>& out, const torch::Tensor& in);
  /// The same, asynchronous: `out` and `in` must live until the Work is waited for.
  Work all_gather_async(std::vector<torch::Tensor>& out, const torch::Tensor& in);
  /// The same into one contiguous tensor of size() x in.numel() elements, rank r's `in` at
  /// r x in.numel() (`in` may be that place of `out`: nothing is copied then). NCCL gathers
  /// straight into `out`; Gloo through views of it.
  Work all_gather_flat_async(torch::Tensor& out, const torch::Tensor& in);
  /// Returns when every rank has called it.
  void barrier();
  /// The sum of one number over the ranks; waits.
  double sum(double value);
  /// The sums of a few numbers over the ranks, in one message; waits.
  std::vector<double> sums(const std::vector<double>& values);

 private:
  struct Impl;
  Group(std::unique_ptr<Impl> impl, int rank, int size);
  // Gathers every rank's process id and host, which a failed collective's error uses to name
  // a rank whose process is gone.
  void learn_peers();
  std::unique_ptr<Impl> impl_;
  int rank_;
  int size_;
};

}  // namespace frugal::distributed
