// Usage & cost: tokens, cost and requests per key, account or model by
// hour or day over 24 h, 7 d or 30 d (GET /admin/usage/series), failures
// by kind, the totals per group as a table (CSV), and key budgets.
"use strict";
import {$, el, put, button, dollars, tokens, iso, settled} from "../dom.js";
import {api, getOr, download} from "../api.js";
import {makeTable} from "../table.js";
import {card, draw, buckets} from "../charts.js";

let totals = null, budgetsTable = null, usageChart = null, failChart = null;
const METRICS = {cost_usd: ["Cost", "money"], total_tokens: ["Tokens", "count"],
                 requests: ["Requests", "count"], failed: ["Failures", "count"]};

function selectOf(id, label, options) {
  const s = el("select", {id});
  options.forEach((o) => s.appendChild(el("option", {value: o[0]}, o[1])));
  s.addEventListener("change", () => refresh());
  return put(el("label", null, label + " "), s);
}

function build(root) {
  root.id = "section-usage";
  root.appendChild(el("h2", null, "Usage and cost over time"));
  root.appendChild(put(el("div", {"class": "controls", id: "usage-section"}),
    selectOf("usage-range", "Range", [["24h", "24 h"], ["7d", "7 d"], ["30d", "30 d"]]),
    selectOf("usage-bucket", "By", [["", "auto"], ["hour", "hour"], ["day", "day"]]),
    selectOf("usage-group", "Per", [["key", "key"], ["account", "account"], ["model", "model"], ["none", "all together"]]),
    selectOf("usage-metric", "Show", Object.keys(METRICS).map((k) => [k, METRICS[k][0]])),
    button("Export every bucket (CSV)", "", exportSeries, {id: "usage-export"})));
  usageChart = card("usage-chart", "Cost per key");
  failChart = card("failure-chart", "Failures by kind");
  root.appendChild(put(el("div", {"class": "charts"}), usageChart.box, failChart.box));
  root.appendChild(el("h2", {id: "usage-totals-title"}, "Totals"));
  totals = makeTable({
    id: "usage", csv: "usage", empty: "no usage counted", rowKey: (r) => String(r.group),
    sortBy: "cost", sortDir: -1,
    rowAttrs: (r) => ({"class": "usage-row", "data-group": String(r.group)}),
    columns: [
      {id: "group", title: "Group", value: (r) => r.group},
      {id: "requests", title: "Served", cls: "num", value: (r) => r.usage_requests !== undefined ? r.usage_requests : r.requests || 0, render: (r) => tokens(r.usage_requests !== undefined ? r.usage_requests : r.requests || 0)},
      {id: "failed", title: "Failed", cls: "num", value: (r) => r.failed || 0},
      {id: "input", title: "Input", cls: "num", value: (r) => r.input_tokens || 0, render: (r) => tokens(r.input_tokens || 0)},
      {id: "cached", title: "Cached", cls: "num", value: (r) => r.cached_input_tokens || 0, render: (r) => tokens(r.cached_input_tokens || 0)},
      {id: "output", title: "Output", cls: "num", value: (r) => r.output_tokens || 0, render: (r) => tokens(r.output_tokens || 0)},
      {id: "reasoning", title: "Reasoning", cls: "num", value: (r) => r.reasoning_tokens || 0, render: (r) => tokens(r.reasoning_tokens || 0)},
      {id: "total", title: "Total", cls: "num", value: (r) => r.total_tokens || 0, render: (r) => tokens(r.total_tokens || 0)},
      {id: "cost", title: "Cost", cls: "num", value: (r) => r.cost_usd || 0,
       render: (r) => money(r.cost_usd, r.unpriced !== undefined ? r.unpriced : r.unpriced_requests)},
    ],
  });
  root.appendChild(totals.root);
  root.appendChild(el("h2", null, "Key budgets"));
  budgetsTable = makeTable({
    id: "budgets", csv: "budgets", empty: "no key has a budget", rowKey: (b) => b.key,
    rowAttrs: (b) => ({"class": "budget-row", "data-key": String(b.key)}),
    columns: [
      {id: "key", title: "Key"},
      {id: "today", title: "Tokens today", value: (b) => b.daily_tokens || b.monthly_tokens ? tokens(b.daily_used) + (b.daily_tokens ? " / " + tokens(b.daily_tokens) : "") : ""},
      {id: "month", title: "Tokens this month", value: (b) => b.daily_tokens || b.monthly_tokens ? tokens(b.monthly_used) + (b.monthly_tokens ? " / " + tokens(b.monthly_tokens) : "") : ""},
      {id: "spent_today", title: "Spent today", value: (b) => spent(b.daily_spent_usd, b.daily_usd)},
      {id: "spent_month", title: "Spent this month", value: (b) => spent(b.monthly_spent_usd, b.monthly_usd)},
      {id: "resets", title: "Resets", value: (b) => [b.daily_resets_at ? "day " + iso(b.daily_resets_at) : "", b.monthly_resets_at ? "month " + iso(b.monthly_resets_at) : ""].filter(Boolean).join(" · ")},
    ],
  });
  root.appendChild(budgetsTable.root);
}

