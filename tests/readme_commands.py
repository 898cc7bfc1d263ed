#!/usr/bin/env python3
"""The README's example lines run as printed: every `./build/<preset>/examples/...` command of
its Examples table, each in a folder of its own, with this build's programs in place of the
path. A line that fails, a row without a command or a table with fewer rows than programs
fails the test.
Usage: readme_commands.py README.md EXAMPLES_DIR WORK_DIR
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_check import check, finish  # noqa: E402

README, EXAMPLES, WORK = sys.argv[1:4]
PROGRAMS = sorted(n for n in os.listdir(EXAMPLES)
                  if os.path.isfile(os.path.join(EXAMPLES, n)) and os.access(os.path.join(EXAMPLES, n), os.X_OK))

text = open(README, encoding="utf-8").read()
section = re.search(r"^## Examples\n(.*?)(?=^## )", text, re.S | re.M)
check(section is not None, "the README has an Examples section")
rows = [line for line in (section.group(1) if section else "").splitlines()
        if line.startswith("| `")]
commands = {}
for row in rows:
    program = re.match(r"\| `([^`]+)`", row).group(1)
    lines = re.findall(r"`(\./build/[^`]+)`", row)
    check(len(lines) == 1, f"the row of {program} gives one command")
    if lines:
        commands[program] = lines[0]
check(set(commands) == set(PROGRAMS),
      f"the table has a line for each example program ({', '.join(PROGRAMS)}); "
      f"it has {', '.join(sorted(commands))}")

shutil.rmtree(WORK, ignore_errors=True)
for program, line in sorted(commands.items()):
    argv = shlex.split(line)
    path = re.match(r"\./build/[^/]+/examples/(.+)$", argv[0])
    check(path is not None and path.group(1) == program,
          f"{program}'s line runs {argv[0]}, the program of its row")
    folder = os.path.join(WORK, program)
    os.makedirs(folder)
    began = time.monotonic()
    try:
        done = subprocess.run([os.path.join(EXAMPLES, program), *argv[1:]], cwd=folder,
                              capture_output=True, text=True, timeout=300)
        code, said = done.returncode, (done.stdout + done.stderr).strip()
    except subprocess.TimeoutExpired:
        code, said = "timeout", "ran past 300 s"
    check(code == 0, f"{line} (exit {code}, {time.monotonic() - began:.0f} s)"
          + ("" if code == 0 else ":\n" + said[-1500:]))
finish()
