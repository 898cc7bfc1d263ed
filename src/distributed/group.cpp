// The process group over LibTorch's c10d: the one file that includes Gloo.
#include "frugal/distributed/group.h"

#include <c10/util/Exception.h>
#include <signal.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <vector>

#include "backend.h"
#include "compat.h"
#include "frugal/error.h"
#include "gather.h"
#include "waiting.h"

namespace frugal::distributed {

using detail::in_flight;
using detail::Peers;
using detail::wait_for;
using detail::Waiting;

namespace {

const char* variable(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

// The integer in variable `name`, within [low, high]; `fallback` when unset and allowed.
int integer(const char* name, int low, int high, const int* fallback = nullptr) {
  const char* text = variable(name);
  if (text == nullptr) {
    FRUGAL_CHECK(fallback != nullptr, "frugal: the environment variable ", name,
                 " is not set; start the program with torchrun (e.g. `torchrun "
                 "--nproc-per-node 2 --no-python PROGRAM ...`) or set RANK, WORLD_SIZE, "
                 "MASTER_ADDR and MASTER_PORT");
    return *fallback;
  }
  errno = 0;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  FRUGAL_CHECK(errno == 0 && end != text && *end == '\0' && value >= low && value <= high,
               "frugal: the environment variable ", name, "='", text, "' is not an integer in [",
               low, ", ", high, "]");
  return static_cast<int>(value);
}

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

}  // namespace

bool LaunchEnv::launched() {
  return variable("RANK") != nullptr && variable("WORLD_SIZE") != nullptr;
}

LaunchEnv LaunchEnv::from_environment() {
  constexpr int kMax = std::numeric_limits<int>::max();
  const int zero = 0;
  LaunchEnv env;
  env.world_size = integer("WORLD_SIZE", 1, kMax);
  env.rank = integer("RANK", 0, env.world_size - 1);
  env.local_rank = integer("LOCAL_RANK", 0, env.world_size - 1, &zero);
  const char* addr = variable("MASTER_ADDR");
  FRUGAL_CHECK(addr != nullptr, "frugal: the environment variable MASTER_ADDR is not set (rank ",
               env.rank, " of ", env.world_size,
               "); torchrun sets it, or set it to rank 0's "
               "host name or address");
  env.master_addr = addr;
  env.master_port = integer("MASTER_PORT", 1, 65535);
  env.restart_count = integer("TORCHELASTIC_RESTART_COUNT", 0, kMax, &zero);
  const char* agent = variable("TORCHELASTIC_USE_AGENT_STORE");
  // As torchrun's own workers decide: the agent serves the store only at its own address.
  env.use_agent_store = agent != nullptr && std::string(agent) == "True";
  return env;
}

void Work::wait() {
  if (wait_) {
    auto wait = std::move(wait_);
    wait_ = nullptr;
    done_ = nullptr;
    wait();
  }
}

struct Group::Impl {
  c10::intrusive_ptr<detail::BackendBase> pg;  // null in a group of one
  Waiting waiting;
  torch::Device device = torch::kCPU;
  bool no_bfloat16 = false;  // Gloo before LibTorch 2.2 refuses bfloat16 ("Invalid scalar type")

