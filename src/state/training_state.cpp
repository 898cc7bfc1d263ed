#include "frugal/state/training_state.h"

#include <torch/torch.h>

#include <algorithm>
#include <sstream>
#include <utility>

#include "frugal/error.h"
#include "frugal/state/archive.h"
#include "frugal/train/trainer.h"
#include "state_parts.h"

namespace frugal {
namespace {

// The trainer's counters in a saved state: each one's key and field.
const std::pair<const char*, std::int64_t TrainerCounters::*> kCounters[] = {
    {"trainer/steps", &TrainerCounters::steps},
    {"trainer/skipped", &TrainerCounters::skipped},
    {"trainer/batches", &TrainerCounters::batches},
    {"trainer/micro_batch", &TrainerCounters::micro_batch},
    {"trainer/eval_batch", &TrainerCounters::eval_batch}};

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

constexpr const char* kWhose = "this trainer";

std::vector<std::string> policy_names(const Trainer& trainer) {
  std::vector<std::string> names;
  for (const auto& policy : trainer.policies()) {
    names.push_back(policy->name());
  }
  return names;
}

// The bytes of a policy's state, and putting them back: for undoing a failed load.
std::string policy_bytes(const Policy& policy) {
  OutputArchive archive;
  policy.save_state(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

void load_policy_bytes(Policy& policy, const std::string& bytes) {
  InputArchive archive;
  archive.load_from(bytes.data(), bytes.size());
  policy.load_state(archive);
}

// Everything read from a file, checked against the trainer before anything changes.
struct Loaded {
  TrainerCounters counters;
  detail::SavedModel model;
  std::vector<InputArchive> policies;
  detail::SavedRng rng;
  UserState user;
};

Loaded read_checked(Trainer& trainer, InputArchive& archive, const std::string& path) {
  Loaded out;
  c10::IValue loop_models;
  FRUGAL_CHECK(!archive.try_read("loop/models", loop_models), "frugal: '", path,
               "' was saved from a frugal::Loop; load it into one");
  out.model = detail::read_model(archive, "", trainer.module(), trainer.optimizer(), path, kWhose);

  const auto policies = state::read_string(archive, "policies/names");
  const auto my_policies = detail::join_lines(policy_names(trainer));
  auto list = [](std::string s) {
    std::replace(s.begin(), s.end(), '\n', ',');
    return "[" + s + "]";
  };
  FRUGAL_CHECK(policies == my_policies, detail::state_mismatch(path, kWhose, "the list of policies",
                                                               list(policies), list(my_policies)));
  for (std::size_t i = 0; i < trainer.policies().size(); ++i) {
    out.policies.push_back(state::read_archive(archive, "policies/" + std::to_string(i)));
  }

  for (const auto& [key, field] : kCounters) {
    out.counters.*field = state::read_int(archive, key);
  }
  out.rng = detail::read_rng(archive, path);
  out.user = detail::read_user(archive);
  return out;
}

}  // namespace

void save_training_state(Trainer& trainer, const std::string& path, const UserState& user) {
  FRUGAL_CHECK(trainer.halted().empty(), "frugal: not saving a halted trainer: ", trainer.halted());
  FRUGAL_CHECK(!trainer.window_open(),
               "frugal: cannot save inside an accumulation window (its "
               "gradients are not saved); save after the step that ends it");
  detail::check_user_keys(user);
  auto archive = detail::new_state_archive();
  detail::write_model(archive, "", trainer.module(), trainer.optimizer());
  archive.write("policies/names", c10::IValue(detail::join_lines(policy_names(trainer))));
  for (std::size_t i = 0; i < trainer.policies().size(); ++i) {
    OutputArchive policy;
    trainer.policies()[i]->save_state(policy);
    archive.write("policies/" + std::to_string(i), policy);
  }
  const auto counters = trainer.counters();
  for (const auto& [key, field] : kCounters) {
    state::write_int(archive, key, counters.*field);
  }
  detail::finish_state(archive, path, user);
}

UserState load_training_state(Trainer& trainer, const std::string& path) {
  FRUGAL_CHECK(!trainer.window_open(),
               "frugal: cannot load a saved state inside an "
               "accumulation window; load before the window's first batch");
  auto loaded = detail::read_naming(path, [&] {
    auto archive = detail::open_state(path);
    return read_checked(trainer, archive, path);
  });

  // The fallible part: the optimizer's and the policies' own loads, undone on failure.
  auto& optimizer = trainer.optimizer();
  const auto old_optimizer = detail::optimizer_bytes(optimizer);
  std::vector<std::string> old_policies;
  for (const auto& policy : trainer.policies()) {
    old_policies.push_back(policy_bytes(*policy));
  }
  std::size_t loaded_policies = 0;
  try {
    detail::load_optimizer(optimizer, loaded.model.optimizer);
    for (; loaded_policies < trainer.policies().size(); ++loaded_policies) {
      trainer.policies()[loaded_policies]->load_state(loaded.policies[loaded_policies]);
    }
  } catch (const std::exception& error) {
    detail::load_optimizer_bytes(optimizer, old_optimizer);
    for (std::size_t i = 0; i < loaded_policies; ++i) {
      load_policy_bytes(*trainer.policies()[i], old_policies[i]);
    }
    FRUGAL_CHECK(false, "frugal: '", path,
                 "' does not fit this trainer (nothing was changed): ", error_message(error));
  }
  detail::put_back_tensors(trainer.module(), loaded.model);
  trainer.restore_counters(loaded.counters);
  detail::put_back_rng(loaded.rng);
  return loaded.user;
}

}  // namespace frugal
