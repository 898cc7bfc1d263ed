#!/usr/bin/env python3
"""Runs every benchmark binary and Python twin for a few steps at small sizes, so that a
changed flag, report format or table breaks the test suite rather than a benchmark run
months later. Each run must exit 0, print its markdown table and end with its JSON line
holding the fields the benchmark pages' tables are made from. The figures themselves mean nothing
at these sizes and are not checked.
Usage: bench_smoke.py BUILD_DIR PYTHON_WITH_TORCH|"" [NAME ...]
  NAME: one of the runs below (all without a name). Without a Python that has torch ("")
  the Python twins are left out, and said so. The Python twins run one after another in one
  process of PYTHON_WITH_TORCH, each twin's main() called as its command line would (torch
  is imported once, not once a twin); those that load frugal's allocator into the process
  (twin.py, tiny_lm_twin.py) come last.
"""
import contextlib
import importlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

from cli_check import check, finish

BUILD = sys.argv[1]
PYTHON = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] else None
NAMES = sys.argv[3:]
HERE = os.path.dirname(os.path.abspath(__file__))
TWINS = os.path.join(HERE, "..", "bench", "python")
BENCH = os.path.join(BUILD, "bench")
FASHION = os.path.join(BUILD, "examples", "fashion_mnist")
TINY_LM = os.path.join(BUILD, "examples", "tiny_lm")


TWIN_SIZES = ["--blocks", "2", "--width", "16", "--hidden", "32", "--mlp-batch", "8",
              "--cnn-batch", "4"]


def last_json(stdout):
    lines = [line for line in stdout.strip().splitlines() if line.startswith(("{", "["))]
    return json.loads(lines[-1]) if lines else None


def has_keys(value, path):
    """`path` like "rows.0.hand_us": every step must exist."""
    for part in path.split("."):
        if isinstance(value, list):
            if not part.isdigit() or int(part) >= len(value):
                return False
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            return False
    return True


def verdict(name, ok, took, stdout, keys, table):
    check(ok, f"{name}: exits 0 ({took:.1f} s)")
    if not ok:
        return
    if table:
        check("|---" in stdout, f"{name}: prints its markdown table")
    try:
        result = last_json(stdout)
    except json.JSONDecodeError as error:
        result = None
        print(f"     last JSON line does not parse: {error}")
    missing = [k for k in keys if result is None or not has_keys(result, k)]
    check(not missing, f"{name}: its JSON line holds {', '.join(keys)}"
          + (f" (missing: {', '.join(missing)})" if missing else ""))


def smoke(name, cmd, keys, table):
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        print(done.stdout[-2000:], done.stderr[-2000:])
    verdict(name, done.returncode == 0, time.monotonic() - start, done.stdout, keys, table)


def smoke_in_process(name, argv, keys, table):
    """Runs the twin `name`'s main() in this process with `argv` as its arguments."""
    if TWINS not in sys.path:
        sys.path.insert(0, TWINS)
    start = time.monotonic()
    out, saved, ok = io.StringIO(), sys.argv, True
    try:
        sys.argv = [name] + argv
        with contextlib.redirect_stdout(out):
            importlib.import_module(name[:-len(".py")]).main()
    except (Exception, SystemExit):  # a failed check=True run, a parser error
        ok = False
        print(out.getvalue()[-2000:], traceback.format_exc()[-3000:])
    finally:
        sys.argv = saved
    verdict(name, ok, time.monotonic() - start, out.getvalue(), keys, table)


