// DOM and formatting helpers every section uses.
"use strict";

export function $(id) { return document.getElementById(id); }

export function el(tag, attrs, text) {
  const node = document.createElement(tag);
  Object.keys(attrs || {}).forEach((k) => {
    if (attrs[k] !== undefined && attrs[k] !== null) { node.setAttribute(k, attrs[k]); }
  });
  if (text !== undefined && text !== null) { node.textContent = String(text); }
  return node;
}

// Append children (nodes or text; null skipped) to node; returns node.
export function put(node, ...children) {
  children.forEach((c) => {
    if (c === null || c === undefined || c === false) { return; }
    node.appendChild(c instanceof Node ? c : document.createTextNode(String(c)));
  });
  return node;
}

export function button(label, cls, onClick, attrs) {
  const b = el("button", Object.assign({type: "button", "class": cls}, attrs || {}), label);
  b.addEventListener("click", onClick);
  return b;
}

export function show(node, visible) { node.classList.toggle("hidden", !visible); }

// Sections re-render their tables every few seconds. A click is a press
// and a release on one element: a re-render between the two would replace
// the element and lose the click. So a periodic render waits while a button
// is held and runs once it is released (at most PRESS_MS later).
const PRESS_MS = 10000;
let pressedAt = 0, afterRelease = [];
function released() {
  if (!pressedAt) { return; }
  pressedAt = 0;
  const due = afterRelease;
  afterRelease = [];
  setTimeout(() => due.forEach((fn) => fn()), 0);
}
document.addEventListener("pointerdown", () => { pressedAt = Date.now(); }, true);
document.addEventListener("pointerup", released, true);
document.addEventListener("pointercancel", released, true);
window.addEventListener("blur", released);

export function settled(fn) {
  if (pressedAt && Date.now() - pressedAt > PRESS_MS) { pressedAt = 0; afterRelease = []; }
  if (!pressedAt) { fn(); return; }
  afterRelease.push(fn);
}

// Destructive actions take a second click within CONFIRM_S seconds. What
// is armed lives here, keyed by action and target, not in the button: a
// re-render draws the armed button again ("Confirm ...") until it is used
// or the time runs out.
const CONFIRM_S = 8;
const armed = new Map();

export function isArmed(what) {
  const until = armed.get(what);
  if (until && until > Date.now()) { return true; }
  armed.delete(what);
  return false;
}

// A button running run() on its second click. labels: [label, armed label].
export function confirmButton(what, labels, cls, run, rerender) {
  const sure = isArmed(what);
  const b = button(sure ? labels[1] : labels[0], cls + (sure ? " armed" : ""), () => {
    if (isArmed(what)) {
      armed.delete(what);
      run();
    } else {
      armed.set(what, Date.now() + CONFIRM_S * 1000);
      rerender();
      setTimeout(rerender, CONFIRM_S * 1000 + 50);
    }
  });
  b.setAttribute("data-armed", sure ? "1" : "0");
  return b;
}

// say(text, kind) and fail(error) writing into the message box boxId.
export function messages(boxId) {
  function say(text, kind) {
    const box = $(boxId);
    box.textContent = text || "";
    box.className = "msg " + (kind || "");
  }
  return {say, fail: (e) => say(e.message, "error")};
}

// Money in dollars: never rounds a non-zero amount to $0.00 (a $0.001
// budget is "$0.001").
export function dollars(usd) {
  if (typeof usd !== "number" || !isFinite(usd)) { return ""; }
  if (usd === 0) { return "$0.00"; }
  const abs = Math.abs(usd);
  if (abs < 0.000005) { return "$" + Number(usd.toPrecision(2)).toString(); }
  return "$" + usd.toFixed(abs >= 1 ? 2 : abs >= 0.01 ? 4 : 5);
}

export function tokens(n) { return typeof n === "number" ? n.toLocaleString("en-US") : ""; }

export function duration(seconds) {
  seconds = Math.max(0, Math.round(seconds));
  if (seconds < 60) { return seconds + "s"; }
  const m = Math.floor(seconds / 60), s = seconds % 60;
  if (m < 60) { return m + "m" + (s ? " " + s + "s" : ""); }
  const h = Math.floor(m / 60);
  if (h < 48) { return h + "h " + (m % 60) + "m"; }
  return Math.floor(h / 24) + "d " + (h % 24) + "h";
}

let clockOffset = 0;  // server seconds - browser seconds
export function setServerNow(now) { if (typeof now === "number") { clockOffset = now - Date.now() / 1000; } }
export function now() { return Date.now() / 1000 + clockOffset; }

export function until(t) {
  if (!t) { return ""; }
  const left = t - now();
  return left > 0 ? "in " + duration(left) : "now";
}

export function ago(t) {
  if (!t) { return ""; }
  const s = now() - t;
  return s >= 0 ? duration(s) + " ago" : "just now";
}

export function iso(t) { return t ? new Date(t * 1000).toISOString().replace(/\.\d+Z$/, "Z") : ""; }

export function ms(v) {
  if (v === null || v === undefined) { return "–"; }
  return v >= 1000 ? (v / 1000).toFixed(v >= 10000 ? 0 : 1) + " s" : Math.round(v) + " ms";
}

// A progress bar: used of limit, with its text (what is left) under it.
export function meter(used, limit, text, cls) {
  const box = el("div", {"class": "meter-box " + (cls || "")});
  const bar = el("div", {"class": "meter"});
  const pct = limit > 0 ? Math.min(100, 100 * used / limit) : (used > 0 ? 100 : 0);
  const fill = el("span", {"class": "fill" + (pct >= 90 ? " high" : pct >= 70 ? " mid" : "")});
  fill.style.width = pct.toFixed(1) + "%";
  bar.appendChild(fill);
  box.appendChild(bar);
  box.setAttribute("data-percent", pct.toFixed(0));
  if (text) { box.appendChild(el("span", {"class": "meter-text"}, text)); }
  return box;
}

export function listOf(text) {
  const items = (text || "").split(",").map((s) => s.trim()).filter(Boolean);
  return items.length ? items : null;
}
