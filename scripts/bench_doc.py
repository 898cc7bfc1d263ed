#!/usr/bin/env python3
"""Writes docs/benchmarks.md (and the README's speed table) from what the benchmark
programs print, so that refreshing a number is a run, not an edit.

  scripts/bench_doc.py --run [ID ...]   run the entries of bench/doc.json (all without IDs) on
                                        their builds, keep each output in docs/results/ID.json,
                                        then write the pages
  scripts/bench_doc.py --render         write the pages from the kept outputs only
  scripts/bench_doc.py --check          exit 1 if the pages differ from what --render writes

`make bench-doc` is `--run` on every entry. The README's speed and memory tables are written
from the same results, each with the machine, date and LibTorch beside it. Run it on a quiet
machine: each result records the load average when the runs began, and the page shows it.
"""
import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = os.path.join(ROOT, "bench", "doc.json")
RESULTS = os.path.join(ROOT, "docs", "results")
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
README = os.path.join(ROOT, "README.md")
SPEED_BEGIN = "<!-- bench-doc: engine -->"
MEMORY_BEGIN = "<!-- bench-doc: memory -->"
BLOCK_END = "<!-- /bench-doc -->"
# The memory tour's rows the README shows, by policy name less its note in parentheses (the
# page shows them all).
README_POLICIES = ["baseline", "micro-batching", "autocast bf16", "checkpointing every block",
                   "set_to_none", "all together", "evaluation with grad",
                   "evaluation under no_grad"]


def entries(manifest):
    for section in manifest["sections"]:
        for entry in section["entries"]:
            yield section, entry


def machine():
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}"


def run(entry, load):
    if entry.get("runner") == "python":  # a Python twin, run by the venv's Python from ROOT
        venv = os.environ.get("FRUGAL_VENV", os.path.join(
            os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "frugal", "venv"))
        argv = [os.path.join(venv, "bin", "python"), os.path.join(ROOT, entry["command"][0])]
    else:
        argv = [os.path.join(ROOT, "build", entry["build"], entry["command"][0])]
    if not os.path.exists(argv[0]):
        sys.exit(f"bench_doc: {entry['id']}: {argv[0]} is not there (make build-{entry['build']})")
    done = subprocess.run(argv + entry["command"][1:], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench_doc: {entry['id']} exited {done.returncode}:\n{done.stderr[-2000:]}")
    lines = done.stdout.splitlines()
    data = [line for line in lines if line.startswith("{")]
    if not data and entry.get("json", True):
        sys.exit(f"bench_doc: {entry['id']} printed no JSON line")
    table = [line for line in lines if line.startswith("|")]
    summary = next((line for line in lines if line.strip() and not line.startswith(("|", "{"))),
                   "")
    result = {"id": entry["id"], "build": entry["build"],
              "command": " ".join(entry["command"]), "summary": summary,
              "table": table, "json": json.loads(data[-1]) if data else {},
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
              "machine": machine(), "load_before": round(load, 2)}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, entry["id"] + ".json"), "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"{entry['id']}: {summary}")


