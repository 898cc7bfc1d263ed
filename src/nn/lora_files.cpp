// A Lora's adapters in PEFT's files: adapter_model.safetensors and adapter_config.json.
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "frugal/error.h"
#include "frugal/io/safetensors.h"
#include "frugal/nn/lora.h"
#include "nn/lora_state.h"

namespace frugal::nn {
namespace {

namespace fs = std::filesystem;

constexpr const char* kWeights = "adapter_model.safetensors";
constexpr const char* kConfig = "adapter_config.json";

std::set<std::string> as_set(const std::vector<std::string>& v) { return {v.begin(), v.end()}; }

}  // namespace

LoraOptions read_lora_config(const std::string& dir) {
  const auto path = fs::path(dir) / kConfig;
  std::ifstream in(path);
  FRUGAL_CHECK(in.good(), "frugal: cannot open ", path.string());
  const auto json = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  FRUGAL_CHECK(json.is_object(), "frugal: ", path.string(), " is not a JSON object");
  FRUGAL_CHECK(json.value("peft_type", std::string()) == "LORA", "frugal: ", path.string(),
               " describes peft_type ", json.value("peft_type", nlohmann::json()).dump(),
               ", not LORA");
  LoraOptions o;
  o.rank(json.value("r", o.rank()));
  o.alpha(json.value("lora_alpha", o.alpha()));
  o.dropout(json.value("lora_dropout", o.dropout()));
  o.use_rslora(json.value("use_rslora", o.use_rslora()));
  o.fan_in_fan_out(json.value("fan_in_fan_out", o.fan_in_fan_out()));
  const auto targets = json.value("target_modules", nlohmann::json());
  FRUGAL_CHECK(targets.is_null() || targets.is_array(), "frugal: ", path.string(),
               " gives target_modules as ", targets.dump(),
               "; a list of module names is understood, not a pattern");
  if (targets.is_array()) {
    o.target_modules(targets.get<std::vector<std::string>>());
  }
  for (const char* unsupported : {"use_dora", "lora_bias"}) {
    FRUGAL_CHECK(!json.value(unsupported, false), "frugal: ", path.string(), " sets ", unsupported,
                 ", which frugal's LoRA does not do");
  }
  for (const char* patterns : {"rank_pattern", "alpha_pattern"}) {
    const auto p = json.value(patterns, nlohmann::json::object());
    FRUGAL_CHECK(p.is_object() && p.empty(), "frugal: ", path.string(), " sets ", patterns, " ",
                 p.dump(), "; frugal's LoRA has one rank and one alpha");
  }
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
  const auto path = fs::path(dir) / kConfig;
  std::ofstream out(path, std::ios::trunc);
  out << config.dump(2) << "\n";
  FRUGAL_CHECK(out.good(), "frugal: writing ", path.string(), " failed");
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
