#include "frugal/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "frugal/error.h"
#include "io/mapping_guard.h"
#include "io/safetensors_format.h"
#include "io/untrusted.h"

namespace frugal::io {
namespace detail {

/// One mapped .safetensors file: unmapped when the last view of it goes.
struct SafetensorsShard {
  std::string path;
  void* base = nullptr;
  std::size_t size = 0;
  std::size_t data_start = 0;                                           // 8 + the header's length
  std::map<std::string, std::pair<std::int64_t, std::int64_t>> ranges;  // data offsets
  int fd = -1;                         // kept open to see the file's size when it is read
  std::atomic<bool> truncated{false};  // set when a read found pages gone from the file

  SafetensorsShard() = default;
  SafetensorsShard(const SafetensorsShard&) = delete;
  SafetensorsShard& operator=(const SafetensorsShard&) = delete;
  ~SafetensorsShard() {
    if (base != nullptr) {
      unguard_mapping(base);
      munmap(base, size);
    }
    if (fd >= 0) {
      ::close(fd);
    }
  }

  /// An error when another program shortened the file since it was mapped: what was read
  /// from it since then is not the file's data.
  void check_intact() const {
    struct stat st {};
    const bool stated = ::fstat(fd, &st) == 0;
    if (truncated.load() || !stated || static_cast<std::size_t>(st.st_size) < size) {
      throw Error(
          c10::str("frugal: ", path, " changed while it was read: it had ", size,
                   " bytes when opened and has ",
                   stated ? std::to_string(st.st_size) : std::string("an unknown number of"),
                   " now; what was read from it since is not its data, so load it again"));
    }
  }
};

namespace {

constexpr std::uint64_t kMaxHeader = 100'000'000;  // the safetensors package's own bound
constexpr std::uint64_t kMaxIndex = std::numeric_limits<std::int64_t>::max();

[[noreturn]] void refuse(const std::string& path, const std::string& what) {
  throw Error("frugal: " + path + " is not a whole safetensors file: " + what);
}

std::shared_ptr<SafetensorsShard> map_file(const std::string& path) {
  auto shard = std::make_shared<SafetensorsShard>();
  shard->path = path;
  shard->fd = open_regular(path, &shard->size);
  if (shard->size < 8) {
    refuse(path, c10::str(shard->size, " bytes, fewer than the header's 8-byte length"));
  }
  // Private and writable: a view written to changes this process's pages, not the file.
  void* p = ::mmap(nullptr, shard->size, PROT_READ | PROT_WRITE, MAP_PRIVATE, shard->fd, 0);
  FRUGAL_CHECK(p != MAP_FAILED, "frugal: cannot map ", path, ": ", std::strerror(errno));
  shard->base = p;
  guard_mapping(shard->base, shard->size, &shard->truncated);
  return shard;
}

std::vector<std::int64_t> read_shape(const nlohmann::json& shape, const std::string& path,
                                     const std::string& name) {
  if (!shape.is_array()) {
    refuse(path, "tensor " + quote_name(name) + " has no shape array");
  }
  std::vector<std::int64_t> out;
  for (const auto& d : shape) {
    if (!d.is_number_unsigned() || d.get<std::uint64_t>() > kMaxIndex) {
      refuse(path, "tensor " + quote_name(name) + " has a shape of " + excerpt(shape));
    }
    out.push_back(d.get<std::int64_t>());
  }
  return out;
}

// Parses and checks the header of `shard`: every tensor's entry, byte ranges inside the data,
// of the right size, none overlapping, the data wholly covered.
std::map<std::string, TensorInfo> read_header(SafetensorsShard& shard,
                                              std::map<std::string, std::string>* metadata) {
  const auto& path = shard.path;
  std::uint64_t n = 0;
  std::memcpy(&n, shard.base, 8);  // little-endian, as the format is
  if (n > kMaxHeader || n > shard.size - 8) {
    refuse(path, c10::str("its first 8 bytes give a header of ", n, " bytes",
                          n > kMaxHeader ? c10::str(", more than the format's ", kMaxHeader)
                                         : c10::str(" and only ", shard.size - 8, " follow them"),
                          ": it is not a safetensors file, or it was cut short"));
  }
  shard.data_start = 8 + n;
  const char* text = static_cast<const char*>(shard.base) + 8;
  auto header = nlohmann::json::parse(text, text + n, nullptr, /*allow_exceptions=*/false);
  shard.check_intact();
  if (!header.is_object()) {
    refuse(path, "its header is not a JSON object");
  }
  std::map<std::string, TensorInfo> infos;
  std::vector<std::pair<std::int64_t, std::int64_t>> spans;
  const auto data_bytes = static_cast<std::int64_t>(shard.size - shard.data_start);
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (metadata != nullptr && entry.is_object()) {
        for (const auto& [k, v] : entry.items()) {
          if (v.is_string()) {
            (*metadata)[k] = v.get<std::string>();
          }
        }
      }
      continue;
    }
    if (!entry.is_object() || !entry.contains("dtype") || !entry["dtype"].is_string() ||
        !entry.contains("data_offsets") || !entry["data_offsets"].is_array() ||
        entry["data_offsets"].size() != 2 || !entry["data_offsets"][0].is_number_unsigned() ||
        !entry["data_offsets"][1].is_number_unsigned() ||
        entry["data_offsets"][0].get<std::uint64_t>() > kMaxIndex ||
        entry["data_offsets"][1].get<std::uint64_t>() > kMaxIndex) {
      refuse(path, "tensor " + quote_name(name) +
                       " has an entry without dtype and data_offsets: " + excerpt(entry));
    }
    TensorInfo info;
    info.dtype = entry["dtype"].get<std::string>();
    // Read in place: a copy of a value is recursive, and a file may nest one deep.
    static const nlohmann::json kNone;
    const auto shape = entry.find("shape");
    info.shape = read_shape(shape == entry.end() ? kNone : *shape, path, name);
    info.file = path;
    const auto bytes = detail::dtype_bytes(info.dtype);
    if (bytes == 0) {
      refuse(path, "tensor " + quote_name(name) + " has dtype " + quote_name(info.dtype) +
                       ", which safetensors lacks");
    }
    const auto begin = entry["data_offsets"][0].get<std::int64_t>();
    const auto end = entry["data_offsets"][1].get<std::int64_t>();
    std::int64_t need = bytes;
    for (const auto d : info.shape) {
      if (__builtin_mul_overflow(need, d, &need)) {
        refuse(path, c10::str("tensor ", quote_name(name), " has a shape of ",
                              c10::IntArrayRef(info.shape), ", more bytes than 64 bits count"));
      }
    }
    if (end < begin || end > data_bytes || end - begin != need) {
      refuse(path, c10::str("tensor ", quote_name(name), " (", info.dtype, ", shape ",
                            c10::IntArrayRef(info.shape), ") has bytes [", begin, ", ", end,
                            ") of ", data_bytes, " in the file's data; it needs ", need));
    }
    spans.emplace_back(begin, end);
    shard.ranges[name] = {begin, end};
    infos.emplace(name, std::move(info));
  }
  std::sort(spans.begin(), spans.end());
  std::int64_t reached = 0;
  for (const auto& [begin, end] : spans) {
    if (begin < reached) {
      refuse(path, c10::str("two tensors' bytes overlap at offset ", begin));
    }
    if (begin > reached) {
      refuse(path, c10::str("no tensor holds its bytes ", reached, " to ", begin));
    }
    reached = end;
  }
  if (reached != data_bytes) {
    refuse(path,
           c10::str("its tensors hold ", reached, " bytes of data and the file has ", data_bytes));
  }
  return infos;
}

}  // namespace

