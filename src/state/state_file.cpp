#include "state_file.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/file.h>
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
#include <vector>

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

// Whether `path` still names the file open as `fd`.
bool is_at_path(int fd, const std::string& path) {
  struct stat open_file {
  }, named{};
  return ::fstat(fd, &open_file) == 0 && ::stat(path.c_str(), &named) == 0 &&
         open_file.st_dev == named.st_dev && open_file.st_ino == named.st_ino;
}

// Closes the descriptor and removes the temporary file unless released.
class TempFile {
 public:
  // Created and locked (flock) for as long as it lives: a save in another process that
  // sweeps abandoned temporary files from the folder leaves a locked one alone.
  explicit TempFile(std::string path) : path_(std::move(path)) {
    for (;;) {
      fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      FRUGAL_CHECK(fd_ >= 0, "frugal: cannot create ", system_error("the file", path_));
      FRUGAL_CHECK(::flock(fd_, LOCK_EX) == 0, "frugal: cannot lock ",
                   system_error("the file", path_));
      if (is_at_path(fd_, path_)) {
        break;
      }
      ::close(fd_);  // swept away between its creation and the lock: made again
    }
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
  void sync() {
    FRUGAL_CHECK(::fsync(fd_) == 0, "frugal: cannot flush ", system_error("the file", path_));
  }
  /// Keeps the file (renamed by now) and closes it, which drops the lock.
  void release() {
    released_ = true;
    ::close(fd_);
    fd_ = -1;
  }
  /// Closes and removes the file now.
  void discard() {
    ::unlink(path_.c_str());
    if (fd_ >= 0) {
      ::close(fd_);
      fd_ = -1;
    }
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
      tmp.sync();  // a full disk may show here, on a file system that delays
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

namespace {

// What kind of file `mode` is, for the error that refuses one that is not regular.
const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) {
    return "a folder";
  }
  if (S_ISFIFO(mode)) {
    return "a FIFO";
  }
  if (S_ISSOCK(mode)) {
    return "a socket";
  }
  return S_ISCHR(mode) || S_ISBLK(mode) ? "a device" : "not a regular file";
}

// A saved state opened for reading, its header checked: the payload's length and CRC-32.
class StateReader {
 public:
  explicit StateReader(const std::string& path) : path_(path) {
    // Without O_NONBLOCK, opening a FIFO waits for a writer that may never come.
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    FRUGAL_CHECK(fd_ >= 0, "frugal: cannot open ", system_error("the saved state", path));
    struct stat info {};
    FRUGAL_CHECK(::fstat(fd_, &info) == 0, "frugal: cannot stat ", system_error("the file", path));
    FRUGAL_CHECK(S_ISREG(info.st_mode), "frugal: '", path, "' is ", kind_of(info.st_mode),
                 ", not a saved state");
    const int flags = ::fcntl(fd_, F_GETFL);
    FRUGAL_CHECK(flags >= 0 && ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK) == 0,
                 "frugal: cannot read ", system_error("the saved state", path));
    std::array<unsigned char, kHeaderBytes> header{};
    const std::size_t got = read(header.data(), header.size());
    FRUGAL_CHECK(got >= sizeof(kMagic) && std::memcmp(header.data(), kMagic, sizeof(kMagic)) == 0,
                 "frugal: '", path, "' is not a frugal training state (no FRUGALTS header)");
    FRUGAL_CHECK(got == kHeaderBytes, "frugal: '", path, "' is truncated: ", got,
                 " bytes, shorter than its header (", kHeaderBytes, ")");
    const auto version = static_cast<unsigned>(get_le(header.data() + 8, 4));
    FRUGAL_CHECK(version == kStateFormatVersion, "frugal: '", path, "' has format version ",
                 version, "; this frugal reads version ", kStateFormatVersion);
    length_ = get_le(header.data() + 16, 8);
    crc_ = static_cast<std::uint32_t>(get_le(header.data() + 24, 4));
    const auto size = static_cast<std::uint64_t>(info.st_size);
    FRUGAL_CHECK(size - kHeaderBytes >= length_, "frugal: '", path, "' is truncated: ", size,
                 " bytes of ", kHeaderBytes + length_);
    FRUGAL_CHECK(size - kHeaderBytes == length_, "frugal: '", path, "' has ",
                 size - kHeaderBytes - length_, " bytes after its end (", kHeaderBytes + length_,
                 " bytes)");
  }
  StateReader(const StateReader&) = delete;
  StateReader& operator=(const StateReader&) = delete;
  ~StateReader() { ::close(fd_); }

  std::uint64_t length() const { return length_; }

  // Reads up to `size` bytes, fewer only at the end of the file.
  std::size_t read(void* out, std::size_t size) {
    auto* bytes = static_cast<char*>(out);
    std::size_t done = 0;
    while (done < size) {
      const ssize_t n = ::read(fd_, bytes + done, size - done);
      if (n < 0 && errno == EINTR) {
        continue;
      }
      FRUGAL_CHECK(n >= 0, "frugal: cannot read ", system_error("the saved state", path_));
      if (n == 0) {
        break;
      }
      done += static_cast<std::size_t>(n);
    }
    return done;
  }

  // Reads the next `size` bytes of the payload into `out`, adding them to the checksum.
  void read_payload(void* out, std::size_t size) {
    FRUGAL_CHECK(read(out, size) == size, "frugal: '", path_, "' is truncated while reading");
    crc_seen_ = crc_update(crc_seen_, out, size);
  }

  // After the whole payload was read: throws unless its checksum is the header's.
  void check_crc() const {
    FRUGAL_CHECK(crc_seen_ == crc_, "frugal: '", path_, "' is damaged: its CRC-32 is ", crc_seen_,
                 ", the header says ", crc_);
  }

 private:
  std::string path_;
  int fd_ = -1;
  std::uint64_t length_ = 0;
  std::uint32_t crc_ = 0;
  std::uint32_t crc_seen_ = crc_update(0, nullptr, 0);
};

}  // namespace

bool remove_if_abandoned(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    return false;
  }
  const bool abandoned = ::flock(fd, LOCK_EX | LOCK_NB) == 0 && is_at_path(fd, path);
  if (abandoned) {
    ::unlink(path.c_str());  // under the lock: a writer that locks it next finds it gone
  }
  ::close(fd);
  return abandoned;
}

std::string read_state_file(const std::string& path) {
  StateReader reader(path);
  std::string payload(reader.length(), '\0');
  reader.read_payload(payload.data(), payload.size());
  reader.check_crc();
  return payload;
}

void check_state_file(const std::string& path) {
  StateReader reader(path);
  std::vector<char> buffer(std::min<std::uint64_t>(reader.length(), 1 << 20));
  for (std::uint64_t left = reader.length(); left > 0;) {
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(left, buffer.size()));
    reader.read_payload(buffer.data(), n);
    left -= n;
  }
  reader.check_crc();
}

}  // namespace frugal::detail
