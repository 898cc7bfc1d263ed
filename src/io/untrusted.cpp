#include "io/untrusted.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "frugal/error.h"

namespace frugal::io::detail {
namespace {

constexpr int kExcerptDepth = 3;

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

void append_excerpt(const nlohmann::json& v, int depth, std::size_t max_chars, std::string& out) {
  if (out.size() > max_chars) {
    return;
  }
  if (v.is_string()) {
    const auto& s = v.get_ref<const std::string&>();
    const bool cut = s.size() > max_chars;
    // Replacing invalid UTF-8 keeps dump() from throwing on bytes the file made up.
    out += nlohmann::json(cut ? s.substr(0, max_chars) : s)
               .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    if (cut) {
      out += "...";
    }
    return;
  }
  if (!v.is_structured()) {
    out += v.dump();
    return;
  }
  const bool object = v.is_object();
  if (depth >= kExcerptDepth && !v.empty()) {
    out += object ? "{...}" : "[...]";
    return;
  }
  out += object ? '{' : '[';
  bool first = true;
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (out.size() > max_chars) {
      out += ", ...";
      break;
    }
    out += first ? "" : ", ";
    first = false;
    if (object) {
      append_excerpt(nlohmann::json(it.key()), depth + 1, max_chars, out);
      out += ": ";
    }
    append_excerpt(*it, depth + 1, max_chars, out);
  }
  out += object ? '}' : ']';
}

}  // namespace

int open_regular(const std::string& path, std::size_t* size) {
  // O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting for one.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  FRUGAL_CHECK(fd >= 0, "frugal: cannot open ", path, ": ", std::strerror(errno));
  struct stat st {};
  const bool stated = ::fstat(fd, &st) == 0;
  if (!stated || !S_ISREG(st.st_mode)) {
    const int error = errno;
    ::close(fd);
    throw Error(c10::str("frugal: cannot read ", path, ": ",
                         stated ? kind_of(st.st_mode) : std::strerror(error),
                         stated ? ", not a regular file" : ""));
  }
  // Reads of a regular file never block; the flag is cleared for the descriptor's later users.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  *size = static_cast<std::size_t>(st.st_size);
  return fd;
}

std::string read_regular(const std::string& path, std::size_t max_bytes) {
  std::size_t size = 0;
  const int fd = open_regular(path, &size);
  if (size > max_bytes) {
    ::close(fd);
    throw Error(c10::str("frugal: ", path, " has ", size, " bytes, more than the ", max_bytes,
                         " a file of its kind may have"));
  }
  std::string text(size, '\0');
  std::size_t done = 0;
  while (done < size) {
    const auto n = ::read(fd, text.data() + done, size - done);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      const int error = errno;
      ::close(fd);
      throw Error(c10::str("frugal: reading ", path, " failed after ", done, " of ", size,
                           " bytes: ", n == 0 ? "the file became shorter" : std::strerror(error)));
    }
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
  return text;
}

nlohmann::json read_json(const std::string& path, std::size_t max_bytes) {
  const auto text = read_regular(path, max_bytes);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    std::string why = e.what();
    if (why.size() > 240) {  // the parser quotes its last token, which may be the whole file
      why = why.substr(0, 240) + "...";
    }
    throw Error(c10::str("frugal: ", path, " is not JSON: ", why));
  }
}

std::string excerpt(const nlohmann::json& value, std::size_t max_chars) {
  std::string out;
  append_excerpt(value, 0, max_chars, out);
  return out;
}

std::string quote_name(const std::string& name, std::size_t max_chars) {
  const bool cut = name.size() > max_chars;
  std::string out(1, '\'');
  out.append(name, 0, cut ? max_chars : name.size());
  if (cut) {
    out += "...' (";
    out += std::to_string(name.size());
    out += " bytes)";
  } else {
    out += '\'';
  }
  return out;
}

std::string describe(const nlohmann::json& value) {
  if (value.is_null()) return "null";
  if (value.is_structured()) return std::string("a JSON ") + value.type_name();
  return std::string("a JSON ") + value.type_name() + " " + excerpt(value, 60);
}

}  // namespace frugal::io::detail
