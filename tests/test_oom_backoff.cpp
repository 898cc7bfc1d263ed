// The engine's back-off after an out-of-memory error: what the Trainer's OomRecovery and
// Loop::accumulate(oom_recovery) both run the batch again with.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <stdexcept>
#include <string>
#include <tuple>

#include "engine/oom_backoff.h"
#include "frugal/memory/probe.h"

namespace {

c10::OutOfMemoryError simulated_oom() {
  try {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "simulated: 96 MiB do not fit");
  } catch (const c10::OutOfMemoryError& e) {
    return e;
  }
  throw std::logic_error("not reached");
}

TEST(OomBackoff, TellsAnOutOfMemoryErrorFromOthers) {
  EXPECT_TRUE(frugal::detail::is_out_of_memory(simulated_oom()));
  EXPECT_FALSE(frugal::detail::is_out_of_memory(std::runtime_error("out of memory")));
  try {
    TORCH_CHECK(false, "out of memory, but not the type");
  } catch (const c10::Error& e) {
    EXPECT_FALSE(frugal::detail::is_out_of_memory(e));
  }
}

TEST(OomBackoff, HalvesTheMicroBatchDownToTheFloor) {
  const frugal::MemoryProbe probe;
  const auto oom = simulated_oom();
  for (const auto& [size, floor, next] : {std::tuple<int, int, int>{8, 1, 4},
                                          {5, 1, 2},
                                          {2, 1, 1},
                                          {3, 2, 2},
                                          {100, 30, 50},
                                          {40, 30, 30}}) {
    EXPECT_EQ(frugal::detail::back_off(size, floor, probe, oom, "-"), next)
        << size << " with the floor at " << floor;
  }
}

TEST(OomBackoff, AtTheFloorSaysSoWithTheMemoryAndTheCause) {
  const frugal::MemoryProbe probe;
  const auto keep = torch::ones({1024});  // some allocated bytes for the figures
  try {
    frugal::detail::back_off(2, 2, probe, simulated_oom(), "The model is as before.");
    FAIL() << "no error at the floor";
  } catch (const c10::OutOfMemoryError& e) {
    const std::string what = e.what();
    for (const char* part : {"out of memory at micro-batch 2 (the floor is 2)", "allocated ",
                             "peak ", "The model is as before.", "simulated: 96 MiB do not fit"}) {
      EXPECT_NE(what.find(part), std::string::npos) << part << " not in: " << what;
    }
  }
}

}  // namespace
