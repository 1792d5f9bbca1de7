// Settings: the runtime settings (each one editable, saved as a partial
// PUT), account groups and model prices (add, change, delete).
"use strict";
import {$, el, put, button, show, confirmButton, messages, settled} from "../dom.js";
import {api, getOr} from "../api.js";
import {makeTable} from "../table.js";
import {input, fields, buttons, panel} from "../forms.js";

let msg = null, settingsTable = null, groupsTable = null, pricesTable = null, flat = [];
let editedSettings = {};

function flatten(obj, prefix, out) {
  Object.keys(obj || {}).sort().forEach((k) => {
    const v = obj[k], name = prefix ? prefix + "." + k : k;
    if (v && typeof v === "object" && !Array.isArray(v)) { flatten(v, name, out); } else { out.push({name, value: v}); }
  });
  return out;
}

function shownValue(v) { return v === null || v === undefined ? "" : typeof v === "object" ? JSON.stringify(v) : String(v); }

function parsed(text, before, type) {
  if (type === "integer" || type === "number" || typeof before === "number") { return Number(text); }
  if (type === "boolean" || typeof before === "boolean") { return text === "true"; }
  if (before === null || typeof before === "object") {
    if (text === "") { return null; }
    try { return JSON.parse(text); } catch (e) { return text; }
  }
  return text;
}

function settingInput(row) {
  const id = "setting-" + row.name.replace(/[^a-z0-9]+/gi, "-");
  let node;
  const choices = row.choices || (row.type === "boolean" || typeof row.value === "boolean" ? ["true", "false"] : null);
  if (choices) {
    node = el("select", {id, "class": "setting", "data-name": row.name});
    choices.forEach((v) => node.appendChild(el("option", {value: String(v)}, String(v))));
  } else {
    const numeric = row.type === "integer" || row.type === "number" || typeof row.value === "number";
    node = el("input", {id, "class": "setting", "data-name": row.name, type: numeric ? "number" : "text",
                        step: row.type === "integer" ? "1" : "any", min: row.minimum, max: row.maximum});
  }
  node.value = row.name in editedSettings ? editedSettings[row.name] : shownValue(row.value);
  node.addEventListener("input", () => { editedSettings[row.name] = node.value; });
  node.addEventListener("change", () => { editedSettings[row.name] = node.value; });
  return node;
}

function build(root) {
  msg = messages("settings-msg");
  root.appendChild(el("h2", null, "Runtime settings"));
  root.appendChild(el("div", {id: "settings-msg", "class": "msg", role: "status"}));
  settingsTable = makeTable({
    id: "settings-table", csv: "settings", empty: "no settings", rowKey: (r) => r.name,
    rowAttrs: (r) => ({"class": "setting-row", "data-name": r.name}),
    columns: [{id: "name", title: "Setting", width: "34%"},
              {id: "value", title: "Value", width: "26%", value: (r) => shownValue(r.value), render: settingInput, sort: false},
              {id: "range", title: "Range", value: (r) => [r.minimum !== undefined && r.minimum !== null ? r.minimum + " to " + (r.maximum !== null && r.maximum !== undefined ? r.maximum : "∞") : "",
                r.note || ""].filter(Boolean).join(" · ")}],
  });
  root.appendChild(settingsTable.root);
  root.appendChild(buttons(button("Save settings", "", saveSettings, {id: "settings-save"}),
                           button("Discard changes", "", () => { editedSettings = {}; settingsTable.draw(); }, {id: "settings-discard"})));

  root.appendChild(el("h2", null, "Account groups"));
  groupsTable = makeTable({
    id: "groups-table", csv: "groups", empty: "no groups", rowKey: (g) => g.name,
    rowAttrs: (g) => ({"class": "group-row", "data-group": g.name, "data-source": g.source}),
    columns: [{id: "name", title: "Group", width: "18%"},
              {id: "accounts", title: "Accounts", value: (g) => (g.accounts || []).join(", ")},
              {id: "keys", title: "Keys bound", width: "18%", value: (g) => (g.keys || []).join(", ")},
              {id: "source", title: "Source", width: "10%"},
              {id: "actions", title: "", width: "190px", sort: false, value: () => "", cls: "actions",
               render: (g) => g.source === "file" ? el("span", {"class": "sub"}, "in the file") : put(el("div"),
                 button("Edit", "group-edit", () => openGroup(g)),
                 confirmButton("group:delete:" + g.name, ["Delete", "Confirm delete"], "group-delete danger",
                   () => change("DELETE", "groups/" + encodeURIComponent(g.name), undefined, "Group " + g.name + " deleted."), () => groupsTable.draw()))}],
  });
  root.appendChild(groupsTable.root);
  root.appendChild(buttons(button("Add group", "", () => openGroup(null), {id: "group-open"})));
  root.appendChild(panel("group-panel", "Group", fields(input("Name", "group-name"),
    input("Accounts", "group-accounts", {placeholder: "a1, a2"}), input("Label", "group-label", {placeholder: "optional"})),
    buttons(button("Save", "", saveGroup, {id: "group-save"}), button("Cancel", "", () => show($("group-panel"), false), {id: "group-cancel"}))));

  root.appendChild(el("h2", null, "Prices (US dollars per 1M tokens)"));
  pricesTable = makeTable({
    id: "prices-table", csv: "prices", empty: "no prices", rowKey: (p) => p.model,
    rowAttrs: (p) => ({"class": "price-row", "data-model": p.model, "data-source": p.source}),
    columns: [{id: "model", title: "Model", width: "22%"},
              {id: "input", title: "Input", cls: "num"}, {id: "cached_input", title: "Cached input", cls: "num"},
              {id: "output", title: "Output", cls: "num"}, {id: "reasoning", title: "Reasoning", cls: "num"},
              {id: "per_call", title: "Per call", cls: "num"},
              {id: "source", title: "Source", width: "9%"},
              {id: "actions", title: "", width: "190px", sort: false, value: () => "", cls: "actions",
               render: (p) => put(el("div"), p.per_call === undefined ? button("Edit", "price-edit", () => openPrice(p)) : null,
                 p.source === "admin" ? confirmButton("price:delete:" + p.model, ["Delete", "Confirm delete"], "price-delete danger",
                   () => change("DELETE", "prices/" + encodeURIComponent(p.model), undefined, "Price of " + p.model + " deleted."), () => pricesTable.draw()) : null)}],
    filters: [{id: "source", title: "Source", options: [["", "any"], ["admin", "admin"], ["config", "config"], ["default", "default"]], test: (p, v) => p.source === v}],
  });
  root.appendChild(pricesTable.root);
  root.appendChild(buttons(button("Set a price", "", () => openPrice(null), {id: "price-open"})));
  root.appendChild(panel("price-panel", "Price", fields(input("Model", "price-model"),
    input("Input", "price-input", {type: "number", step: "any", min: "0"}),
    input("Cached input", "price-cached", {type: "number", step: "any", min: "0", placeholder: "as input"}),
    input("Output", "price-output", {type: "number", step: "any", min: "0"}),
    input("Reasoning", "price-reasoning", {type: "number", step: "any", min: "0", placeholder: "as output"})),
    buttons(button("Save", "", savePrice, {id: "price-save"}), button("Cancel", "", () => show($("price-panel"), false), {id: "price-cancel"}))));
}

