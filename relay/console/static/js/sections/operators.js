// Operators: who may use this console and with which role (owner, admin,
// viewer). Add one (a password, or an e-mail for OIDC only), change a
// role, reset a password, sign one out everywhere, remove one. The server
// decides what each role may do (a viewer changes nothing; only an owner
// manages owners): this section only shows its answers.
"use strict";
import {el, put, button, confirmButton, messages, iso, settled} from "../dom.js";
import {api} from "../api.js";
import {makeTable} from "../table.js";
import {input, select, fields, buttons} from "../forms.js";

const ROLES = [["viewer", "viewer"], ["admin", "admin"], ["owner", "owner"]];
let table = null, msg = null, me = null, rerender = () => {};

function canManage(o) {
  if (!me || me.role === "viewer") { return false; }
  return o.source === "admin" && (me.role === "owner" || o.role !== "owner");
}

function actions(o) {
  const box = el("span", {"class": "row-buttons"});
  if (!canManage(o)) { return put(box, o.source === "file" ? "in the file" : "–"); }
  const role = el("select", {"class": "op-role", "aria-label": "role of " + o.name, "data-operator": o.name});
  ROLES.filter((r) => me.role === "owner" || r[0] !== "owner")
    .forEach((r) => role.appendChild(el("option", {value: r[0]}, r[1])));
  role.value = o.role;
  role.addEventListener("change", () => change(o.name, {role: role.value}, "role of " + o.name + " is now " + role.value));
  put(box, role,
      button("Reset password", "op-reset", () => {
        const password = window.prompt("New password for " + o.name + " (at least 12 characters)");
        if (password) { change(o.name, {password}, "password of " + o.name + " reset; their sessions ended"); }
      }, {"data-operator": o.name}),
      button("Sign out", "op-signout", () => run(api("POST", "operators/" + encodeURIComponent(o.name) + "/signout"),
                                                 (r) => o.name + ": " + r.ended + " session(s) ended"), {"data-operator": o.name}),
      confirmButton("remove-op:" + o.name, ["Remove", "Confirm remove"], "op-remove danger",
                    () => run(api("DELETE", "operators/" + encodeURIComponent(o.name)), () => o.name + " removed"), () => rerender()));
  return box;
}

function run(promise, text) {
  return promise.then((r) => { msg.say(text(r), "ok"); return refresh(); }).catch((e) => msg.fail(e));
}

function change(name, body, text) {
  return run(api("PATCH", "operators/" + encodeURIComponent(name), body), () => text);
}

function build(root) {
  root.appendChild(el("h2", null, "Operators"));
  const who = el("p", {id: "op-me", "class": "muted"});
  root.appendChild(who);
  root.appendChild(el("div", {id: "op-msg", "class": "msg", role: "status"}));
  msg = messages("op-msg");
  const form = el("form", {id: "op-add", autocomplete: "off"});
  put(form, el("h3", null, "Add an operator"),
      fields(input("Name", "op-name", {required: "required"}), select("Role", "op-new-role", ROLES),
             input("Password", "op-password", {type: "password", autocomplete: "new-password"}),
             input("E-mail (OIDC)", "op-email", {type: "email"})),
      buttons(el("button", {type: "submit", id: "op-add-submit"}, "Add")));
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const body = {name: form.querySelector("#op-name").value.trim(), role: form.querySelector("#op-new-role").value};
    const password = form.querySelector("#op-password").value, email = form.querySelector("#op-email").value.trim();
    if (password) { body.password = password; }
    if (email) { body.email = email; }
    form.querySelector("#op-password").value = "";
    run(api("POST", "operators", body), (r) => r.operator.name + " added as " + r.operator.role)
      .then(() => { form.querySelector("#op-name").value = ""; form.querySelector("#op-email").value = ""; });
  });
  root.appendChild(form);
  table = makeTable({
    id: "operators", csv: "operators", empty: "no operators", rowKey: (o) => o.name, sortBy: "name",
    rowAttrs: (o) => ({"class": "operator-row", "data-operator": o.name, "data-role": o.role}),
    columns: [
      {id: "name", title: "Name", width: "16%"},
      {id: "role", title: "Role", width: "10%"},
      {id: "source", title: "From", width: "8%"},
      {id: "signin", title: "Signs in with", width: "16%",
       value: (o) => [o.password ? "password" : "", o.email ? "OIDC " + o.email : ""].filter(Boolean).join(" · ")},
      {id: "added", title: "Added", width: "16%", value: (o) => o.created_by ? (o.created_by + " " + iso(o.created_at)) : "–"},
      {id: "actions", title: "", sort: false, value: () => "", render: actions},
    ],
  });
  root.appendChild(table.root);
  rerender = () => table.draw();
  root.__who = who;
  root.__form = form;
}

let rootNode = null;
function refresh() {
  return api("GET", "operators").then((data) => settled(() => {
    me = data.me;
    rootNode = rootNode || document.getElementById("section-operators");
    if (rootNode && rootNode.__who) {
      rootNode.__who.textContent = "Signed in as " + me.name + " (" + me.role + (me.via === "admin_key" ? ", the admin key" : "") + ")";
      rootNode.__form.classList.toggle("hidden", me.role === "viewer");
    }
    table.setRows(data.operators || []);
    document.body.setAttribute("data-operators-loaded", "1");
  }));
}

export default {id: "operators", title: "Operators", build, refresh, refreshMs: 10000};