function seriesQuery() {
  const bucket = $("usage-bucket").value;
  return "usage/series?range=" + $("usage-range").value + "&group_by=" + $("usage-group").value +
    (bucket ? "&bucket=" + bucket : "");
}

function exportSeries() {
  return download(seriesQuery() + "&format=csv", "usage-" + $("usage-range").value + ".csv")
    .catch((e) => { $("usage-totals-title").textContent = "Totals (export failed: " + e.message + ")"; });
}

function money(usd, unpriced) {
  let text = typeof usd === "number" ? dollars(usd) : "";
  if (unpriced) { text += (text ? " + " : "") + unpriced + " unpriced"; }
  return text;
}

function spent(used, limit) {
  if (typeof used !== "number") { return ""; }
  return dollars(used) + (typeof limit === "number" ? " / " + dollars(limit) + " (" + dollars(Math.max(0, limit - used)) + " left)" : "");
}

const RANGE_S = {"24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400};

// For a relay without /usage/series: one hourly series of every key.
function fallbackSeries(range, group) {
  const since = Math.floor(Date.now() / 1000) - RANGE_S[range];
  return Promise.all([api("GET", "usage?group_by=hour&since=" + since),
                      api("GET", "usage?group_by=" + (group === "none" ? "key" : group) + "&since=" + since)])
    .then(([hours, groups]) => {
      const byHour = {};
      (hours.rows || []).forEach((r) => { byHour[r.hour] = r; });
      const xs = buckets(Math.floor(since / 3600) * 3600, Date.now() / 1000, 3600);
      return {bucket: "hour", buckets: xs, failure_kinds: [],
        series: [{group: "all", points: xs.map((t) => Object.assign({time: t}, byHour[t] || {}))}],
        totalsRows: (groups.rows || []).map((r) => Object.assign({group: r[groups.group_by]}, r))};
    });
}

function refresh() {
  const range = $("usage-range").value, group = $("usage-group").value;
  const metric = $("usage-metric").value;
  const q = seriesQuery();
  const since = Math.floor(Date.now() / 1000) - 86400;
  return Promise.all([
    getOr(q, null).then((s) => s || fallbackSeries(range, group)),
    getOr("usage?since=" + since, {budgets: []}),
  ]).then(([s, usage]) => settled(() => {
    const xs = s.buckets || [];
    const series = (s.series || []).slice().sort((a, b) => ((b.total || {})[metric] || 0) - ((a.total || {})[metric] || 0));
    const top = series.slice(0, 8);
    $("usage-chart-card").querySelector("h3").textContent = METRICS[metric][0] + " per " + (group === "none" ? "bucket" : group) + " by " + (s.bucket || "hour");
    draw(usageChart.plot, {xs, kind: top.length === 1 ? "bars" : "lines", unit: METRICS[metric][1], height: 220,
      series: top.map((x) => ({label: String(x.group), values: (x.points || []).map((p) => p[metric] || 0)}))});
    const kinds = s.failure_kinds || [];
    const fail = kinds.map((k) => ({label: k, values: xs.map((_, i) => series.reduce((n, x) => n + ((((x.points || [])[i] || {}).failures || {})[k] || 0), 0))}));
    draw(failChart.plot, {xs, kind: fail.length === 1 ? "bars" : "lines", unit: "count", height: 220,
      series: fail.length ? fail : [{label: "failures", values: xs.map(() => 0)}]});
    const rows = s.totalsRows || series.map((x) => Object.assign({group: x.group}, x.total || {}));
    totals.setRows(rows);
    budgetsTable.setRows(usage.budgets || []);
    document.body.setAttribute("data-usage-loaded", "1");
  }));
}

export default {id: "usage", title: "Usage & cost", build, refresh, refreshMs: 10000};
