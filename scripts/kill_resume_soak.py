#!/usr/bin/env python3
"""Kills two-rank ZeRO-3 runs with SIGKILL while they save, resumes each, and checks that
every resumed run ends bit for bit where an uninterrupted run ends.

Each round starts the test binary's `dp-fit` ranks (frugal::fit, ZeroOptimizer stage 3 or 2,
a save every 5 steps), kills one rank or both at a random moment, then resumes in the same
save folder up to the last step. The ranks must agree on the newest step both hold whole:
a round fails when a resume fails or its weights differ from the uninterrupted run's.

    scripts/kill_resume_soak.py --binary build/torch2/tests/frugal_tests --rounds 20
"""
import argparse
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(binary, mode, saves, steps, out, log):
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [binary, "--child", "dp-fit", mode, saves, str(steps), out],
            env=env, stdout=subprocess.DEVNULL, stderr=open(f"{log}-{rank}.txt", "w")))
    return procs


def weights_equal(binary, a, b):
    """Compares two runs' saved weights through the binary's own child."""
    return subprocess.run([binary, "--child", "same-weights", a, b]).returncode == 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", default="build/torch2/tests/frugal_tests")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--mode", default="zero3", choices=["zero2", "zero3"])
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="frugal-kill-soak-")
    straight = os.path.join(work, "straight")
    for p in start(args.binary, args.mode, "-", args.steps, straight, straight):
        assert p.wait() == 0, "the uninterrupted run failed"
    # How long a whole run takes: the kills land anywhere in it.
    t0 = time.monotonic()
    probe = os.path.join(work, "probe")
    for p in start(args.binary, args.mode, probe + "-saves", args.steps, probe, probe):
        p.wait()
    whole = time.monotonic() - t0
    failures = 0
    apart = 0  # rounds whose ranks' newest saves were of different steps
    for r in range(args.rounds):
        saves = os.path.join(work, f"saves-{r}")
        out = os.path.join(work, f"w-{r}")
        victims = rng.choice([[0], [1], [0, 1]])
        procs = start(args.binary, args.mode, saves, args.steps, out + "-killed", out + "-killed")
        time.sleep(rng.uniform(0.15, 0.9) * whole)
        for v in victims:
            procs[v].send_signal(signal.SIGKILL)
        for p in procs:
            try:
                p.wait(timeout=90)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        held = {rank: sorted(os.listdir(os.path.join(saves, f"rank-{rank}")))
                if os.path.isdir(os.path.join(saves, f"rank-{rank}")) else []
                for rank in range(2)}
        resumed = start(args.binary, args.mode, saves, args.steps, out, out + "-resumed")
        codes = [p.wait() for p in resumed]
        same = codes == [0, 0] and all(
            weights_equal(args.binary, f"{straight}-{rank}.pt", f"{out}-{rank}.pt")
            for rank in range(2))
        steps = {rank: [f[5:17].lstrip("0") or "0" for f in held[rank] if f.startswith("step-")]
                 for rank in held}
        apart += steps[0][-1:] != steps[1][-1:]
        print(f"round {r + 1}: killed rank(s) {victims}; saves held: rank 0 {steps[0]}, "
              f"rank 1 {steps[1]}; resume exit {codes}; "
              f"{'bit for bit' if same else 'DIFFERS'}")
        if not same:
            failures += 1
            for rank in range(2):
                with open(f"{out}-resumed-{rank}.txt") as f:
                    sys.stdout.write(f.read())
    print(f"{args.rounds - failures} of {args.rounds} resumed runs ended bit for bit; in {apart} "
          "the ranks' newest saves were of different steps")
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
