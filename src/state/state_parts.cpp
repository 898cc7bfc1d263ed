#include "state_parts.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Type.h>
#include <torch/torch.h>

#include <algorithm>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "compat.h"
#include "frugal/error.h"
#include "frugal/state/archive.h"
#include "memory/state_tensors.h"
#include "state_file.h"

namespace frugal::detail {

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

std::string join_lines(const std::vector<std::string>& items, const char* separator) {
  std::string out;
  for (const auto& item : items) {
    out += (out.empty() ? "" : separator) + item;
  }
  return out;
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    out.push_back(line);
  }
  return out;
}

std::string state_mismatch(const std::string& path, const std::string& whose,
                           const std::string& what, const std::string& file,
                           const std::string& here) {
  return "frugal: '" + path + "' does not fit " + whose + ": " + what + " is " + file +
         " in the file, " + here + " here";
}

namespace {

// The module's parameters or buffers, by name, in the module's order.
struct Named {
  std::vector<std::string> names;
  std::vector<torch::Tensor> tensors;
};

Named named(const torch::OrderedDict<std::string, torch::Tensor>& dict) {
  Named out;
  for (const auto& item : dict) {
    out.names.push_back(item.key());
    out.tensors.push_back(item.value());
  }
  return out;
}

void write_named(OutputArchive& archive, const std::string& prefix, const Named& tensors) {
  state::write_int(archive, prefix + "/count", static_cast<std::int64_t>(tensors.names.size()));
  archive.write(prefix + "/names", c10::IValue(join_lines(tensors.names)));
  for (std::size_t i = 0; i < tensors.tensors.size(); ++i) {
    archive.write(prefix + "/" + std::to_string(i), tensors.tensors[i].detach());
  }
}

// The saved tensors in this module's order, after checking names, shapes and dtypes.
std::vector<torch::Tensor> read_named(InputArchive& archive, const std::string& prefix,
                                      const char* what, const Named& here) {
  const auto count = state::read_int(archive, prefix + "/count");
  auto names = split_lines(state::read_string(archive, prefix + "/names"));
  FRUGAL_CHECK(static_cast<std::int64_t>(names.size()) == count, "frugal: the saved ", what,
               " names (", names.size(), ") do not match their count (", count, ")");
  std::unordered_map<std::string, std::size_t> index;
  for (std::size_t i = 0; i < names.size(); ++i) {
    index[names[i]] = i;
  }
  for (const auto& name : names) {
    FRUGAL_CHECK(std::find(here.names.begin(), here.names.end(), name) != here.names.end(),
                 "the file's model has a ", what, " '", name, "' that this model lacks");
  }
  std::vector<torch::Tensor> out;
  for (std::size_t i = 0; i < here.names.size(); ++i) {
    const auto& name = here.names[i];
    const auto found = index.find(name);
    FRUGAL_CHECK(found != index.end(), "this model's ", what, " '", name, "' is not in the file");
    auto saved = state::read_tensor(archive, prefix + "/" + std::to_string(found->second));
    const auto& mine = here.tensors[i];
    FRUGAL_CHECK(saved.sizes() == mine.sizes(), what, " '", name, "' has shape ", saved.sizes(),
                 " in the file, ", mine.sizes(), " here");
    FRUGAL_CHECK(saved.scalar_type() == mine.scalar_type(), what, " '", name, "' is ",
                 saved.scalar_type(), " in the file, ", mine.scalar_type(), " here");
    out.push_back(std::move(saved));
  }
  return out;
}

// Each param group of the optimizer as the names of its parameters in the module.
std::vector<std::string> group_names(torch::optim::Optimizer& optimizer,
                                     torch::nn::Module& module) {
  std::unordered_map<const void*, std::string> name_of;
  for (const auto& item : module.named_parameters()) {
    name_of[item.value().unsafeGetTensorImpl()] = item.key();
  }
  std::vector<std::string> groups;
  for (const auto& group : optimizer.param_groups()) {
    std::vector<std::string> names;
    for (const auto& p : group.params()) {
      const auto found = name_of.find(p.unsafeGetTensorImpl());
      names.push_back(found == name_of.end() ? "<not in the module>" : found->second);
    }
    groups.push_back(join_lines(names, " "));
  }
  return groups;
}

torch::Tensor cpu_rng_state() {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_cpu_rng_state(const torch::Tensor& state) {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

// A generator's saved state must have the type and size of this LibTorch's (set_state
// checks them only when it is called, after other parts of a load have been put back).
void check_generator_state(const torch::Tensor& saved, const torch::Tensor& mine,
                           const std::string& whose, const std::string& path) {
  FRUGAL_CHECK(saved.scalar_type() == mine.scalar_type() && saved.sizes() == mine.sizes(),
               "frugal: '", path, "' holds ", whose, " state of ", saved.scalar_type(),
               saved.sizes(), ", this LibTorch's is ", mine.scalar_type(), mine.sizes());
}

std::int64_t cuda_devices() {
#ifdef FRUGAL_WITH_CUDA
  return torch::cuda::is_available() ? static_cast<std::int64_t>(torch::cuda::device_count()) : 0;
#else
  return 0;
#endif
}

}  // namespace

std::string optimizer_type(const torch::optim::Optimizer& optimizer) {
  return c10::demangle(typeid(optimizer).name());
}

void write_model(OutputArchive& archive, const std::string& prefix, torch::nn::Module& module,
                 torch::optim::Optimizer& optimizer) {
  write_named(archive, prefix + "model/parameters", named(module.named_parameters()));
  write_named(archive, prefix + "model/buffers", named(module.named_buffers()));
  archive.write(prefix + "optimizer/type", c10::IValue(optimizer_type(optimizer)));
  archive.write(prefix + "optimizer/groups",
                c10::IValue(join_lines(group_names(optimizer, module))));
  OutputArchive optimizer_state;
  optimizer.save(optimizer_state);
  archive.write(prefix + "optimizer/state", optimizer_state);
}

SavedModel read_model(InputArchive& archive, const std::string& prefix, torch::nn::Module& module,
                      torch::optim::Optimizer& optimizer, const std::string& path,
                      const std::string& whose) {
  SavedModel out;
  try {
    out.parameters = read_named(archive, prefix + "model/parameters", "parameter",
                                named(module.named_parameters()));
    out.buffers =
        read_named(archive, prefix + "model/buffers", "buffer", named(module.named_buffers()));
  } catch (const c10::Error& e) {
    FRUGAL_CHECK(false, "frugal: '", path, "' does not fit ", whose, ": ", error_message(e));
  }
  const auto type = state::read_string(archive, prefix + "optimizer/type");
  FRUGAL_CHECK(type == optimizer_type(optimizer),
               state_mismatch(path, whose, "the optimizer", type, optimizer_type(optimizer)));
  const auto groups = split_lines(state::read_string(archive, prefix + "optimizer/groups"));
  const auto my_groups = group_names(optimizer, module);
  FRUGAL_CHECK(groups.size() == my_groups.size(),
               state_mismatch(path, whose, "the number of param groups",
                              std::to_string(groups.size()), std::to_string(my_groups.size())));
  for (std::size_t g = 0; g < groups.size(); ++g) {
    FRUGAL_CHECK(groups[g] == my_groups[g],
                 state_mismatch(path, whose, "param group " + std::to_string(g),
                                "[" + groups[g] + "]", "[" + my_groups[g] + "]"));
  }
  out.optimizer = state::read_archive(archive, prefix + "optimizer/state");
  return out;
}

void put_back_tensors(torch::nn::Module& module, const SavedModel& saved) {
  torch::NoGradGuard no_grad;
  const auto params = named(module.named_parameters());
  for (std::size_t i = 0; i < params.tensors.size(); ++i) {
    params.tensors[i].detach().copy_(saved.parameters[i]);
  }
  const auto buffers = named(module.named_buffers());
  for (std::size_t i = 0; i < buffers.tensors.size(); ++i) {
    buffers.tensors[i].detach().copy_(saved.buffers[i]);
  }
}

std::string optimizer_bytes(torch::optim::Optimizer& optimizer) {
  OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

void load_optimizer(torch::optim::Optimizer& optimizer, InputArchive& archive) {
  optimizer.state().clear();  // a load adds to the state; nothing stale may stay
  optimizer.load(archive);
  place_state_with_parameters(optimizer);
}

void place_state_with_parameters(torch::optim::Optimizer& optimizer) {
  // Every state type serializes itself: written out and read back onto the parameter's
  // device, whatever tensors the type holds (frugal's quantized states included). A state
  // already there (the usual load) is left as it is.
  for (auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const auto it = optimizer.state().find(compat::optimizer_state_key(p));
      if (it == optimizer.state().end() || !it->second) {
        continue;
      }
      bool elsewhere = false;
      for_each_state_tensor(*it->second, [&](const torch::Tensor& t) {
        elsewhere = elsewhere || (t.defined() && t.device() != p.device());
      });
      if (!elsewhere) {
        continue;
      }
      OutputArchive out;
      it->second->serialize(out);
      std::ostringstream bytes;
      out.save_to(bytes);
      std::istringstream in_bytes(bytes.str());
      InputArchive in;
      in.load_from(in_bytes, p.device());
      it->second->serialize(in);
    }
  }
}

void load_optimizer_bytes(torch::optim::Optimizer& optimizer, const std::string& bytes) {
  InputArchive archive;
  archive.load_from(bytes.data(), bytes.size());
  load_optimizer(optimizer, archive);
}

void write_rng(OutputArchive& archive) {
  archive.write("rng/cpu", cpu_rng_state());
  const auto cuda = cuda_devices();
  state::write_int(archive, "rng/cuda_devices", cuda);
#ifdef FRUGAL_WITH_CUDA
  for (std::int64_t d = 0; d < cuda; ++d) {
    archive.write("rng/cuda/" + std::to_string(d), compat::cuda_rng_state(static_cast<int>(d)));
  }
#endif
}

SavedRng read_rng(InputArchive& archive, const std::string& path) {
  SavedRng out;
  out.cpu = state::read_tensor(archive, "rng/cpu");
  check_generator_state(out.cpu, cpu_rng_state(), "a CPU generator", path);
  const auto cuda = std::min(state::read_int(archive, "rng/cuda_devices"), cuda_devices());
#ifdef FRUGAL_WITH_CUDA
  for (std::int64_t d = 0; d < cuda; ++d) {
    out.cuda.push_back(state::read_tensor(archive, "rng/cuda/" + std::to_string(d)));
    // Checked before anything is set: a refused state must leave every generator as it was.
    check_generator_state(out.cuda.back(), compat::cuda_rng_state(static_cast<int>(d)),
                          "the CUDA generator of device " + std::to_string(d), path);
  }
#else
  (void)cuda;
#endif
  return out;
}

void put_back_rng(const SavedRng& rng) {
  set_cpu_rng_state(rng.cpu);
#ifdef FRUGAL_WITH_CUDA
  for (std::size_t d = 0; d < rng.cuda.size(); ++d) {
    compat::set_cuda_rng_state(static_cast<int>(d), rng.cuda[d]);
  }
#endif
}

void check_user_keys(const UserState& user) {
  auto check_key = [](const std::string& key) {
    FRUGAL_CHECK(!key.empty() && key.find('\n') == std::string::npos,
                 "frugal: a user state key must be one non-empty line, got '", key, "'");
  };
  for (const auto& item : user.values) {
    check_key(item.first);
  }
  for (const auto& item : user.numbers) {
    check_key(item.first);
  }
}

void write_user(OutputArchive& archive, const UserState& user) {
  std::vector<std::string> keys;
  std::int64_t i = 0;
  for (const auto& [key, value] : user.values) {
    keys.push_back(key);
    state::write_int(archive, "user/" + std::to_string(i++), value);
  }
  archive.write("user/keys", c10::IValue(join_lines(keys)));
  std::vector<std::string> number_keys;
  for (const auto& [key, value] : user.numbers) {
    state::write_double(archive, "user/number/" + std::to_string(number_keys.size()), value);
    number_keys.push_back(key);
  }
  archive.write("user/number_keys", c10::IValue(join_lines(number_keys)));
  archive.write("user/blob", c10::IValue(user.blob));
}

UserState read_user(InputArchive& archive) {
  UserState out;
  const auto keys = split_lines(state::read_string(archive, "user/keys"));
  for (std::size_t i = 0; i < keys.size(); ++i) {
    out.values[keys[i]] = state::read_int(archive, "user/" + std::to_string(i));
  }
  const auto number_keys = split_lines(state::read_string(archive, "user/number_keys"));
  for (std::size_t i = 0; i < number_keys.size(); ++i) {
    out.numbers[number_keys[i]] = state::read_double(archive, "user/number/" + std::to_string(i));
  }
  out.blob = state::read_string(archive, "user/blob");
  return out;
}

OutputArchive new_state_archive() {
  OutputArchive archive;
  state::write_int(archive, "frugal/layout", kStateLayout);
  return archive;
}

void finish_state(OutputArchive& archive, const std::string& path, const UserState& user) {
  write_rng(archive);
  write_user(archive, user);
  write_state_file(path, [&](const ByteWriter& write) { archive.save_to(write); });
}

void rethrow_naming(const std::string& path, const std::exception& error) {
  const auto message = error_message(error);
  if (message.find("'" + path + "'") != std::string::npos) {
    throw;
  }
  FRUGAL_CHECK(false, "frugal: '", path, "' cannot be read as a saved state: ", message);
}

InputArchive open_state(const std::string& path) {
  const auto payload = read_state_file(path);
  InputArchive archive;
  archive.load_from(payload.data(), payload.size());
  const auto layout = state::read_int(archive, "frugal/layout");
  FRUGAL_CHECK(layout == kStateLayout, "frugal: '", path, "' has layout ", layout,
               "; this frugal reads layout ", kStateLayout);
  return archive;
}

}  // namespace frugal::detail
