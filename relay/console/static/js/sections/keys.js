// Client keys: search, filter, sort; issue (the secret shown once), edit
// an admin key's policy, disable / enable, revoke; budgets as progress with
// what is left; bulk disable, enable, revoke.
"use strict";
import {$, el, put, button, show, confirmButton, messages, meter, dollars, tokens, iso,
        settled} from "../dom.js";
import {api, getOr} from "../api.js";
import {makeTable} from "../table.js";
import {input, select, fields, buttons, panel} from "../forms.js";

const FIELDS = [
  ["models", "key-models", "list"], ["deny_models", "key-deny", "list"],
  ["concurrency", "key-concurrency", "int"], ["rpm", "key-rpm", "int"],
  ["tpm", "key-tpm", "int"], ["expires_at", "key-expires", "time"],
  ["daily_usd", "key-daily-usd", "number"], ["monthly_usd", "key-monthly-usd", "number"],
  ["daily_tokens", "key-daily-tokens", "int"], ["monthly_tokens", "key-monthly-tokens", "int"],
  ["group", "key-group", "text"], ["accounts", "key-accounts", "list"],
];

let table = null, msg = null, keys = [], groups = [], editing = null;

export function policyText(p) {
  const parts = [];
  if (p.models) { parts.push("models " + p.models.join(", ")); }
  if (p.deny_models) { parts.push("not " + p.deny_models.join(", ")); }
  if (p.rpm) { parts.push("rpm " + p.rpm); }
  if (p.tpm) { parts.push("tpm " + p.tpm); }
  if (typeof p.daily_usd === "number") { parts.push(dollars(p.daily_usd) + "/day"); }
  if (typeof p.monthly_usd === "number") { parts.push(dollars(p.monthly_usd) + "/month"); }
  if (p.daily_tokens) { parts.push(tokens(p.daily_tokens) + " tok/day"); }
  if (p.monthly_tokens) { parts.push(tokens(p.monthly_tokens) + " tok/month"); }
  if (p.group) { parts.push("group " + p.group); }
  if (p.accounts) { parts.push("accounts " + p.accounts.join(", ")); }
  if (p.expires_at) { parts.push("expires " + iso(p.expires_at)); }
  parts.push((p.concurrency || "∞") + " slots");
  return parts.join(" · ");
}

function usageText(u) {
  if (!u || !u.requests) { return "no turns"; }
  let text = u.requests + " turns · " + tokens(u.total_tokens) + " tok · " + dollars(u.cost_usd || 0);
  if (u.unpriced_requests) { text += " + " + u.unpriced_requests + " unpriced"; }
  if (u.estimated_requests) { text += " (" + u.estimated_requests + " estimated)"; }
  return text;
}

function stateText(k) {
  if (k.disabled) {
    return k.disabled_by === "file" ? "disabled in the file" : "disabled" + (k.disabled_reason ? ": " + k.disabled_reason : "");
  }
  return k.expired ? "expired" : "active";
}

// Budget meters: what is spent of each limit and what is left.
function budgets(k) {
  const p = k.policy || {}, u = k.usage || {}, out = [];
  const money = (label, limit, used) => {
    const left = Math.max(0, limit - used);
    out.push(meter(used, limit, label + ": " + dollars(used) + " of " + dollars(limit) + " · " + dollars(left) + " left", "budget"));
  };
  const toks = (label, limit, used) => {
    out.push(meter(used, limit, label + ": " + tokens(used) + " of " + tokens(limit) + " tok · " + tokens(Math.max(0, limit - used)) + " left", "budget"));
  };
  if (typeof p.daily_usd === "number") { money("today", p.daily_usd, (u.today || {}).cost_usd || 0); }
  if (typeof p.monthly_usd === "number") { money("month", p.monthly_usd, (u.month || {}).cost_usd || 0); }
  if (p.daily_tokens) { toks("today", p.daily_tokens, (u.today || {}).total_tokens || 0); }
  if (p.monthly_tokens) { toks("month", p.monthly_tokens, (u.month || {}).total_tokens || 0); }
  return out.length ? put(el("div", {"class": "budgets"}), ...out) : el("span", {"class": "sub"}, "no budget");
}

function actions(k) {
  const box = el("div", {"class": "actions"});
  if (k.source === "admin") { box.appendChild(button("Edit", "key-edit", () => openForm(k))); }
  box.appendChild(k.disabled ? button("Enable", "key-enable", () => act("POST", [k.name], "enable", "enabled"))
                             : button("Disable", "key-disable", () => act("POST", [k.name], "disable", "disabled")));
  if (k.source === "admin") {
    box.appendChild(confirmButton("key:revoke:" + k.name, ["Revoke", "Confirm revoke"], "key-revoke danger",
      () => act("DELETE", [k.name], null, "revoked: it is refused from its next request"), () => table.draw()));
  }
  return box;
}

