#include "frugal/fit/fit.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <csignal>
#include <optional>

#include "frugal/dist/shard.h"
#include "frugal/dist/zero.h"
#include "frugal/train/trainer.h"
#include "frugal/error.h"

namespace frugal {
namespace {

volatile std::sig_atomic_t g_signal = 0;

extern "C" void remember_signal(int signal) { g_signal = signal; }

// SIGINT and SIGTERM only set a flag while a fit runs; the old handlers come back after.
class SignalWatch {
 public:
  explicit SignalWatch(bool enabled) : enabled_(enabled) {
    if (!enabled_) {
      return;
    }
    g_signal = 0;
    struct sigaction action {};
    action.sa_handler = remember_signal;
    sigemptyset(&action.sa_mask);
    sigaction(SIGINT, &action, &old_int_);
    sigaction(SIGTERM, &action, &old_term_);
  }
  ~SignalWatch() {
    if (enabled_) {
      sigaction(SIGINT, &old_int_, nullptr);
      sigaction(SIGTERM, &old_term_, nullptr);
    }
  }
  SignalWatch(const SignalWatch&) = delete;
  SignalWatch& operator=(const SignalWatch&) = delete;
  int caught() const { return enabled_ ? static_cast<int>(g_signal) : 0; }

 private:
  bool enabled_;
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

void check_options(const FitOptions& o, const DataSource& train) {
  FRUGAL_CHECK(o.epochs() >= 1, "frugal: fit epochs must be >= 1, got ", o.epochs());
  FRUGAL_CHECK(o.batch_size() >= 1, "frugal: fit batch_size must be >= 1, got ", o.batch_size());
  FRUGAL_CHECK(o.max_steps() >= 0, "frugal: fit max_steps must be >= 0, got ", o.max_steps());
  FRUGAL_CHECK(o.eval_every() >= 0, "frugal: fit eval_every must be >= 0, got ", o.eval_every());
  FRUGAL_CHECK(o.save_every() >= 0, "frugal: fit save_every must be >= 0, got ", o.save_every());
  FRUGAL_CHECK(!o.save_dir().empty() || (!o.resume() && o.save_every() == 0),
               "frugal: fit resume and save_every need a save_dir");
  FRUGAL_CHECK(train.size() >= 1, "frugal: fit needs training data, got 0 samples");
}

constexpr const char* kEpoch = "fit/epoch";
constexpr const char* kBatch = "fit/batch";

// Loads the newest loadable save, if any, and sets the position fit goes on from.
void resume(SaveDir& saves, Trainer& trainer, const FitOptions& options,
            const FitOptions::LogFn& log, FitResult& result) {
  auto user = saves.resume(trainer, log);
  if (!user) {
    return;
  }
  auto& pos = result.position;
  FRUGAL_CHECK(user->values.count(kEpoch) && user->values.count(kBatch), "frugal: '",
               saves.resumed_from(), "' was not saved by fit (no position in it)");
  pos.epoch = user->values.at(kEpoch);
  pos.batch = user->values.at(kBatch);
  FRUGAL_CHECK(pos.epoch >= 1 && pos.batch >= 0 && pos.batch <= pos.batches_per_epoch, "frugal: '",
               saves.resumed_from(), "' stopped at epoch ", pos.epoch, " batch ", pos.batch,
               ", which this data (", pos.batches_per_epoch, " batches an epoch) does not have");
  result.resumed_from = saves.resumed_from();
  if (options.on_resume()) {
    options.on_resume()(*user);
  }
  log(fmt::format("resumed from {} (step {}, epoch {}, batch {} of {})", result.resumed_from,
                  trainer.steps(), pos.epoch, pos.batch, pos.batches_per_epoch));
}

}  // namespace

FitResult fit(Trainer& trainer, const DataSource& train, const FitOptions& options,
              const Batch& eval) {
  check_options(options, train);
  const FitOptions::LogFn log = options.log() ? options.log() : [](const std::string& line) {
    fmt::print(stderr, "frugal: {}\n", line);
  };
  const std::int64_t n = train.size();
  const std::int64_t bs = options.batch_size();
  FitResult result;
  auto& pos = result.position;
  pos.batches_per_epoch = (n - 1) / bs + 1;

  dist::Group* group = options.group().get();
  // A sharded optimizer's state differs by rank: every rank keeps its own saves then.
  const bool sharded =
      group != nullptr && dynamic_cast<const dist::ZeroOptimizer*>(&trainer.optimizer()) != nullptr;
  const bool writes = group == nullptr || group->rank() == 0 || sharded;
  std::optional<SaveDir> saves;
  if (!options.save_dir().empty()) {
    saves.emplace(sharded ? options.save_dir() + "/rank-" + std::to_string(group->rank())
                          : options.save_dir(),
                  options.keep());
  }
  if (options.resume()) {
    resume(*saves, trainer, options, log, result);
  }
  if (group != nullptr && options.resume()) {
    const double steps = static_cast<double>(trainer.steps());
    FRUGAL_CHECK(group->sum(steps) == steps * group->size(), "frugal: rank ", group->rank(),
                 " resumed at step ", trainer.steps(), " but not every rank did; the ranks' "
                 "saves differ (remove the newer ones)");
  }
  std::int64_t saved_step = -1;  // the step of the newest save file
  if (!result.resumed_from.empty()) {
    saved_step = trainer.steps();
  }
  auto save = [&] {
    if (!writes) {  // the ranks hold the same state: rank 0's file is every rank's
      saved_step = trainer.steps();
      return;
    }
    UserState user;
    if (options.on_save()) {
      options.on_save()(user);
    }
    user.values[kEpoch] = pos.epoch;
    user.values[kBatch] = pos.batch;
    result.saved = saves->save(trainer, user);
    saved_step = trainer.steps();
  };
  auto evaluate = [&] {
    result.eval = group != nullptr ? dist::evaluate(trainer, *group, eval) : trainer.evaluate(eval);
    if (options.on_eval()) {
      options.on_eval()(result.eval, pos);
    }
  };
  auto reached_max = [&] {
    return options.max_steps() > 0 && trainer.steps() >= options.max_steps();
  };

  SignalWatch signals(options.handle_signals());
  auto generator = torch::make_generator<torch::CPUGeneratorImpl>(options.seed());
  for (std::int64_t e = 1; options.shuffle() && e < pos.epoch; ++e) {
    torch::randperm(n, generator);  // the orders of the epochs already done
  }
  bool stop = reached_max();
  for (; pos.epoch <= options.epochs() && !stop; ++pos.epoch, pos.batch = 0) {
    pos.end_of_epoch = false;
    pos.step = trainer.steps();
    if (options.on_epoch_begin()) {
      options.on_epoch_begin()(pos);
    }
    const auto order =
        options.shuffle() ? torch::randperm(n, generator) : torch::arange(n, torch::kLong);
    while (pos.batch < pos.batches_per_epoch) {
      const std::int64_t start = pos.batch * bs;
      auto indices = order.narrow(0, start, std::min(bs, n - start));
      if (group != nullptr) {
        if (indices.size(0) < group->size()) {
          ++pos.batch;  // too small to give every rank a sample
          continue;
        }
        const auto share = dist::share_of(indices.size(0), group->rank(), group->size());
        indices = indices.narrow(0, share.start, share.length);
      }
      const auto report = trainer.step(train.get(indices));
      ++pos.batch;
      pos.step = trainer.steps();
      if (options.on_step()) {
        options.on_step()(report, pos);
      }
      if (trainer.window_open()) {
        continue;  // saves, evaluations and stops wait for the step that ends the window
      }
      const bool every_eval = options.eval_every() > 0 && pos.step % options.eval_every() == 0;
      if (every_eval && eval.inputs.defined()) {
        evaluate();
      }
      int caught = signals.caught();
      if (group != nullptr && options.handle_signals()) {
        // The ranks stop together: after the step where any of them saw a signal.
        const double seen = group->sum(caught);
        caught = seen > 0 ? (caught != 0 ? caught : SIGTERM) : 0;
      }
      if (caught != 0) {
        if (saves) {
          save();
          log(fmt::format("stopped by signal {} at step {}; saved {}", caught, pos.step,
                          result.saved));
        }
        result.signal = caught;
        result.steps = trainer.steps();
        return result;
      }
      if (options.save_every() > 0 && pos.step % options.save_every() == 0) {
        save();
      }
      if ((stop = reached_max())) {
        break;
      }
    }
    if (trainer.flush()) {
      pos.step = trainer.steps();
    }
    pos.end_of_epoch = pos.batch == pos.batches_per_epoch;
    if (options.eval_every() == 0 && eval.inputs.defined()) {
      evaluate();
    }
    if (stop) {
      break;
    }
  }
  if (pos.epoch > options.epochs()) {  // the position after the last epoch
    pos.epoch = options.epochs();
    pos.batch = pos.batches_per_epoch;
  }
  pos.step = trainer.steps();
  if (saves && saved_step != trainer.steps()) {
    save();
  }
  result.steps = trainer.steps();
  return result;
}

}  // namespace frugal
