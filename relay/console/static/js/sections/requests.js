// Requests: find a request (relay's id, the client's id, key, account,
// model, outcome, since), its attempts on a click. The first page
// refreshes itself every few seconds; "Older" pages on with the cursor.
"use strict";
import {$, el, put, button, show, ms, dollars} from "../dom.js";
import {api, download} from "../api.js";
import {makeTable} from "../table.js";

// R111: request_id is relay's own; client_request_id is the client's.
const FIELDS = ["request_id", "client_request_id", "key", "account", "model", "outcome"];
let table = null, next = null, records = {}, paged = false, selected = null, auto = true;
let searched = null;  // the filters of the last search: refreshes repeat it, not half-typed ones

function when(t) { return new Date(t * 1000).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z"); }

function cost(r) {
  if (r.unpriced) { return "unpriced"; }
  return typeof r.cost_usd === "number" ? dollars(r.cost_usd) : "";
}

function query(cursor) {
  const parts = [];
  FIELDS.forEach((f) => {
    const v = $("rq-" + f.replace(/_/g, "-")).value.trim();
    if (v) { parts.push(f + "=" + encodeURIComponent(v)); }
  });
  const since = $("rq-since").value;
  if (since) { parts.push("since=" + Math.floor(Date.now() / 1000 - Number(since))); }
  parts.push("limit=50");
  if (cursor) { parts.push("cursor=" + encodeURIComponent(cursor)); }
  return "requests?" + parts.join("&");
}

function label(text, id, control) { return put(el("label", null, text), control || el("input", {id, name: id})); }

function selectOf(id, options) {
  const s = el("select", {id});
  options.forEach((o) => s.appendChild(el("option", {value: o[0]}, o[1])));
  return s;
}

function build(root) {
  root.appendChild(el("h2", null, "Requests"));
  const form = put(el("form", {id: "request-filters", autocomplete: "off"}),
    label("Request id", "rq-request-id", el("input", {id: "rq-request-id", placeholder: "req_… or ws_…"})),
    label("Client request id", "rq-client-request-id", el("input", {id: "rq-client-request-id", placeholder: "the client's X-Request-Id"})),
    label("Key", "rq-key"), label("Account", "rq-account"), label("Model", "rq-model"),
    label("Outcome", "", selectOf("rq-outcome", [["", "any"], ["completed", "completed"], ["failed", "failed"],
      ["client_gone", "client gone"], ["error", "error"]])),
    label("Since", "", selectOf("rq-since", [["", "any time"], ["900", "last 15 min"], ["3600", "last hour"], ["86400", "last 24 h"]])),
    el("button", {id: "rq-search", type: "submit"}, "Search"),
    button("Reset", "", () => { form.reset(); load(null); }, {id: "rq-reset"}),
    put(el("label", {"class": "inline"}), el("input", {id: "rq-auto", type: "checkbox", checked: "checked"}), " refresh by itself"));
  form.addEventListener("submit", (ev) => { ev.preventDefault(); closeDetail(); load(null); });
  root.appendChild(form);
  $("rq-auto").addEventListener("change", () => { auto = $("rq-auto").checked; });
  table = makeTable({
    id: "requests", csv: "requests", empty: "no request matches", rowKey: (r) => r.request_id,
    sortBy: "time", sortDir: -1,
    rowAttrs: (r) => ({"class": "request outcome-" + r.outcome + (r.request_id === selected ? " selected" : ""),
                       "data-request-id": r.request_id}),
    onRow: (r, tr) => tr.addEventListener("click", () => detail(r.request_id)),
    columns: [
      {id: "time", title: "When", width: "11%", value: (r) => r.time, render: (r) => when(r.time), csv: (r) => when(r.time)},
      {id: "request_id", title: "Request id", width: "16%", cls: "rid",
       render: (r) => { const s = el("span", {title: r.request_id + (r.client_request_id ? "\nclient request id: " + r.client_request_id : "")}, r.request_id);
         if (r.client_request_id) { s.setAttribute("data-client-request-id", r.client_request_id); } return s; }},
      {id: "key", title: "Key", width: "8%"},
      {id: "entry", title: "Entry", width: "10%", value: (r) => r.entrypoint + (r.mode ? " " + r.mode : "") + (r.endpoint === "chat" ? " chat" : "")},
      {id: "model", title: "Model", width: "9%"},
      {id: "account", title: "Account (tried)", width: "13%", value: (r) => (r.account || "–") + (r.accounts && r.accounts.length > 1 ? " (" + r.accounts.join(" → ") + ")" : "")},
      {id: "outcome", title: "Outcome", width: "10%", value: (r) => r.outcome + " " + r.status},
      {id: "times", title: "First output / total", width: "10%", value: (r) => r.duration_ms || 0,
       render: (r) => ms(r.first_output_ms) + " / " + ms(r.duration_ms), csv: (r) => ms(r.first_output_ms) + " / " + ms(r.duration_ms)},
      {id: "cost", title: "Tokens / cost", value: (r) => r.cost_usd || 0,
       render: (r) => (r.input_tokens === null || r.input_tokens === undefined ? "–" : (r.usage_estimated ? "≈" : "") +
         (r.input_tokens + r.output_tokens) + " tok") + " " + cost(r),
       csv: (r) => (r.input_tokens === null || r.input_tokens === undefined ? "" : (r.input_tokens + r.output_tokens) + " tok ") + cost(r)},
    ],
    filters: [{id: "outcome", title: "Shown", options: [["", "all"], ["failed", "failed"], ["completed", "completed"]],
               test: (r, v) => v === "failed" ? r.outcome !== "completed" : r.outcome === v}],
  });
  root.appendChild(table.root);
  root.appendChild(button("Older", "hidden", () => { if (next) { load(next, true); } }, {id: "rq-older"}));
  root.appendChild(button("Export up to 5,000 matching (CSV)", "", () =>
    download(query(null).replace("limit=50", "limit=5000") + "&format=csv", "requests.csv")
      .catch((e) => document.body.setAttribute("data-requests-error", e.message)), {id: "rq-export"}));
  root.appendChild(el("div", {id: "request-detail", "class": "panel hidden"}));
}

function closeDetail() { selected = null; show($("request-detail"), false); }

function render(data, append) {
  if (!append) { records = {}; }
  (data.requests || []).forEach((r) => { records[r.request_id] = r; });
  const rows = Object.values(records);
  table.setRows(rows);
  next = data.next || null;
  paged = !!append;
  show($("rq-older"), !!next);
  document.body.setAttribute("data-requests-loaded", "1");
  document.body.setAttribute("data-requests-count", String(rows.length));
  if (selected && records[selected]) { detail(selected, true); }
}

function load(cursor, again) {
  if (!again || searched === null) { searched = query(null); }
  const path = cursor ? searched + "&cursor=" + encodeURIComponent(cursor) : searched;
  return api("GET", path).then((data) => render(data, !!cursor)).catch((e) => {
    if (e.status === 401) { throw e; }
    table.setRows([]);
    document.body.setAttribute("data-requests-error", e.message);
  });
}

function detail(id, quiet) {
  const r = records[id];
  const box = $("request-detail");
  selected = id;
  document.querySelectorAll("tr.request").forEach((tr) => tr.classList.toggle("selected", tr.getAttribute("data-request-id") === id));
  if (!r) { show(box, false); return; }
  box.textContent = "";
  box.appendChild(el("h3", null, "Request " + r.request_id));
  const dl = el("dl");
  [["time", when(r.time)], ["client request id", r.client_request_id], ["key", r.key],
   ["entrypoint", r.entrypoint], ["mode", r.mode], ["endpoint", r.endpoint], ["model", r.model],
   ["outcome", r.outcome + " (status " + r.status + ")"],
   ["error", r.error ? (r.error_code ? r.error_code + ": " : "") + r.error : null],
   ["served by", r.account], ["first output", ms(r.first_output_ms)], ["total", ms(r.duration_ms)],
   ["waited", ms(r.waited_ms)],
   ["tokens", r.input_tokens === null || r.input_tokens === undefined ? null : r.input_tokens + " in (" +
     r.cached_input_tokens + " cached), " + r.output_tokens + " out (" + r.reasoning_tokens + " reasoning)" +
     (r.usage_estimated ? ", estimated (R107)" : "")],
   ["cost", cost(r)], ["client", r.client_ip], ["user agent", r.user_agent],
   ["upstream request id", r.upstream_request_id]].forEach((kv) => {
    if (kv[1] === null || kv[1] === undefined || kv[1] === "") { return; }
    put(dl, el("dt", null, kv[0]), el("dd", {"data-field": kv[0]}, kv[1]));
  });
  box.appendChild(dl);
  const t = el("table", {"class": "attempts plain"});
  const head = el("tr");
  ["#", "Account", "Status", "Why it ended", "Then"].forEach((h) => head.appendChild(el("th", null, h)));
  t.appendChild(head);
  (r.attempts || []).forEach((a, i) => {
    const tr = el("tr", {"class": "attempt"});
    [i + 1, a.account, a.status === null ? "–" : a.status, a.reason || "–", a.decision || "–"].forEach((v) => tr.appendChild(el("td", null, v)));
    t.appendChild(tr);
  });
  if (!(r.attempts || []).length) {
    const td = el("td", null, "no upstream attempt (refused before any account)");
    td.colSpan = 5;
    t.appendChild(put(el("tr"), td));
  }
  box.appendChild(t);
  box.appendChild(button("Close", "", closeDetail, {id: "request-detail-close"}));
  show(box, true);
  if (!quiet) { document.body.setAttribute("data-request-detail", id); }
}

// The first page refreshes itself; a page of older records stays put.
function refresh() {
  if (paged || (!auto && document.body.getAttribute("data-requests-loaded"))) { return Promise.resolve(); }
  return load(null, true);
}

export default {id: "requests", title: "Requests", build, refresh, refreshMs: 3000};