function build(root, ctx) {
  msg = messages("keys-msg");
  root.appendChild(el("h2", null, "Client keys"));
  root.appendChild(el("div", {id: "keys-msg", "class": "msg", role: "status"}));
  table = makeTable({
    id: "keys-table", csv: "keys", empty: "no keys", rowKey: (k) => k.name,
    rowAttrs: (k) => ({"class": "key-row", "data-key": k.name, "data-source": k.source,
                       "data-disabled": k.disabled ? "1" : "0", "data-expired": k.expired ? "1" : "0"}),
    columns: [
      {id: "name", title: "Key", width: "16%", value: (k) => k.name + (k.label ? " " + k.label : ""), csv: (k) => k.name,
       render: (k) => put(el("div"), el("span", {"class": "id"}, k.name), el("span", {"class": "source " + k.source}, k.source),
         k.label ? el("span", {"class": "sub label"}, k.label) : null, k.hint ? el("span", {"class": "sub hint"}, k.hint) : null)},
      {id: "policy", title: "Policy", width: "22%", cls: "key-policy", value: (k) => policyText(k.policy || {})},
      {id: "usage", title: "Usage and cost (UTC today / month)", width: "20%", cls: "key-usage",
       value: (k) => ((k.usage || {}).today || {}).cost_usd || 0,
       csv: (k) => "today: " + usageText((k.usage || {}).today) + "; month: " + usageText((k.usage || {}).month),
       render: (k) => put(el("div"), el("span", {"class": "num usage-today"}, "today: " + usageText((k.usage || {}).today)),
         el("span", {"class": "sub usage-month"}, "month: " + usageText((k.usage || {}).month)))},
      {id: "budget", title: "Budget left", width: "18%", value: (k) => (k.policy || {}).daily_usd || 0,
       csv: (k) => Array.from(budgets(k).querySelectorAll(".meter-text")).map((n) => n.textContent).join("; "), render: budgets},
      {id: "state", title: "State", width: "9%", cls: "kstate", value: stateText},
      {id: "actions", title: "Actions", sort: false, value: () => "", cls: "actions", render: actions},
    ],
    filters: [{id: "state", title: "State", options: [["", "any"], ["active", "active"], ["disabled", "disabled"], ["expired", "expired"]],
               test: (k, v) => v === "disabled" ? !!k.disabled : v === "expired" ? !!k.expired : !k.disabled && !k.expired},
              {id: "source", title: "Source", options: [["", "any"], ["admin", "admin"], ["file", "file"]], test: (k, v) => k.source === v}],
    bulk: [{id: "disable", label: "Disable", run: (names) => act("POST", names, "disable", "disabled")},
           {id: "enable", label: "Enable", run: (names) => act("POST", names, "enable", "enabled")},
           {id: "revoke", label: "Revoke", confirm: "Confirm revoke", danger: true,
            run: (names) => act("DELETE", names.filter((n) => (keys.find((k) => k.name === n) || {}).source === "admin"), null, "revoked")}],
  });
  root.appendChild(table.root);
  root.appendChild(buttons(button("Issue key", "", () => openForm(null), {id: "key-issue-open"})));
  const secret = panel("key-secret-panel", "New key",
    el("p", {"class": "secret-warn"}, "Copy this secret now: it is shown once. relay keeps only its digest and cannot show it again."),
    el("input", {id: "key-secret", readonly: "readonly", autocomplete: "off", spellcheck: "false"}),
    buttons(button("Copy", "", copySecret, {id: "key-copy"}),
            button("I have copied it, close", "", closeSecret, {id: "key-secret-close"}),
            el("span", {id: "key-copy-status", "class": "sub"})));
  secret.classList.add("secret");
  secret.setAttribute("role", "alert");
  root.appendChild(secret);
  root.appendChild(panel("key-form-panel", "Issue a key", put(el("form", {id: "key-form", autocomplete: "off"}),
    fields(input("Name", "key-name", {placeholder: "e.g. alice"}, "key-new-only"),
      input("Label", "key-label", {placeholder: "optional"}),
      input("Models", "key-models", {placeholder: "all, or gpt-5.5, ..."}),
      input("Denied models", "key-deny", {placeholder: "none"}),
      input("Slots (concurrency)", "key-concurrency", {type: "number", min: "0", placeholder: "5"}),
      input("Requests / min (rpm)", "key-rpm", {type: "number", min: "1", placeholder: "no limit"}),
      input("Tokens / min (tpm)", "key-tpm", {type: "number", min: "1", placeholder: "no limit"}),
      input("Expires at", "key-expires", {placeholder: "never, or 2027-03-01T00:00:00Z"}),
      input("$ per day", "key-daily-usd", {type: "number", step: "any", min: "0", placeholder: "no budget"}),
      input("$ per month", "key-monthly-usd", {type: "number", step: "any", min: "0", placeholder: "no budget"}),
      input("Tokens per day", "key-daily-tokens", {type: "number", min: "1", placeholder: "no budget"}),
      input("Tokens per month", "key-monthly-tokens", {type: "number", min: "1", placeholder: "no budget"}),
      select("Group", "key-group", [["", "every account"]]),
      input("Accounts", "key-accounts", {placeholder: "every account, or a1, a2"})),
    buttons(el("button", {id: "key-submit", type: "submit"}, "Issue"),
            button("Cancel", "", () => { editing = null; show($("key-form-panel"), false); }, {id: "key-cancel"})))));
  $("key-form").addEventListener("submit", submit);
}

