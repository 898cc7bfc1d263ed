#include "frugal/memory/recorder.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <map>
#include <thread>
#include <unordered_set>

#include "../compat.h"
#include "frugal/error.h"
#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/format.h"
#include "frugal/memory/memory_names.h"
#include "module_tensors.h"
#include "recorder_impl.h"

namespace frugal {

namespace {

// The named storages: each held weakly, so a name dies with its storage.
struct NamedStorage {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  std::string name;
};

std::mutex& names_mutex() {
  static std::mutex m;
  return m;
}

std::vector<NamedStorage>& named_storages() {
  static std::vector<NamedStorage> names;
  return names;
}

}  // namespace

// The storages still alive, with their names; the dead ones forgotten.
detail::NamedStorages detail::live_names() {
  std::lock_guard<std::mutex> lock(names_mutex());
  auto& names = named_storages();
  detail::NamedStorages alive;
  std::vector<NamedStorage> kept;
  for (auto& n : names) {
    // Locked once: a storage another thread lets go of between a check and a lock is gone.
    if (auto strong = n.storage.lock()) {
      alive.emplace_back(c10::Storage(std::move(strong)), n.name);
      kept.push_back(std::move(n));
    }
  }
  names = std::move(kept);
  return alive;
}

void name_memory(const torch::Tensor& tensor, const std::string& name) {
  FRUGAL_CHECK(!name.empty(), "frugal: name_memory needs a name, got an empty one");
  FRUGAL_CHECK(tensor.defined() && tensor.has_storage(), "frugal: name_memory('", name,
               "'): the tensor ", tensor.defined() ? "has no storage" : "is undefined");
  const auto& storage = tensor.storage();
  std::lock_guard<std::mutex> lock(names_mutex());
  auto& names = named_storages();
  for (auto& n : names) {
    if (n.storage.lock().get() == storage.unsafeGetStorageImpl()) {
      n.name = name;
      return;
    }
  }
  names.push_back(NamedStorage{storage.getWeakStorageImpl(), name});
}

MemoryRecorderOptions& MemoryRecorderOptions::capacity(std::int64_t events) {
  FRUGAL_CHECK(events > 0, "frugal: a memory recorder keeps at least 1 event, got ", events);
  capacity_ = events;
  return *this;
}

MemoryRecorderOptions& MemoryRecorderOptions::oom_file(std::string path) {
  if (!path.empty()) {
    detail::check_recording_kind(path);
  }
  oom_file_ = std::move(path);
  return *this;
}

MemoryRecorderOptions& MemoryRecorderOptions::device(torch::Device device) {
  FRUGAL_CHECK(device.is_cpu() || device.is_cuda(),
               "frugal: a memory recorder records the CPU or a CUDA device, not ", device);
  device_ = device;
  return *this;
}

MemoryRecorder::Impl::Impl(MemoryRecorderOptions options) : options_(std::move(options)) {
  const auto device = options_.device();
  device_ = device.is_cuda() ? (device.has_index() ? device.index() : 0) : -1;
}

void MemoryRecorder::Impl::watch(const torch::nn::Module& module,
                                 const torch::optim::Optimizer* optimizer,
                                 const std::string& prefix) {
  // Taken before the lock and let go after it: the last reference to a storage may free it,
  // which this recorder records.
  const auto names = detail::live_names();
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& item : module.named_modules(prefix)) {
    const auto* m = item.value().get();
    const auto name = item.key().empty() ? m->name() : item.key();
    const auto it = unit_of_.find(m);
    if (it == unit_of_.end()) {
      units_.push_back(name);
      unit_of_[m] = static_cast<std::int32_t>(units_.size() - 1);
    } else {
      units_[static_cast<std::size_t>(it->second)] = name;
    }
  }
  watched_.push_back({&module, optimizer});
  classify_locked(names);
}

void MemoryRecorder::Impl::classify() {
  const auto names = detail::live_names();  // let go after the lock, as in watch()
  std::lock_guard<std::mutex> lock(mutex);
  if (recording_) {
    classify_locked(names);
  }
}