def kept(entry):
    path = os.path.join(RESULTS, entry["id"] + ".json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def libtorch(result):
    found = re.search(r"LibTorch \(?(\d+\.\d+\.\d+)", result["summary"])
    return found.group(1) if found else "?"


def page(manifest):
    out = ["# Benchmarks", "",
           "<!-- Written by scripts/bench_doc.py from bench/doc.json and docs/results/: edit",
           "those, not this page. -->", "",
           "Each table is a benchmark program's own output, kept in `docs/results/` with its",
           "command, build, machine, date and the load average when its runs began. To refresh them:",
           "`make bench-doc` (runs every entry of `bench/doc.json`, then writes this page and the",
           "README's speed and memory tables); `scripts/bench_doc.py --run ID` runs one. Back to the",
           "[README](../README.md).", ""]
    for section in manifest["sections"]:
        out += [f"## {section['title']}", "", textwrap.fill(section["about"], 92), ""]
        for entry in section["entries"]:
            result = kept(entry)
            out.append(f"**`{' '.join(entry['command'])}`** ({entry['build']} build)")
            out.append("")
            if result is None:
                out += ["Not run yet.", ""]
                continue
            out += [result["summary"], "",
                    f"Measured {result['date']} on {result['machine']}, LibTorch "
                    f"{libtorch(result)}; load average {result['load_before']} when the runs began.",
                    ""]
            out += result["table"] + [""]
    out += ["## Earlier measurements", "",
            "The figures measured before this page was generated — the capacity searches under a",
            "cap, the accuracy and perplexity runs, the Python twins, data parallel against DDP,",
            "ZeRO-3 prefetch, the optimizers' floors — are in",
            "[benchmarks-history.md](benchmarks-history.md), each with its command and machine.",
            "They move here as their commands join `bench/doc.json`.", ""]
    return "\n".join(out)


def provenance(results):
    """Where and when the results were measured, for the line beside a README table."""
    machines = sorted({r["machine"] for r in results})
    dates = sorted({r["date"] for r in results})
    versions = sorted({libtorch(r) for r in results})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    return (f"*Measured {when} on {'; '.join(machines)}; LibTorch {', '.join(versions)} "
            f"(`make bench-doc`, [benchmarks](docs/benchmarks.md)).*")


def speed_table(manifest):
    results = []
    rows = ["| model | LibTorch | threads | hand-written (ms/step) | frugal::Trainer | "
            "frugal::Loop | Loop ratio |", "|---|---|---|---|---|---|---|"]
    for _, entry in entries(manifest):
        result = kept(entry)
        if result is None or result["json"].get("bench") != "engine_overhead":
            continue
        results.append(result)
        j = result["json"]
        rows.append(f"| Fashion-MNIST {j['model'].upper()}, batch 64 | {libtorch(result)} | "
                    f"{j['threads']} | {j['hand_ms']:.3f} | {j['engine_ms']:.3f} "
                    f"({j['ratio']:.3f}) | {j['loop_ms']:.3f} | **{j['loop_ratio']:.3f}** |")
    return "\n".join(rows + ["", provenance(results)] if results else rows)


def memory_table(manifest):
    result = next((kept(e) for _, e in entries(manifest) if e["id"] == "memory-tour-torch2"), None)
    if result is None:
        return "Not run yet: `scripts/bench_doc.py --run memory-tour-torch2`."
    rows = ["| policy | peak | x | allocated after the step | x |", "|---|---|---|---|---|"]
    for line in result["table"][2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if re.sub(r" \(.*\)$", "", cells[0]) in README_POLICIES:
            rows.append("| " + " | ".join(cells[:5]) + " |")
    return "\n".join(rows + ["", provenance([result])])


def replace_block(text, begin_mark, body):
    begin = text.find(begin_mark)
    end = text.find(BLOCK_END, begin)
    if begin < 0 or end < begin:
        sys.exit(f"bench_doc: README.md lacks the {begin_mark} ... {BLOCK_END} block")
    return text[:begin + len(begin_mark)] + "\n" + body + "\n" + text[end:]


def readme(manifest):
    with open(README) as f:
        text = f.read()
    text = replace_block(text, SPEED_BEGIN, speed_table(manifest))
    return replace_block(text, MEMORY_BEGIN, memory_table(manifest))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", nargs="*", metavar="ID", help="run these entries (all: none)")
    parser.add_argument("--render", action="store_true", help="write the pages from docs/results")
    parser.add_argument("--check", action="store_true", help="exit 1 if the pages are stale")
    args = parser.parse_args()
    with open(MANIFEST) as f:
        manifest = json.load(f)
    known = {e["id"]: e for _, e in entries(manifest)}
    if args.run is not None:
        unknown = [i for i in args.run if i not in known]
        if unknown:
            sys.exit(f"bench_doc: no entry {', '.join(unknown)} in bench/doc.json "
                     f"(there are: {', '.join(known)})")
        load = os.getloadavg()[0]  # before the first run: later ones see the runs' own load
        if load > 0.5:
            print(f"bench_doc: the load average is {load:.2f}: the timings will be noisy")
        for entry_id in args.run or list(known):
            run(known[entry_id], load)
    written = {PAGE: page(manifest), README: readme(manifest)}
    if args.check:
        stale = []
        for path, text in written.items():
            with open(path) as f:
                if f.read() != text:
                    stale.append(os.path.relpath(path, ROOT))
        if stale:
            sys.exit(f"bench_doc: {', '.join(stale)} differ from docs/results; run "
                     "scripts/bench_doc.py --render")
        print("bench_doc: the pages match docs/results")
        return
    if args.run is not None or args.render:
        for path, text in written.items():
            with open(path, "w") as f:
                f.write(text)
        print("bench_doc: wrote docs/benchmarks.md and README.md's speed and memory tables")


if __name__ == "__main__":
    main()
