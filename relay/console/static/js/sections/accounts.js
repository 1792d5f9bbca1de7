// Accounts: every account once, with its state (the relay's health),
// slots, plan windows, the last 15 minutes and its last error; search,
// filter, sort; add, edit, pause with a reason, resume, clear, test,
// re-login, redeem a banked reset, delete; bulk pause, resume, clear,
// delete; explain (which account a key's next turn gets, and why).
"use strict";
import {$, el, put, button, show, confirmButton, messages, meter, until, ago, now, settled} from "../dom.js";
import {api, getOr} from "../api.js";
import {makeTable} from "../table.js";
import {stateOf, healthLine, lastError} from "../health.js";
import {input, select, fields, buttons, panel, WS_MODES} from "../forms.js";
import {buildAdd, openAdd, openRelogin, proxyInto} from "./logins.js";
import {card, draw} from "../charts.js";
import {explainBlock} from "./explain.js";

let table = null, msg = null, ctxRef = null, editing = null, pausing = [];
let accounts = [];
const testing = {};

function windowMeter(name, w) {
  if (!w) { return null; }
  const used = Math.round(w.used_percent || 0);
  const text = name + " " + used + "%" + (w.reset_at ? " · resets " + until(w.reset_at) : "");
  const m = meter(used, 100, text, "window");
  m.title = text + (w.reset_at ? " (" + new Date(w.reset_at * 1000).toISOString() + ")" : "");
  return m;
}

function stateCell(a) {
  const st = stateOf(a, now());
  const wrap = el("div");
  wrap.appendChild(el("span", {"class": "badge"}, st[1]));
  const reason = (a.paused && a.paused_reason ? "paused: " + a.paused_reason : "") || a.reason ||
    (a.disabled ? "disabled" : "");
  const when = a.until || a.rate_limited_until;
  if (reason || when) {
    const text = [reason, when ? until(when) : ""].filter(Boolean).join(" · ");
    wrap.appendChild(el("span", {"class": "sub reason", title: text}, text));
  }
  const line = healthLine(a);
  if (line) {
    const node = el("span", {"class": "sub health"}, line);
    if (a.health && a.health.why) { node.title = a.health.why; }
    wrap.appendChild(node);
  }
  if (a.token_status && a.token_status !== "ok" && reason.indexOf(a.token_status) < 0) {
    wrap.appendChild(el("span", {"class": "sub token"}, "token " + a.token_status +
      (a.token_reason ? ": " + a.token_reason : "")));
  }
  return wrap;
}

function errorCell(a) {
  const e = lastError(a);
  const wrap = el("div", {"class": "lasterror"});
  if (!e) { return wrap; }
  const stale = a.last_success_at && e.at && a.last_success_at > e.at;
  if (stale) { wrap.classList.add("stale"); }
  wrap.appendChild(el("span", {"class": "text"}, e.text));
  wrap.appendChild(el("span", {"class": "sub"}, [e.at ? ago(e.at) : "", stale ? "ok since " + ago(a.last_success_at) : ""].filter(Boolean).join(" · ")));
  wrap.title = e.text;
  return wrap;
}

function actionsCell(a) {
  const box = el("div", {"class": "actions"});
  const rerender = () => table.draw();
  if (a.source === "admin") { box.appendChild(button("Edit", "edit", () => openEdit(a))); }
  box.appendChild(a.paused ? button("Resume", "resume", () => act("POST", [a.id], "enable", "resumed"))
                           : button("Pause", "pause", () => openPause([a.id])));
  box.appendChild(button("Test", "test", () => test(a.id)));
  if (a.type === "oauth") {
    box.appendChild(button("Re-login", "relogin", () => openRelogin(a)));
    if (a.banked_resets > 0) {
      box.appendChild(button("Redeem reset", "redeem", () => act("POST", [a.id], "redeem-reset", "had a banked reset redeemed")));
    }
  }
  box.appendChild(button("Clear", "clear", () => act("POST", [a.id], "clear", "cleared")));
  if (a.source === "admin") {
    box.appendChild(confirmButton("account:delete:" + a.id, ["Delete", "Confirm delete"], "delete danger",
      () => act("DELETE", [a.id], null, "deleted"), rerender));
  }
  return box;
}

