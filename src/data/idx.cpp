#include "frugal/data/idx.h"

#include <c10/util/Exception.h>
#include <sys/stat.h>
#include <zlib.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <memory>
#include <vector>

#include <torch/torch.h>
#include "frugal/error.h"

namespace frugal::data {
namespace {

struct GzCloser {
  void operator()(gzFile f) const { gzclose(f); }
};
using GzFile = std::unique_ptr<std::remove_pointer_t<gzFile>, GzCloser>;

// The IDX format's dimensions are 32-bit counts; a file of unsigned bytes larger than
// this is refused before anything is read.
constexpr std::int64_t kMaxElements = std::int64_t{1} << 40;

class Reader {
 public:
  explicit Reader(const std::string& path) : path_(path) {
    struct stat info {};
    FRUGAL_CHECK(::stat(path.c_str(), &info) == 0, "frugal: cannot open '", path,
                 "': ", std::strerror(errno));
    // A directory reads as an empty stream and a FIFO blocks: only regular files.
    FRUGAL_CHECK(S_ISREG(info.st_mode), "frugal: '", path, "' is ",
                 S_ISDIR(info.st_mode) ? "a directory" : "not a regular file",
                 "; an IDX file is expected");
    errno = 0;
    file_.reset(gzopen(path.c_str(), "rb"));
    FRUGAL_CHECK(file_ != nullptr, "frugal: cannot open '", path,
                 "': ", errno != 0 ? std::strerror(errno) : "gzopen failed");
  }

  // Reads up to n bytes; a corrupt compressed stream is an error naming zlib's reason.
  std::int64_t read(void* out, std::int64_t n) {
    std::int64_t done = 0;
    auto* p = static_cast<unsigned char*>(out);
    while (done < n) {
      const auto chunk = static_cast<unsigned>(std::min<std::int64_t>(n - done, 1 << 30));
      const int got = gzread(file_.get(), p + done, chunk);
      if (got < 0) {
        int code = 0;
        const char* reason = gzerror(file_.get(), &code);
        FRUGAL_CHECK(false, "frugal: '", path_, "' is corrupt: its gzip stream fails after ",
                     offset_ + done, " bytes (", reason != nullptr ? reason : "zlib error", ")");
      }
      if (got == 0) {
        break;
      }
      done += got;
    }
    offset_ += done;
    return done;
  }

  void header_bytes(unsigned char* out, std::int64_t n, const char* what) {
    FRUGAL_CHECK(read(out, n) == n, "frugal: '", path_, "' ends inside its IDX header (", what,
                 ")");
  }

 private:
  std::string path_;
  GzFile file_;
  std::int64_t offset_ = 0;
};

}  // namespace

torch::Tensor read_idx(const std::string& path) {
  Reader reader(path);
  std::array<unsigned char, 4> magic{};
  reader.header_bytes(magic.data(), 4, "magic number");
  FRUGAL_CHECK(magic[0] == 0 && magic[1] == 0, "frugal: '", path,
               "' is not an IDX file (its first bytes are not 0x00 0x00)");
  FRUGAL_CHECK(magic[2] == 0x08, "frugal: '", path, "' holds IDX type 0x", std::hex,
               static_cast<int>(magic[2]), "; only unsigned bytes (0x08) are supported");
  const int dims = magic[3];
  FRUGAL_CHECK(dims >= 1 && dims <= 4, "frugal: '", path, "' declares ", dims,
               " dimensions; expected 1 to 4");
  std::vector<std::int64_t> shape;
  std::int64_t numel = 1;
  for (int i = 0; i < dims; ++i) {
    std::array<unsigned char, 4> b{};
    reader.header_bytes(b.data(), 4, "dimension sizes");
    std::int64_t size = 0;
    for (const unsigned char byte : b) {
      size = (size << 8) | byte;
    }
    shape.push_back(size);
    FRUGAL_CHECK(size == 0 || numel <= kMaxElements / size, "frugal: '", path,
                 "' declares dimensions ", c10::IntArrayRef(shape),
                 "..., more than the 2^40 bytes an IDX file can hold here");
    numel *= size;
  }
  // Read in pieces, so that memory follows what the file holds rather than what its header
  // claims; the tensor is made once the data is known to be all there.
  std::vector<torch::Tensor> pieces;
  std::int64_t found = 0;
  constexpr std::int64_t kPiece = 1 << 20;
  while (found < numel) {
    const auto want = std::min(kPiece, numel - found);
    auto piece = torch::empty({want}, torch::kUInt8);
    const auto got = reader.read(piece.data_ptr<std::uint8_t>(), want);
    pieces.push_back(got < want ? piece.narrow(0, 0, got) : piece);
    found += got;
    if (got < want) {
      break;
    }
  }
  FRUGAL_CHECK(found == numel, "frugal: '", path, "' is truncated: its header promises ",
               numel, " bytes of data for shape ", c10::IntArrayRef(shape), ", the file holds ",
               found);
  unsigned char extra = 0;
  FRUGAL_CHECK(reader.read(&extra, 1) == 0, "frugal: '", path, "' holds more data than its ",
               "header declares (", numel, " bytes for shape ", c10::IntArrayRef(shape), ")");
  if (pieces.empty()) {
    return torch::empty(shape, torch::kUInt8);
  }
  auto flat = pieces.size() == 1 ? pieces.front() : torch::cat(pieces);
  pieces.clear();
  return flat.reshape(shape);
}

torch::Tensor to_unit_floats(const torch::Tensor& images) {
  return images.scalar_type() == torch::kByte ? images.to(torch::kFloat).div_(255.0) : images;
}

Batch load_mnist_dir(const std::string& dir, Split split, Pixels pixels) {
  const std::string prefix = dir + (split == Split::Train ? "/train" : "/t10k");
  const std::string images_path = prefix + "-images-idx3-ubyte.gz";
  const std::string labels_path = prefix + "-labels-idx1-ubyte.gz";
  auto images = read_idx(images_path);
  auto labels = read_idx(labels_path);
  FRUGAL_CHECK(images.dim() == 3 && images.size(1) == 28 && images.size(2) == 28, "frugal: '",
               images_path, "' holds images of shape ", images.sizes(),
               "; (count, 28, 28) is expected");
  FRUGAL_CHECK(images.size(0) > 0, "frugal: '", images_path, "' holds no images");
  FRUGAL_CHECK(labels.dim() == 1 && labels.size(0) == images.size(0), "frugal: '", labels_path,
               "' holds ", labels.numel(), " labels of shape ", labels.sizes(), " for ",
               images.size(0), " images");
  const auto bad = (labels > 9).nonzero();
  if (bad.numel() > 0) {
    const auto at = bad[0][0].item<std::int64_t>();
    FRUGAL_CHECK(false, "frugal: '", labels_path, "' holds label ", labels[at].item<int>(),
                 " at index ", at, " (", bad.size(0), " labels out of range); classes are 0 to 9");
  }
  Batch batch;
  batch.inputs = pixels == Pixels::Bytes ? images.unsqueeze(1).contiguous()
                                         : to_unit_floats(images.unsqueeze(1));
  batch.targets = labels.to(torch::kLong);
  return batch;
}

}  // namespace frugal::data
