// The counting allocator's cache: free blocks by size class, in shards with a lock each.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace frugal::detail {

// Free blocks by size class, in shards with a lock each: threads that allocate different
// sizes do not wait for one another.
class FreeLists {
 public:
  void* take(std::int64_t capacity) {
    auto& shard = shard_of(capacity);
    std::lock_guard<std::mutex> lock(shard.mutex);
    const auto it = shard.free.find(capacity);
    if (it == shard.free.end() || it->second.empty()) {
      return nullptr;
    }
    void* base = it->second.back();
    it->second.pop_back();
    return base;
  }

  void put(void* base, std::int64_t capacity) {
    auto& shard = shard_of(capacity);
    std::lock_guard<std::mutex> lock(shard.mutex);
    shard.free[capacity].push_back(base);
  }

  // Free blocks of at least `bytes` in all (every one for the default), taken out of the
  // cache for the caller to release.
  std::vector<std::pair<void*, std::int64_t>> drain(
      std::int64_t bytes = std::numeric_limits<std::int64_t>::max()) {
    std::vector<std::pair<void*, std::int64_t>> out;
    std::int64_t taken = 0;
    for (auto& shard : shards_) {
      std::lock_guard<std::mutex> lock(shard.mutex);
      for (auto it = shard.free.begin(); it != shard.free.end() && taken < bytes;) {
        auto& blocks = it->second;
        for (; !blocks.empty() && taken < bytes; blocks.pop_back()) {
          out.emplace_back(blocks.back(), it->first);
          taken += it->first;
        }
        it = blocks.empty() ? shard.free.erase(it) : std::next(it);
      }
    }
    return out;
  }

 private:
  struct Shard {
    std::mutex mutex;
    std::unordered_map<std::int64_t, std::vector<void*>> free;
  };
  Shard& shard_of(std::int64_t capacity) {
    return shards_[static_cast<std::size_t>(capacity / 512) % shards_.size()];
  }
  std::array<Shard, 16> shards_;
};

}  // namespace frugal::detail
