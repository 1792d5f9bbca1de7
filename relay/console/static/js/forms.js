// Small form builders: a labelled input or select inside a .fields grid.
"use strict";
import {el, put} from "./dom.js";

// input(label, id, attrs) -> <label>label <input id=...></label>
export function input(label, id, attrs, cls) {
  return put(el("label", cls ? {"class": cls} : null, label + " "),
             el("input", Object.assign({id}, attrs || {})));
}

// select(label, id, [[value, text], ...])
export function select(label, id, options, cls) {
  const s = el("select", {id});
  options.forEach((o) => s.appendChild(el("option", {value: o[0]}, o[1])));
  return put(el("label", cls ? {"class": cls} : null, label + " "), s);
}

export function fields(...items) { return put(el("div", {"class": "fields"}), ...items); }

export function buttons(...items) { return put(el("div", {"class": "row-buttons"}), ...items); }

export function panel(id, title, ...children) {
  return put(el("div", {id, "class": "panel hidden"}), el("h3", {id: id + "-title"}, title), ...children);
}

export const WS_MODES = [["", "gateway default"], ["ctx_pool", "ctx_pool"],
  ["passthrough", "passthrough"], ["http_bridge", "http_bridge"], ["off", "off"]];
