// safetensors checkpoints: read (memory-mapped, sharded or whole) into a module, and written.
#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace frugal::io {

namespace detail {
struct SafetensorsShard;
}  // namespace detail

/// A safetensors header's `__metadata__`: strings by name.
using Metadata = std::map<std::string, std::string>;

/// One tensor of a safetensors checkpoint as its header describes it.
struct TensorInfo {
  std::string dtype;  ///< the file's name for it: "F32", "BF16", "I8", ...
  std::vector<std::int64_t> shape;
  std::string file;  ///< the shard that holds it
};

/// A safetensors checkpoint opened for reading: one `.safetensors` file, a sharded one (its
/// `model.safetensors.index.json`), or a directory holding either (as `save_pretrained`
/// writes them). The files are memory-mapped, not read: a tensor is a view of the mapped
/// bytes, so a model can be loaded block by block (each block straight into a compact
/// store) without the checkpoint ever being copied whole into memory. The header is checked
/// when the file opens: its size, its JSON, each tensor's dtype, shape and byte range (inside
/// the file, of the size its shape and dtype need, no two overlapping, none missing), so a
/// truncated or corrupted file is refused before anything reads it, naming the file and
/// what is wrong. A sharded index may name only files inside its own folder, and only
/// regular files are opened (a FIFO is refused, not waited on).
///
/// Example:
///   frugal::io::SafetensorsFile file("gpt2/model.safetensors");
///   torch::Tensor wte = file.tensor("transformer.wte.weight");  // a view of the mapping
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);

  /// Every tensor's name, sorted.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  /// An error naming `name` when the checkpoint has no such tensor.
  const TensorInfo& info(const std::string& name) const;
  /// The tensor as stored: a CPU view of the mapped bytes (kept mapped while any view
  /// lives). Writing to it changes this process's copy only, never the file. An error
  /// for a dtype this LibTorch has no type for.
  torch::Tensor tensor(const std::string& name) const;
  /// An error naming the file when another program shortened a file of the checkpoint
  /// since it was opened (re-saving it in place, say). Reading such a file's vanished
  /// bytes gives zeros, never a crash; tensor() and load() call this, so what they return
  /// was read from whole files.
  void check_unchanged() const;
  /// The header's `__metadata__` (of the first shard, or the index's `metadata`).
  const Metadata& metadata() const { return metadata_; }

 private:
  std::map<std::string, TensorInfo> infos_;
  std::map<std::string, std::shared_ptr<detail::SafetensorsShard>> shards_;  // by file
  Metadata metadata_;
};

/// How a checkpoint's tensors find a module's parameters and buffers.
struct LoadOptions {
  /// The module's name for a tensor of the file ("" skips it), e.g. a prefix removed to
  /// load one block of a whole model's checkpoint. By default the names are the same.
  TORCH_ARG(std::function<std::string(const std::string&)>, rename) = nullptr;
  /// Whether the module's tensor `name` is stored transposed in the file: transformers'
  /// GPT-2 keeps its Conv1D weights as (in, out) where torch::nn::Linear has (out, in).
  TORCH_ARG(std::function<bool(const std::string&)>, transposed) = nullptr;
  /// Floating-point tensors are cast to the module's floating-point dtype (a bfloat16
  /// checkpoint into a float32 model, as transformers loads one); false refuses them.
  /// Integer and boolean tensors must match exactly either way.
  TORCH_ARG(bool, cast_floats) = true;
  /// Module tensors that no file tensor maps to are an error (true) or keep their values.
  TORCH_ARG(bool, require_all) = true;
  /// File tensors that map to no module tensor are an error (false) or skipped.
  TORCH_ARG(bool, allow_unexpected) = false;
};

/// What a load did: the module names it wrote, and those it left (allowed by the options).
struct LoadResult {
  std::vector<std::string> loaded;
  std::vector<std::string> missing;     ///< module tensors the file lacks
  std::vector<std::string> unexpected;  ///< file tensors (file names) the module lacks
};

/// Copies the checkpoint's tensors into `module`'s parameters and buffers, by name. Every
/// tensor is checked before any is written: one error lists each missing, unexpected,
/// mis-shaped and mis-typed tensor, and the module is left as it was. A file that another
/// program shortens while the load copies from it is an error after the copy
/// (SafetensorsFile::check_unchanged): the module then holds zeros where the file's bytes
/// were gone, and must be loaded again. Writes go in place
/// (the parameters keep their identity, so an optimizer over them stays valid).
///
/// Example:
///   GPT2 model(config);
///   frugal::io::load(*model, frugal::io::SafetensorsFile("twin/model.safetensors"),
///                    frugal::io::LoadOptions().transposed(frugal::io::gpt2_conv1d));
LoadResult load(torch::nn::Module& module, const SafetensorsFile& file,
                const LoadOptions& options = {});

/// Whether a module tensor name is one of transformers' GPT-2 Conv1D weights (c_attn,
/// c_proj, c_fc), stored (in, out): for LoadOptions::transposed and SaveOptions::transposed.
bool gpt2_conv1d(const std::string& name);

/// How a module's tensors are written.
struct SaveOptions {
  /// The file's name for a module tensor ("" leaves it out).
  TORCH_ARG(std::function<std::string(const std::string&)>, rename) = nullptr;
  /// Module tensors written transposed (as LoadOptions::transposed reads them).
  TORCH_ARG(std::function<bool(const std::string&)>, transposed) = nullptr;
  /// Written as the header's `__metadata__`; transformers reads {"format": "pt"}.
  TORCH_ARG(Metadata, metadata) = Metadata{{"format", "pt"}};
};

/// Writes `tensors` (CPU or not; any contiguous layout is made) as one safetensors file, in
/// the layout the safetensors package writes: the header padded to 8 bytes, tensors by
/// alignment then name. Written to a temporary file and renamed, so `path` is either the
/// old file or the whole new one. An error names a duplicate or empty name or a dtype the
/// format has no name for.
void save(const std::string& path,
          const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
          const Metadata& metadata = Metadata{{"format", "pt"}});

/// Writes `module`'s parameters and persistent buffers (named as named_parameters and
/// named_buffers name them), renamed and transposed as `options` say.
void save(const std::string& path, const torch::nn::Module& module,
          const SaveOptions& options = {});

}  // namespace frugal::io