function build(root, ctx) {
  ctxRef = ctx;
  msg = messages("manage-msg");
  root.appendChild(el("h2", null, "Accounts"));
  root.appendChild(el("div", {id: "manage-msg", "class": "msg", role: "status"}));
  table = makeTable({
    id: "accounts", csv: "accounts", empty: "no accounts",
    rowKey: (a) => a.id,
    rowAttrs: (a) => {
      const st = stateOf(a, now());
      return {"class": "account manage-row state-" + st[0], "data-account-id": a.id, "data-state": st[0],
              "data-health": a.health ? a.health.state : "", "data-source": a.source || "file",
              "data-paused": a.paused ? "1" : "0"};
    },
    columns: [
      {id: "id", title: "Account", width: "16%", value: (a) => a.id + (a.label ? " " + a.label : ""),
       csv: (a) => a.id,
       render: (a) => put(el("div"), el("span", {"class": "id"}, a.id),
         el("span", {"class": "source " + (a.source || "file")}, a.source || "file"),
         el("span", {"class": "sub"}, [a.label, a.type === "oauth" ? "ChatGPT" : "API key",
           "prio " + a.priority].filter(Boolean).join(" · ")))},
      {id: "state", title: "State", width: "19%", value: (a) => stateOf(a, now())[1], render: stateCell},
      {id: "slots", title: "Slots / waiting", width: "11%", value: (a) => a.in_use || 0,
       render: (a) => put(el("div"), meter(a.in_use || 0, a.concurrency || 0,
         (a.in_use || 0) + " / " + (a.concurrency || "∞"), "slots"),
         el("span", {"class": "sub"}, (a.waiting || 0) + " waiting"))},
      {id: "usage", title: "Plan windows", width: "16%", cls: "usage",
       value: (a) => a.usage && a.usage.primary ? a.usage.primary.used_percent : -1,
       csv: (a) => a.usage ? ["primary", "secondary"].map((w) => a.usage[w] ? w + " " + Math.round(a.usage[w].used_percent) + "%" : "").filter(Boolean).join("; ") : "",
       render: (a) => a.usage ? put(el("div"), windowMeter("5 h", a.usage.primary), windowMeter("7 d", a.usage.secondary),
           a.banked_resets > 0 ? el("span", {"class": "sub resets"}, a.banked_resets + " banked reset(s)") : null)
         : el("span", {"class": "sub"}, a.type === "oauth" ? "not known yet" : "–")},
      {id: "turns", title: "Turns / failovers", width: "9%", value: (a) => a.turns || 0,
       render: (a) => put(el("div", {"class": "num"}), String(a.turns || 0),
         el("span", {"class": "sub"}, (a.failovers || 0) + " failovers"))},
      {id: "error", title: "Last error", width: "13%", value: (a) => (lastError(a) || {}).text || "", render: errorCell},
      {id: "actions", title: "Actions", sort: false, value: () => "", cls: "actions", render: actionsCell},
    ],
    filters: [{id: "state", title: "State", options: [["", "any"], ["ok", "ok"], ["failing", "failing"],
      ["cooldown", "cooling / blocked"], ["disabled", "paused / needs login"], ["doubt", "degraded / doubt"]],
      test: (a, v) => { const s = stateOf(a, now())[0]; return v === "cooldown" ? ["cooldown", "rate_limited", "breaker"].indexOf(s) >= 0 : s === v; }},
      {id: "type", title: "Type", options: [["", "any"], ["apikey", "API key"], ["oauth", "ChatGPT"]],
       test: (a, v) => a.type === v}],
    bulk: [{id: "pause", label: "Pause", run: (ids) => openPause(ids)},
           {id: "resume", label: "Resume", run: (ids) => act("POST", ids, "enable", "resumed")},
           {id: "clear", label: "Clear", run: (ids) => act("POST", ids, "clear", "cleared")},
           {id: "delete", label: "Delete", confirm: "Confirm delete", danger: true,
            run: (ids) => act("DELETE", ids.filter((id) => (accounts.find((a) => a.id === id) || {}).source === "admin"), null, "deleted")}],
  });
  root.appendChild(table.root);
  root.appendChild(buttons(button("Add account", "", openAdd, {id: "add-open"})));
  buildAdd(root, {say: (t, k) => msg.say(t, k), reload: () => refresh(ctx, true)});
  root.appendChild(panel("pause-panel", "Pause", fields(input("Reason", "pause-reason", {placeholder: "why (shown on the account and in the audit)", maxlength: "200"})),
    buttons(button("Pause", "", submitPause, {id: "pause-submit"}),
            button("Cancel", "", () => show($("pause-panel"), false), {id: "pause-cancel"}))));
  root.appendChild(panel("test-panel", "Test", el("div", {id: "test-result", role: "status"}),
    buttons(button("Close", "", () => show($("test-panel"), false), {id: "test-close"}))));
  root.appendChild(panel("edit-panel", "Edit", put(el("form", {id: "edit-form", autocomplete: "off"}),
    fields(input("Label", "edit-label"), input("Priority", "edit-priority", {type: "number"}),
      input("Slots (concurrency)", "edit-concurrency", {type: "number"}),
      input("Models", "edit-models", {placeholder: "all"}),
      input("Proxy", "edit-proxy", {placeholder: "direct, a proxy id or URL (unchanged if empty)"}),
      select("WebSocket mode", "edit-ws", WS_MODES),
      input("New API key", "edit-key", {type: "password", autocomplete: "new-password", placeholder: "unchanged if empty"}, "edit-key")),
    buttons(el("button", {id: "edit-save", type: "submit"}, "Save"),
            button("Cancel", "", () => show($("edit-panel"), false), {id: "edit-cancel"})))));
  $("edit-form").addEventListener("submit", submitEdit);
  root.appendChild(el("h2", null, "Explain: which account a key's next turn gets, and why not the others"));
  root.appendChild(explainBlock());
  root.appendChild(el("h2", null, "Last 15 minutes per account"));
  root.appendChild(el("div", {id: "history", "class": "charts"}));
}

