// How the page proves who it is to the admin API: today the admin key,
// given once in the address (#key=...) or typed into the sign-in form and
// kept in sessionStorage. Everything that sends a request asks this module
// for its headers, so another way of signing in (operator sessions) only
// replaces this file.
"use strict";

const STORAGE = "relay.adminKey";
let memoryKey = null;

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

export function signedIn() { return !!key(); }

export function signOut() { setKey(null); }

// The fetch options that carry the credential.
export function requestInit() {
  return {credentials: "omit", headers: {"Authorization": "Bearer " + key()}};
}

// The sign-in form's fields: [{id, label, type}] and what to do with them.
export const form = {
  fields: [{id: "admin-key", label: "Admin key", type: "password"}],
  submit(values) { setKey((values["admin-key"] || "").trim()); return Promise.resolve(); },
};