// The path of a shard an index names, which must be a file inside the index's folder: no
// absolute path, no "..", and no symbolic link that leads out of it.
std::string shard_in(const std::filesystem::path& dir, const std::string& name,
                     const std::string& index) {
  namespace fs = std::filesystem;
  FRUGAL_CHECK(name.size() <= 1024, "frugal: ", index, " names a shard of ", name.size(),
               " characters, ", excerpt(nlohmann::json(name), 60), ", longer than a file name");
  const fs::path relative(name);
  bool inside = !name.empty() && !relative.has_root_path();
  for (const auto& part : relative) {
    inside = inside && part != "..";
  }
  FRUGAL_CHECK(inside, "frugal: ", index, " names the shard ", excerpt(nlohmann::json(name)),
               ", which is not a file inside its folder");
  const auto path = dir / relative;
  std::error_code error, dir_error;
  const auto real = fs::canonical(path, error);
  const auto real_dir = fs::canonical(dir.empty() ? fs::path(".") : dir, dir_error);
  FRUGAL_CHECK(!error && !dir_error, "frugal: cannot open ", path.string(), ": ",
               (error ? error : dir_error).message());
  const auto [d, r] = std::mismatch(real_dir.begin(), real_dir.end(), real.begin(), real.end());
  FRUGAL_CHECK(d == real_dir.end() && r != real.end(), "frugal: ", index, " names the shard '",
               name, "', a link to ", quote_name(real.string(), 300), " outside its folder");
  return path.string();
}

}  // namespace detail

