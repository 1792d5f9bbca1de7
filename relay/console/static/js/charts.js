// Charts drawn by uPlot (vendored: static/vendor/uplot-*/, loaded by the
// shell as the global uPlot). Each chart lives in a container element and
// is redrawn with new data in place; the container carries what it shows
// (data-series, data-points: the non-zero values) for readers and tests.
"use strict";
import {el, dollars} from "./dom.js";

const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2",
                 "#db2777", "#65a30d", "#9333ea", "#ea580c", "#0f766e", "#4b5563"];

export function colour(i) { return PALETTE[i % PALETTE.length]; }

function widthOf(node) {
  return Math.max(240, Math.floor((node.clientWidth || node.parentNode.clientWidth || 600) - 4));
}

// spec: {title, xs: [unix seconds], series: [{label, values, colour, right}], kind:
// "bars" | "lines", unit: "money" | "count" | "tokens" | "ms", height}
export function draw(container, spec) {
  const U = window.uPlot;
  const labels = spec.series.map((s) => s.label);
  const points = spec.series.reduce((n, s) => n + s.values.filter((v) => v).length, 0);
  container.setAttribute("data-series", labels.join("|"));
  container.setAttribute("data-points", String(points));
  container.setAttribute("data-chart", spec.kind || "lines");
  if (!U) { container.textContent = "charting library not loaded"; return; }
  const key = JSON.stringify([labels, spec.kind, spec.unit, spec.title]);
  const data = [spec.xs].concat(spec.series.map((s) => s.values));
  if (container._plot && container._key === key && container._plot.width === widthOf(container)) {
    container._plot.setData(data);
    return;
  }
  if (container._plot) { container._plot.destroy(); container._plot = null; }
  container.textContent = "";
  const fmt = spec.unit === "money" ? (v) => v === null || v === undefined ? "" : dollars(v)
    : spec.unit === "ms" ? (v) => v === null || v === undefined ? "" : Math.round(v) + " ms"
    : (v) => v === null || v === undefined ? "" : Number(v).toLocaleString("en-US");
  // Bars for one series; several share a bucket, so they are lines.
  const bars = spec.kind === "bars" && spec.series.length === 1;
  const series = [{}].concat(spec.series.map((s, i) => {
    const c = s.colour || colour(i);
    const one = {label: s.label, stroke: c, width: bars ? 0 : 2, value: (u, v) => fmt(v),
                 points: {show: true, size: 4}};
    if (s.right) {
      // On the right-hand axis, in milliseconds (a first-output median).
      one.scale = "ms";
      one.value = (u, v) => v === null || v === undefined ? "" : Math.round(v) + " ms";
      one.dash = [4, 3];
    }
    if (bars) {
      one.fill = c;
      one.paths = U.paths.bars({size: [0.8, 60]});
      one.points = {show: false};
    }
    return one;
  }));
  const opts = {
    title: spec.title, width: widthOf(container), height: spec.height || 200,
    series,
    scales: {x: {time: true, range: (u, lo, hi) => xRange(spec.xs, lo, hi)},
             // From zero, with headroom; an empty chart still has a scale.
             y: {range: (u, lo, hi) => [Math.min(0, lo || 0), hi > 0 ? hi * 1.1 : 1]},
             ms: {range: (u, lo, hi) => [0, hi > 0 ? hi * 1.1 : 1]}},
    axes: [{}, {values: (u, vals) => vals.map(fmt), size: 70}].concat(spec.series.some((x) => x.right)
      ? [{scale: "ms", side: 1, grid: {show: false}, size: 60, values: (u, vals) => vals.map((v) => v + " ms")}] : []),
    legend: {live: true},
    cursor: {drag: {x: false, y: false}},
  };
  container._plot = new U(opts, data, container);
  container._key = key;
}

// The x range: the buckets asked for (half a bucket either side), not
// just the points that have data.
function xRange(xs, lo, hi) {
  if (!xs.length) { return [lo, hi]; }
  const step = xs.length > 1 ? xs[1] - xs[0] : 60;
  return [xs[0] - step / 2, xs[xs.length - 1] + step / 2];
}

// Buckets from start to end (seconds) every step seconds.
export function buckets(start, end, step) {
  const xs = [];
  for (let t = Math.floor(start / step) * step; t <= end; t += step) { xs.push(t); }
  return xs;
}

// A card holding a chart, its title above.
export function card(id, title) {
  const box = el("div", {"class": "chart-card", id: id + "-card"});
  box.appendChild(el("h3", null, title));
  const plot = el("div", {"class": "chart", id: id});
  box.appendChild(plot);
  return {box, plot};
}
