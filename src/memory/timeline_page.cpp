// The HTML, style and script of a memory timeline page: no network, no library.
#include "timeline.h"

namespace frugal::detail {

const char* timeline_page_head() {
  return R"html(<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>frugal memory timeline</title>
<style>
body { font: 14px sans-serif; margin: 16px; color: #222; }
#chart { border: 1px solid #ccc; background: #fff; }
#legend span, #phases span { display: inline-block; margin-right: 14px; }
#legend i, #phases i { display: inline-block; width: 12px; height: 12px; margin-right: 4px;
                       vertical-align: -1px; }
#legend .sum { font-weight: bold; }
#axis-choice { margin: 6px 0; }
#tip { position: absolute; pointer-events: none; background: #fffbe6; border: 1px solid #999;
       padding: 4px 6px; font-size: 12px; display: none; white-space: pre; }
.axis { font-size: 11px; fill: #555; }
</style>
</head>
<body>
<h1>Memory timeline</h1>
<p id="summary"></p>
<div id="legend"></div>
<div id="axis-choice">x axis:
<label><input type="radio" name="axis" value="time" checked> time</label>
<label><input type="radio" name="axis" value="order"> order of events</label></div>
<svg id="chart" width="960" height="460" xmlns="http://www.w3.org/2000/svg"></svg>
<div id="phases"></div>
<p id="about"></p>
<div id="tip"></div>
)html";
}

