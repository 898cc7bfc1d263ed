// The safetensors format's dtype names and their sizes, shared by the reader and the writer.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>

namespace frugal::io::detail {

/// The header's dtype name's element size in bytes, or 0 for a name the format lacks.
std::int64_t dtype_bytes(const std::string& name);

/// LibTorch's type for a dtype name, or none where this LibTorch has no such type.
std::optional<c10::ScalarType> scalar_type(const std::string& name);

/// The format's name for a LibTorch type; an error for one it has no name for.
std::string dtype_name(c10::ScalarType type);

}  // namespace frugal::io::detail