  // A transfer's tensor as the backend takes it: bfloat16 where it is refused moves the
  // same bits as Half.
  torch::Tensor as_sent(const torch::Tensor& t) const {
    return no_bfloat16 && t.scalar_type() == torch::kBFloat16 ? t.view(torch::kHalf) : t;
  }
};

Group::Group(std::unique_ptr<Impl> impl, int rank, int size)
    : impl_(std::move(impl)), rank_(rank), size_(size) {}

torch::Device Group::device() const { return impl_->device; }

#ifndef FRUGAL_WITH_NCCL
namespace detail {
c10::intrusive_ptr<BackendBase> make_nccl(const c10::intrusive_ptr<c10d::Store>&, int, int, int,
                                          std::chrono::milliseconds) {
  FRUGAL_CHECK(false,
               "frugal: this build has no NCCL (its LibTorch has no CUDA, or nccl.h was "
               "not found when frugal was built); use the Gloo backend");
}
}  // namespace detail
#endif

Group::~Group() = default;

std::shared_ptr<Group> Group::single() {
  return std::shared_ptr<Group>(new Group(std::make_unique<Impl>(), 0, 1));
}

std::shared_ptr<Group> Group::join(const LaunchEnv& env, GroupOptions options) {
  FRUGAL_CHECK(env.world_size >= 1 && env.rank >= 0 && env.rank < env.world_size, "frugal: rank ",
               env.rank, " is not in a world of ", env.world_size);
  if (env.world_size == 1) {
    return single();
  }
  FRUGAL_CHECK(options.timeout().count() > 0, "frugal: the group's timeout must be positive, got ",
               options.timeout().count(), " ms");
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(env.master_port);
  store_options.isServer = !env.use_agent_store && env.rank == 0;
  store_options.numWorkers = env.world_size;
  store_options.timeout = options.timeout();
  // LibTorch 1.13's store client does not speak to the agent store of torchrun 2.x: it
  // waits for an answer that never comes.
  const char* old_client_hint = "";
#if !FRUGAL_TORCH_AT_LEAST(2, 0)
  if (env.use_agent_store) {
    old_client_hint =
        " (with torchrun 2.x, LibTorch 1.13 programs need "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment)";
    TORCH_WARN_ONCE(
        "frugal: joining torchrun's agent store from LibTorch 1.13; if this "
        "hangs, the torchrun is 2.x: run it with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1");
  }
#endif
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);
  } catch (const std::exception& e) {
    FRUGAL_CHECK(false, "frugal: rank ", env.rank, " could not reach the store at ",
                 env.master_addr, ":", env.master_port, " within ", options.timeout().count(),
                 " ms", old_client_hint, ": ", c10::GetExceptionString(e));
  }
  // Keys of an earlier attempt (torchrun restarts) stay apart from this one's.
  store = c10::make_intrusive<c10d::PrefixStore>(
      "frugal/attempt_" + std::to_string(env.restart_count), store);

  auto impl = std::make_unique<Impl>();
  impl->waiting.rank = env.rank;
  impl->waiting.timeout = options.timeout();
  if (options.backend() == Backend::Nccl) {
    FRUGAL_CHECK(torch::cuda::is_available(),
                 "frugal: the NCCL backend needs CUDA, which is not "
                 "available here (rank ",
                 env.rank, ")");
    const int device = env.local_rank % static_cast<int>(torch::cuda::device_count());
    impl->device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(device));
    impl->pg = detail::make_nccl(store, env.rank, env.world_size, device, options.timeout());
    impl->waiting.release = false;
    std::shared_ptr<Group> group(new Group(std::move(impl), env.rank, env.world_size));
    group->learn_peers();
    return group;
  }
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout());
  std::string interface = options.interface();
  if (interface.empty() && variable("GLOO_SOCKET_IFNAME") != nullptr) {
    interface = variable("GLOO_SOCKET_IFNAME");
  }
  if (!interface.empty()) {
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(interface));
  } else if (is_loopback(env.master_addr)) {
    gloo_options->devices.push_back(
        c10d::ProcessGroupGloo::createDeviceForHostname(env.master_addr));
  } else {
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  impl->pg =
      c10::make_intrusive<c10d::ProcessGroupGloo>(store, env.rank, env.world_size, gloo_options);
  impl->no_bfloat16 = !FRUGAL_TORCH_AT_LEAST(2, 2);
  std::shared_ptr<Group> group(new Group(std::move(impl), env.rank, env.world_size));
  group->learn_peers();
  return group;
}

void Group::learn_peers() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  auto peers = std::make_shared<Peers>();
  peers->self = rank_;
  for (const auto& values :
       detail::gather_numbers(*this, {static_cast<std::int64_t>(::getpid()),
                                      static_cast<std::int64_t>(std::hash<std::string>{}(host))})) {
    peers->pids.push_back(values[0]);
    peers->hosts.push_back(values[1]);
  }
  impl_->waiting.peers = std::move(peers);
}

namespace detail {

std::vector<std::vector<std::int64_t>> gather_numbers(Group& group,
                                                      const std::vector<std::int64_t>& values) {
  const auto mine = torch::tensor(values, torch::kLong).to(group.device());
  std::vector<torch::Tensor> all;
  for (int r = 0; r < group.size(); ++r) {
    all.push_back(torch::empty_like(mine));
  }
  group.all_gather(all, mine);
  std::vector<std::vector<std::int64_t>> out;
  for (const auto& t : all) {
    const auto host = t.cpu();
    out.emplace_back(host.data_ptr<std::int64_t>(), host.data_ptr<std::int64_t>() + host.numel());
  }
  return out;
}

}  // namespace detail

