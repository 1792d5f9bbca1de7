// Adding an account (API key, or a ChatGPT login by browser paste-back or
// device code) and the login panel. A paste the relay cannot use leaves
// the login open: the panel says why and keeps Complete and Cancel.
"use strict";
import {$, el, put, button, show, until} from "../dom.js";
import {api} from "../api.js";
import {input, select, fields, buttons, panel, WS_MODES} from "../forms.js";

const LOGIN_POLL_MS = 1000;
let login = null, loginTimer = null, reloginFor = null, say = null, reload = null;

export function buildAdd(root, hooks) {
  say = hooks.say;
  reload = hooks.reload;
  const add = panel("add-panel", "Add an account", put(el("form", {id: "add-form", autocomplete: "off"}),
    fields(
      select("Kind", "add-kind", [["apikey", "API key"], ["login", "ChatGPT login"]]),
      input("Id", "add-id", {required: "required", placeholder: "e.g. team-b"}),
      input("Label", "add-label", {placeholder: "optional"}),
      input("Priority", "add-priority", {type: "number", value: "50"}),
      input("Slots (concurrency)", "add-concurrency", {type: "number", value: "3"}),
      input("Models", "add-models", {placeholder: "all, or gpt-5.5, ..."}),
      input("Proxy", "add-proxy", {placeholder: "direct, a proxy id or URL"}),
      select("WebSocket mode", "add-ws", WS_MODES),
      input("API key", "add-key", {type: "password", autocomplete: "new-password"}, "apikey-only"),
      input("Base URL", "add-base", {placeholder: "https://api.openai.com/v1"}, "apikey-only"),
      select("Login flow", "add-flow", [["browser", "browser (paste the address back)"],
                                        ["device", "device code (headless)"]], "login-only hidden"),
      input("Base URL", "add-obase", {placeholder: "https://chatgpt.com/backend-api/codex"}, "login-only hidden"),
      input("Auth base URL", "add-auth", {placeholder: "https://auth.openai.com"}, "login-only hidden")),
    buttons(el("button", {id: "add-submit", type: "submit"}, "Add"),
            button("Cancel", "", () => show($("add-panel"), false), {id: "add-cancel"}))));
  const lp = panel("login-panel", "ChatGPT login",
    put(el("div", {id: "login-chooser", "class": "row-buttons hidden"}),
      button("Browser login", "", () => startRelogin("browser"), {id: "relogin-browser"}),
      button("Device code login", "", () => startRelogin("device"), {id: "relogin-device"}),
      button("Cancel", "login-cancel", cancelLogin)),
    put(el("div", {id: "login-browser", "class": "hidden"}),
      put(el("p"), "1. Open ", el("a", {id: "login-url", "class": "break", href: "#", target: "_blank",
        rel: "noopener noreferrer"}, "the sign-in page"), " in any browser and sign in."),
      put(el("p"), "2. The browser is then sent to ", el("code", null, "localhost:1455"),
        " (the page does not load): copy the whole address from its address bar and paste it here (or just the code)."),
      el("textarea", {id: "login-paste", placeholder: "http://localhost:1455/auth/callback?code=...&state=..."}),
      el("p", {id: "login-paste-error", "class": "bad", role: "alert"}),
      buttons(button("Complete login", "", completeLogin, {id: "login-complete"}),
              button("Cancel login", "login-cancel", cancelLogin))),
    put(el("div", {id: "login-device", "class": "hidden"}),
      put(el("p"), "Open ", el("a", {id: "device-url", "class": "break", href: "#", target: "_blank",
        rel: "noopener noreferrer"}), " on any device and enter this code:"),
      el("p", {id: "device-code", "class": "usercode"}),
      buttons(button("Cancel login", "login-cancel", cancelLogin))),
    el("p", {id: "login-status", "class": "sub"}),
    el("p", {id: "login-warnings", "class": "warn", role: "alert"}),
    buttons(button("Close", "", closeLogin, {id: "login-close", "class": "hidden"})));
  root.appendChild(add);
  root.appendChild(lp);
  $("add-kind").addEventListener("change", kindChanged);
  $("add-form").addEventListener("submit", submitAdd);
  kindChanged();
}

export function openAdd() { show($("add-panel"), true); $("add-id").focus(); }

function kindChanged() {
  const isLogin = $("add-kind").value === "login";
  document.querySelectorAll(".apikey-only").forEach((n) => show(n, !isLogin));
  document.querySelectorAll(".login-only").forEach((n) => show(n, isLogin));
  $("add-submit").textContent = isLogin ? "Start login" : "Add";
}

function intOf(id) {
  const v = $(id).value.trim();
  return v === "" ? undefined : Number(v);
}

export function proxyInto(target, value) {
  value = (value || "").trim();
  if (!value) { return; }
  if (value === "direct") { target.proxy = null; }
  else if (value.indexOf("://") >= 0) { target.proxy = value; }
  else { target.proxy_id = value; }
}

function warningsText(w) {
  return (w || []).map((x) => "Warning: " + x.message).join(" ");
}

