// A checkpoint into a module (checked whole first), and a module into a checkpoint.
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "file_write.h"
#include "frugal/error.h"
#include "frugal/io/safetensors.h"
#include "io/safetensors_format.h"
#include "io/untrusted.h"

namespace frugal::io {
namespace {

// A module's parameters and buffers by qualified name.
std::map<std::string, torch::Tensor> module_tensors(const torch::nn::Module& module) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : module.named_parameters()) {
    out.emplace(item.key(), item.value());
  }
  for (const auto& item : module.named_buffers()) {
    out.emplace(item.key(), item.value());
  }
  return out;
}

// Why a file tensor cannot go into `target`, or "" when it can.
std::string mismatch(const TensorInfo& info, std::vector<std::int64_t> shape,
                     const torch::Tensor& target, bool cast_floats) {
  if (shape != target.sizes().vec()) {
    return c10::str("shape ", c10::IntArrayRef(shape), " in the file, ", target.sizes(),
                    " in the module");
  }
  const auto type = detail::scalar_type(info.dtype);
  if (!type.has_value()) {
    return "dtype " + info.dtype + ", which this LibTorch has no type for";
  }
  const bool floats = c10::isFloatingType(*type) && target.is_floating_point();
  if (*type != target.scalar_type() && !(floats && cast_floats)) {
    return c10::str("dtype ", info.dtype, " in the file, ", target.scalar_type(), " in the module");
  }
  return "";
}

std::string joined(const std::vector<std::string>& names) {
  constexpr std::size_t kShown = 20;  // a file may name thousands
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < kShown; ++i) {
    out += (out.empty() ? "" : ", ") + detail::quote_name(names[i]);
  }
  if (names.size() > kShown) {
    out += c10::str(" and ", names.size() - kShown, " more");
  }
  return out;
}

}  // namespace

bool gpt2_conv1d(const std::string& name) {
  for (const char* layer : {"c_attn.weight", "c_proj.weight", "c_fc.weight"}) {
    const std::string suffix = std::string(".") + layer;
    if (name == layer || (name.size() > suffix.size() &&
                          name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)) {
      return true;
    }
  }
  return false;
}

LoadResult load(torch::nn::Module& module, const SafetensorsFile& file,
                const LoadOptions& options) {
  auto targets = module_tensors(module);
  LoadResult result;
  struct Planned {
    std::string name, target;
    bool transposed;
  };
  std::vector<Planned> plan;
  std::unordered_map<std::string, std::string> source;  // module name -> file name
  std::vector<std::string> problems;
  for (const auto& name : file.names()) {
    const auto target = options.rename() ? options.rename()(name) : name;
    if (target.empty()) {
      continue;
    }
    const auto it = targets.find(target);
    if (it == targets.end()) {
      result.unexpected.push_back(name);
      continue;
    }
    if (!source.emplace(target, name).second) {
      problems.push_back(c10::str(detail::quote_name(name), " and ",
                                  detail::quote_name(source[target]), " both map to ",
                                  detail::quote_name(target)));
      continue;
    }
    const auto& info = file.info(name);
    auto shape = info.shape;
    const bool transposed = options.transposed() && options.transposed()(target);
    if (transposed && shape.size() == 2) {
      std::swap(shape[0], shape[1]);
    }
    const auto why = mismatch(info, shape, it->second, options.cast_floats());
    if (!why.empty()) {
      problems.push_back(c10::str(detail::quote_name(name),
                                  name == target ? "" : " (module '" + target + "')", ": ", why,
                                  transposed ? " (read transposed)" : ""));
      continue;
    }
    plan.push_back({name, target, transposed && info.shape.size() == 2});
  }
  for (const auto& [name, tensor] : targets) {
    if (source.count(name) == 0) {
      result.missing.push_back(name);
    }
  }
  if (options.require_all() && !result.missing.empty()) {
    problems.push_back("missing from the file: " + joined(result.missing));
  }
  if (!options.allow_unexpected() && !result.unexpected.empty()) {
    problems.push_back("not in the module: " + joined(result.unexpected));
  }
  if (!problems.empty()) {
    std::string message = "frugal: the checkpoint does not fit the module, which is unchanged:";
    for (const auto& p : problems) {
      message += "\n  " + p;
    }
    throw Error(message);
  }
  torch::NoGradGuard no_grad;
  for (const auto& p : plan) {
    const auto from = file.tensor(p.name);
    targets[p.target].copy_(p.transposed ? from.t() : from);
    result.loaded.push_back(p.target);
  }
  file.check_unchanged();
  return result;
}

void save(const std::string& path,
          const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
          const Metadata& metadata) {
  struct Item {
    std::string name;
    torch::Tensor data;  // contiguous, on the CPU
    std::int64_t align;
  };
  std::vector<Item> items;
  std::map<std::string, int> seen;
  for (const auto& [name, tensor] : tensors) {
    FRUGAL_CHECK(!name.empty() && name != "__metadata__",
                 "frugal: a safetensors tensor cannot be named '", name, "'");
    FRUGAL_CHECK(seen[name]++ == 0, "frugal: tensor '", name, "' is given twice to save");
    FRUGAL_CHECK(tensor.defined(), "frugal: tensor '", name, "' is undefined");
    detail::dtype_name(tensor.scalar_type());  // an error for a dtype the format lacks
    items.push_back({name, tensor.detach().to(torch::kCPU).contiguous(),
                     static_cast<std::int64_t>(tensor.element_size())});
  }
  // As the safetensors package writes them: the widest elements first, then by name.
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.align != b.align ? a.align > b.align : a.name < b.name;
  });
  nlohmann::ordered_json header;
  if (!metadata.empty()) {
    header["__metadata__"] = metadata;
  }
  std::int64_t offset = 0;
  for (const auto& item : items) {
    const auto bytes = static_cast<std::int64_t>(item.data.nbytes());
    header[item.name] = {{"dtype", detail::dtype_name(item.data.scalar_type())},
                         {"shape", item.data.sizes().vec()},
                         {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  auto text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const std::uint64_t n = text.size();
  std::vector<std::pair<const char*, std::size_t>> parts{{reinterpret_cast<const char*>(&n), 8},
                                                         {text.data(), text.size()}};
  for (const auto& item : items) {
    parts.emplace_back(static_cast<const char*>(item.data.data_ptr()), item.data.nbytes());
  }
  frugal::detail::write_whole(path, parts);
}

void save(const std::string& path, const torch::nn::Module& module, const SaveOptions& options) {
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& [name, tensor] : module_tensors(module)) {
    const auto file_name = options.rename() ? options.rename()(name) : name;
    if (file_name.empty()) {
      continue;
    }
    const bool transposed = options.transposed() && options.transposed()(name) && tensor.dim() == 2;
    tensors.emplace_back(file_name, transposed ? tensor.t() : tensor);
  }
  save(path, tensors, options.metadata());
}

}  // namespace frugal::io