function refresh(ctx, fresh) {
  return Promise.all([ctx.accounts(fresh), getOr("history", null)]).then(([data, history]) => {
    settled(() => {
      accounts = data.accounts || [];
      table.setRows(accounts);
      drawHistory(history);
      const width = document.documentElement.clientWidth;
      const clipped = Array.prototype.some.call(document.querySelectorAll("#accounts button"),
        (b) => b.getBoundingClientRect().right > width);
      document.body.setAttribute("data-manage-clipped", clipped ? "1" : "0");
      document.body.setAttribute("data-overflow-x", document.documentElement.scrollWidth > width ? "1" : "0");
      document.body.setAttribute("data-manage-loaded", "1");
    });
  });
}

function drawHistory(history) {
  const box = $("history");
  if (!history || !history.accounts) { return; }
  const ids = accounts.map((a) => a.id);
  Object.keys(history.accounts).forEach((id) => { if (ids.indexOf(id) < 0) { ids.push(id); } });
  ids.forEach((id) => {
    let c = $("history-" + id);
    if (!c) {
      const made = card("history-" + id, id);
      made.box.setAttribute("data-account-id", id);
      box.appendChild(made.box);
      c = made.plot;
    }
    const zeros = Array.from({length: history.minutes || 15}, () => 0);
    const h = history.accounts[id] || {requests: zeros, failovers: zeros};
    const step = history.bucket_seconds || 60;
    const xs = (h.requests || []).map((_, i) => history.start + i * step);
    draw(c, {xs, kind: "lines", unit: "count", height: 140, series: [
      {label: "requests", values: h.requests || [], colour: "#2563eb"},
      {label: "failovers", values: h.failovers || [], colour: "#dc2626"},
      {label: "first output p50", values: h.first_output_p50_ms || zeros.map(() => null), colour: "#d97706", right: true}]});
  });
}

function act(method, ids, action, done) {
  const one = (id) => api(method, "accounts/" + encodeURIComponent(id) + (action ? "/" + action : ""),
    method === "POST" ? {} : undefined);
  return Promise.all(ids.map((id) => one(id).then(() => null, (e) => id + ": " + e.message)))
    .then((errors) => refresh(ctxRef, true).then(() => {
      const failed = errors.filter(Boolean);
      if (failed.length) { msg.say(failed.join("; "), "error"); return; }
      msg.say((ids.length === 1 ? "Account " + ids[0] : ids.length + " accounts (" + ids.join(", ") + ")") + " " + done + ".", "ok");
    }));
}

function openPause(ids) {
  pausing = ids;
  $("pause-panel-title").textContent = "Pause " + ids.join(", ");
  $("pause-reason").value = "";
  show($("pause-panel"), true);
  $("pause-reason").focus();
}

