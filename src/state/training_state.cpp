#include "frugal/state/training_state.h"

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
#include "frugal/train/trainer.h"
#include "state_file.h"

namespace frugal {
namespace {

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

// The archive's keys and their meaning, within the file's format version.
constexpr std::int64_t kLayout = 1;

std::string join(const std::vector<std::string>& items, const char* separator = "\n") {
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
  archive.write(prefix + "/names", c10::IValue(join(tensors.names)));
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
    groups.push_back(join(names, " "));
  }
  return groups;
}

std::string optimizer_type(const torch::optim::Optimizer& optimizer) {
  return c10::demangle(typeid(optimizer).name());
}

std::vector<std::string> policy_names(const Trainer& trainer) {
  std::vector<std::string> names;
  for (const auto& policy : trainer.policies()) {
    names.push_back(policy->name());
  }
  return names;
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

std::int64_t cuda_devices() {
#ifdef FRUGAL_WITH_CUDA
  return torch::cuda::is_available() ? static_cast<std::int64_t>(torch::cuda::device_count()) : 0;
#else
  return 0;
#endif
}

// The bytes of an archive, and an archive from bytes: for putting state back.
template <typename Save>
std::string to_bytes(Save save) {
  OutputArchive archive;
  save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

InputArchive from_bytes(const std::string& bytes) {
  InputArchive archive;
  archive.load_from(bytes.data(), bytes.size());
  return archive;
}

void load_optimizer(torch::optim::Optimizer& optimizer, InputArchive& archive) {
  optimizer.state().clear();  // a load adds to the state; nothing stale may stay
  optimizer.load(archive);
}

std::string mismatch(const std::string& path, const std::string& what, const std::string& file,
                     const std::string& here) {
  return "frugal: '" + path + "' does not fit this trainer: " + what + " is " + file +
         " in the file, " + here + " here";
}

// Everything read from a file, checked against the trainer before anything changes.
struct Loaded {
  TrainerCounters counters;
  std::vector<torch::Tensor> parameters, buffers;
  InputArchive optimizer;
  std::vector<InputArchive> policies;
  torch::Tensor cpu_rng;
  std::vector<torch::Tensor> cuda_rng;
  UserState user;
};

Loaded read_checked(Trainer& trainer, InputArchive& archive, const std::string& path) {
  Loaded out;
  const auto layout = state::read_int(archive, "frugal/layout");
  FRUGAL_CHECK(layout == kLayout, "frugal: '", path, "' has layout ", layout,
               "; this frugal reads layout ", kLayout);
  auto& module = trainer.module();
  try {
    out.parameters =
        read_named(archive, "model/parameters", "parameter", named(module.named_parameters()));
    out.buffers = read_named(archive, "model/buffers", "buffer", named(module.named_buffers()));
  } catch (const c10::Error& e) {
    FRUGAL_CHECK(false, "frugal: '", path, "' does not fit this trainer: ", error_message(e));
  }

  auto& optimizer = trainer.optimizer();
  const auto type = state::read_string(archive, "optimizer/type");
  FRUGAL_CHECK(type == optimizer_type(optimizer),
               mismatch(path, "the optimizer", type, optimizer_type(optimizer)));
  const auto groups = split_lines(state::read_string(archive, "optimizer/groups"));
  const auto my_groups = group_names(optimizer, module);
  FRUGAL_CHECK(groups.size() == my_groups.size(),
               mismatch(path, "the number of param groups", std::to_string(groups.size()),
                       std::to_string(my_groups.size())));
  for (std::size_t g = 0; g < groups.size(); ++g) {
    FRUGAL_CHECK(groups[g] == my_groups[g],
                 mismatch(path, "param group " + std::to_string(g), "[" + groups[g] + "]",
                         "[" + my_groups[g] + "]"));
  }
  out.optimizer = state::read_archive(archive, "optimizer/state");

  const auto policies = state::read_string(archive, "policies/names");
  const auto my_policies = join(policy_names(trainer));
  auto list = [](std::string s) {
    std::replace(s.begin(), s.end(), '\n', ',');
    return "[" + s + "]";
  };
  FRUGAL_CHECK(policies == my_policies,
               mismatch(path, "the list of policies", list(policies), list(my_policies)));
  for (std::size_t i = 0; i < trainer.policies().size(); ++i) {
    out.policies.push_back(state::read_archive(archive, "policies/" + std::to_string(i)));
  }

  auto& c = out.counters;
  c.steps = state::read_int(archive, "trainer/steps");
  c.skipped = state::read_int(archive, "trainer/skipped");
  c.batches = state::read_int(archive, "trainer/batches");
  c.micro_batch = state::read_int(archive, "trainer/micro_batch");
  c.eval_batch = state::read_int(archive, "trainer/eval_batch");

  out.cpu_rng = state::read_tensor(archive, "rng/cpu");
  const auto mine = cpu_rng_state();
  FRUGAL_CHECK(
      out.cpu_rng.scalar_type() == mine.scalar_type() && out.cpu_rng.sizes() == mine.sizes(),
      "frugal: '", path, "' holds a CPU generator state of ", out.cpu_rng.scalar_type(),
      out.cpu_rng.sizes(), ", this LibTorch's is ", mine.scalar_type(), mine.sizes());
  const auto cuda = std::min(state::read_int(archive, "rng/cuda_devices"), cuda_devices());
  for (std::int64_t d = 0; d < cuda; ++d) {
    out.cuda_rng.push_back(state::read_tensor(archive, "rng/cuda/" + std::to_string(d)));
  }

  const auto keys = split_lines(state::read_string(archive, "user/keys"));
  for (std::size_t i = 0; i < keys.size(); ++i) {
    out.user.values[keys[i]] = state::read_int(archive, "user/" + std::to_string(i));
  }
  const auto number_keys = split_lines(state::read_string(archive, "user/number_keys"));
  for (std::size_t i = 0; i < number_keys.size(); ++i) {
    out.user.numbers[number_keys[i]] =
        state::read_double(archive, "user/number/" + std::to_string(i));
  }
  out.user.blob = state::read_string(archive, "user/blob");
  return out;
}

}  // namespace

void save_training_state(Trainer& trainer, const std::string& path, const UserState& user) {
  FRUGAL_CHECK(trainer.halted().empty(), "frugal: not saving a halted trainer: ", trainer.halted());
  FRUGAL_CHECK(!trainer.window_open(),
               "frugal: cannot save inside an accumulation window (its "
               "gradients are not saved); save after the step that ends it");
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
  OutputArchive archive;
  state::write_int(archive, "frugal/layout", kLayout);
  auto& module = trainer.module();
  write_named(archive, "model/parameters", named(module.named_parameters()));
  write_named(archive, "model/buffers", named(module.named_buffers()));

  auto& optimizer = trainer.optimizer();
  archive.write("optimizer/type", c10::IValue(optimizer_type(optimizer)));
  archive.write("optimizer/groups", c10::IValue(join(group_names(optimizer, module))));
  OutputArchive optimizer_state;
  optimizer.save(optimizer_state);
  archive.write("optimizer/state", optimizer_state);

  archive.write("policies/names", c10::IValue(join(policy_names(trainer))));
  for (std::size_t i = 0; i < trainer.policies().size(); ++i) {
    OutputArchive policy;
    trainer.policies()[i]->save_state(policy);
    archive.write("policies/" + std::to_string(i), policy);
  }

  const auto c = trainer.counters();
  state::write_int(archive, "trainer/steps", c.steps);
  state::write_int(archive, "trainer/skipped", c.skipped);
  state::write_int(archive, "trainer/batches", c.batches);
  state::write_int(archive, "trainer/micro_batch", c.micro_batch);
  state::write_int(archive, "trainer/eval_batch", c.eval_batch);

  archive.write("rng/cpu", cpu_rng_state());
  const auto cuda = cuda_devices();
  state::write_int(archive, "rng/cuda_devices", cuda);
#ifdef FRUGAL_WITH_CUDA
  for (std::int64_t d = 0; d < cuda; ++d) {
    archive.write("rng/cuda/" + std::to_string(d), compat::cuda_rng_state(static_cast<int>(d)));
  }
#endif

  std::vector<std::string> keys;
  std::int64_t i = 0;
  for (const auto& [key, value] : user.values) {
    keys.push_back(key);
    state::write_int(archive, "user/" + std::to_string(i++), value);
  }
  archive.write("user/keys", c10::IValue(join(keys)));
  std::vector<std::string> number_keys;
  for (const auto& [key, value] : user.numbers) {
    state::write_double(archive, "user/number/" + std::to_string(number_keys.size()), value);
    number_keys.push_back(key);
  }
  archive.write("user/number_keys", c10::IValue(join(number_keys)));
  archive.write("user/blob", c10::IValue(user.blob));

  detail::write_state_file(path, [&](const detail::ByteWriter& write) { archive.save_to(write); });
}

UserState load_training_state(Trainer& trainer, const std::string& path) {
  FRUGAL_CHECK(!trainer.window_open(),
               "frugal: cannot load a saved state inside an "
               "accumulation window; load before the window's first batch");
  const auto payload = detail::read_state_file(path);
  InputArchive archive;
  archive.load_from(payload.data(), payload.size());
  auto loaded = read_checked(trainer, archive, path);

  // The fallible part: the optimizer's and the policies' own loads, undone on failure.
  auto& optimizer = trainer.optimizer();
  const auto old_optimizer = to_bytes([&](OutputArchive& a) { optimizer.save(a); });
  std::vector<std::string> old_policies;
  for (const auto& policy : trainer.policies()) {
    old_policies.push_back(to_bytes([&](OutputArchive& a) { policy->save_state(a); }));
  }
  std::size_t loaded_policies = 0;
  try {
    load_optimizer(optimizer, loaded.optimizer);
    for (; loaded_policies < trainer.policies().size(); ++loaded_policies) {
      trainer.policies()[loaded_policies]->load_state(loaded.policies[loaded_policies]);
    }
  } catch (const std::exception& error) {
    auto old = from_bytes(old_optimizer);
    load_optimizer(optimizer, old);
    for (std::size_t i = 0; i < loaded_policies; ++i) {
      auto policy_old = from_bytes(old_policies[i]);
      trainer.policies()[i]->load_state(policy_old);
    }
    FRUGAL_CHECK(false, "frugal: '", path,
                 "' does not fit this trainer (nothing was changed): ", error_message(error));
  }

  {
    torch::NoGradGuard no_grad;
    auto& module = trainer.module();
    const auto params = named(module.named_parameters());
    for (std::size_t i = 0; i < params.tensors.size(); ++i) {
      params.tensors[i].detach().copy_(loaded.parameters[i]);
    }
    const auto buffers = named(module.named_buffers());
    for (std::size_t i = 0; i < buffers.tensors.size(); ++i) {
      buffers.tensors[i].detach().copy_(loaded.buffers[i]);
    }
  }
  trainer.restore_counters(loaded.counters);
  set_cpu_rng_state(loaded.cpu_rng);
#ifdef FRUGAL_WITH_CUDA
  for (std::size_t d = 0; d < loaded.cuda_rng.size(); ++d) {
    compat::set_cuda_rng_state(static_cast<int>(d), loaded.cuda_rng[d]);
  }
#endif
  return loaded.user;
}

}  // namespace frugal
