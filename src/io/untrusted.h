// Reading files other programs wrote: opened without blocking on special files, sized before
// they are read, and quoted in errors without reproducing whatever they hold.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>

namespace frugal::io::detail {

/// Opens `path` for reading and returns its descriptor, refusing (frugal::Error naming the
/// path) anything but a regular file: a FIFO, a device or a directory is named as such
/// before any read could block on it. `size` gets the file's size. The caller closes it.
int open_regular(const std::string& path, std::size_t* size);

/// The whole of a regular file of at most `max_bytes` bytes; an error names the path and
/// what it is otherwise (missing, not a regular file, too large, unreadable).
std::string read_regular(const std::string& path, std::size_t max_bytes);

/// A JSON file of at most `max_bytes`, parsed; an error names the path and where the text
/// stops being JSON. Parsing is iterative, so nesting depth cannot overflow the stack.
nlohmann::json read_json(const std::string& path, std::size_t max_bytes = 16u << 20);

/// A JSON value as an error message quotes it: nested at most a few levels deep (deeper
/// parts shown as `[...]` or `{...}`), cut to about `max_chars` characters, so a value
/// from an untrusted file can be quoted whatever its size or depth.
std::string excerpt(const nlohmann::json& value, std::size_t max_chars = 160);

/// A name read from a file (a tensor's, a shard's), in single quotes, cut to `max_chars`.
std::string quote_name(const std::string& name, std::size_t max_chars = 120);

/// A JSON value's type as a message names it ("a string", "a number 2.9", ...).
std::string describe(const nlohmann::json& value);

}  // namespace frugal::io::detail