function renderGroups() {
  const s = $("key-group"), chosen = s.value;
  s.textContent = "";
  s.appendChild(el("option", {value: ""}, "every account"));
  groups.forEach((g) => s.appendChild(el("option", {value: g.name}, g.name + " (" + (g.accounts || []).join(", ") + ")")));
  s.value = chosen;
}

function refresh() {
  return Promise.all([api("GET", "keys"), getOr("groups", {groups})]).then(([k, g]) => {
    settled(() => {
      keys = k.keys || [];
      groups = g.groups || [];
      table.setRows(keys);
      renderGroups();
      document.body.setAttribute("data-overflow-x", document.documentElement.scrollWidth > document.documentElement.clientWidth ? "1" : "0");
      document.body.setAttribute("data-keys-loaded", "1");
    });
  });
}

function act(method, names, action, done) {
  return Promise.all(names.map((n) => api(method, "keys/" + encodeURIComponent(n) + (action ? "/" + action : ""),
    method === "POST" ? {} : undefined).then(() => null, (e) => n + ": " + e.message))).then((errors) =>
    refresh().then(() => {
      const failed = errors.filter(Boolean);
      if (failed.length) { msg.say(failed.join("; "), "error"); return; }
      msg.say((names.length === 1 ? "Key " + names[0] : names.length + " keys (" + names.join(", ") + ")") + " " + done + ".", "ok");
    }));
}

function valueOf(kind, id) {
  const raw = $(id).value.trim();
  if (raw === "") { return null; }
  if (kind === "list") { const items = raw.split(",").map((s) => s.trim()).filter(Boolean); return items.length ? items : null; }
  if (kind === "int" || kind === "number") { return Number(raw); }
  return raw;
}

function shown(kind, value) {
  if (value === null || value === undefined) { return ""; }
  if (kind === "list") { return value.join(", "); }
  if (kind === "time") { return iso(value); }
  return String(value);
}

function openForm(k) {
  editing = k;
  $("key-form-panel-title").textContent = k ? "Edit " + k.name : "Issue a key";
  $("key-submit").textContent = k ? "Save" : "Issue";
  document.querySelectorAll(".key-new-only").forEach((n) => show(n, !k));
  $("key-name").value = "";
  $("key-label").value = k && k.label ? k.label : "";
  FIELDS.forEach((f) => { $(f[1]).value = shown(f[2], k ? k.policy[f[0]] : null); });
  show($("key-form-panel"), true);
}

function submit(ev) {
  ev.preventDefault();
  const change = {};
  FIELDS.forEach((f) => {
    const value = valueOf(f[2], f[1]);
    if (!editing) { if (value !== null) { change[f[0]] = value; } return; }
    let before = editing.policy[f[0]];
    if (before === undefined) { before = null; }
    if (f[2] === "time" && value !== null && before !== null && value === iso(before)) { return; }
    if (JSON.stringify(value) !== JSON.stringify(before)) { change[f[0]] = value; }
  });
  const label = $("key-label").value.trim() || null;
  if (!editing) {
    change.name = $("key-name").value.trim();
    if (label) { change.label = label; }
    api("POST", "keys", change).then((data) => {
      show($("key-form-panel"), false);
      showSecret(data.key.name, data.secret);
      msg.say("Key " + change.name + " issued; it serves from its first request.", "ok");
      return refresh();
    }).catch(msg.fail);
    return;
  }
  if (label !== (editing.label || null)) { change.label = label; }
  const name = editing.name;
  if (!Object.keys(change).length) { show($("key-form-panel"), false); return; }
  api("PATCH", "keys/" + encodeURIComponent(name), change).then((data) => {
    show($("key-form-panel"), false);
    editing = null;
    msg.say("Key " + name + " changed: " + data.changed.join(", ") + ".", "ok");
    return refresh();
  }).catch(msg.fail);
}

function showSecret(name, secret) {
  $("key-secret-panel-title").textContent = "New key " + name;
  $("key-secret").value = secret;
  $("key-copy-status").textContent = "";
  show($("key-secret-panel"), true);
  $("key-secret").focus();
  $("key-secret").select();
}

function copySecret() {
  const field = $("key-secret"), secret = field.value;
  if (!secret) { return; }
  const done = () => { $("key-copy-status").textContent = "copied"; };
  const fallback = () => {
    field.focus();
    field.select();
    try { if (document.execCommand("copy")) { done(); return; } } catch (e) { /* below */ }
    $("key-copy-status").textContent = "select it and press Ctrl+C";
  };
  if (navigator.clipboard && navigator.clipboard.writeText) { navigator.clipboard.writeText(secret).then(done, fallback); } else { fallback(); }
}

function closeSecret() {
  $("key-secret").value = "";
  $("key-copy-status").textContent = "";
  show($("key-secret-panel"), false);
  document.body.setAttribute("data-secret-closed", "1");
}

export default {id: "keys", title: "Keys", build, refresh, refreshMs: 3000};
