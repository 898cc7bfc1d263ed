#include "file_write.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "frugal/error.h"

namespace frugal::detail {

void write_whole(const std::string& path,
                 const std::vector<std::pair<const char*, std::size_t>>& parts) {
  const auto tmp = path + ".partial";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  FRUGAL_CHECK(fd >= 0, "frugal: cannot write ", tmp, ": ", std::strerror(errno));
  auto fail = [&](const char* what, int error) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw Error(c10::str("frugal: ", what, " ", path, " failed: ", std::strerror(error),
                         "; the file is as it was"));
  };
  for (const auto& [data, size] : parts) {
    std::size_t done = 0;
    while (done < size) {
      const auto n = ::write(fd, data + done, size - done);
      if (n < 0 && errno == EINTR) {
        continue;
      }
      if (n <= 0) {
        fail("writing", n == 0 ? EIO : errno);
      }
      done += static_cast<std::size_t>(n);
    }
  }
  if (::close(fd) != 0) {
    const int error = errno;
    ::unlink(tmp.c_str());
    throw Error(c10::str("frugal: writing ", path, " failed: ", std::strerror(error),
                         "; the file is as it was"));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(tmp.c_str());
    throw Error(c10::str("frugal: cannot rename ", tmp, " to ", path, ": ", std::strerror(error)));
  }
}

}  // namespace frugal::detail
