// The file around a saved training state: header, checksum, atomic replacement.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

namespace frugal::detail {

/// Writes what `payload` produces (through the writer it is given) to `path` with a header
/// (magic, format version, length, CRC-32): to a temporary file beside it, fsync, rename,
/// fsync of the folder. On failure the temporary file is removed and `path` is untouched.
using ByteWriter = std::function<std::size_t(const void* data, std::size_t size)>;
void write_state_file(const std::string& path,
                      const std::function<void(const ByteWriter&)>& payload);

/// The payload of a file written by write_state_file, after checking its header, length and
/// checksum; the error names the file and what is wrong with it.
std::string read_state_file(const std::string& path);

/// The format version write_state_file writes and read_state_file accepts.
constexpr unsigned kStateFormatVersion = 1;

}  // namespace frugal::detail
