#include "state_file.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "frugal/error.h"

namespace frugal::detail {
namespace {

// Header, 32 bytes, little-endian: magic, version, reserved, payload length, CRC-32, reserved.
constexpr char kMagic[8] = {'F', 'R', 'U', 'G', 'A', 'L', 'T', 'S'};
constexpr std::size_t kHeaderBytes = 32;

void put_u32(unsigned char* out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) {
    out[i] = static_cast<unsigned char>(v >> (8 * i));
  }
}

void put_u64(unsigned char* out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<unsigned char>(v >> (8 * i));
  }
}

std::uint64_t get_le(const unsigned char* in, int bytes) {
  std::uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) {
    v = (v << 8) | in[i];
  }
  return v;
}

std::uint32_t crc_update(std::uint32_t crc, const void* data, std::size_t size) {
  const auto* bytes = static_cast<const Bytef*>(data);
  while (size > 0) {  // zlib takes at most a uInt at a time
    const auto chunk = static_cast<uInt>(std::min<std::size_t>(size, 1u << 30));
    crc = static_cast<std::uint32_t>(crc32(crc, bytes, chunk));
    bytes += chunk;
    size -= chunk;
  }
  return crc;
}

// The bytes an unprivileged writer may still use in the file system of `dir` (-1: unknown).
long long free_bytes(const std::string& dir) {
  struct statvfs fs {};
  if (::statvfs(dir.c_str(), &fs) != 0) {
    return -1;
  }
  return static_cast<long long>(fs.f_bavail) * static_cast<long long>(fs.f_frsize);
}

std::string system_error(const char* what, const std::string& path) {
  return std::string(what) + " '" + path + "': " + std::strerror(errno);
}

// Closes the descriptor and removes the temporary file unless released.
class TempFile {
 public:
  explicit TempFile(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    FRUGAL_CHECK(fd_ >= 0, "frugal: cannot create ", system_error("the file", path_));
  }
  ~TempFile() {
    if (!released_) {
      discard();
    } else if (fd_ >= 0) {
      ::close(fd_);
    }
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  void write_all(const void* data, std::size_t size, off_t* at = nullptr) {
    const auto* bytes = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t n = at ? ::pwrite(fd_, bytes, size, *at) : ::write(fd_, bytes, size);
      if (n < 0 && errno == EINTR) {
        continue;
      }
      FRUGAL_CHECK(n > 0, "frugal: cannot write ", system_error("the file", path_));
      bytes += n;
      size -= static_cast<std::size_t>(n);
      if (at) {
        *at += n;
      }
    }
  }
  void sync_and_close() {
    FRUGAL_CHECK(::fsync(fd_) == 0, "frugal: cannot flush ", system_error("the file", path_));
    const int fd = fd_;
    fd_ = -1;
    FRUGAL_CHECK(::close(fd) == 0, "frugal: cannot close ", system_error("the file", path_));
  }
  void release() { released_ = true; }
  /// Closes and removes the file now.
  void discard() {
    if (fd_ >= 0) {
      ::close(fd_);
      fd_ = -1;
    }
    ::unlink(path_.c_str());
    released_ = true;
  }

 private:
  std::string path_;
  int fd_ = -1;
  bool released_ = false;
};

std::pair<std::string, std::string> split_path(const std::string& path) {
  const auto slash = path.rfind('/');
  if (slash == std::string::npos) {
    return {".", path};
  }
  return {slash == 0 ? "/" : path.substr(0, slash), path.substr(slash + 1)};
}

}  // namespace

