"""What the example CLI checks share: a check that prints its verdict and remembers failures."""
import sys

failures = []


def check(condition, what):
    print(("ok   " if condition else "FAIL ") + what)
    if not condition:
        failures.append(what)


def finish():
    print(f"{len(failures)} failed")
    sys.exit(1 if failures else 0)
