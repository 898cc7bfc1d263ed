#include "frugal/fit/fit.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <csignal>
#include <filesystem>
#include <optional>

#include "frugal/error.h"
#include "frugal/train/trainer.h"

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

void check_options(const FitOptions& o) {
  detail::check_at_least(o.epochs(), 1, "fit epochs");
  detail::check_at_least(o.batch_size(), 1, "fit batch_size");
  detail::check_at_least(o.max_steps(), 0, "fit max_steps");
  detail::check_at_least(o.eval_every(), 0, "fit eval_every");
  detail::check_at_least(o.save_every(), 0, "fit save_every");
  FRUGAL_CHECK(!o.save_dir().empty() || (!o.resume() && o.save_every() == 0),
               "frugal: fit resume and save_every need a save_dir");
}

// A DataSource's batches: each epoch in the order of the next permutation of a generator
// seeded with the options' seed (replayed for the epochs a resumed run has done), each batch
// shared among the ranks.
class IndexedBatches : public FitBatches {
 public:
  IndexedBatches(const DataSource& data, const FitOptions& options, const Ranks& ranks)
      : data_(data),
        options_(options),
        ranks_(ranks),
        n_(data.size()),
        generator_(torch::make_generator<torch::CPUGeneratorImpl>(options.seed())) {}
  std::int64_t per_epoch() const override { return (n_ - 1) / options_.batch_size() + 1; }
  void begin(std::int64_t epoch, std::int64_t done) override {
    for (; options_.shuffle() && drawn_ + 1 < epoch; ++drawn_) {
      torch::randperm(n_, generator_);  // the orders of the epochs already done
    }
    order_ = options_.shuffle() ? torch::randperm(n_, generator_) : torch::arange(n_, torch::kLong);
    drawn_ = epoch;
    batch_ = done;
  }
  c10::optional<Batch> next() override {
    if (batch_ >= per_epoch()) {
      return c10::nullopt;
    }
    const std::int64_t bs = options_.batch_size();
    const std::int64_t start = batch_++ * bs;
    const auto indices = ranks_.share(order_.narrow(0, start, std::min(bs, n_ - start)));
    if (!indices.defined()) {
      return Batch{};  // too small to give every process a sample
    }
    return data_.get(indices);
  }

 private:
  const DataSource& data_;
  const FitOptions& options_;
  const Ranks& ranks_;
  std::int64_t n_;
  torch::Generator generator_;
  std::int64_t drawn_ = 0;  // permutations drawn
  torch::Tensor order_;
  std::int64_t batch_ = 0;
};

const Ranks& ranks_of(const FitOptions& options) {
  static const Ranks one_process;
  return options.ranks() ? *options.ranks() : one_process;
}

constexpr const char* kEpoch = "fit/epoch";
constexpr const char* kBatch = "fit/batch";

// Refuses to start afresh in a save_dir that holds the saves of another layout: one folder a
// rank (a sharded optimizer's, as ZeroOptimizer's), met by a run whose saves are in the
// folder itself, or the other way round.
void check_save_layout(const std::string& base, const SaveDir& saves) {
  if (!saves.files().empty()) {
    return;
  }
  const auto rank_zero = (std::filesystem::path(base) / "rank-0").string();
  if (saves.dir() == base) {
    FRUGAL_CHECK(SaveDir::files_in(rank_zero).empty(), "frugal: '", base,
                 "' holds the saves of a sharded optimizer (one folder a rank: '", rank_zero,
                 "', ...) and none of this run's, whose optimizer is not sharded; resume with the "
                 "optimizer that saved them (ZeroOptimizer), or choose another save_dir");
  } else {
    FRUGAL_CHECK(SaveDir::files_in(base).empty(), "frugal: '", base,
                 "' holds the saves of an optimizer that is not sharded and '", saves.dir(),
                 "' none of this run's, whose optimizer is sharded (one folder a rank); resume "
                 "with the optimizer that saved them, or choose another save_dir");
  }
}