void write_state_file(const std::string& path,
                      const std::function<void(const ByteWriter&)>& payload) {
  const auto [dir, name] = split_path(path);
  FRUGAL_CHECK(!name.empty(), "frugal: '", path, "' names a folder, not a file");
  const std::string tmp_path = dir + "/." + name + ".tmp-" + std::to_string(::getpid());
  TempFile tmp(tmp_path);
  std::array<unsigned char, kHeaderBytes> header{};
  std::uint64_t length = 0;
  std::string failed;  // the first write's error: the file is dropped, the save refused
  // LibTorch's archive writer must not see an error: one thrown through it comes back from
  // its destructor and ends the process. The payload is counted on after a failed write, so
  // that the error can say how much the save needs.
  auto write = [&](const void* data, std::size_t size, off_t* at = nullptr) {
    if (failed.empty()) {
      try {
        tmp.write_all(data, size, at);
      } catch (const std::exception& e) {
        failed = error_message(e);
      }
    }
  };
  write(header.data(), header.size());  // filled in once the payload is known
  std::uint32_t crc = crc_update(0, nullptr, 0);
  payload([&](const void* data, std::size_t size) {
    write(data, size);
    crc = crc_update(crc, data, size);
    length += size;
    return size;
  });
  std::memcpy(header.data(), kMagic, sizeof(kMagic));
  put_u32(header.data() + 8, kStateFormatVersion);
  put_u64(header.data() + 16, length);
  put_u32(header.data() + 24, crc);
  off_t at = 0;
  write(header.data(), header.size(), &at);
  if (failed.empty()) {
    try {
      tmp.sync_and_close();  // a full disk may show here, on a file system that delays
    } catch (const std::exception& e) {
      failed = error_message(e);
    }
  }
  if (!failed.empty()) {
    tmp.discard();
    const std::string prefix = "frugal: ";
    if (failed.rfind(prefix, 0) == 0) {
      failed.erase(0, prefix.size());
    }
    FRUGAL_CHECK(false, "frugal: cannot save '", path, "': ", failed, "; the save needs ",
                 kHeaderBytes + length, " bytes and the file system has ", free_bytes(dir),
                 " free. The temporary file was removed; '", path, "' is as it was");
  }
  FRUGAL_CHECK(::rename(tmp_path.c_str(), path.c_str()) == 0, "frugal: cannot rename ",
               system_error("the temporary file to", path));
  tmp.release();
  // The rename is durable once the folder's entry is on disk.
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  FRUGAL_CHECK(dir_fd >= 0, "frugal: cannot open ", system_error("the folder", dir));
  const int synced = ::fsync(dir_fd);
  ::close(dir_fd);
  FRUGAL_CHECK(synced == 0, "frugal: cannot flush ", system_error("the folder", dir));
}

std::string read_state_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  FRUGAL_CHECK(fd >= 0, "frugal: cannot open ", system_error("the saved state", path));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  auto read_exactly = [&](void* out, std::size_t size) {
    auto* bytes = static_cast<char*>(out);
    std::size_t done = 0;
    while (done < size) {
      const ssize_t n = ::read(fd, bytes + done, size - done);
      if (n < 0 && errno == EINTR) {
        continue;
      }
      FRUGAL_CHECK(n >= 0, "frugal: cannot read ", system_error("the saved state", path));
      if (n == 0) {
        break;
      }
      done += static_cast<std::size_t>(n);
    }
    return done;
  };
  std::array<unsigned char, kHeaderBytes> header{};
  const std::size_t got = read_exactly(header.data(), header.size());
  FRUGAL_CHECK(got >= sizeof(kMagic) && std::memcmp(header.data(), kMagic, sizeof(kMagic)) == 0,
               "frugal: '", path, "' is not a frugal training state (no FRUGALTS header)");
  FRUGAL_CHECK(got == kHeaderBytes, "frugal: '", path, "' is truncated: ", got,
               " bytes, shorter than its header (", kHeaderBytes, ")");
  const auto version = static_cast<unsigned>(get_le(header.data() + 8, 4));
  FRUGAL_CHECK(version == kStateFormatVersion, "frugal: '", path, "' has format version ", version,
               "; this frugal reads version ", kStateFormatVersion);
  const std::uint64_t length = get_le(header.data() + 16, 8);
  const auto expected_crc = static_cast<std::uint32_t>(get_le(header.data() + 24, 4));
  struct stat info {};
  FRUGAL_CHECK(::fstat(fd, &info) == 0, "frugal: cannot stat ", system_error("the file", path));
  const auto size = static_cast<std::uint64_t>(info.st_size);
  FRUGAL_CHECK(size - kHeaderBytes >= length, "frugal: '", path, "' is truncated: ", size,
               " bytes of ", kHeaderBytes + length);
  FRUGAL_CHECK(size - kHeaderBytes == length, "frugal: '", path, "' has ",
               size - kHeaderBytes - length, " bytes after its end (", kHeaderBytes + length,
               " bytes)");
  std::string payload(length, '\0');
  FRUGAL_CHECK(read_exactly(payload.data(), length) == length, "frugal: '", path,
               "' is truncated while reading");
  const std::uint32_t crc = crc_update(crc_update(0, nullptr, 0), payload.data(), length);
  FRUGAL_CHECK(crc == expected_crc, "frugal: '", path, "' is damaged: its CRC-32 is ", crc,
               ", the header says ", expected_crc);
  return payload;
}

}  // namespace frugal::detail
