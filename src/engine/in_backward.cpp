#include "in_backward.h"

#include <c10/util/Type.h>

#include <typeinfo>

#include "frugal/error.h"

namespace frugal::detail {

optim::InPlaceOptimizer& in_place_optimizer(torch::optim::Optimizer& optimizer,
                                            const std::string& who) {
  auto* in_place = dynamic_cast<optim::InPlaceOptimizer*>(&optimizer);
  FRUGAL_CHECK(in_place != nullptr, "frugal: ", who,
               " updates one parameter at a time and needs one of frugal's optimizers "
               "(frugal::optim::SGD, Adam or AdamW); its optimizer is ",
               c10::demangle(typeid(optimizer).name()));
  return *in_place;
}

optim::ShardedOptimizer* sharded_optimizer(torch::optim::Optimizer& optimizer) {
  return dynamic_cast<optim::ShardedOptimizer*>(&optimizer);
}

}  // namespace frugal::detail