// Loads the newest loadable save, if any, and sets the position fit goes on from.
void resume(SaveDir& saves, Trainer& trainer, const FitOptions& options, const Ranks& ranks,
            const FitOptions::LogFn& log, FitResult& result) {
  check_save_layout(options.save_dir(), saves);
  auto user = ranks.resume(saves, trainer, log);
  if (!user) {
    return;
  }
  auto& pos = result.position;
  FRUGAL_CHECK(user->values.count(kEpoch) && user->values.count(kBatch), "frugal: '",
               saves.resumed_from(), "' was not saved by fit (no position in it)");
  pos.epoch = user->values.at(kEpoch);
  pos.batch = user->values.at(kBatch);
  FRUGAL_CHECK(pos.epoch >= 1 && pos.batch >= 0 &&
                   (pos.batches_per_epoch < 0 || pos.batch <= pos.batches_per_epoch),
               "frugal: '", saves.resumed_from(), "' stopped at epoch ", pos.epoch, " batch ",
               pos.batch, ", which this data (", pos.batches_per_epoch,
               " batches an epoch) does not have");
  result.resumed_from = saves.resumed_from();
  if (options.on_resume()) {
    options.on_resume()(*user);
  }
  log(fmt::format("resumed from {} (step {}, epoch {}, batch {} of {})", result.resumed_from,
                  trainer.steps(), pos.epoch, pos.batch, pos.batches_per_epoch));
}

}  // namespace

std::optional<UserState> Ranks::resume(SaveDir& saves, Trainer& trainer,
                                       const std::function<void(const std::string&)>& warn) const {
  return saves.resume(trainer, warn);
}

EvalReport Ranks::evaluate(Trainer& trainer, const Batch& data) const {
  return trainer.evaluate(data);
}

FitResult fit(Trainer& trainer, const DataSource& train, const FitOptions& options,
              const Batch& eval) {
  check_options(options);
  FRUGAL_CHECK(train.size() >= 1, "frugal: fit needs training data, got 0 samples");
  IndexedBatches batches(train, options, ranks_of(options));
  return fit(trainer, static_cast<FitBatches&>(batches), options, eval);
}

FitResult fit(Trainer& trainer, FitBatches& train, const FitOptions& options, const Batch& eval) {
  check_options(options);
  const FitOptions::LogFn log = options.log() ? options.log() : [](const std::string& line) {
    fmt::print(stderr, "frugal: {}\n", line);
  };
  FitResult result;
  auto& pos = result.position;
  pos.batches_per_epoch = train.per_epoch();
  const Ranks& ranks = ranks_of(options);
  const bool writes = ranks.writes_saves(trainer.optimizer());
  std::optional<SaveDir> saves;
  if (!options.save_dir().empty()) {
    saves.emplace(ranks.save_dir(options.save_dir(), trainer.optimizer()), options.keep());
  }
  if (options.resume()) {
    resume(*saves, trainer, options, ranks, log, result);
  }
  std::int64_t saved_step = -1;  // the step of the newest save file
  if (!result.resumed_from.empty()) {
    saved_step = trainer.steps();
  }
  auto save = [&] {
    if (!writes) {  // the processes hold the same state: another's file is this one's
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
    result.eval = ranks.evaluate(trainer, eval);
    if (options.on_eval()) {
      options.on_eval()(result.eval, pos);
    }
  };
  auto reached_max = [&] {
    return options.max_steps() > 0 && trainer.steps() >= options.max_steps();
  };

  SignalWatch signals(options.handle_signals());
  bool stop = reached_max();
  for (; pos.epoch <= options.epochs() && !stop; ++pos.epoch, pos.batch = 0) {
    pos.end_of_epoch = false;
    pos.step = trainer.steps();
    if (options.on_epoch_begin()) {
      options.on_epoch_begin()(pos);
    }
    train.begin(pos.epoch, pos.batch);
    bool finished = false;  // the epoch's batches ran out (not stopped inside it)
    while (true) {
      auto batch = train.next();
      if (!batch) {
        finished = true;
        break;
      }
      if (!batch->inputs.defined()) {
        ++pos.batch;  // too small to give every process a sample
        continue;
      }
      const auto report = trainer.step(*batch);
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
      const int caught = options.handle_signals() ? ranks.agree_on_stop(signals.caught()) : 0;
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
    FRUGAL_CHECK(pos.batch > 0 || !finished, "frugal: fit got no batches in epoch ", pos.epoch);
    if (finished && pos.batches_per_epoch < 0) {
      pos.batches_per_epoch = pos.batch;  // known now: the epoch has ended
    }
    if (trainer.flush()) {
      pos.step = trainer.steps();
    }
    pos.end_of_epoch =
        finished || (pos.batches_per_epoch >= 0 && pos.batch == pos.batches_per_epoch);
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
