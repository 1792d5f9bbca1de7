// How the page proves who it is to the admin API, one of two ways:
//  - an operator's session (docs/security.md "Console sessions"): name and
//    password (or OIDC) open a server-side session whose cookie the browser
//    keeps (HttpOnly: this script never sees it); every change carries the
//    session's CSRF token in X-CSRF-Token;
//  - the admin key (automation, or a person who holds it), given once in the
//    address (#key=...) or typed into the sign-in form and kept in
//    sessionStorage, sent as Authorization: Bearer.
// Everything that sends a request asks this module for its headers.
"use strict";

const STORAGE = "relay.adminKey";
let memoryKey = null;
let session = null;      // {operator: {name, role, via}, csrf_token, expires_at}
let methods = ["password"];

export function key() {
  try { return sessionStorage.getItem(STORAGE) || memoryKey; } catch (e) { return memoryKey; }
}

export function setKey(value) {
  memoryKey = value || null;
  try {
    if (value) { sessionStorage.setItem(STORAGE, value); } else { sessionStorage.removeItem(STORAGE); }
  } catch (e) { /* storage disabled: in memory only */ }
}

// A key passed as #key=... (alone or beside a section name, #accounts&key=...)
// is stored and dropped from the address bar; the section stays.
// Returns the section named in the fragment, or "".
export function takeFragment() {
  const parts = (location.hash || "").replace(/^#/, "").split("&").filter(Boolean);
  let section = "", found = false;
  parts.forEach((p) => {
    if (p.indexOf("key=") === 0) { setKey(decodeURIComponent(p.slice(4))); found = true; }
    else if (p.indexOf("=") < 0) { section = p; }
  });
  if (found) {
    try {
      history.replaceState(null, "", location.pathname + location.search + (section ? "#" + section : ""));
    } catch (e) { /* keep the address */ }
  }
  return section;
}

// Ask the server whether this browser holds a session (the cookie is
// HttpOnly), and which sign-in methods it offers. Resolves either way.
export function restore() {
  return fetch("/auth/session", {credentials: "same-origin", cache: "no-store"})
    .then((r) => r.json().then((d) => {
      methods = (d && d.methods) || methods;
      session = r.ok ? d : null;
    }))
    .catch(() => { session = null; });
}

export function signedIn() { return !!key() || !!session; }

// Who is signed in: {name, role, via}; the admin key acts as an owner.
export function who() {
  if (key()) { return {name: "admin-key", role: "owner", via: "admin_key"}; }
  return session ? session.operator : null;
}

export function oidc() { return methods.indexOf("oidc") >= 0; }

export function signOut() {
  setKey(null);
  if (!session) { return Promise.resolve(); }
  const csrf = session.csrf_token;
  session = null;
  return fetch("/auth/signout", {method: "POST", credentials: "same-origin",
                                 headers: {"X-CSRF-Token": csrf}}).catch(() => {});
}

// The fetch options that carry the credential.
export function requestInit() {
  if (key()) { return {credentials: "omit", headers: {"Authorization": "Bearer " + key()}}; }
  return {credentials: "same-origin", headers: session ? {"X-CSRF-Token": session.csrf_token} : {}};
}

function refused(r, d) {
  const e = new Error((d && d.error && d.error.message) || ("HTTP " + r.status));
  e.status = r.status;
  return e;
}

// The sign-in form's fields: [{id, label, type, required}] and what to do
// with them: a name and password, or the admin key.
export const form = {
  fields: [{id: "signin-name", label: "Name", type: "text", required: false},
           {id: "signin-password", label: "Password", type: "password", required: false},
           {id: "admin-key", label: "or the admin key", type: "password", required: false}],
  submit(values) {
    const adminKey = (values["admin-key"] || "").trim();
    if (adminKey) { session = null; setKey(adminKey); return Promise.resolve(); }
    const body = {name: (values["signin-name"] || "").trim(), password: values["signin-password"] || ""};
    return fetch("/auth/signin", {method: "POST", credentials: "same-origin", cache: "no-store",
                                  headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)})
      .then((r) => r.json().catch(() => ({})).then((d) => {
        if (!r.ok) { throw refused(r, d); }
        setKey(null);
        session = d;
      }));
  },
};
