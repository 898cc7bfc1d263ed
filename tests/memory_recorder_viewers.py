"""A recorded step opened as its users open it: the snapshot with PyTorch's own memory tools
(torch.cuda._memory_viz), the timeline page in headless Chromium with no network.

usage: memory_recorder_viewers.py FRUGAL_TESTS PYTHON_WITH_TORCH CHROMIUM WORK_DIR
"""
import json
import os
import re
import subprocess
import sys

tests, python, chromium, work = sys.argv[1:5]
os.makedirs(work, exist_ok=True)
env = dict(os.environ, FRUGAL_RECORDER_DIR=work, OMP_NUM_THREADS="1")
subprocess.run([tests, "--gtest_filter=MemoryRecorderFiles.AStepForTheViewers"], env=env,
               check=True, stdout=subprocess.DEVNULL)
recorded = json.load(open(os.path.join(work, "step.json")))
expected = json.load(open(os.path.join(work, "expected.json")))
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


# 1. PyTorch's tools over the pickled snapshot, in the Python that has torch.
viz = r"""
import json, pickle, sys
from torch.cuda import _memory_viz as mv
data = pickle.load(open(sys.argv[1], "rb"))
mv.segsum(data)        # raises where a segment's blocks do not add up to its size
mv.trace(data)
mv.trace_plot(data)
mv.segment_plot(data)
trace = data["device_traces"][0]
print(json.dumps({
    "net": sum(e["size"] for e in trace if e["action"] == "alloc")
           - sum(e["size"] for e in trace if e["action"] == "free_completed"),
    "active": sum(b["requested_size"] for s in data["segments"] for b in s["blocks"]
                  if b["state"] == "active_allocated"),
    "ooms": [e["size"] for e in trace if e["action"] == "oom"],
    "last": trace[-1]["action"],
}))
"""
out = subprocess.run([python, "-c", viz, os.path.join(work, "step.pickle")], check=True,
                     capture_output=True, text=True).stdout
seen = json.loads(out.strip().splitlines()[-1])
check(seen["net"] == recorded["end_bytes"] - recorded["start_bytes"],
      f"the trace's allocations less its frees ({seen['net']}) are the recording's change "
      f"({recorded['end_bytes'] - recorded['start_bytes']})")
check(seen["active"] == recorded["end_bytes"],
      f"the segments' active bytes ({seen['active']}) are the allocated bytes at the end "
      f"({recorded['end_bytes']})")
check(seen["ooms"] == [expected["refused_bytes"]] and seen["last"] == "oom",
      f"one oom event, last, of the refused request: {seen['ooms']}")
check(recorded["peak"]["bytes"] == expected["peak_bytes"],
      f"the recorded peak ({recorded['peak']['bytes']}) is the probe's ({expected['peak_bytes']})")
check(sum(g["bytes"] for g in recorded["peak"]["groups"]) == expected["peak_bytes"],
      "the peak's groups add up to the probe's peak")

# 2. The page, drawn by Chromium with no network: one area a category that held bytes.
page = "file://" + os.path.abspath(os.path.join(work, "step.html"))
flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--proxy-server=127.0.0.1:9", "--window-size=1000,640"]
dom = subprocess.run([chromium, *flags, "--dump-dom", page], check=True, capture_output=True,
                     text=True, timeout=120).stdout
drawn = re.findall(r'class="area" data-category="([^"]+)"', dom)
# The parts, then the names given with name_memory (a peak group "(name)"), each its own area.
names = [g["module"][1:-1] for g in recorded["peak"]["groups"]
         if g["module"].startswith("(") and g["module"] != "(alive before the recording)"]
held = []
for name in ["weights", "gradients", "optimizer state", "activations", "other",
             "weights (materialised)"]:
    if any(e["category"] == name for e in recorded["events"]) or any(
            g["category"] == name and g["module"][1:-1] not in names
            for g in recorded["peak"]["groups"]):
        held.append(name)
held += names
check("data set" in names, f"the step's batch is named: {names}")
check(drawn == held, f"areas drawn {drawn}, categories and names recorded {held}")
check(len(re.findall(r'class="legend-item"', dom)) == len(held), "a legend entry an area")
# The legend gives each category's bytes at the peak; they add up to the probe's peak.
parts = [int(b) for b in re.findall(r'class="legend-item" data-bytes="(\d+)"', dom)]
shown = re.search(r'class="sum" data-bytes="(\d+)"', dom)
check(len(parts) == len(held) and sum(parts) == expected["peak_bytes"] and shown is not None
      and int(shown.group(1)) == expected["peak_bytes"],
      f"the legend's parts at the peak ({parts}) add up to the probe's peak "
      f"({expected['peak_bytes']}), and its sum says so")
# The phases drawn as a band under the areas: each phase the events happened in, and no other.
bands = re.findall(r'class="phase" data-phase="([^"]+)"', dom)
phases = {e["at"] for e in recorded["events"]}
check(bands and set(bands) == phases,
      f"the band shows the phases {sorted(set(bands))}, the events' {sorted(phases)}")
check(re.search(r'value="time" checked', dom) is not None and "time since the recording began" in dom,
      "the x axis is time unless the reader chooses the order of events")
check('class="peak"' in dom and 'class="oom"' in dom, "the peak and the refusal are marked")
shot = os.path.join(work, "page.png")
subprocess.run([chromium, *flags, f"--screenshot={shot}", page], check=True,
               capture_output=True, timeout=120)
check(os.path.getsize(shot) > 10000, f"a screenshot of {os.path.getsize(shot)} bytes")

# 3. frugal's own PNG of the timeline, decoded by the browser: the image and its size.
show = os.path.join(work, "show_png.html")
with open(show, "w") as f:
    f.write('<img id="t" src="step.png" onload="document.title = this.naturalWidth + \'x\' + '
            'this.naturalHeight" onerror="document.title = \'broken\'">')
dom = subprocess.run([chromium, *flags, "--dump-dom", "file://" + os.path.abspath(show)],
                     check=True, capture_output=True, text=True, timeout=120).stdout
title = re.search(r"<title>([^<]*)</title>", dom)
check(title is not None and title.group(1) == "960x460",
      f"the browser decodes the timeline's PNG: {title.group(1) if title else dom[:200]}")

sys.exit(1 if failures else 0)
