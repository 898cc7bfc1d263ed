// How a process reads what torchrun tells it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
// the elastic agent's variables): each missing or wrong variable named.
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "frugal/distributed/group.h"
#include "frugal/error.h"

namespace {

class ScopedEnv {
 public:
  explicit ScopedEnv(std::vector<std::pair<std::string, const char*>> values) {
    for (auto& [name, value] : values) {
      const char* old = std::getenv(name.c_str());
      saved_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
      value ? setenv(name.c_str(), value, 1) : unsetenv(name.c_str());
    }
  }
  ~ScopedEnv() {
    for (auto& [name, value] : saved_) {
      value ? setenv(name.c_str(), value->c_str(), 1) : unsetenv(name.c_str());
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

std::string launch_error() {
  try {
    frugal::distributed::LaunchEnv::from_environment();
  } catch (const std::exception& e) {
    return frugal::error_message(e);
  }
  return "";
}

TEST(DistLaunchEnv, NamesTheMissingOrWrongVariable) {
  // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (null: unset), and what the error must say.
  struct Case {
    const char *rank, *world, *addr, *port, *says;
  };
  for (const auto& c :
       {Case{"0", nullptr, "127.0.0.1", "29500", "WORLD_SIZE is not set"},
        Case{"5", "2", "127.0.0.1", "29500", "RANK='5' is not an integer in [0, 1]"},
        Case{"1", "2", nullptr, "29500", "MASTER_ADDR is not set"},
        Case{"1", "2", "127.0.0.1", "http", "MASTER_PORT='http'"}}) {
    ScopedEnv env({{"RANK", c.rank},
                   {"WORLD_SIZE", c.world},
                   {"MASTER_ADDR", c.addr},
                   {"MASTER_PORT", c.port}});
    EXPECT_NE(launch_error().find(c.says), std::string::npos) << launch_error();
  }
  {
    ScopedEnv env({{"RANK", "1"},
                   {"WORLD_SIZE", "2"},
                   {"MASTER_ADDR", "10.0.0.1"},
                   {"MASTER_PORT", "29400"},
                   {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                   {"TORCHELASTIC_RESTART_COUNT", "2"}});
    const auto env_read = frugal::distributed::LaunchEnv::from_environment();
    EXPECT_EQ(env_read.rank, 1);
    EXPECT_EQ(env_read.master_port, 29400);
    EXPECT_TRUE(env_read.use_agent_store);
    EXPECT_EQ(env_read.restart_count, 2);
  }
}

}  // namespace
