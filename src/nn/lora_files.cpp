// A Lora's adapters in PEFT's files: adapter_model.safetensors and adapter_config.json.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "file_write.h"
#include "frugal/error.h"
#include "frugal/io/safetensors.h"
#include "frugal/nn/lora.h"
#include "io/untrusted.h"
#include "nn/lora_state.h"

namespace frugal::nn {
namespace {

namespace fs = std::filesystem;

constexpr const char* kWeights = "adapter_model.safetensors";
constexpr const char* kConfig = "adapter_config.json";

std::set<std::string> as_set(const std::vector<std::string>& v) { return {v.begin(), v.end()}; }

}  // namespace

LoraOptions read_lora_config(const std::string& dir) {
  const auto path = (fs::path(dir) / kConfig).string();
  const auto json = io::detail::read_json(path);
  FRUGAL_CHECK(json.is_object(), "frugal: ", path, " is not a JSON object");
  // A field of the expected JSON type, or an error naming the field and what it holds.
  auto field = [&](const char* key, bool (nlohmann::json::*is)() const noexcept,
                   const char* expected) -> const nlohmann::json* {
    const auto it = json.find(key);
    if (it == json.end() || it->is_null()) {
      return nullptr;
    }
    FRUGAL_CHECK(((*it).*is)(), "frugal: ", path, " gives ", key, " as ", io::detail::describe(*it),
                 "; it must be ", expected);
    return &*it;
  };
  const auto* type = field("peft_type", &nlohmann::json::is_string, "a string");
  FRUGAL_CHECK(type != nullptr && type->get_ref<const std::string&>() == "LORA", "frugal: ", path,
               " describes peft_type ", type ? io::detail::excerpt(*type) : "null", ", not LORA");
  LoraOptions o;
  if (const auto* r = field("r", &nlohmann::json::is_number_integer, "a whole number >= 1")) {
    FRUGAL_CHECK(r->get<std::int64_t>() >= 1 &&
                     !(r->is_number_unsigned() && r->get<std::uint64_t>() > (1ull << 62)),
                 "frugal: ", path, " gives r as ", io::detail::excerpt(*r),
                 "; it must be a whole number >= 1");
    o.rank(r->get<std::int64_t>());
  }
  if (const auto* a = field("lora_alpha", &nlohmann::json::is_number, "a number > 0")) {
    o.alpha(a->get<double>());
  }
  if (const auto* d = field("lora_dropout", &nlohmann::json::is_number, "a number in [0, 1)")) {
    o.dropout(d->get<double>());
  }
  if (const auto* b = field("use_rslora", &nlohmann::json::is_boolean, "true or false")) {
    o.use_rslora(b->get<bool>());
  }
  if (const auto* b = field("fan_in_fan_out", &nlohmann::json::is_boolean, "true or false")) {
    o.fan_in_fan_out(b->get<bool>());
  }
  if (const auto* targets = field("target_modules", &nlohmann::json::is_array,
                                  "a list of module names (a pattern is not understood)")) {
    std::vector<std::string> names;
    for (const auto& t : *targets) {
      FRUGAL_CHECK(t.is_string(), "frugal: ", path, " lists ", io::detail::describe(t),
                   " in target_modules; it must list module names");
      names.push_back(t.get<std::string>());
    }
    o.target_modules(names);
  }
  for (const char* unsupported : {"use_dora", "lora_bias"}) {
    const auto* b = field(unsupported, &nlohmann::json::is_boolean, "true or false");
    FRUGAL_CHECK(b == nullptr || !b->get<bool>(), "frugal: ", path, " sets ", unsupported,
                 ", which frugal's LoRA does not do");
  }
  for (const char* patterns : {"rank_pattern", "alpha_pattern"}) {
    const auto* p = field(patterns, &nlohmann::json::is_object, "an object");
    FRUGAL_CHECK(p == nullptr || p->empty(), "frugal: ", path, " sets ", patterns, " ",
                 io::detail::excerpt(*p), "; frugal's LoRA has one rank and one alpha");
  }
  FRUGAL_CHECK(std::isfinite(o.alpha()) && o.alpha() > 0, "frugal: ", path, " gives lora_alpha as ",
               o.alpha(), "; it must be a finite number > 0");
  FRUGAL_CHECK(o.dropout() >= 0 && o.dropout() < 1, "frugal: ", path, " gives lora_dropout as ",
               o.dropout(), "; it must be in [0, 1)");
  return o;
}

void Lora::save(const std::string& dir, const std::string& prefix) const {
  fs::create_directories(dir);
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& layer : state_->layers) {
    tensors.emplace_back(prefix + layer->name + ".lora_A.weight", layer->a->weight);
    tensors.emplace_back(prefix + layer->name + ".lora_B.weight", layer->b->weight);
  }
  io::save((fs::path(dir) / kWeights).string(), tensors);
  auto targets = options_.target_modules();
  std::sort(targets.begin(), targets.end());
  const nlohmann::ordered_json config = {
      {"peft_type", "LORA"},
      {"task_type", nullptr},
      {"base_model_name_or_path", nullptr},
      {"inference_mode", true},
      {"r", options_.rank()},
      {"lora_alpha", options_.alpha()},
      {"lora_dropout", options_.dropout()},
      {"target_modules", targets},
      {"fan_in_fan_out", options_.fan_in_fan_out()},
      {"bias", "none"},
      {"use_rslora", options_.use_rslora()},
      {"use_dora", false},
      {"init_lora_weights", true},
      {"modules_to_save", nullptr},
      {"rank_pattern", nlohmann::json::object()},
      {"alpha_pattern", nlohmann::json::object()},
  };
  const auto text = config.dump(2) + "\n";
  frugal::detail::write_whole((fs::path(dir) / kConfig).string(), {{text.data(), text.size()}});
}