void MemoryRecorder::Impl::classify_locked(const detail::NamedStorages& names) {
  std::unordered_set<std::uintptr_t> seen;
  auto to_category = [](detail::LedgerPart part) {
    switch (part) {
      case detail::LedgerPart::Weights:
        return MemoryCategory::Weights;
      case detail::LedgerPart::Gradients:
        return MemoryCategory::Gradients;
      default:
        return MemoryCategory::OptimizerState;
    }
  };
  for (const auto& w : watched_) {
    detail::for_each_ledger_tensor(
        w.module->parameters(), w.module->buffers(), w.optimizer,
        [&](const torch::Tensor& t, detail::LedgerPart part) {
          if (!t.defined() || !t.has_storage() || !recorded_device(t.device())) {
            return;
          }
          const auto& ptr = t.storage().data_ptr();
          const auto address = reinterpret_cast<std::uintptr_t>(ptr.get());
          if (address == 0 || !seen.insert(address).second) {
            return;  // a storage belongs to the first part that holds it
          }
          const auto category = to_category(part);
          auto it = live_.find(address);
          if (it == live_.end()) {
            const auto bytes = block_bytes(t.storage());
            if (bytes < 0) {
              return;  // not the recorded allocator's
            }
            unattributed_ -= bytes;  // alive since before the recording: identified now
            live_[address] = detail::LiveBlock{bytes, -1, -1, MemoryPhase::Other, category, -1};
            return;
          }
          if (it->second.category == MemoryCategory::MaterialisedWeights) {
            return;  // a unit's parameter while it is whole: its store holds the weights
          }
          it->second.category = category;
          it->second.label = -1;
          const auto seq = it->second.seq;
          if (kept(seq)) {
            event(seq).category = category;
            event(seq).label = -1;
          }
        });
  }
  name_blocks_locked(names);
}

bool MemoryRecorder::Impl::recorded_device(const c10::Device& device) const {
  return device_ < 0 ? device.is_cpu() : device.is_cuda() && device.index() == device_;
}

std::int64_t MemoryRecorder::Impl::block_bytes(const c10::Storage& storage) const {
  if (device_ < 0) {
    return detail::counted_bytes(storage.data_ptr());
  }
#ifdef FRUGAL_WITH_CUDA
  return compat::cuda_block_bytes(static_cast<std::int64_t>(storage.nbytes()));
#else
  return -1;
#endif
}

std::int32_t MemoryRecorder::Impl::label_index(const std::string& name) {
  const auto it = std::find(labels_.begin(), labels_.end(), name);
  if (it != labels_.end()) {
    return static_cast<std::int32_t>(it - labels_.begin());
  }
  labels_.push_back(name);
  return static_cast<std::int32_t>(labels_.size() - 1);
}

void MemoryRecorder::Impl::name_blocks_locked(const detail::NamedStorages& names) {
  for (const auto& [storage, name] : names) {
    const auto address = reinterpret_cast<std::uintptr_t>(storage.data_ptr().get());
    if (address == 0 || !recorded_device(storage.device())) {
      continue;
    }
    const auto label = label_index(name);
    auto it = live_.find(address);
    if (it == live_.end()) {
      const auto bytes = block_bytes(storage);
      if (bytes < 0) {
        continue;  // not the recorded allocator's
      }
      unattributed_ -= bytes;  // alive since before the recording: named now
      live_[address] =
          detail::LiveBlock{bytes, -1, -1, MemoryPhase::Other, MemoryCategory::Other, label};
      continue;
    }
    auto& block = it->second;
    if (block.category != MemoryCategory::Activations && block.category != MemoryCategory::Other) {
      continue;  // a watched tensor (or a unit's whole weights) keeps its part
    }
    block.category = MemoryCategory::Other;
    block.label = label;
    if (kept(block.seq)) {
      event(block.seq).category = MemoryCategory::Other;
      event(block.seq).label = label;
    }
  }
}

