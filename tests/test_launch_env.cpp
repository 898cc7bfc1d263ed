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
  {
    ScopedEnv env({{"RANK", "0"},
                   {"WORLD_SIZE", nullptr},
                   {"MASTER_ADDR", "127.0.0.1"},
                   {"MASTER_PORT", "29500"}});
    EXPECT_NE(launch_error().find("WORLD_SIZE is not set"), std::string::npos) << launch_error();
  }
  {
    ScopedEnv env({{"RANK", "5"},
                   {"WORLD_SIZE", "2"},
                   {"MASTER_ADDR", "127.0.0.1"},
                   {"MASTER_PORT", "29500"}});
    EXPECT_NE(launch_error().find("RANK='5' is not an integer in [0, 1]"), std::string::npos)
        << launch_error();
  }
  {
    ScopedEnv env(
        {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", nullptr}, {"MASTER_PORT", "29500"}});
    EXPECT_NE(launch_error().find("MASTER_ADDR is not set"), std::string::npos) << launch_error();
  }
  {
    ScopedEnv env({{"RANK", "1"},
                   {"WORLD_SIZE", "2"},
                   {"MASTER_ADDR", "127.0.0.1"},
                   {"MASTER_PORT", "http"}});
    EXPECT_NE(launch_error().find("MASTER_PORT='http'"), std::string::npos) << launch_error();
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