def runs(tmp):
    """name -> (command, JSON fields, prints a table, needs a Python with torch)."""
    b = lambda name: os.path.join(BENCH, name)  # noqa: E731
    py = lambda script: [PYTHON or "python3", os.path.join(TWINS, script)]  # noqa: E731
    return {
        "bench_allocator": ([b("bench_allocator"), "--rounds", "1", "--steps", "2", "--batch", "4",
                             "--threads", "1"], ["ratio"], True, False),
        "bench_engine": ([b("bench_engine"), "--rounds", "1", "--steps", "2", "--batch", "4",
                          "--threads", "1"],
                         ["hand_ms", "engine_ms", "ratio", "loop_ms", "loop_ratio", "hand_faults",
                          "engine_faults", "loop_faults"], True, False),
        "bench_recorder": ([b("bench_recorder"), "--rounds", "1", "--steps", "2", "--batch", "4",
                            "--threads", "1"],
                           ["plain_ms", "off_ratio", "on_ratio", "events_a_step"], True, False),
        "bench_rss": ([b("bench_rss"), "--steps", "3", "--batch", "8", "--workers", "0",
                       "--threads", "1", "--test-samples", "100"],
                      ["ratio", "plain_kib", "frugal_kib"], True, False),
        "bench_checkpoint": ([b("bench_checkpoint"), "--rounds", "1", "--steps", "1", "--blocks",
                              "2", "--width", "16", "--hidden", "32", "--batch", "4",
                              "--threads", "1"], ["time_ratio"], True, False),
        "bench_checkpoint_budget": ([b("bench_checkpoint_budget"), "--rounds", "1", "--steps",
                                     "1", "--pairs", "2", "--width", "16", "--batch", "8",
                                     "--gate-steps", "2", "--threads", "1"],
                                    ["time_ratio", "budgeted_peak", "fits"], True, False),
        "bench_capacity": ([b("bench_capacity"), "--cap-mib", "8", "--layers", "1", "--batch",
                            "2", "--seq", "16", "--max-dim", "256", "--threads", "1", "--only",
                            "factored-b0"], ["rows.1.dim", "rows.1.params"], True, False),
        # The 8-bit weights' row: the model built into them under the cap.
        "bench_capacity_int8": ([b("bench_capacity"), "--cap-mib", "8", "--layers", "1",
                                 "--batch", "2", "--seq", "16", "--max-dim", "256", "--threads",
                                 "1", "--only", "int8-b0"], ["rows.1.dim", "rows.1.params"], True,
                                False),
        # The ZeRO-3 row: each trial two processes that join one group.
        "bench_capacity_zero3": ([b("bench_capacity"), "--cap-mib", "8", "--layers", "2",
                                  "--batch", "2", "--seq", "16", "--max-dim", "256", "--threads",
                                  "1", "--ranks", "2", "--only", "zero3"],
                                 ["ranks", "rows.1.dim", "rows.1.params"], True, False),
        "accuracy.py": (["python3", os.path.join(TWINS, "accuracy.py"), FASHION, "--epochs", "1",
                         "--seeds", "1", "--threads", "1", "--extra",
                         "--max-steps 3 --eval-samples 100"],
                        ["rows.3.gap_points", "rows.0.accuracy.0"], True, False),
        "bench_optimizer": ([b("bench_optimizer"), "--rounds", "1", "--calls", "1",
                             "--threads", "1"], ["rows.10.in_backward_ms", "rows.6.frugal_ms"], True, False),
        "bench_save_state": ([b("bench_save_state"), "--rounds", "1", "--threads", "1", "--dir",
                              tmp], ["save_ms", "load_ms"], True, False),
        "bench_linear_cross_entropy": ([b("bench_linear_cross_entropy"), "--tokens", "64",
                                        "--width", "8", "--classes", "128", "--chunk", "16",
                                        "--rounds", "1", "--calls", "1", "--threads", "1"],
                                       ["time_ratio", "saved_fraction"], True, False),
        "bench_overhead": ([b("bench_overhead"), "--rounds", "1", "--steps", "2", "--models",
                            "8-4-1", "6-4-3", "--batches", "1", "2"],
                           ["rows.3.hand_us", "rows.3.trainer_us", "rows.3.trainer_policies_us",
                            "rows.3.own_us"], True, False),
        "bench_zero_prefetch": ([b("bench_zero_prefetch"), "--blocks", "2", "--width", "16",
                                 "--batch", "4", "--steps", "2", "--rounds", "2", "--threads",
                                 "1"], ["ratio", "rows.1.ms", "rows.1.peak_bytes"], True, False),
        "bench_twin": ([b("bench_twin"), "--steps", "1", "--threads", "1", *TWIN_SIZES],
                       ["step_ms", "peak_bytes"], False, False),
        "twin.py": (py("twin.py") + ["--build", BUILD, "--steps", "1", "--threads", "1",
                                     *TWIN_SIZES],
                    ["0.frugal.step_ms", "0.pytorch.step_ms"], True, True),
        "speed_twin.py": (py("speed_twin.py") + [
            "--binary", FASHION, "--engine", b("bench_engine"), "--steps", "3", "--warmup", "1",
            "--rounds", "1", "--threads", "1", "--batch", "4", "--micro-batch", "2", "--profile",
            "--allocator"],
            ["rows.4.frugal_ms", "rows.4.modules_ms", "rows.4.functional_ms", "rows.4.ratio",
             "rows.0.fastest_on_frugal_allocator_ms", "split.own_ms"], True, True),
        "overhead_twin.py": (py("overhead_twin.py") + [
            "--binary", b("bench_overhead"), "--rounds", "1", "--inner", "2", "--steps", "2",
            "--models", "8-4-1", "--batches", "2"], ["rows.0.trainer_us", "rows.0.trainer_over_python",
                                "rows.0.fastest_python", "rows.0.trainer_over_fastest_python"],
            True, True),
        "tiny_lm_twin.py": (py("tiny_lm_twin.py") + [
            "--build", BUILD, "--steps", "3", "--warmup", "1", "--rounds", "1", "--threads", "1",
            "--batch", "4",
            "--dim", "16", "--heads", "2", "--layers", "1", "--max-len", "32"],
            ["rows.3.frugal_ms", "rows.3.pytorch_ms"], True, True),
        "ddp_twin.py": (py("ddp_twin.py") + ["--binary", FASHION, "--steps", "3", "--warmup", "1",
                                             "--rounds", "1", "--batch", "4"],
                        ["ms"], True, True),
    }


with tempfile.TemporaryDirectory() as tmp:
    every = runs(tmp)
    unknown = [name for name in NAMES if name not in every]
    if unknown:
        sys.exit(f"bench_smoke.py: no benchmark named {', '.join(unknown)}; "
                 f"there are {', '.join(every)}")
    chosen = NAMES or list(every)
    twins = [name for name in chosen if every[name][3]]
    if twins and PYTHON is None:
        print(f"skip {', '.join(twins)}: no python with torch was given")
    elif twins and importlib.util.find_spec("torch") is None:
        # The twins import torch: this script goes on in the Python that has it.
        sys.stdout.flush()
        os.execv(PYTHON, [PYTHON, os.path.abspath(__file__), BUILD, PYTHON, *chosen])
    last = ("twin.py", "tiny_lm_twin.py")  # they load frugal's allocator into this process
    for name in sorted(chosen, key=lambda n: n in last):
        cmd, keys, table, needs_torch = every[name]
        if not needs_torch:
            smoke(name, cmd, keys, table)
        elif PYTHON is not None:
            smoke_in_process(name, cmd[2:], keys, table)
finish()
