// Tests that need a fresh process run this test binary again as `--child NAME ARGS...`.
#pragma once

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

extern char** environ;

namespace frugal::testing {

using ChildFn = std::function<int(const std::vector<std::string>& args)>;

/// The children this binary can run, by name (filled by RegisterChild objects).
inline std::map<std::string, ChildFn>& children() {
  static std::map<std::string, ChildFn> registry;
  return registry;
}

struct RegisterChild {
  RegisterChild(const std::string& name, ChildFn fn) { children()[name] = std::move(fn); }
};

/// Starts this binary as the child `name`; returns its pid. `env`: "NAME=value" entries
/// added to this process's environment (replacing the same names); `stderr_path`: a file
/// that receives the child's standard error (empty: this process's).
inline pid_t spawn_child(const std::string& name, const std::vector<std::string>& args,
                         const std::vector<std::string>& env = {},
                         const std::string& stderr_path = "") {
  std::vector<std::string> argv_text{"/proc/self/exe", "--child", name};
  argv_text.insert(argv_text.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& arg : argv_text) {
    argv.push_back(arg.data());
  }
  argv.push_back(nullptr);
  std::vector<std::string> env_text(env);
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const auto key = entry.substr(0, entry.find('=') + 1);
    bool replaced = false;
    for (const auto& added : env) {
      replaced = replaced || added.rfind(key, 0) == 0;
    }
    if (!replaced) {
      env_text.push_back(entry);
    }
  }
  std::vector<char*> envp;
  for (auto& entry : env_text) {
    envp.push_back(entry.data());
  }
  envp.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (!stderr_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, 2, stderr_path.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
  }
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  return rc == 0 ? pid : -1;
}

/// Waits for a child: its exit status, or 128 + the signal that ended it.
inline int wait_child(pid_t pid) {
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

inline int run_child(const std::string& name, const std::vector<std::string>& args) {
  const pid_t pid = spawn_child(name, args);
  return pid < 0 ? -1 : wait_child(pid);
}

}  // namespace frugal::testing
