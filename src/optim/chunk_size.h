// How many elements of a parameter the in-place update takes at a time.
#pragma once

#include <c10/core/DeviceType.h>

#include <algorithm>
#include <cstdint>

namespace frugal::detail {

/// What decides a parameter's chunk.
struct ChunkRequest {
  c10::DeviceType device = c10::DeviceType::CPU;
  std::int64_t chunk = 1;              ///< InPlaceOptions::chunk: elements a chunk on the CPU
  std::int64_t device_scratch = 0;     ///< InPlaceOptions::device_scratch: bytes, 0 for none
  std::int64_t bytes_per_element = 1;  ///< scratch bytes one element of a chunk costs
  std::int64_t multiple = 1;           ///< chunks are a multiple of this many elements
  std::int64_t numel = 0;              ///< the parameter's elements
  bool flat = true;                    ///< contiguous: a chunk may be a range of it
};

/// The chunk's elements. On the CPU, `chunk` (cache-sized: the update's buffers stay in the
/// caches between its passes). On an accelerator each pass over a chunk is a kernel launch of
/// a few microseconds whatever its size, so the chunk grows until its scratch reaches
/// `device_scratch` bytes (never below `chunk`). Always a multiple of `multiple`, and at most
/// the whole parameter, which a parameter that is not flat is taken as.
inline std::int64_t chunk_elements(const ChunkRequest& r) {
  if (!r.flat) {
    return r.numel;
  }
  std::int64_t want = r.chunk;
  if (r.device != c10::DeviceType::CPU && r.device_scratch > 0) {
    want = std::max(want, r.device_scratch / std::max<std::int64_t>(1, r.bytes_per_element));
  }
  const std::int64_t multiple = std::max<std::int64_t>(1, r.multiple);
  return std::min(std::max(multiple, want / multiple * multiple), r.numel);
}

}  // namespace frugal::detail
