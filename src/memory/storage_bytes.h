// A storage that gives its bytes back and takes new ones later as the same StorageImpl:
// tensors and views that share it (those autograd saved in a forward) see the new bytes.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include "frugal/memory/memory_context.h"

namespace frugal::detail {

/// `t`'s storage keeps its identity and holds no bytes.
inline void drop_bytes(const at::Tensor& t) {
  auto* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  storage->set_nbytes(0);
}

/// `t`'s storage takes new bytes (uninitialised) for t's elements, from its device's
/// allocator: a unit's weights made whole, which a MemoryRecorder counts as such.
inline void take_bytes(const at::Tensor& t) {
  const c10::DeviceGuard on(t.device());
  const MaterialiseScope materialising;
  const auto bytes = static_cast<std::size_t>(t.numel()) * t.element_size();
  auto* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(c10::GetAllocator(t.device().type())->allocate(bytes));
  storage->set_nbytes(bytes);
}

/// Whether `t`'s storage holds bytes.
inline bool holds_bytes(const at::Tensor& t) { return t.storage().nbytes() > 0; }

}  // namespace frugal::detail
