// The test binary: Google Test, or one of the child processes tests start (children.h).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "children.h"
#include "frugal/memory/counting_allocator.h"
#include "frugal/train/trainer.h"

int main(int argc, char** argv) {
  // MKL may run a product on fewer threads when the machine is busy, which changes the order
  // of its sums: the tests that compare two runs bit for bit need the same thread count in
  // both. Before the first product; the child processes inherit it.
  setenv("MKL_DYNAMIC", "FALSE", /*overwrite=*/0);
  if (argc >= 3 && std::string(argv[1]) == "--child") {
    const auto& registry = frugal::testing::children();
    const auto found = registry.find(argv[2]);
    if (found == registry.end()) {
      fmt::print(stderr, "no child named '{}'\n", argv[2]);
      return 2;
    }
    try {
      return found->second(std::vector<std::string>(argv + 3, argv + argc));
    } catch (const std::exception& e) {
      fmt::print(stderr, "child {}: {}\n", argv[2], frugal::error_message(e));
      return 3;
    }
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
