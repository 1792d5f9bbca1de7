// The console: sign-in (an operator's name and password, OIDC, or the
// admin key: auth.js), the section list, navigation and polling. Each
// section is a module (sections/*.js) exporting {id, title, build(root,
// ctx), refresh(ctx), refreshMs}; adding a section is one entry in
// SECTIONS. Only the section shown polls (plus the small header status), so
// an open tab costs the relay little.
"use strict";
import * as auth from "./auth.js";
import {api, onUnauthorised} from "./api.js";
import {$, el, put, show, setServerNow} from "./dom.js";
import overview from "./sections/overview.js";
import accounts from "./sections/accounts.js";
import keys from "./sections/keys.js";
import requests from "./sections/requests.js";
import usage from "./sections/usage.js";
import settings from "./sections/settings.js";
import audit from "./sections/audit.js";
import operators from "./sections/operators.js";

export const SECTIONS = [overview, accounts, keys, requests, usage, settings, audit, operators];

let current = null, timer = null, started = false;
const built = new Set();

// What sections share: the accounts view (read at most once a second).
let accountsCache = null, accountsAt = 0, accountsPending = null;
const ctx = {
  api,
  accounts(fresh) {
    if (!fresh && accountsCache && Date.now() - accountsAt < 1000) { return Promise.resolve(accountsCache); }
    if (accountsPending) { return accountsPending; }
    accountsPending = api("GET", "accounts").then((data) => {
      setServerNow(data.now);
      accountsCache = data;
      accountsAt = Date.now();
      document.body.setAttribute("data-loaded", "1");
      return data;
    }).finally(() => { accountsPending = null; });
    return accountsPending;
  },
  go(id) { navigate(id); },
  status(text) { $("status").textContent = text; },
};

function sectionOf(id) { return SECTIONS.find((s) => s.id === id) || SECTIONS[0]; }

function navigate(id) {
  const s = sectionOf(id);
  if (location.hash !== "#" + s.id) {
    try { history.replaceState(null, "", "#" + s.id); } catch (e) { /* keep */ }
  }
  current = s;
  SECTIONS.forEach((x) => {
    show($("section-" + x.id), x === s);
    $("nav-" + x.id).classList.toggle("active", x === s);
    $("nav-" + x.id).setAttribute("aria-current", x === s ? "page" : "false");
  });
  if (!built.has(s.id)) { s.build($("section-" + s.id), ctx); built.add(s.id); }
  document.body.setAttribute("data-section", s.id);
  poll();
}

function poll() {
  if (timer) { clearTimeout(timer); timer = null; }
  if (!auth.signedIn() || !current) { return; }
  const s = current;
  new Promise((resolve) => resolve(s.refresh(ctx))).then(() => {
    ctx.status("updated " + new Date().toLocaleTimeString());
  }).catch((e) => {
    if (e && e.status !== 401) { ctx.status("error: " + e.message); }
  }).then(() => {
    if (current === s && auth.signedIn()) { timer = setTimeout(poll, s.refreshMs || 5000); }
  });
}

function showLogin(message) {
  if (timer) { clearTimeout(timer); timer = null; }
  // Nothing read with the old credential stays in the page.
  SECTIONS.forEach((x) => { $("section-" + x.id).textContent = ""; });
  built.clear();
  accountsCache = null;
  show($("dashboard"), false);
  show($("nav"), false);
  show($("logout"), false);
  show($("login"), true);
  $("login-error").textContent = message || "";
  ctx.status("not signed in");
}

function start(section) {
  show($("login"), false);
  show($("dashboard"), true);
  show($("nav"), true);
  show($("logout"), true);
  if (!started) {
    started = true;
    window.addEventListener("hashchange", () => {
      const id = location.hash.replace(/^#/, "");
      if (id && (!current || id !== current.id) && SECTIONS.some((s) => s.id === id)) { navigate(id); }
    });
  }
  navigate(section || (current && current.id) || "overview");
}

function buildShell() {
  const nav = $("nav");
  SECTIONS.forEach((s) => {
    const a = el("a", {href: "#" + s.id, id: "nav-" + s.id, "data-section": s.id}, s.title);
    a.addEventListener("click", (ev) => { ev.preventDefault(); navigate(s.id); });
    nav.appendChild(a);
    $("dashboard").appendChild(el("section", {id: "section-" + s.id, "class": "view hidden",
                                              "aria-label": s.title}));
  });
  const form = $("login-form");
  auth.form.fields.forEach((f) => {
    form.insertBefore(put(el("label", {"for": f.id}, f.label)), $("login-error"));
    form.insertBefore(el("input", {id: f.id, type: f.type, name: f.id,
                                   required: f.required === false ? undefined : "required",
                                   autocomplete: "off"}), $("login-error"));
  });
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const values = {};
    auth.form.fields.forEach((f) => { values[f.id] = $(f.id).value; $(f.id).value = ""; });
    auth.form.submit(values).then(() => start(location.hash.replace(/^#/, "")),
                                  (e) => showLogin(e.message));
  });
  // An operator may sign in through OIDC when the relay offers it.
  const oidc = el("a", {id: "login-oidc", href: "/auth/oidc/start", "class": "hidden"},
                  "Sign in with OIDC");
  form.parentNode.appendChild(oidc);
  $("logout").addEventListener("click", () => { auth.signOut().then(() => showLogin("")); });
  onUnauthorised(() => {
    if (!$("login").classList.contains("hidden")) { return; }  // already said why
    const message = auth.who() && auth.who().via !== "admin_key" ? "Your session has ended; sign in again"
      : "Invalid admin key";
    auth.signOut();
    showLogin(message);
  });
}

buildShell();
const fromFragment = auth.takeFragment();
if (auth.key()) {
  start(fromFragment || location.hash.replace(/^#/, ""));  // the admin key: no session to ask for
} else {
  auth.restore().then(() => {
    show($("login-oidc"), auth.oidc());
    if (auth.signedIn()) { start(fromFragment || location.hash.replace(/^#/, "")); } else { showLogin(""); }
  });
}
