// Starting ranks of this test binary as torchrun starts them, on the loopback.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "children.h"

namespace frugal::testing {

inline int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t size = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &size);
  close(fd);
  return ntohs(addr.sin_port);
}

// Starts `world` ranks of child `name` as torchrun would; their exit statuses by rank.
inline std::vector<int> launch(const std::string& name, int world, const std::vector<std::string>& args,
                        const std::string& stderr_prefix = "") {
  const auto port = std::to_string(free_port());
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    pids.push_back(frugal::testing::spawn_child(
        name, args,
        {"RANK=" + std::to_string(r), "LOCAL_RANK=" + std::to_string(r),
         "WORLD_SIZE=" + std::to_string(world), "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port},
        stderr_prefix.empty() ? "" : stderr_prefix + std::to_string(r) + ".txt"));
  }
  std::vector<int> status;
  for (const auto pid : pids) {
    status.push_back(frugal::testing::wait_child(pid));
  }
  return status;
}

}  // namespace frugal::testing
