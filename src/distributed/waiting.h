// How a rank waits for a collective, and what it says when one fails: the peers it can name.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "frugal/distributed/group.h"
#include "frugal/error.h"

namespace frugal::distributed::detail {

// Each rank's process, as it told the others on joining: on a failed collective, a rank names
// the ranks on its own host whose process is gone.
struct Peers {
  int self = 0;
  std::vector<std::int64_t> pids, hosts;  // by rank; hosts as hashes of their names

  // "rank 1 (process 4242 on this host) has exited; ", or "" where none is known to be gone.
  // A peer's socket closes a moment before its process is gone, and a process may take a
  // while to end (a sanitizer's leak check at exit, a loaded machine): looked for during two
  // seconds (on the error's path only).
  std::string gone() const {
    std::string out;
    for (int tries = 0; tries < 40 && out.empty(); ++tries) {
      if (tries > 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      for (std::size_t r = 0; r < pids.size(); ++r) {
        if (static_cast<int>(r) != self && hosts[r] == hosts[static_cast<std::size_t>(self)] &&
            !alive(static_cast<pid_t>(pids[r]))) {
          out += "rank " + std::to_string(r) + " (process " + std::to_string(pids[r]) +
                 " on this host) has exited; ";
        }
      }
    }
    return out;
  }

  // Whether the process runs: it exists and is not a zombie that no one has waited for yet.
  static bool alive(pid_t pid) {
    if (::kill(pid, 0) != 0) {
      return errno != ESRCH;
    }
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    std::getline(stat, line);
    const auto end_of_name = line.rfind(')');
    return end_of_name == std::string::npos || line.size() < end_of_name + 3 ||
           line[end_of_name + 2] != 'Z';
  }
};

// How this rank waits for a collective, and what its failure says.
struct Waiting {
  int rank = 0;
  std::chrono::milliseconds timeout{0};
  bool release = true;  // Gloo: wait for its worker to drop each work (NCCL's watchdog keeps them)
  std::shared_ptr<const Peers> peers;  // null until the group has gathered them
};

// Waits for a collective; its failure says which rank saw it and the likely cause. Then,
// with `release`, waits (briefly) until the backend's worker thread has dropped the work too:
// Gloo's keeps it, and so its tensors and scratch, a moment after waking the waiter, and
// the memory figures must not depend on that race.
template <typename Ptr>
inline void wait_for(Ptr work, const char* what, const Waiting& w) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    const auto gone = w.peers ? w.peers->gone() : std::string();
    const auto timeout = std::to_string(w.timeout.count()) + " ms";
    const auto cause =
        gone.empty()
            ? "another rank stopped, or did not come within the group's timeout (" + timeout + ")"
            : gone + "the group's timeout is " + timeout;
    FRUGAL_CHECK(false, "frugal: rank ", w.rank, "'s ", what, " failed: ", cause,
                 ". The backend said: ", c10::GetExceptionString(e));
  }
  if (!w.release) {
    return;
  }
  using Target = typename Ptr::element_type;
  c10::weak_intrusive_ptr<Target> weak(work);
  work.reset();
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (!weak.expired() && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::yield();
  }
}

// A collective in flight, waited for (and its failure reported) as wait_for does.
template <typename Ptr>
inline Work in_flight(Ptr work, const char* what, const Waiting& w) {
  using Target = typename Ptr::element_type;
  c10::weak_intrusive_ptr<Target> weak(work);
  return Work([work, what, w]() mutable { wait_for(std::move(work), what, w); },
              [weak] {
                const auto strong = weak.lock();
                return !strong || strong->isCompleted();
              });
}

}  // namespace frugal::distributed::detail