MemoryPeak MemoryRecorder::Impl::peak_locked() const {
  // The blocks alive at the peak: those alive now, with the events since the peak undone.
  FRUGAL_CHECK(peak_kept(), "frugal: the memory recorder's ring (", options_.capacity(),
               " events) dropped events after the peak; raise its capacity");
  auto live = live_;
  auto unattributed = unattributed_;
  for (auto seq = next_seq_ - 1; seq > peak_seq_; --seq) {
    const auto& e = event(seq);
    if (e.action == detail::EventAction::Alloc) {
      live.erase(e.address);
    } else if (e.action == detail::EventAction::Free) {
      if (e.known) {
        live[e.address] = detail::LiveBlock{e.bytes, -2, e.unit, e.phase, e.category, e.label};
      } else {
        unattributed += e.bytes;
      }
    }
  }
  MemoryPeak peak;
  peak.event = peak_seq_;
  if (peak_seq_ >= 0) {
    peak.phase = event(peak_seq_).phase;
  }
  std::map<std::pair<MemoryCategory, std::int32_t>, MemoryPeak::Group> groups;
  auto add = [&](MemoryCategory category, std::int32_t unit, std::int64_t bytes) {
    auto& g = groups[{category, unit}];
    g.category = category;
    g.module = unit < 0 ? "" : units_[static_cast<std::size_t>(unit)];
    g.bytes += bytes;
    g.blocks += 1;
    peak.bytes += bytes;
  };
  for (const auto& [address, block] : live) {
    if (block.label >= 0) {  // a named block: its name for a unit
      add(MemoryCategory::Other, -3 - block.label, block.bytes);
      groups[{MemoryCategory::Other, -3 - block.label}].module =
          "(" + labels_[static_cast<std::size_t>(block.label)] + ")";
    } else {
      add(block.category, block.unit, block.bytes);
    }
  }
  if (unattributed != 0) {
    add(MemoryCategory::Other, -2, unattributed);
    groups[{MemoryCategory::Other, -2}].module = "(alive before the recording)";
  }
  for (auto& [key, group] : groups) {
    peak.groups.push_back(std::move(group));
  }
  std::stable_sort(peak.groups.begin(), peak.groups.end(),
                   [](const auto& a, const auto& b) { return a.bytes > b.bytes; });
  return peak;
}

MemoryPeak MemoryRecorder::Impl::peak() const {
  std::lock_guard<std::mutex> lock(mutex);
  return peak_locked();
}

detail::Recording MemoryRecorder::Impl::recording() const {
  std::lock_guard<std::mutex> lock(mutex);
  detail::Recording r;
  r.events.reserve(static_cast<std::size_t>(size_));
  for (auto seq = next_seq_ - size_; seq < next_seq_; ++seq) {
    r.events.push_back(event(seq));
  }
  r.dropped = dropped_;
  r.units = units_;
  r.labels = labels_;
  r.live = live_;
  r.unattributed = unattributed_;
  r.start_bytes = start_bytes_;
  r.end_bytes = end_bytes_;
  r.device = device_;
  if (peak_kept()) {
    r.peak = peak_locked();
  }
  return r;
}

MemoryRecorder::MemoryRecorder(MemoryRecorderOptions options)
    : impl_(std::make_shared<Impl>(options)) {
  impl_->start();
}

MemoryRecorder::~MemoryRecorder() {
  try {
    impl_->stop();
  } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw
  }
}

void MemoryRecorder::watch(const torch::nn::Module& module,
                           const torch::optim::Optimizer* optimizer, const std::string& prefix) {
  impl_->watch(module, optimizer, prefix);
}

void MemoryRecorder::stop() { impl_->stop(); }

bool MemoryRecorder::recording() const { return impl_->read(impl_->recording_); }
std::int64_t MemoryRecorder::events() const { return impl_->read(impl_->size_); }
std::int64_t MemoryRecorder::dropped() const { return impl_->read(impl_->dropped_); }
std::int64_t MemoryRecorder::start_bytes() const { return impl_->read(impl_->start_bytes_); }
std::int64_t MemoryRecorder::peak_bytes() const { return impl_->read(impl_->peak_bytes_); }

MemoryPeak MemoryRecorder::peak() const { return impl_->peak(); }

}  // namespace frugal
