// Every CPU allocation and free of a scope, with what the program was doing: the memory
// timeline of a step, a snapshot PyTorch's memory viewer opens, and the peak explained.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "frugal/memory/memory_context.h"

namespace frugal {

/// Whose bytes a block holds: the ledger's parts, with `Activations` for what the forward,
/// backward, recompute and evaluation made that is none of the first three.
enum class MemoryCategory : std::uint8_t {
  Weights,
  Gradients,
  OptimizerState,
  Activations,
  Other,
  /// A unit's weights while they are whole: an 8-bit unit's (nn::Int8Weights) or a ZeRO-3
  /// unit's, made from their compact or sharded store for the unit's forward, recompute
  /// and backward, and freed after.
  MaterialisedWeights,
};
const char* to_string(MemoryCategory category);

struct MemoryRecorderOptions {
  /// Events kept: the newest this many allocations and frees (a ring, 2^18 by default, about
  /// 80 bytes each); older ones are dropped and counted.
  MemoryRecorderOptions& capacity(std::int64_t events);
  std::int64_t capacity() const { return capacity_; }
  /// Where a refused allocation (out of memory under a cap) writes the recording at once,
  /// before the error reaches any recovery: .pickle/.pkl, .html, .png or .json ("": nowhere).
  MemoryRecorderOptions& oom_file(std::string path);
  const std::string& oom_file() const { return oom_file_; }
  /// The memory recorded: the CPU's (the counting allocator's, exact) or a CUDA device's
  /// (the caching allocator's blocks, through its trace hook; LibTorch 2.1 or later).
  MemoryRecorderOptions& device(torch::Device device);
  torch::Device device() const { return device_; }

 private:
  std::int64_t capacity_ = 1 << 18;
  std::string oom_file_;
  torch::Device device_ = torch::kCPU;
};

/// The blocks alive at the peak of a recording, grouped by category and module.
struct MemoryPeak {
  struct Group {
    MemoryCategory category = MemoryCategory::Other;
    std::string module;  ///< the unit that allocated them ("" outside every unit)
    std::int64_t bytes = 0;
    std::int64_t blocks = 0;
  };
  std::int64_t bytes = 0;   ///< the process's allocated bytes at the peak: the groups' sum
  std::int64_t event = -1;  ///< the event that reached it (-1: nothing was recorded)
  MemoryPhase phase = MemoryPhase::Other;
  std::vector<Group> groups;  ///< largest first

  /// "at the peak (412.0 MiB, backward): activations of blocks.5 41.2 MiB, weights 30.0
  /// MiB, ..." with the `top` largest groups and the rest summed.
  std::string summary(std::size_t top = 8) const;
};

/// Records every allocation and free of the counting CPU allocator (or of a CUDA device's
/// caching allocator, MemoryRecorderOptions::device) while it lives (one recorder at a
/// time), with the thread's phase, the unit it ran and the block's category.
/// The category of a block is decided when it is allocated (its phase) and corrected at
/// each phase boundary for the tensors of the watched modules and optimizers (weights,
/// gradients, optimizer state); blocks alive before the recording are known by those
/// tensors, the rest of them counted as `Other`.
///
/// Example:
///   frugal::MemoryRecorder recorder;
///   recorder.watch(*model, &optimizer);
///   trainer.step(batch);
///   recorder.stop();
///   std::cout << recorder.peak().summary() << "\n";
///   recorder.write("step.html");  // or step.pickle: PyTorch's memory viewer opens it
class MemoryRecorder {
 public:
  explicit MemoryRecorder(MemoryRecorderOptions options = {});
  ~MemoryRecorder();
  MemoryRecorder(const MemoryRecorder&) = delete;
  MemoryRecorder& operator=(const MemoryRecorder&) = delete;

  /// Names the module's units by their paths (`prefix` first) and tells the recorder which
  /// blocks are its weights and gradients, and `optimizer`'s state. Kept by reference: both
  /// must outlive the recording.
  void watch(const torch::nn::Module& module, const torch::optim::Optimizer* optimizer = nullptr,
             const std::string& prefix = "");
  /// Ends the recording (the destructor does too); what was recorded stays readable.
  void stop();
  bool recording() const;

  std::int64_t events() const;   ///< events kept
  std::int64_t dropped() const;  ///< events the ring dropped
  /// The process's allocated bytes when the recording began, and its peak since.
  std::int64_t start_bytes() const;
  std::int64_t peak_bytes() const;
  /// The blocks alive at the peak; an error if the events after the peak were dropped.
  MemoryPeak peak() const;

  /// Writes by the extension: `.pickle`/`.pkl` a snapshot in the format of PyTorch's
  /// `torch.cuda.memory._snapshot()` (open it at pytorch.org/memory_viz or with
  /// torch.cuda._memory_viz), `.html` a self-contained timeline, `.png` its picture, `.json`
  /// the events.
  void write(const std::string& path) const;
  /// An error naming `path` unless `write` can write it (by its extension).
  static void check_path(const std::string& path);
  /// As `write`, to a stream; `kind` is one of those extensions.
  void write_to(std::ostream& out, const std::string& kind) const;

  class Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace frugal
