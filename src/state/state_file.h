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

/// Removes `path`, a temporary file of write_state_file, unless a save is writing it now
/// (in this process or another: it holds a lock on the file while it lives). Returns
/// whether it removed it.
bool remove_if_abandoned(const std::string& path);

/// The payload of a file written by write_state_file, after checking its header, length and
/// checksum; the error names the file and what is wrong with it.
std::string read_state_file(const std::string& path);
/// Checks a file as read_state_file does (header, length, checksum) without keeping its
/// payload: a megabyte at a time.
void check_state_file(const std::string& path);

/// The format version write_state_file writes and read_state_file accepts.
constexpr unsigned kStateFormatVersion = 1;

}  // namespace frugal::detail
