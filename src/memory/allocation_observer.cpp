#include "allocation_observer.h"

#include <thread>

#include "frugal/error.h"

namespace frugal::detail {

void tell_phase_boundary() {
  tell_observer([](AllocationObserver& o) { o.on_phase_boundary(); });
}

void set_allocation_observer(AllocationObserver* o) {
  if (o == nullptr) {
    observer.store(nullptr);
    while (observing.load() != 0) {
      std::this_thread::yield();
    }
    return;
  }
  AllocationObserver* none = nullptr;
  FRUGAL_CHECK(observer.compare_exchange_strong(none, o),
               "frugal: a memory recorder is recording already; one at a time");
}

}  // namespace frugal::detail
