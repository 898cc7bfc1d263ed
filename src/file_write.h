// Files written whole or not at all: what a failed write leaves is the old file.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace frugal::detail {

/// Writes the byte ranges `parts`, in order, as the file `path`: to `<path>.partial`
/// first, renamed over `path` once whole, so `path` is the old file or the whole new one.
/// On failure the partial file is removed and the error names the path and the system's
/// reason (a full disk: "No space left on device").
void write_whole(const std::string& path,
                 const std::vector<std::pair<const char*, std::size_t>>& parts);

}  // namespace frugal::detail
