// The planner's 8-bit weights: which units may be stored, what storing them changes, the
// check that the step reaches them, and storing them.
#include <unordered_set>

#include "frugal/compose/planner.h"
#include "frugal/error.h"
#include "frugal/nn/unit_hook.h"
#include "policy/module_select.h"

namespace frugal {
namespace {

// Records whether frugal::nn::call reached a unit.
struct ReachHook : nn::UnitHook {
  void before_forward() override { reached = true; }
  void after_forward(const std::vector<torch::Tensor>& /*outputs*/) override {}
  bool reached = false;
};

// Keeps a plan's 8-bit weights while the trainer lives.
class KeptInt8Weights : public Policy {
 public:
  explicit KeptInt8Weights(std::shared_ptr<nn::Int8Weights> weights)
      : weights_(std::move(weights)) {}
  std::string name() const override { return "int8 weights"; }

 private:
  std::shared_ptr<nn::Int8Weights> weights_;
};

constexpr const char* kInt8Rule = "MemoryPlannerOptions::int8_weights";

}  // namespace

void MemoryPlanner::select_int8_units() {
  FRUGAL_CHECK(dynamic_cast<optim::InPlaceOptimizer*>(&trainer_.optimizer()) != nullptr,
               "frugal: ", kInt8Rule,
               " needs one of frugal's optimizers (frugal::optim::SGD, Adam, AdamW, "
               "Adam8bit, ...): they update the codes");
  FRUGAL_CHECK(trainer_.optimizer().state().empty(), "frugal: ", kInt8Rule,
               " needs an optimizer without state: the weights are stored before the first "
               "step");
  std::unordered_set<const void*> seen;
  for (const auto& node :
       detail::select_modules(trainer_.module(), options_.int8_weights(), kInt8Rule)) {
    FRUGAL_CHECK(nn::unit_hook(*node.module) == nullptr, "frugal: ", kInt8Rule, " chose '",
                 node.name, "', a unit already (of an Int8Weights or a ZeroOptimizer)");
    const auto params = nn::Int8Weights::storable(*node.module, options_.int8_options());
    FRUGAL_CHECK(!params.empty(), "frugal: ", kInt8Rule, " chose '", node.name, "' (",
                 node.module->name(), "), which has no matrix of at least ",
                 options_.int8_options().min_elements(), " elements to store");
    for (const auto& p : params) {
      int8_dtype_ = int8_dtype_.value_or(p.scalar_type());
      FRUGAL_CHECK(p.scalar_type() == *int8_dtype_, "frugal: ", kInt8Rule, " chose '", node.name,
                   "', whose matrices are ", p.scalar_type(), " where another's are ", *int8_dtype_,
                   ": the units run in one dtype");
      FRUGAL_CHECK(seen.insert(p.unsafeGetTensorImpl()).second, "frugal: ", kInt8Rule, " chose '",
                   node.name, "', which shares a matrix with another unit");
    }
    int8_units_.emplace_back(node.name, node.module);
  }
}

void MemoryPlanner::price_weights(MemoryPlan& plan) const {
  if (int8_units_.empty() || int8_stored_) {
    return;
  }
  MemoryPlan::WeightCost cost;
  cost.units = static_cast<std::int64_t>(int8_units_.size());
  for (const auto& unit : int8_units_) {
    std::int64_t whole = 0;
    for (const auto& p : nn::Int8Weights::storable(*unit.second, options_.int8_options())) {
      const auto n = p.numel();
      cost.elements += n;
      cost.stored_bytes += nn::Int8Weights::stored_bytes(n, options_.int8_options().group());
      whole += n * static_cast<std::int64_t>(p.element_size());
    }
    cost.bytes += whole;
    cost.unit_bytes = std::max(cost.unit_bytes, whole);
  }
  plan.int8_cost = cost;
}

void MemoryPlanner::check_units_reached(const Batch& sample) {
  std::vector<std::shared_ptr<ReachHook>> hooks;
  struct Remove {  // the hooks go however the trial ends
    std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>& units;
    std::size_t added = 0;
    ~Remove() {
      for (std::size_t i = 0; i < added; ++i) {
        nn::detail::remove_unit_hook(units[i].second.get());
      }
    }
  } remove{int8_units_};
  for (const auto& unit : int8_units_) {
    hooks.push_back(std::make_shared<ReachHook>());
    nn::detail::add_unit_hook(unit.second.get(), hooks.back());
    ++remove.added;
  }
  (void)trainer_.trial(sample);
  for (std::size_t i = 0; i < hooks.size(); ++i) {
    FRUGAL_CHECK(hooks[i]->reached, "frugal: ", kInt8Rule, " chose '", int8_units_[i].first, "' (",
                 int8_units_[i].second->name(),
                 "), but the step did not call it through frugal::nn::call: its weights could "
                 "not be materialised for it. Call it as frugal::nn::call(unit, args...) in "
                 "its parent's forward");
  }
}

void MemoryPlanner::store_weights(MemoryPlan& plan) {
  // Should a later part of plan() throw, the weights come back whole in their dtype as
  // this goes (from their codes: rounded to 8 bits).
  plan.int8_weights = std::make_shared<nn::Int8Weights>(
      nn::Int8WeightsOptions(options_.int8_options()).dtype(*int8_dtype_));
  for (const auto& unit : int8_units_) {
    plan.int8_weights->add_module(unit.second);
  }
}

void MemoryPlanner::keep_int8_weights(const MemoryPlan& plan) {
  trainer_.add_policy(std::make_shared<KeptInt8Weights>(plan.int8_weights));
  int8_stored_ = true;
}

}  // namespace frugal
