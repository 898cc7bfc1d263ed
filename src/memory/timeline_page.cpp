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
#legend span { display: inline-block; margin-right: 14px; }
#legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: -1px; }
#tip { position: absolute; pointer-events: none; background: #fffbe6; border: 1px solid #999;
       padding: 4px 6px; font-size: 12px; display: none; white-space: pre; }
.axis { font-size: 11px; fill: #555; }
</style>
</head>
<body>
<h1>Memory timeline</h1>
<p id="summary"></p>
<div id="legend"></div>
<svg id="chart" width="960" height="420" xmlns="http://www.w3.org/2000/svg"></svg>
<p id="about"></p>
<div id="tip"></div>
)html";
}

const char* timeline_page_script() {
  return R"js(
(function () {
  const colors = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#bab0ac", "#76b7b2"];
  const svg = document.getElementById("chart");
  const ns = "http://www.w3.org/2000/svg";
  const W = 960, H = 420, left = 70, right = 10, top = 10, bottom = 30;
  const pts = DATA.points;
  const mib = b => (b / 1048576).toFixed(2) + " MiB";
  document.getElementById("summary").textContent = DATA.summary;
  document.getElementById("about").textContent = DATA.events + " events" +
      (DATA.dropped ? ", " + DATA.dropped + " older ones dropped" : "") +
      "; the x axis is the order of allocations and frees.";
  const el = (name, attrs) => {
    const e = document.createElementNS(ns, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    svg.appendChild(e);
    return e;
  };
  if (pts.length === 0) return;
  let most = 1;
  for (const p of pts) most = Math.max(most, p[2].reduce((a, b) => a + b, 0));
  const x = i => left + (pts.length === 1 ? 0 : i * (W - left - right) / (pts.length - 1));
  const y = b => H - bottom - b * (H - top - bottom) / most;
  const legend = document.getElementById("legend");
  DATA.categories.forEach((name, c) => {
    if (!pts.some(p => p[2][c] > 0)) return;  // a category that never held a byte
    const upper = [], lower = [];
    pts.forEach((p, i) => {
      let below = 0;
      for (let k = 0; k < c; ++k) below += p[2][k];
      lower.push(x(i).toFixed(1) + "," + y(below).toFixed(1));
      upper.push(x(i).toFixed(1) + "," + y(below + p[2][c]).toFixed(1));
    });
    el("path", {"class": "area", "data-category": name, fill: colors[c], stroke: "none",
                d: "M" + upper.join("L") + "L" + lower.reverse().join("L") + "Z"});
    const item = document.createElement("span");
    item.className = "legend-item";
    item.innerHTML = '<i style="background:' + colors[c] + '"></i>' + name;
    legend.appendChild(item);
  });
  for (let k = 0; k <= 4; ++k) {
    const b = most * k / 4;
    el("line", {x1: left, x2: W - right, y1: y(b), y2: y(b), stroke: "#eee"});
    el("text", {"class": "axis", x: 4, y: y(b) + 4}).textContent = mib(b);
  }
  el("text", {"class": "axis", x: left, y: H - 8}).textContent = "events: allocations and frees, in order";
  let peak = 0;
  pts.forEach((p, i) => {
    if (p[2].reduce((a, b) => a + b, 0) > pts[peak][2].reduce((a, b) => a + b, 0)) peak = i;
  });
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
  const tip = document.getElementById("tip");
  svg.addEventListener("mousemove", ev => {
    const r = svg.getBoundingClientRect();
    const i = Math.round((ev.clientX - r.left - left) / (W - left - right) * (pts.length - 1));
    if (i < 0 || i >= pts.length) { tip.style.display = "none"; return; }
    const p = pts[i];
    tip.textContent = "event " + p[0] + " at " + (p[1] / 1000).toFixed(1) + " ms: " + p[3] +
        " " + mib(p[4]) + "\n" + p[5] + (p[6] ? " of " + p[6] : "") + " (" + p[7] + ")\n" +
        "allocated " + mib(p[2].reduce((a, b) => a + b, 0));
    tip.style.left = (ev.pageX + 12) + "px";
    tip.style.top = (ev.pageY + 12) + "px";
    tip.style.display = "block";
  });
  svg.addEventListener("mouseleave", () => { tip.style.display = "none"; });
})();
)js";
}

}  // namespace frugal::detail
