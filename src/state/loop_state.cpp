// Saving and resuming a frugal::Loop: several models and optimizers in one checked file.
#include <torch/torch.h>

#include "frugal/error.h"
#include "frugal/loop/loop.h"
#include "frugal/policy/grad_scaler.h"
#include "frugal/state/archive.h"
#include "frugal/state/training_state.h"
#include "state_parts.h"

namespace frugal {
namespace {

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

std::vector<std::string> model_names(const Loop& loop) {
  std::vector<std::string> names;
  for (const auto& m : loop.models()) {
    names.push_back(m->name());
  }
  return names;
}

std::string prefix_of(std::size_t i) { return "loop/" + std::to_string(i) + "/"; }

GradScaler* scaler_of(const Loop& loop) {
  const auto& scaler = loop.options().scaler();
  return scaler && scaler->is_enabled() ? scaler.get() : nullptr;
}

// Everything read from a file, checked against the loop before anything changes.
struct LoopLoaded {
  std::vector<detail::SavedModel> saved;
  std::vector<std::pair<std::int64_t, std::int64_t>> counters;  // steps, skipped
  std::int64_t iterations = 0;
  std::map<std::string, double> scaler_state;
  detail::SavedRng rng;
  UserState user;
};

LoopLoaded read_loop_checked(Loop& loop, const std::string& path) {
  LoopLoaded out;
  auto archive = detail::open_state(path);
  c10::IValue names_value;
  FRUGAL_CHECK(archive.try_read("loop/models", names_value), "frugal: '", path,
               "' was saved from a Trainer, not a frugal::Loop");
  const auto names = names_value.toStringRef();
  const auto mine = detail::join_lines(model_names(loop));
  FRUGAL_CHECK(names == mine, detail::state_mismatch(
                                  path, "this loop", "the list of models",
                                  "[" + detail::join_lines(detail::split_lines(names), ", ") + "]",
                                  "[" + detail::join_lines(model_names(loop), ", ") + "]"));
  for (std::size_t i = 0; i < loop.models().size(); ++i) {
    auto& m = *loop.models()[i];
    out.saved.push_back(detail::read_model(archive, prefix_of(i), m.module(), m.optimizer(), path,
                                           "this loop's model '" + m.name() + "'"));
    out.counters.emplace_back(state::read_int(archive, prefix_of(i) + "steps"),
                              state::read_int(archive, prefix_of(i) + "skipped"));
  }
  out.iterations = state::read_int(archive, "loop/iterations");
  auto* scaler = scaler_of(loop);
  const bool saved_scaler = state::read_int(archive, "loop/scaler") != 0;
  FRUGAL_CHECK(saved_scaler == (scaler != nullptr),
               detail::state_mismatch(path, "this loop", "a loss scaler",
                                      saved_scaler ? "present" : "absent",
                                      scaler != nullptr ? "present" : "absent"));
  if (scaler != nullptr) {
    for (const auto& item : scaler->state_dict()) {
      out.scaler_state[item.first] = state::read_double(archive, "loop/scaler/" + item.first);
    }
  }
  out.rng = detail::read_rng(archive, path);
  out.user = detail::read_user(archive);

  return out;
}

}  // namespace

void save_training_state(Loop& loop, const std::string& path, const UserState& user) {
  FRUGAL_CHECK(!loop.pending(),
               "frugal: cannot save a Loop while a model has gradients "
               "waiting for its step (they are not saved); save after the steps");
  detail::check_user_keys(user);
  auto archive = detail::new_state_archive();
  archive.write("loop/models", c10::IValue(detail::join_lines(model_names(loop))));
  state::write_int(archive, "loop/iterations", loop.iterations());
  for (std::size_t i = 0; i < loop.models().size(); ++i) {
    auto& m = *loop.models()[i];
    detail::write_model(archive, prefix_of(i), m.module(), m.optimizer());
    state::write_int(archive, prefix_of(i) + "steps", m.steps());
    state::write_int(archive, prefix_of(i) + "skipped", m.skipped_steps());
  }
  const auto* scaler = scaler_of(loop);
  state::write_int(archive, "loop/scaler", scaler != nullptr ? 1 : 0);
  if (scaler != nullptr) {
    for (const auto& [key, value] : scaler->state_dict()) {
      state::write_double(archive, "loop/scaler/" + key, value);
    }
  }
  detail::finish_state(archive, path, user);
}

UserState load_training_state(Loop& loop, const std::string& path) {
  FRUGAL_CHECK(!loop.pending(),
               "frugal: cannot load a saved state into a Loop while a model "
               "has gradients waiting for its step");
  auto loaded = detail::read_naming(path, [&] { return read_loop_checked(loop, path); });
  auto& saved = loaded.saved;
  auto* scaler = scaler_of(loop);

  // The fallible part: the optimizers' own loads, undone on failure.
  std::vector<std::string> old;
  for (const auto& m : loop.models()) {
    old.push_back(detail::optimizer_bytes(m->optimizer()));
  }
  std::size_t done = 0;
  try {
    for (; done < saved.size(); ++done) {
      detail::load_optimizer(loop.models()[done]->optimizer(), saved[done].optimizer);
    }
    if (scaler != nullptr) {
      scaler->load_state_dict(loaded.scaler_state);
    }
  } catch (const std::exception& error) {
    for (std::size_t i = 0; i < done; ++i) {
      detail::load_optimizer_bytes(loop.models()[i]->optimizer(), old[i]);
    }
    FRUGAL_CHECK(false, "frugal: '", path,
                 "' does not fit this loop (nothing was changed): ", error_message(error));
  }
  for (std::size_t i = 0; i < saved.size(); ++i) {
    detail::put_back_tensors(loop.models()[i]->module(), saved[i]);
  }
  loop.restore_counters(loaded.iterations, loaded.counters);
  detail::put_back_rng(loaded.rng);
  return loaded.user;
}

}  // namespace frugal
