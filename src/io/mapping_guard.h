// A file mapping that another program truncates must not kill the process that reads it.
#pragma once

#include <atomic>
#include <cstddef>

namespace frugal::io::detail {

/// Guards [base, base + size), a read-only-file mapping: a read past the file's end after
/// another program truncated it (SIGBUS) gets zero pages instead of the signal, and sets
/// `*truncated`, which the reader checks before it trusts what it read. Signals outside every
/// guarded range go to the handler that was there before. Returns false when no slot is
/// free (the range is then unguarded, as any mapping is).
bool guard_mapping(void* base, std::size_t size, std::atomic<bool>* truncated);

/// Stops guarding the range that starts at `base`; call before unmapping it.
void unguard_mapping(void* base);

}  // namespace frugal::io::detail