Work Group::all_reduce(torch::Tensor& tensor) {
  if (!impl_->pg) {
    return {};
  }
  if (impl_->no_bfloat16 && tensor.scalar_type() == torch::kBFloat16) {
    // Summed in float32 and rounded back once the sum is in.
    std::vector<torch::Tensor> wide{tensor.to(torch::kFloat)};
    auto work =
        std::make_shared<Work>(in_flight(impl_->pg->allreduce(wide), "all-reduce", impl_->waiting));
    return {[work, wide, tensor]() mutable {
              work->wait();
              tensor.copy_(wide.front());
            },
            [work] { return work->done(); }};
  }
  std::vector<torch::Tensor> tensors{tensor};
  return in_flight(impl_->pg->allreduce(tensors), "all-reduce", impl_->waiting);
}

torch::ScalarType Group::summed_dtype(torch::ScalarType dtype) const {
  return impl_->no_bfloat16 && dtype == torch::kBFloat16 ? torch::kFloat : dtype;
}

void Group::broadcast(torch::Tensor& tensor, int root) {
  FRUGAL_CHECK(root >= 0 && root < size_, "frugal: broadcast from rank ", root, " in a group of ",
               size_);
  if (!impl_->pg) {
    return;
  }
  std::vector<torch::Tensor> tensors{impl_->as_sent(tensor)};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  wait_for(impl_->pg->broadcast(tensors, options), "broadcast", impl_->waiting);
}

void Group::all_gather(std::vector<torch::Tensor>& out, const torch::Tensor& in) {
  all_gather_async(out, in).wait();
}

Work Group::all_gather_async(std::vector<torch::Tensor>& out, const torch::Tensor& in) {
  FRUGAL_CHECK(static_cast<int>(out.size()) == size_, "frugal: all_gather needs ", size_,
               " output tensors, got ", out.size());
  if (!impl_->pg) {
    out[0].copy_(in);
    return {};
  }
  std::vector<std::vector<torch::Tensor>> outputs(1);
  for (const auto& t : out) {
    outputs.front().push_back(impl_->as_sent(t));
  }
  std::vector<torch::Tensor> inputs{impl_->as_sent(in)};
  return in_flight(impl_->pg->allgather(outputs, inputs), "all-gather", impl_->waiting);
}

Work Group::all_gather_flat_async(torch::Tensor& out, const torch::Tensor& in) {
  FRUGAL_CHECK(out.is_contiguous() && in.is_contiguous() && out.numel() == size_ * in.numel() &&
                   out.scalar_type() == in.scalar_type(),
               "frugal: all_gather_flat needs a contiguous output of ", size_, " x ", in.numel(),
               " elements of the input's dtype, got ", out.numel(), " (", out.scalar_type(),
               ") for ", in.scalar_type());
  if (impl_->pg && impl_->device.is_cuda()) {
    // All-gather into one tensor: NCCL writes each rank's part in place, where the list
    // form would gather into a temporary and copy each part out.
    auto sent_out = impl_->as_sent(out);
    auto sent_in = impl_->as_sent(in);
    return in_flight(impl_->pg->_allgather_base(sent_out, sent_in), "all-gather", impl_->waiting);
  }
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < size_; ++r) {
    parts.push_back(out.narrow(0, r * in.numel(), in.numel()).view(in.sizes()));
  }
  return all_gather_async(parts, in);
}

void Group::barrier() {
  if (impl_->pg) {
    wait_for(impl_->pg->barrier(), "barrier", impl_->waiting);
  }
}

double Group::sum(double value) { return sums({value}).front(); }

std::vector<double> Group::sums(const std::vector<double>& values) {
  auto t = torch::tensor(values, torch::TensorOptions(torch::kDouble).device(impl_->device));
  all_reduce(t).wait();
  t = t.cpu();
  return {t.data_ptr<double>(), t.data_ptr<double>() + t.numel()};
}

}  // namespace frugal::distributed
