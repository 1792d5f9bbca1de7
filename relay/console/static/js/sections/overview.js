// Overview: pool capacity now and the next resets, requests and failures
// per minute, spend today, accounts needing attention, recent failovers.
"use strict";
import {el, put, dollars, tokens, until, ago, now} from "../dom.js";
import {getOr} from "../api.js";
import {stateOf} from "../health.js";
import {card, draw} from "../charts.js";
import {makeTable} from "../table.js";

let root = null, chart = null, resets = null, failovers = null;

function tile(id, label) {
  const t = el("div", {"class": "tile", id: "tile-" + id});
  t.appendChild(el("div", {"class": "label"}, label));
  t.appendChild(el("div", {"class": "value"}, "–"));
  t.appendChild(el("div", {"class": "sub"}));
  return t;
}

function setTile(id, value, sub) {
  const t = root.querySelector("#tile-" + id);
  t.querySelector(".value").textContent = value;
  t.querySelector(".sub").textContent = sub || "";
}

function build(node) {
  root = node;
  put(root, el("h2", null, "Pool now"));
  const tiles = el("div", {"class": "tiles"});
  [["capacity", "Accounts serving"], ["slots", "Slots in use"], ["rpm", "Requests / min"],
   ["fpm", "Failures / min"], ["spend", "Spend today (UTC)"], ["tokens", "Tokens today"]]
    .forEach((t) => tiles.appendChild(tile(t[0], t[1])));
  root.appendChild(tiles);
  root.appendChild(el("h2", null, "Last 15 minutes"));
  chart = card("overview-chart", "Requests and failures per minute");
  root.appendChild(put(el("div", {"class": "charts"}), chart.box));
  root.appendChild(el("h2", null, "Needs attention"));
  root.appendChild(el("ul", {id: "attention"}));
  root.appendChild(el("h2", null, "Next resets"));
  resets = makeTable({id: "resets", empty: "nothing to wait for", rowKey: (r) => r.account + r.kind + r.at,
    sortBy: "when", rowAttrs: () => ({"class": "reset"}),
    columns: [{id: "account", title: "Account", width: "18%"}, {id: "kind", title: "What", width: "18%"},
              {id: "reason", title: "Reason", value: (r) => r.reason || ""},
              {id: "when", title: "When", width: "14%", value: (r) => r.at, render: (r) => until(r.at),
               csv: (r) => new Date(r.at * 1000).toISOString()}]});
  root.appendChild(resets.root);
  root.appendChild(el("h2", null, "Recent failovers"));
  failovers = makeTable({id: "failovers", empty: "none recorded", rowKey: (f) => f.at + f.account_id,
    sortBy: "when", sortDir: -1, rowAttrs: () => ({"class": "failover"}),
    columns: [{id: "when", title: "When", value: (f) => f.at, render: (f) => ago(f.at), csv: (f) => new Date(f.at * 1000).toISOString()},
              {id: "entrypoint", title: "Entry"}, {id: "account_id", title: "From"},
              {id: "next_account_id", title: "To", value: (f) => f.next_account_id || "–"},
              {id: "reason", title: "Reason"}, {id: "upstream_status", title: "Status"}]});
  root.appendChild(failovers.root);
}

// Resets from the accounts view, for a relay without GET /admin/overview.
function resetsOf(accounts) {
  const out = [];
  accounts.forEach((a) => {
    (a.blocks || []).forEach((b) => { if (b.until) { out.push({account: a.id, kind: b.kind, reason: b.reason, at: b.until}); } });
    const u = a.usage || {};
    [["primary", "5 h window"], ["secondary", "7 d window"]].forEach((w) => {
      if (u[w[0]] && u[w[0]].reset_at) { out.push({account: a.id, kind: w[1], reason: Math.round(u[w[0]].used_percent) + "% used", at: u[w[0]].reset_at}); }
    });
  });
  return out.filter((r) => r.at > now()).sort((x, y) => x.at - y.at).slice(0, 20);
}

