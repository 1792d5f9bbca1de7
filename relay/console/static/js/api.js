// Requests to the admin API (relative to /admin/), with the credential
// from auth.js. An error answer rejects with the API's message; e.status
// is the HTTP status (401: the credential is refused).
"use strict";
import * as auth from "./auth.js";

const unauthorised = [];

export function onUnauthorised(fn) { unauthorised.push(fn); }

export function send(method, path, body) {
  const init = auth.requestInit();
  init.method = method;
  init.cache = "no-store";
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  return fetch(path, init);
}

export function api(method, path, body) {
  return send(method, path, body).then((resp) =>
    resp.json().catch(() => ({})).then((data) => {
      if (!resp.ok) {
        const e = new Error((data && data.error && data.error.message) || ("HTTP " + resp.status));
        e.status = resp.status;
        e.body = data;
        if (resp.status === 401) { unauthorised.forEach((fn) => fn(e)); }
        throw e;
      }
      return data;
    }));
}

export function get(path) { return api("GET", path); }

// A GET that answers fallback on a 404 (a route this relay does not have).
export function getOr(path, fallback) {
  return get(path).catch((e) => { if (e.status === 404) { return fallback; } throw e; });
}

// Fetch a CSV export of the API (format=csv) with the credential and hand
// it to the browser as a download named name.
export function download(path, name) {
  return send("GET", path).then((resp) => {
    if (!resp.ok) { const e = new Error("HTTP " + resp.status); e.status = resp.status; throw e; }
    return resp.blob();
  }).then((blob) => {
    const url = URL.createObjectURL(blob);
    const a = document.createElement("a");
    a.href = url;
    a.download = name;
    a.className = "hidden";
    document.body.appendChild(a);
    a.click();
    setTimeout(() => { URL.revokeObjectURL(url); a.remove(); }, 1000);
  });
}