SafetensorsFile::SafetensorsFile(const std::string& path) {
  namespace fs = std::filesystem;
  std::string file = path;
  if (fs::is_directory(path)) {
    const auto index = fs::path(path) / "model.safetensors.index.json";
    file = fs::exists(index) ? index.string() : (fs::path(path) / "model.safetensors").string();
  }
  const bool sharded = file.size() > 11 && file.compare(file.size() - 11, 11, ".index.json") == 0;
  if (!sharded) {
    auto shard = detail::map_file(file);
    infos_ = detail::read_header(*shard, &metadata_);
    shards_.emplace(file, std::move(shard));
    return;
  }
  const auto index = detail::read_json(file);
  FRUGAL_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
               "frugal: ", file, " is not a safetensors index: it has no weight_map object");
  if (index.contains("metadata") && index["metadata"].is_object()) {
    for (const auto& [k, v] : index["metadata"].items()) {
      metadata_[k] = v.is_string() ? v.get<std::string>() : detail::excerpt(v, 4096);
    }
  }
  const auto dir = fs::path(file).parent_path();
  for (const auto& [name, shard_name] : index["weight_map"].items()) {
    FRUGAL_CHECK(shard_name.is_string(), "frugal: ", file, " maps ", detail::quote_name(name),
                 " to ", detail::excerpt(shard_name), ", not a file name");
    const auto shard_path = detail::shard_in(dir, shard_name.get<std::string>(), file);
    if (shards_.count(shard_path) == 0) {
      auto shard = detail::map_file(shard_path);
      for (auto& [tensor, info] : detail::read_header(*shard, nullptr)) {
        FRUGAL_CHECK(infos_.count(tensor) == 0, "frugal: tensor ", detail::quote_name(tensor),
                     " is in both ", infos_[tensor].file, " and ", shard_path);
        infos_.emplace(tensor, std::move(info));
      }
      shards_.emplace(shard_path, std::move(shard));
    }
    FRUGAL_CHECK(infos_.count(name) == 1 && infos_[name].file == shard_path, "frugal: ", file,
                 " puts tensor ", detail::quote_name(name), " in ", shard_path,
                 ", which does not hold it");
  }
}

void SafetensorsFile::check_unchanged() const {
  for (const auto& [file, shard] : shards_) {
    shard->check_intact();
  }
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  for (const auto& item : infos_) {
    out.push_back(item.first);
  }
  return out;
}

bool SafetensorsFile::contains(const std::string& name) const { return infos_.count(name) == 1; }

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  const auto it = infos_.find(name);
  FRUGAL_CHECK(it != infos_.end(), "frugal: the checkpoint has no tensor ",
               detail::quote_name(name));
  return it->second;
}

torch::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const auto& i = info(name);
  const auto type = detail::scalar_type(i.dtype);
  FRUGAL_CHECK(type.has_value(), "frugal: tensor ", detail::quote_name(name), " has dtype ",
               i.dtype, ", which this LibTorch has no type for");
  const auto& shard = shards_.at(i.file);
  shard->check_intact();
  const auto [begin, end] = shard->ranges.at(name);
  auto* data = static_cast<char*>(shard->base) + shard->data_start + begin;
  const auto options = torch::TensorOptions().dtype(*type);
  const auto bytes = detail::dtype_bytes(i.dtype);
  if (reinterpret_cast<std::uintptr_t>(data) % bytes != 0) {  // a writer that did not align
    auto out = torch::empty(i.shape, options);
    if (end > begin) {  // an empty tensor has no data pointer to copy to
      std::memcpy(out.data_ptr(), data, static_cast<std::size_t>(end - begin));
    }
    return out;
  }
  auto keep = shard;  // the mapping lives while the view does
  return torch::from_blob(
      data, i.shape, [keep](void*) {}, options);
}

}  // namespace frugal::io
