// Ranks started on this machine as torchrun starts them: a free port on the loopback for
// MASTER_PORT, and the processes with the variables set.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace examples {

// A port on 127.0.0.1 that nothing listens on now.
inline int free_loopback_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof addr;
  const bool ok = fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) == 0;
  if (fd >= 0) {
    close(fd);
  }
  if (!ok) {
    throw std::runtime_error("no free TCP port on the loopback");
  }
  return ntohs(addr.sin_port);
}

// Runs `world` processes of `argv` (argv[0] a path), rank r with RANK=r, LOCAL_RANK=r,
// WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT; their exit
// statuses by rank (-1 for a process that did not exit).
inline std::vector<int> run_local_ranks(const std::vector<std::string>& argv, int world) {
  std::vector<char*> args;
  for (const auto& s : argv) {
    args.push_back(const_cast<char*>(s.c_str()));
  }
  args.push_back(nullptr);
  const auto port = std::to_string(free_loopback_port());
  const auto size = std::to_string(world);
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      const auto rank = std::to_string(r);
      setenv("RANK", rank.c_str(), 1);
      setenv("LOCAL_RANK", rank.c_str(), 1);
      setenv("WORLD_SIZE", size.c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", size.c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", port.c_str(), 1);
      execv(args[0], args.data());
      _exit(127);
    }
    if (pid < 0) {
      throw std::runtime_error("fork failed for rank " + std::to_string(r));
    }
    pids.push_back(pid);
  }
  std::vector<int> codes;
  for (const auto pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  }
  return codes;
}

}  // namespace examples
