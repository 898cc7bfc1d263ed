#include "frugal/data/idx.h"

#include <c10/util/Exception.h>
#include <zlib.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <memory>
#include <vector>

namespace frugal::data {
namespace {

struct GzCloser {
  void operator()(gzFile f) const { gzclose(f); }
};
using GzFile = std::unique_ptr<std::remove_pointer_t<gzFile>, GzCloser>;

// Reads exactly n bytes; returns how many could be read.
std::int64_t read_bytes(gzFile f, void* out, std::int64_t n) {
  std::int64_t done = 0;
  auto* p = static_cast<unsigned char*>(out);
  while (done < n) {
    const auto chunk = static_cast<unsigned>(std::min<std::int64_t>(n - done, 1 << 30));
    const int got = gzread(f, p + done, chunk);
    if (got <= 0) {
      break;
    }
    done += got;
  }
  return done;
}

}  // namespace

torch::Tensor read_idx(const std::string& path) {
  errno = 0;
  GzFile file(gzopen(path.c_str(), "rb"));
  TORCH_CHECK(file != nullptr, "frugal: cannot open '", path,
              "': ", errno != 0 ? std::strerror(errno) : "gzopen failed");
  std::array<unsigned char, 4> magic{};
  TORCH_CHECK(read_bytes(file.get(), magic.data(), 4) == 4, "frugal: '", path,
              "' is too short for an IDX header");
  TORCH_CHECK(magic[0] == 0 && magic[1] == 0, "frugal: '", path,
              "' is not an IDX file (its first bytes are not 0x00 0x00)");
  TORCH_CHECK(magic[2] == 0x08, "frugal: '", path, "' holds IDX type 0x", std::hex,
              static_cast<int>(magic[2]), "; only unsigned bytes (0x08) are supported");
  const int dims = magic[3];
  TORCH_CHECK(dims >= 1 && dims <= 4, "frugal: '", path, "' declares ", dims,
              " dimensions; expected 1 to 4");
  std::vector<std::int64_t> shape;
  std::int64_t numel = 1;
  for (int i = 0; i < dims; ++i) {
    std::array<unsigned char, 4> b{};
    TORCH_CHECK(read_bytes(file.get(), b.data(), 4) == 4, "frugal: '", path,
                "' ends inside its IDX header");
    const std::int64_t size = (std::int64_t{b[0]} << 24) | (b[1] << 16) | (b[2] << 8) | b[3];
    shape.push_back(size);
    numel *= size;
  }
  auto out = torch::empty(shape, torch::kUInt8);
  const auto got = read_bytes(file.get(), out.data_ptr<std::uint8_t>(), numel);
  TORCH_CHECK(got == numel, "frugal: '", path, "' is truncated: its header promises ", numel,
              " bytes of data, found ", got);
  return out;
}

Batch load_mnist_dir(const std::string& dir, Split split) {
  const std::string prefix = dir + (split == Split::Train ? "/train" : "/t10k");
  auto images = read_idx(prefix + "-images-idx3-ubyte.gz");
  auto labels = read_idx(prefix + "-labels-idx1-ubyte.gz");
  TORCH_CHECK(images.dim() == 3, "frugal: ", prefix, "-images-idx3-ubyte.gz has ", images.dim(),
              " dimensions; images need 3 (count, rows, columns)");
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == images.size(0), "frugal: ", prefix,
              ": ", images.size(0), " images but ", labels.numel(), " labels");
  Batch batch;
  batch.inputs = images.unsqueeze(1).to(torch::kFloat).div_(255.0);
  batch.targets = labels.to(torch::kLong);
  return batch;
}

}  // namespace frugal::data
