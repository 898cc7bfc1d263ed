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
#include <nlohmann/json.hpp>

#include "frugal/error.h"
#include "io/safetensors_format.h"

namespace frugal::io {
namespace detail {

/// One mapped .safetensors file: unmapped when the last view of it goes.
struct SafetensorsShard {
  std::string path;
  void* base = nullptr;
  std::size_t size = 0;
  std::size_t data_start = 0;                                           // 8 + the header's length
  std::map<std::string, std::pair<std::int64_t, std::int64_t>> ranges;  // data offsets

  ~SafetensorsShard() {
    if (base != nullptr) {
      munmap(base, size);
    }
  }
};

namespace {

constexpr std::uint64_t kMaxHeader = 100'000'000;  // the safetensors package's own bound

[[noreturn]] void refuse(const std::string& path, const std::string& what) {
  throw Error("frugal: " + path + " is not a whole safetensors file: " + what);
}

std::shared_ptr<SafetensorsShard> map_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  FRUGAL_CHECK(fd >= 0, "frugal: cannot open ", path, ": ", std::strerror(errno));
  struct stat st {};
  const bool stated = ::fstat(fd, &st) == 0;
  auto shard = std::make_shared<SafetensorsShard>();
  shard->path = path;
  shard->size = stated ? static_cast<std::size_t>(st.st_size) : 0;
  if (shard->size > 0) {
    // Private and writable: a view written to changes this process's pages, not the file.
    void* p = ::mmap(nullptr, shard->size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    shard->base = p == MAP_FAILED ? nullptr : p;
  }
  ::close(fd);
  if (shard->size < 8) {
    refuse(path, c10::str(shard->size, " bytes, fewer than the header's 8-byte length"));
  }
  FRUGAL_CHECK(shard->base != nullptr, "frugal: cannot map ", path, ": ", std::strerror(errno));
  return shard;
}

std::vector<std::int64_t> read_shape(const nlohmann::json& shape, const std::string& path,
                                     const std::string& name) {
  if (!shape.is_array()) {
    refuse(path, "tensor '" + name + "' has no shape array");
  }
  std::vector<std::int64_t> out;
  for (const auto& d : shape) {
    if (!d.is_number_unsigned()) {
      refuse(path, "tensor '" + name + "' has a shape of " + shape.dump());
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
    refuse(path, c10::str("its header claims ", n, " bytes and the file has ", shard.size - 8,
                          " after the length"));
  }
  shard.data_start = 8 + n;
  const char* text = static_cast<const char*>(shard.base) + 8;
  auto header = nlohmann::json::parse(text, text + n, nullptr, /*allow_exceptions=*/false);
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
        !entry["data_offsets"][1].is_number_unsigned()) {
      refuse(path,
             "tensor '" + name + "' has an entry without dtype and data_offsets: " + entry.dump());
    }
    TensorInfo info;
    info.dtype = entry["dtype"].get<std::string>();
    info.shape = read_shape(entry.value("shape", nlohmann::json()), path, name);
    info.file = path;
    const auto bytes = detail::dtype_bytes(info.dtype);
    if (bytes == 0) {
      refuse(path, "tensor '" + name + "' has dtype '" + info.dtype + "', which safetensors lacks");
    }
    const auto begin = entry["data_offsets"][0].get<std::int64_t>();
    const auto end = entry["data_offsets"][1].get<std::int64_t>();
    std::int64_t numel = 1;
    for (const auto d : info.shape) {
      numel *= d;
    }
    if (end < begin || end > data_bytes || end - begin != numel * bytes) {
      refuse(path, c10::str("tensor '", name, "' (", info.dtype, ", shape ",
                            c10::IntArrayRef(info.shape), ") has bytes [", begin, ", ", end,
                            ") of ", data_bytes, " in the file's data; it needs ", numel * bytes));
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
  std::ifstream in(file);
  FRUGAL_CHECK(in.good(), "frugal: cannot open ", file);
  const auto index = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  FRUGAL_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
               "frugal: ", file, " is not a safetensors index: it has no weight_map object");
  if (index.contains("metadata") && index["metadata"].is_object()) {
    for (const auto& [k, v] : index["metadata"].items()) {
      metadata_[k] = v.is_string() ? v.get<std::string>() : v.dump();
    }
  }
  const auto dir = fs::path(file).parent_path();
  for (const auto& [name, shard_name] : index["weight_map"].items()) {
    FRUGAL_CHECK(shard_name.is_string(), "frugal: ", file, " maps '", name, "' to ",
                 shard_name.dump());
    const auto shard_path = (dir / shard_name.get<std::string>()).string();
    if (shards_.count(shard_path) == 0) {
      auto shard = detail::map_file(shard_path);
      for (auto& [tensor, info] : detail::read_header(*shard, nullptr)) {
        FRUGAL_CHECK(infos_.count(tensor) == 0, "frugal: tensor '", tensor, "' is in both ",
                     infos_[tensor].file, " and ", shard_path);
        infos_.emplace(tensor, std::move(info));
      }
      shards_.emplace(shard_path, std::move(shard));
    }
    FRUGAL_CHECK(infos_.count(name) == 1 && infos_[name].file == shard_path, "frugal: ", file,
                 " puts tensor '", name, "' in ", shard_path, ", which does not hold it");
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
  FRUGAL_CHECK(it != infos_.end(), "frugal: the checkpoint has no tensor '", name, "'");
  return it->second;
}

torch::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const auto& i = info(name);
  const auto type = detail::scalar_type(i.dtype);
  FRUGAL_CHECK(type.has_value(), "frugal: tensor '", name, "' has dtype ", i.dtype,
               ", which this LibTorch has no type for");
  const auto& shard = shards_.at(i.file);
  const auto [begin, end] = shard->ranges.at(name);
  auto* data = static_cast<char*>(shard->base) + shard->data_start + begin;
  const auto options = torch::TensorOptions().dtype(*type);
  const auto bytes = detail::dtype_bytes(i.dtype);
  if (reinterpret_cast<std::uintptr_t>(data) % bytes != 0) {  // a writer that did not align
    auto out = torch::empty(i.shape, options);
    std::memcpy(out.data_ptr(), data, static_cast<std::size_t>(end - begin));
    return out;
  }
  auto keep = shard;  // the mapping lives while the view does
  return torch::from_blob(
      data, i.shape, [keep](void*) {}, options);
}

}  // namespace frugal::io