function submitPause() {
  const reason = $("pause-reason").value.trim();
  const ids = pausing;
  show($("pause-panel"), false);
  return Promise.all(ids.map((id) => api("POST", "accounts/" + encodeURIComponent(id) + "/disable",
    reason ? {reason} : {}).then(() => null, (e) => id + ": " + e.message))).then((errors) =>
    refresh(ctxRef, true).then(() => {
      const failed = errors.filter(Boolean);
      if (failed.length) { msg.say(failed.join("; "), "error"); return; }
      msg.say((ids.length === 1 ? "Account " + ids[0] : ids.length + " accounts") + " paused" +
        (reason ? " (" + reason + ")" : "") + ".", "ok");
    }));
}

function test(id) {
  if (testing[id]) { return; }
  testing[id] = true;
  show($("test-panel"), true);
  $("test-panel-title").textContent = "Test " + id;
  $("test-panel").setAttribute("data-test-status", "running");
  $("test-result").textContent = "asking the upstream…";
  api("POST", "accounts/" + encodeURIComponent(id) + "/test", {}).then((r) => {
    const box = $("test-result");
    box.textContent = "";
    box.appendChild(el("p", {"class": r.ok ? "good" : "bad"}, r.ok ? "OK: the credential works." :
      "Failed: " + ((r.error && r.error.message) || "status " + r.status)));
    const dl = el("dl");
    [["check", r.check === "models" ? "list models" : r.check === "usage" ? "usage probe" : r.check],
     ["status", r.status], ["latency", r.latency_ms !== undefined ? r.latency_ms + " ms" : ""],
     ["models", r.models ? r.models.slice(0, 12).join(", ") + (r.models.length > 12 ? " … (" + r.models.length + ")" : "") : ""],
     ["plan", r.usage && r.usage.plan],
     ["windows", r.usage && r.usage.windows ? r.usage.windows.map((w) => w.name + " " + Math.round(w.used_percent) + "%" +
       (w.resets_at ? " resets " + until(w.resets_at) : "")).join("; ") : ""],
     ["error code", r.error && r.error.code]].forEach((kv) => {
      if (kv[1] === null || kv[1] === undefined || kv[1] === "") { return; }
      put(dl, el("dt", null, kv[0]), el("dd", {"data-field": kv[0]}, kv[1]));
    });
    box.appendChild(dl);
    $("test-panel").setAttribute("data-test-status", r.ok ? "ok" : "failed");
  }).catch((e) => {
    $("test-result").textContent = "Test failed: " + e.message;
    $("test-panel").setAttribute("data-test-status", "error");
  }).then(() => { delete testing[id]; });
}

function openEdit(a) {
  api("GET", "accounts/" + encodeURIComponent(a.id)).then((data) => {
    const v = data.account;
    editing = v;
    $("edit-panel-title").textContent = "Edit " + v.id;
    $("edit-label").value = v.label || "";
    $("edit-priority").value = v.priority;
    $("edit-concurrency").value = v.concurrency;
    $("edit-models").value = v.models ? v.models.join(", ") : "";
    $("edit-ws").value = v.ws_mode || "";
    $("edit-proxy").value = "";
    $("edit-key").value = "";
    document.querySelectorAll("label.edit-key").forEach((n) => show(n, v.type === "apikey"));
    show($("edit-panel"), true);
  }).catch(msg.fail);
}

function submitEdit(ev) {
  ev.preventDefault();
  if (!editing) { return; }
  const v = editing, change = {};
  const label = $("edit-label").value.trim() || null;
  if (label !== (v.label || null)) { change.label = label; }
  ["priority", "concurrency"].forEach((k) => {
    const raw = $("edit-" + k).value.trim();
    if (raw !== "" && Number(raw) !== v[k]) { change[k] = Number(raw); }
  });
  const models = $("edit-models").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (JSON.stringify(models.length ? models : null) !== JSON.stringify(v.models || null)) { change.models = models.length ? models : null; }
  const ws = $("edit-ws").value || null;
  if (ws !== (v.ws_mode || null)) { change.ws_mode = ws; }
  proxyInto(change, $("edit-proxy").value);
  if ($("edit-key").value) { change.api_key = $("edit-key").value; }
  if (!Object.keys(change).length) { show($("edit-panel"), false); return; }
  api("PATCH", "accounts/" + encodeURIComponent(v.id), change).then((data) => {
    $("edit-key").value = "";
    show($("edit-panel"), false);
    msg.say("Account " + v.id + " changed: " + data.changed.join(", ") + ".", "ok");
    return refresh(ctxRef, true);
  }).catch(msg.fail);
}

export default {id: "accounts", title: "Accounts", build, refresh: (ctx) => refresh(ctx), refreshMs: 3000};