const char* timeline_page_script() {
  return R"js(
(function () {
  const colors = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#bab0ac", "#76b7b2",
                  "#edc948", "#b07aa1", "#ff9da7", "#9c755f"];  // the parts, then the names
  const phaseColors = {"forward": "#9ecae1", "backward": "#fdae6b", "recompute": "#c7e9c0",
                       "optimizer step": "#bcbddc", "zeroing": "#fdd0a2", "evaluation": "#d9d9d9",
                       "other": "#f0f0f0"};
  const svg = document.getElementById("chart");
  const ns = "http://www.w3.org/2000/svg";
  // The areas above, the phases' band under them, the axis' labels under that.
  const W = 960, H = 460, left = 70, right = 10, top = 10, bottom = 70, bandH = 16;
  const pts = DATA.points;
  const mib = b => Math.abs(b) >= 1073741824 ? (b / 1073741824).toFixed(2) + " GiB"
                 : Math.abs(b) >= 1048576 ? (b / 1048576).toFixed(2) + " MiB"
                 : (b / 1024).toFixed(2) + " KiB";
  const sum = a => a.reduce((x, y) => x + y, 0);
  document.getElementById("summary").textContent = DATA.summary;
  document.getElementById("about").textContent = DATA.events + " events" +
      (DATA.dropped ? ", " + DATA.dropped + " older ones dropped" : "") +
      "; the band under the areas is the phase each event happened in.";
  if (pts.length === 0) return;
  let most = 1, peak = 0;
  pts.forEach((p, i) => {
    most = Math.max(most, sum(p[2]));
    if (sum(p[2]) > sum(pts[peak][2])) peak = i;
  });
  const y = b => H - bottom - b * (H - top - bottom) / most;
  // The legend: each category's bytes at the peak, and their sum, the peak.
  const legend = document.getElementById("legend");
  const held = DATA.categories.map((_, c) => pts.some(p => p[2][c] > 0));
  DATA.categories.forEach((name, c) => {
    if (!held[c]) return;  // a category that never held a byte
    const item = document.createElement("span");
    item.className = "legend-item";
    item.setAttribute("data-bytes", pts[peak][2][c]);
    item.innerHTML = '<i style="background:' + colors[c] + '"></i>' + name + " " +
        mib(pts[peak][2][c]);
    legend.appendChild(item);
  });
  const total = document.createElement("span");
  total.className = "sum";
  total.setAttribute("data-bytes", sum(pts[peak][2]));
  total.textContent = "= " + mib(sum(pts[peak][2])) + " at the peak (" + pts[peak][8] + ")";
  legend.appendChild(total);
  const phaseLegend = document.getElementById("phases");
  const phasesSeen = [];
  pts.forEach(p => { if (!phasesSeen.includes(p[8])) phasesSeen.push(p[8]); });
  phasesSeen.forEach(name => {
    const item = document.createElement("span");
    item.className = "phase-item";
    item.innerHTML = '<i style="background:' + (phaseColors[name] || "#eee") + '"></i>' + name;
    phaseLegend.appendChild(item);
  });

  let byTime = true;
  let x;  // the x of point i: set by draw() for the axis chosen
  const draw = () => {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const el = (name, attrs) => {
      const e = document.createElementNS(ns, name);
      for (const k in attrs) e.setAttribute(k, attrs[k]);
      svg.appendChild(e);
      return e;
    };
    const t0 = pts[0][1], t1 = pts[pts.length - 1][1];
    const span = W - left - right;
    x = byTime && t1 > t0 ? (i => left + (pts[i][1] - t0) * span / (t1 - t0))
                          : (i => left + (pts.length === 1 ? 0 : i * span / (pts.length - 1)));
    DATA.categories.forEach((name, c) => {
      if (!held[c]) return;
      const upper = [], lower = [];
      pts.forEach((p, i) => {
        let below = 0;
        for (let k = 0; k < c; ++k) below += p[2][k];
        lower.push(x(i).toFixed(1) + "," + y(below).toFixed(1));
        upper.push(x(i).toFixed(1) + "," + y(below + p[2][c]).toFixed(1));
      });
      el("path", {"class": "area", "data-category": name, fill: colors[c], stroke: "none",
                  d: "M" + upper.join("L") + "L" + lower.reverse().join("L") + "Z"});
    });
    // The phases as a band: each run of events in one phase, from its first to the next run.
    let start = 0;
    for (let i = 1; i <= pts.length; ++i) {
      if (i < pts.length && pts[i][8] === pts[start][8]) continue;
      const x0 = x(start), x1 = i < pts.length ? x(i) : x(pts.length - 1) + 1;
      el("rect", {"class": "phase", "data-phase": pts[start][8], x: x0.toFixed(1),
                  y: H - bottom + 4, width: Math.max(1, x1 - x0).toFixed(1), height: bandH,
                  fill: phaseColors[pts[start][8]] || "#eee"});
      start = i;
    }
    for (let k = 0; k <= 4; ++k) {
      const b = most * k / 4;
      el("line", {x1: left, x2: W - right, y1: y(b), y2: y(b), stroke: "#eee"});
      el("text", {"class": "axis", x: 4, y: y(b) + 4}).textContent = mib(b);
    }
    el("text", {"class": "axis", x: 4, y: H - bottom + 16}).textContent = "phase";
    el("text", {"class": "axis", x: left, y: H - bottom + 38}).textContent = byTime
        ? "time since the recording began: " + ((t1 - t0) / 1000).toFixed(1) + " ms in all"
        : "events: allocations and frees, in order";
    el("line", {"class": "peak", x1: x(peak), x2: x(peak), y1: top, y2: H - bottom,
                stroke: "#000", "stroke-dasharray": "4 3"});
    el("text", {"class": "axis", x: Math.min(x(peak) + 4, W - 160), y: top + 12}).textContent =
        "peak " + mib(DATA.peak);
    DATA.refused.forEach(i => {
      el("line", {"class": "oom", x1: x(i), x2: x(i), y1: top, y2: H - bottom, stroke: "#d00",
                  "stroke-width": 2});
      el("text", {"class": "axis", x: Math.min(x(i) + 4, W - 200), y: top + 26, fill: "#d00"})
          .textContent = "refused: out of memory";
    });
  };
  draw();
  document.querySelectorAll('input[name="axis"]').forEach(r => r.addEventListener("change", () => {
    byTime = r.value === "time" && r.checked;
    draw();
  }));
  const tip = document.getElementById("tip");
  svg.addEventListener("mousemove", ev => {
    const r = svg.getBoundingClientRect();
    const at = ev.clientX - r.left;
    let i = 0;  // the point nearest the pointer, on either axis
    for (let k = 1; k < pts.length; ++k) if (Math.abs(x(k) - at) < Math.abs(x(i) - at)) i = k;
    if (at < left || at > W - right) { tip.style.display = "none"; return; }
    const p = pts[i];
    tip.textContent = "event " + p[0] + " at " + (p[1] / 1000).toFixed(1) + " ms: " + p[3] +
        " " + mib(p[4]) + " in " + p[8] + "\n" + p[5] + (p[6] ? " of " + p[6] : "") +
        " (allocated in " + p[7] + ")\n" +
        "allocated " + mib(sum(p[2]));
    tip.style.left = (ev.pageX + 12) + "px";
    tip.style.top = (ev.pageY + 12) + "px";
    tip.style.display = "block";
  });
  svg.addEventListener("mouseleave", () => { tip.style.display = "none"; });
})();
)js";
}

}  // namespace frugal::detail
