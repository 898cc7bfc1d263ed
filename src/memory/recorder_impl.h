// What a MemoryRecorder holds, shared by the recording and the writers of its files.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <ostream>
#include <string>
#include <unordered_map>
#include <vector>

#include "allocation_observer.h"
#include "frugal/memory/recorder.h"

namespace frugal {

namespace detail {

enum class EventAction : std::uint8_t { Alloc, Free, Refused };

/// One allocation, free or refusal, with the context of the block's allocation.
struct MemoryEvent {
  std::int64_t seq = 0;      // the event's number since the recording began
  std::int64_t time_us = 0;  // since the recording began
  std::uintptr_t address = 0;
  std::int64_t bytes = 0;      // requested bytes (a refusal: the request)
  std::int64_t allocated = 0;  // the process's allocated bytes after the event
  std::int64_t cap = 0;        // a refusal: the cap
  std::int32_t unit = -1;      // index into the unit names; -1: outside every unit
  EventAction action = EventAction::Alloc;
  MemoryPhase phase = MemoryPhase::Other;  // the block's allocation's
  MemoryPhase at = MemoryPhase::Other;     // the thread's when the event happened
  MemoryCategory category = MemoryCategory::Other;
  bool known = true;  // a free of a block the recording knew (not one alive before it, unseen)
  std::int32_t label = -1;  // index into the names (name_memory); -1: none
};

/// A block alive now that the recording knows: allocated while it ran (seq >= 0) or alive
/// before it and found among the watched tensors (seq -1).
struct LiveBlock {
  std::int64_t bytes = 0;
  std::int64_t seq = -1;
  std::int32_t unit = -1;
  MemoryPhase phase = MemoryPhase::Other;
  MemoryCategory category = MemoryCategory::Other;
  std::int32_t label = -1;  // index into the names; -1: none
};

/// The recording as the writers read it: taken under the recorder's lock.
struct Recording {
  std::vector<MemoryEvent> events;  // oldest first
  std::int64_t dropped = 0;
  std::vector<std::string> units;
  std::vector<std::string> labels;                     // the names of named blocks (name_memory)
  std::unordered_map<std::uintptr_t, LiveBlock> live;  // at the end
  std::int64_t unattributed = 0;  // bytes alive before the recording and never identified
  std::int64_t start_bytes = 0;
  std::int64_t end_bytes = 0;
  MemoryPeak peak;
  int device = -1;  // the CUDA device recorded; -1: the CPU
};

/// The storages name_memory named that are still alive, with their names.
using NamedStorages = std::vector<std::pair<c10::Storage, std::string>>;
NamedStorages live_names();

/// The recording written as PyTorch's snapshot dictionary, pickled (protocol 2).
void write_snapshot(const Recording& recording, std::ostream& out);
/// The module the calling thread runs (UnitScope), or null.
const torch::nn::Module* current_unit();
/// An error naming `path` unless it ends in .pickle, .pkl, .html, .png or .json.
void check_recording_kind(const std::string& path);
/// The recording in the format of `kind` (one of those extensions), or of the file's.
void write_recording(const Recording& recording, std::ostream& out, const std::string& kind);
void write_recording(const Recording& recording, const std::string& path);

/// The recording's events and peak as JSON.
void write_events_json(const Recording& recording, std::ostream& out);
/// The recording as a self-contained HTML page: stacked areas by category over the events.
void write_timeline_html(const Recording& recording, std::ostream& out);
/// The same timeline drawn as a PNG (960 x 460 pixels).
void write_timeline_png(const Recording& recording, std::ostream& out);

}  // namespace detail

class MemoryRecorder::Impl final : public detail::AllocationObserver {
 public:
  explicit Impl(MemoryRecorderOptions options);

  void on_alloc(const void* data, std::int64_t requested, std::int64_t capacity,
                std::int64_t allocated) override;
  void on_free(const void* data, std::int64_t requested, std::int64_t capacity,
               std::int64_t allocated) override;
  void on_refused(std::int64_t requested, std::int64_t allocated, std::int64_t cap) override;
  void on_device(const detail::DeviceEvent& event) override;
  void on_phase_boundary() override { classify(); }

  void start();
  void stop();
  void watch(const torch::nn::Module& module, const torch::optim::Optimizer* optimizer,
             const std::string& prefix);
  /// Sets the category of the watched tensors' blocks (at each phase boundary).
  void classify();
  detail::Recording recording() const;
  MemoryPeak peak() const;

  /// A field read under the lock.
  template <typename T>
  T read(const T& field) const;

  mutable std::mutex mutex;
  bool recording_ = false;
  std::int64_t start_bytes_ = 0;
  std::int64_t peak_bytes_ = 0;
  std::int64_t dropped_ = 0;
  std::int64_t size_ = 0;  // events kept

 private:
  // The next event, with the calling thread's phase, unit and the category they give.
  detail::MemoryEvent& push(detail::EventAction action, const void* data, std::int64_t bytes,
                            std::int64_t allocated);
  std::int32_t unit_index(const torch::nn::Module* module);
  // An allocation, a free and a refusal of the device recorded, under the lock.
  void alloc_locked(const void* data, std::int64_t bytes, std::int64_t allocated);
  void free_locked(const void* data, std::int64_t bytes, std::int64_t allocated);
  void refused(std::int64_t requested, std::int64_t allocated, std::int64_t cap);
  // The bytes of a watched or named storage's block alive since before the recording, or -1
  // when the recorded allocator did not make it.
  std::int64_t block_bytes(const c10::Storage& storage) const;
  // Whether a storage is the recorded device's.
  bool recorded_device(const c10::Device& device) const;
  // The named storages' blocks: labelled (and counted under their name).
  void name_blocks_locked(const detail::NamedStorages& names);
  std::int32_t label_index(const std::string& name);
  // Event `seq`'s slot in the ring; whether it still holds event `seq` (seq >= 0).
  detail::MemoryEvent& event(std::int64_t seq) {
    return ring_[static_cast<std::size_t>(seq % options_.capacity())];
  }
  const detail::MemoryEvent& event(std::int64_t seq) const {
    return ring_[static_cast<std::size_t>(seq % options_.capacity())];
  }
  bool kept(std::int64_t seq) const { return seq >= 0 && seq >= next_seq_ - size_; }
  // Whether every event after the peak is still in the ring (the peak can be rebuilt).
  bool peak_kept() const { return next_seq_ - peak_seq_ - 1 <= size_; }
  void classify_locked(const detail::NamedStorages& names);
  MemoryPeak peak_locked() const;

  struct Watched {
    const torch::nn::Module* module;
    const torch::optim::Optimizer* optimizer;
  };
  MemoryRecorderOptions options_;
  int device_ = -1;                    // the CUDA device recorded; -1: the CPU
  std::int64_t device_allocated_ = 0;  // its allocated bytes, counted from its trace
  std::chrono::steady_clock::time_point start_;
  std::vector<detail::MemoryEvent> ring_;
  std::int64_t next_seq_ = 0;
  std::int64_t peak_seq_ = -1;
  std::unordered_map<std::uintptr_t, detail::LiveBlock> live_;
  std::int64_t unattributed_ = 0;
  std::int64_t end_bytes_ = 0;
  std::vector<std::string> units_;
  std::vector<std::string> labels_;
  std::unordered_map<const torch::nn::Module*, std::int32_t> unit_of_;
  std::vector<Watched> watched_;
};

template <typename T>
T MemoryRecorder::Impl::read(const T& field) const {
  std::lock_guard<std::mutex> lock(mutex);
  return field;
}

}  // namespace frugal
