// Small models and comparisons shared by the tests.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "frugal/memory/probe.h"

/// Skips a `gpu`-labelled test, with a message, where CUDA is not available.
#define FRUGAL_SKIP_WITHOUT_CUDA()                           \
  if (!torch::cuda::is_available()) {                        \
    GTEST_SKIP() << "CUDA is not available on this machine"; \
  }

namespace frugal::testing {

/// An empty folder of the system's temporary folder, named for `name` and this process.
inline std::filesystem::path fresh_temp_dir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("frugal_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

/// The bytes the CUDA caching allocator takes for a request of `bytes`: whole 512-byte
/// units (its kMinBlockSize), which memory_allocated counts.
constexpr std::int64_t cuda_block_bytes(std::int64_t bytes) { return (bytes + 511) / 512 * 512; }

/// A deterministic MLP (no dropout): the same seed gives the same weights.
// Restores LibTorch's intra-op thread count when it goes.
class ThreadCount {
 public:
  explicit ThreadCount(int n) : before_(torch::get_num_threads()) { torch::set_num_threads(n); }
  ~ThreadCount() { torch::set_num_threads(before_); }
  ThreadCount(const ThreadCount&) = delete;
  ThreadCount& operator=(const ThreadCount&) = delete;

 private:
  int before_;
};

/// Deep and narrow: 256 inputs, `layers` Tanh + Linear(16, 16), 10 outputs. At batch 64
/// its activations outweigh its weights and gradients together: the micro-batch decides
/// the peak.
inline torch::nn::Sequential deep_narrow(int layers) {
  torch::manual_seed(8);
  torch::nn::Sequential seq(torch::nn::Linear(256, 16));
  for (int i = 0; i < layers; ++i) {
    seq->push_back(torch::nn::Tanh());
    seq->push_back(torch::nn::Linear(16, 16));
  }
  seq->push_back(torch::nn::Linear(16, 10));
  return seq;
}

inline torch::nn::Sequential make_mlp(std::int64_t in, std::int64_t hidden, std::int64_t out,
                                      std::uint64_t seed = 7) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(in, hidden), torch::nn::Tanh(),
                               torch::nn::Linear(hidden, out));
}

/// Expects `fn` to throw an exception whose message contains `part`.
template <typename Fn>
void expect_error_contains(Fn fn, const std::string& part) {
  try {
    fn();
    ADD_FAILURE() << "no exception; expected one saying: " << part;
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

inline std::vector<torch::Tensor> clone_all(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const auto& t : tensors) {
    out.push_back(t.defined() ? t.detach().clone() : torch::Tensor());
  }
  return out;
}

inline std::vector<torch::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) {
    out.push_back(p.grad());
  }
  return clone_all(out);
}

inline void expect_all_close(const std::vector<torch::Tensor>& actual,
                             const std::vector<torch::Tensor>& expected, double rtol = 1e-5,
                             double atol = 1e-6) {
  ASSERT_EQ(actual.size(), expected.size());
  for (std::size_t i = 0; i < actual.size(); ++i) {
    ASSERT_TRUE(actual[i].defined()) << "tensor " << i << " is undefined";
    EXPECT_TRUE(torch::allclose(actual[i], expected[i], rtol, atol))
        << "tensor " << i << " differs by up to "
        << (actual[i] - expected[i]).abs().max().item<double>();
  }
}

/// Copies of parameters with their layout (strides kept), as leaves that require grad.
inline std::vector<torch::Tensor> clone_params(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) {
    auto c = torch::empty_strided(p.sizes(), p.strides());
    c.copy_(p.detach());
    out.push_back(c.requires_grad_());
  }
  return out;
}

/// The mean squared error as a Trainer's loss of (output, targets).
inline torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::nn::functional::mse_loss(out, target);
}

/// Seeded normal gradients times `scale`: the same step gives the same gradients.
inline void set_grads(std::vector<torch::Tensor>& params, int step, double scale = 1.0) {
  torch::manual_seed(1000 + step);
  for (auto& p : params) {
    p.mutable_grad() = torch::randn_like(p) * scale;
  }
}

// Steps `optimizer` once over `params`, whose gradients are set but for params[skipped]'s:
// that parameter stays as it was and gets no state, as LibTorch's optimizers leave it.
inline void expect_steps_around_missing_gradient(torch::optim::Optimizer& optimizer,
                                                 std::vector<torch::Tensor>& params,
                                                 std::size_t skipped) {
  const auto before = params[skipped].detach().clone();
  params[skipped].mutable_grad().reset();
  optimizer.step();
  EXPECT_TRUE(torch::equal(params[skipped], before));
  EXPECT_EQ(optimizer.state().size(), params.size() - 1);
}

/// Steps `whole` `steps` times with `a`, and its copy `one_by_one` with `b` a parameter at a
/// time in reverse order, both with the gradients `grads_at(params, step)` sets; expects
/// the two exactly equal: a step of each parameter on its own is the whole step.
template <typename Optimizer, typename SetGrads>
void expect_step_parameter_is_the_whole_step(Optimizer& a, std::vector<torch::Tensor>& whole,
                                             Optimizer& b, std::vector<torch::Tensor>& one_by_one,
                                             int steps, SetGrads grads_at) {
  for (int step = 0; step < steps; ++step) {
    grads_at(whole, step);
    grads_at(one_by_one, step);
    a.step();
    for (auto it = one_by_one.rbegin(); it != one_by_one.rend(); ++it) {  // any order
      b.step_parameter(*it);
    }
  }
  for (std::size_t i = 0; i < whole.size(); ++i) {
    EXPECT_TRUE(torch::equal(one_by_one[i], whole[i])) << "parameter " << i;
  }
}

/// Bytes the second of two optimizer steps allocates above what it started with (the
/// first makes the state).
inline std::int64_t step_overhead(torch::optim::Optimizer& optimizer,
                                  std::vector<torch::Tensor>& params,
                                  const frugal::MemoryProbe& probe) {
  set_grads(params, 0);
  optimizer.step();
  set_grads(params, 1);
  frugal::ScopedPeak peak(probe);
  const auto base = probe.allocated();
  optimizer.step();
  return peak.end() - base;
}

/// The distance from each value of `x` (1-D) to the nearest value of `map` (1-D).
inline torch::Tensor nearest_distance(const torch::Tensor& x, const torch::Tensor& map) {
  return (x.unsqueeze(1) - map.unsqueeze(0)).abs().amin(1);
}

// How far each of `values` lies from the nearer of the two values of `map` (sorted) around
// the matching element of `x`: the highest at or below it and the lowest above it (the
// lowest or the highest of the map where there is none).
inline torch::Tensor bracket_distance(const torch::Tensor& values, const torch::Tensor& x,
                                      const torch::Tensor& map) {
  const auto at_or_below = map.unsqueeze(0) <= x.unsqueeze(1);
  const auto inf = std::numeric_limits<float>::infinity();
  auto below = torch::where(at_or_below, map.unsqueeze(0), torch::full({}, -inf)).amax(1);
  auto above = torch::where(at_or_below, torch::full({}, inf), map.unsqueeze(0)).amin(1);
  below = torch::where(torch::isinf(below), map[0], below);
  above = torch::where(torch::isinf(above), map[-1], above);
  return torch::minimum((values - below).abs(), (values - above).abs());
}

}  // namespace frugal::testing