void Lora::load(const std::string& dir, const std::string& prefix) {
  const auto theirs = read_lora_config(dir);
  std::vector<std::string> problems;
  auto differs = [&problems](const char* what, const auto& mine, const auto& other) {
    if (mine != other) {
      problems.push_back(c10::str(what, " is ", other, " in the file and ", mine, " here"));
    }
  };
  differs("r", options_.rank(), theirs.rank());
  differs("lora_alpha", options_.alpha(), theirs.alpha());
  differs("use_rslora", options_.use_rslora(), theirs.use_rslora());
  if (as_set(options_.target_modules()) != as_set(theirs.target_modules())) {
    problems.push_back(c10::str("target_modules are ", c10::Join(", ", theirs.target_modules()),
                                " in the file and ", c10::Join(", ", options_.target_modules()),
                                " here"));
  }
  const io::SafetensorsFile file((fs::path(dir) / kWeights).string());
  for (const auto& layer : state_->layers) {
    for (const char* part : {".lora_A.weight", ".lora_B.weight"}) {
      const auto name = prefix + layer->name + part;
      if (!file.contains(name)) {
        problems.push_back("the file has no '" + name + "'");
      }
    }
  }
  if (!problems.empty()) {
    std::string message =
        "frugal: the adapters in " + dir + " do not fit this Lora, which is unchanged:";
    for (const auto& p : problems) {
      message += "\n  " + p;
    }
    throw Error(message);
  }
  // io::load checks shapes and dtypes before it writes any; the adapters are loaded through
  // a holder that names them by their layer's index.
  torch::nn::Module holder;
  std::map<std::string, std::string> renamed;  // file name -> name in `holder`
  for (std::size_t i = 0; i < state_->layers.size(); ++i) {
    const auto& layer = state_->layers[i];
    auto node = std::make_shared<torch::nn::Module>();
    node->register_module("lora_A", layer->a);
    node->register_module("lora_B", layer->b);
    holder.register_module(std::to_string(i), node);
    for (const char* part : {".lora_A.weight", ".lora_B.weight"}) {
      renamed[prefix + layer->name + part] = std::to_string(i) + part;
    }
  }
  io::load(holder, file, io::LoadOptions().rename([&renamed](const std::string& n) {
    const auto it = renamed.find(n);
    return it == renamed.end() ? n : it->second;
  }));
}

}  // namespace frugal::nn