function submitAdd(ev) {
  ev.preventDefault();
  const spec = {id: $("add-id").value.trim()};
  if ($("add-label").value.trim()) { spec.label = $("add-label").value.trim(); }
  ["priority", "concurrency"].forEach((k) => { const v = intOf("add-" + k); if (v !== undefined) { spec[k] = v; } });
  const models = $("add-models").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (models.length) { spec.models = models; }
  if ($("add-ws").value) { spec.ws_mode = $("add-ws").value; }
  proxyInto(spec, $("add-proxy").value);
  let done;
  if ($("add-kind").value === "apikey") {
    spec.type = "apikey";
    spec.api_key = $("add-key").value;
    if ($("add-base").value.trim()) { spec.base_url = $("add-base").value.trim(); }
    done = api("POST", "accounts", spec).then((data) => {
      $("add-key").value = "";
      show($("add-panel"), false);
      say(("Account " + data.account.id + " added; it serves from the next turn. " +
           warningsText(data.warnings)).trim(), data.warnings && data.warnings.length ? "warn" : "ok");
      return reload();
    });
  } else {
    if ($("add-obase").value.trim()) { spec.base_url = $("add-obase").value.trim(); }
    if ($("add-auth").value.trim()) { spec.auth_base_url = $("add-auth").value.trim(); }
    done = api("POST", "logins", {flow: $("add-flow").value, account: spec}).then((data) => {
      show($("add-panel"), false);
      showLogin(data.login, "New ChatGPT account " + spec.id);
    });
  }
  done.catch((e) => say(e.message, "error"));
}

function stopPolling() { if (loginTimer) { clearInterval(loginTimer); loginTimer = null; } }

function setStatus(status) { $("login-panel").setAttribute("data-login-status", status); }

function showLogin(l, title) {
  login = l;
  stopPolling();
  show($("login-panel"), true);
  $("login-panel-title").textContent = title + ": " + (l.flow === "device" ? "device code" : "browser") + " login";
  show($("login-browser"), l.flow === "browser");
  show($("login-device"), l.flow === "device");
  show($("login-chooser"), false);
  show($("login-close"), false);
  $("login-paste").value = "";
  $("login-paste-error").textContent = "";
  $("login-warnings").textContent = "";
  if (l.flow === "browser") {
    $("login-url").href = l.authorize_url;
  } else {
    $("device-url").href = l.verification_url;
    $("device-url").textContent = l.verification_url;
    $("device-code").textContent = l.user_code;
  }
  $("login-status").textContent = "waiting for the sign-in (expires " + until(l.expires_at) + ")";
  setStatus("pending");
  loginTimer = setInterval(pollLogin, LOGIN_POLL_MS);
}

function loginEnded(l, message, kind) {
  stopPolling();
  setStatus(l ? l.status : "failed");
  $("login-status").textContent = message;
  $("login-warnings").textContent = warningsText(l && l.warnings);
  show($("login-browser"), false);
  show($("login-device"), false);
  show($("login-close"), true);
  const warned = l && l.warnings && l.warnings.length;
  say((message + " " + warningsText(l && l.warnings)).trim(), warned && kind === "ok" ? "warn" : kind);
  reload();
}

function describeEnd(l) {
  if (l.status === "completed") {
    return ["Logged in: account " + l.account_id + (l.plan ? " (" + l.plan + ")" : "") +
            " serves from the next turn.", "ok"];
  }
  const why = l.error && l.error.message ? l.error.message : l.status;
  return ["Login " + l.status + ": " + why + ". No account was changed.", "error"];
}

function pollLogin() {
  if (!login) { return; }
  api("GET", "logins/" + encodeURIComponent(login.id)).then((data) => {
    const l = data.login;
    if (l.status === "pending" || l.status === "exchanging") { return; }
    const end = describeEnd(l);
    loginEnded(l, end[0], end[1]);
  }).catch(() => {});
}

function completeLogin() {
  if (!login) { return; }
  const pasted = $("login-paste").value.trim();
  const body = pasted.indexOf("=") >= 0 || pasted.indexOf("://") >= 0 ? {redirect_url: pasted} : {code: pasted};
  $("login-paste-error").textContent = "";
  api("POST", "logins/" + encodeURIComponent(login.id) + "/complete", body).then((data) => {
    const l = data.login || {status: "completed", account_id: login.account_id};
    const end = describeEnd(l);
    loginEnded(Object.assign({}, l, {warnings: data.warnings || l.warnings}), end[0], end[1]);
  }).catch((e) => {
    const l = e.body && e.body.login;
    const open = l ? l.status === "pending" || l.status === "exchanging"
      : !!(e.body && e.body.error && e.body.error.code === "no_code");
    if (open) {
      // The login is still open: say why, keep Complete and Cancel.
      $("login-paste-error").textContent = "That did not work: " + e.message +
        ". Paste the whole address again, or cancel the login.";
      setStatus("retry");
      return;
    }
    loginEnded(l || null, "Login failed: " + e.message, "error");
  });
}

function cancelLogin() {
  if (!login) { show($("login-panel"), false); setStatus("closed"); return; }
  const id = login.id;
  api("POST", "logins/" + encodeURIComponent(id) + "/cancel", {})
    .catch((e) => e.status === 404 || e.status === 405 ? api("DELETE", "logins/" + encodeURIComponent(id)) : null)
    .catch(() => {}).then(() => {
      stopPolling();
      login = null;
      show($("login-panel"), false);
      setStatus("cancelled");
      say("Login cancelled.", "");
    });
}

function closeLogin() { login = null; show($("login-panel"), false); }

export function openRelogin(a) {
  reloginFor = a.id;
  stopPolling();
  login = null;
  show($("login-panel"), true);
  $("login-panel-title").textContent = "Log " + a.id + " in again";
  show($("login-browser"), false);
  show($("login-device"), false);
  show($("login-close"), false);
  show($("login-chooser"), true);
  $("login-status").textContent = "";
  $("login-warnings").textContent = "";
  setStatus("choosing");
}

function startRelogin(flow) {
  const id = reloginFor;
  api("POST", "accounts/" + encodeURIComponent(id) + "/login", {flow}).then((data) => {
    showLogin(data.login, "Account " + id);
  }).catch((e) => say(e.message, "error"));
}