function refresh() {
  return Promise.all([getOr("settings/schema", null), getOr("groups", {groups: []}), getOr("prices", {prices: {}})])
    .then(([schema, g, p]) => (schema ? Promise.resolve(schema.settings) : api("GET", "settings").then((s) => flatten(s, "", [])))
      .then((rows) => [rows, g, p]))
    .then(([rows, g, p]) => settled(() => {
      flat = rows;
      settingsTable.setRows(flat);
      groupsTable.setRows(g.groups || []);
      pricesTable.setRows(Object.keys(p.prices || {}).map((m) => Object.assign({model: m}, p.prices[m])));
      document.body.setAttribute("data-settings-loaded", "1");
    }));
}

function change(method, path, body, done) {
  return api(method, path, body).then(() => refresh()).then(() => msg.say(done, "ok")).catch(msg.fail);
}

function saveSettings() {
  const out = {};
  flat.forEach((r) => {
    if (!(r.name in editedSettings)) { return; }
    const v = parsed(editedSettings[r.name], r.value, r.type);
    if (JSON.stringify(v) !== JSON.stringify(r.value)) { out[r.name] = v; }
  });
  if (!Object.keys(out).length) { msg.say("Nothing changed.", ""); return; }
  api("PUT", "settings", out).then(() => {
    editedSettings = {};
    return refresh();
  }).then(() => msg.say("Settings saved: " + Object.keys(out).join(", ") + ".", "ok")).catch(msg.fail);
}

function openGroup(g) {
  $("group-panel-title").textContent = g ? "Edit group " + g.name : "Add a group";
  $("group-name").value = g ? g.name : "";
  $("group-name").disabled = !!g;
  $("group-accounts").value = g ? (g.accounts || []).join(", ") : "";
  $("group-label").value = g && g.label ? g.label : "";
  show($("group-panel"), true);
}

function saveGroup() {
  const name = $("group-name").value.trim();
  const body = {accounts: $("group-accounts").value.split(",").map((s) => s.trim()).filter(Boolean)};
  if ($("group-label").value.trim()) { body.label = $("group-label").value.trim(); }
  api("PUT", "groups/" + encodeURIComponent(name), body).then(() => {
    show($("group-panel"), false);
    return refresh();
  }).then(() => msg.say("Group " + name + " saved.", "ok")).catch(msg.fail);
}

function openPrice(p) {
  $("price-panel-title").textContent = p ? "Price of " + p.model : "Set a price";
  $("price-model").value = p ? p.model : "";
  $("price-input").value = p ? p.input : "";
  $("price-cached").value = p ? p.cached_input : "";
  $("price-output").value = p ? p.output : "";
  $("price-reasoning").value = p ? p.reasoning : "";
  show($("price-panel"), true);
}

function savePrice() {
  const model = $("price-model").value.trim(), body = {};
  [["input", "price-input"], ["cached_input", "price-cached"], ["output", "price-output"], ["reasoning", "price-reasoning"]]
    .forEach((f) => { const v = $(f[1]).value.trim(); if (v !== "") { body[f[0]] = Number(v); } });
  api("PUT", "prices/" + encodeURIComponent(model), body).then(() => {
    show($("price-panel"), false);
    return refresh();
  }).then(() => msg.say("Price of " + model + " saved.", "ok")).catch(msg.fail);
}

export default {id: "settings", title: "Settings", build, refresh, refreshMs: 15000};