// Requests and failovers per minute summed over accounts (GET history).
function perMinuteOf(history) {
  if (!history || !history.accounts) { return []; }
  const out = [];
  Object.values(history.accounts).forEach((h) => {
    (h.requests || []).forEach((n, i) => {
      out[i] = out[i] || {time: history.start + i * (history.bucket_seconds || 60), requests: 0, failed: 0};
      out[i].requests += n || 0;
      out[i].failed += (h.failovers || [])[i] || 0;
    });
  });
  return out;
}

function refresh(ctx) {
  return Promise.all([ctx.accounts(), getOr("overview", null)]).then(([data, ov]) => {
    const accounts = data.accounts || [];
    const t = now();
    const states = accounts.map((a) => [a, stateOf(a, t)]);
    const serving = states.filter((s) => s[1][0] === "ok" || s[1][0] === "doubt").length;
    const cap = ov && ov.capacity;
    setTile("capacity", serving + " of " + accounts.length,
      cap ? [cap.failing ? cap.failing + " failing" : "", cap.paused ? cap.paused + " paused" : "",
             cap.blocked ? cap.blocked + " blocked" : ""].filter(Boolean).join(" · ") : "");
    const slots = accounts.reduce((n, a) => n + (a.concurrency || 0), 0);
    const inUse = accounts.reduce((n, a) => n + (a.in_use || 0), 0);
    const waiting = accounts.reduce((n, a) => n + (a.waiting || 0), 0);
    setTile("slots", inUse + " / " + slots, waiting + " waiting");
    const next = ov ? ov.next_resets || [] : resetsOf(accounts);
    resets.setRows(next);
    failovers.setRows((data.failovers || []).slice(0, 20));
    const attention = root.querySelector("#attention");
    attention.textContent = "";
    states.filter((s) => s[1][0] !== "ok").forEach((s) => {
      const li = el("li", {"class": "attention state-" + s[1][0], "data-account-id": s[0].id});
      li.title = "Open the accounts";
      li.addEventListener("click", () => ctx.go("accounts"));
      li.appendChild(el("strong", null, s[0].id + ": " + s[1][1]));
      const why = (s[0].health && s[0].health.why) || s[0].reason;
      if (why) { li.appendChild(document.createTextNode(" — " + why)); }
      attention.appendChild(li);
    });
    if (!attention.children.length) { attention.appendChild(el("li", {"class": "good"}, "every account serves")); }
    return ov ? ov : Promise.all([getOr("history", null), getOr("usage?since=" + Math.floor(Date.UTC(
      new Date().getUTCFullYear(), new Date().getUTCMonth(), new Date().getUTCDate()) / 1000), null)])
      .then(([history, usage]) => ({per_minute: perMinuteOf(history),
        spend_today_usd: usage && usage.total ? usage.total.cost_usd || 0 : null,
        tokens_today: usage && usage.total ? usage.total.total_tokens || 0 : null}));
  }).then((ov) => {
    const pm = ov.per_minute || [];
    const last5 = pm.slice(-5);
    const mean = (f) => last5.length ? last5.reduce((n, p) => n + (p[f] || 0), 0) / last5.length : 0;
    setTile("rpm", (ov.requests_per_minute !== undefined ? ov.requests_per_minute : mean("requests")).toFixed(1), "mean of the last 5 minutes");
    setTile("fpm", (ov.failures_per_minute !== undefined ? ov.failures_per_minute : mean("failed")).toFixed(1), "");
    setTile("spend", typeof ov.spend_today_usd === "number" ? dollars(ov.spend_today_usd) : "–",
      (ov.spend_today_by_key || []).slice(0, 3).map((k) => k.key + " " + dollars(k.cost_usd)).join(" · "));
    setTile("tokens", typeof ov.tokens_today === "number" ? tokens(ov.tokens_today) : "–");
    draw(chart.plot, {xs: pm.map((p) => p.time), kind: "lines", unit: "count", height: 180,
      series: [{label: "requests", values: pm.map((p) => p.requests || 0), colour: "#2563eb"},
               {label: "failures", values: pm.map((p) => p.failed || 0), colour: "#dc2626"}]});
    document.body.setAttribute("data-overview-loaded", "1");
  });
}

export default {id: "overview", title: "Overview", build, refresh, refreshMs: 3000};
