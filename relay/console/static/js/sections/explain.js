// Explain in the page (GET /admin/explain): for a key and a model, the
// account the next turn would get and why not each other one, with each
// account's health; a warning when the chosen account is failing.
"use strict";
import {$, el, button} from "../dom.js";
import {api} from "../api.js";
import {input, fields, buttons} from "../forms.js";

export function explainBlock() {
  const box = el("div", {"class": "panel explain", id: "explain-panel"});
  box.appendChild(fields(input("Key", "explain-key", {placeholder: "a client key's name"}),
    input("Model", "explain-model", {value: "gpt-5.5"}),
    input("Session", "explain-session", {placeholder: "optional"}),
    input("Previous response id", "explain-previous", {placeholder: "optional"})));
  box.appendChild(buttons(button("Explain", "", run, {id: "explain-run"})));
  box.appendChild(el("div", {id: "explain-result", role: "status"}));
  return box;
}

function run() {
  const q = ["key", "model", "session", "previous"].map((f) => {
    const v = $("explain-" + f).value.trim();
    return v ? (f === "previous" ? "previous_response_id" : f) + "=" + encodeURIComponent(v) : "";
  }).filter(Boolean).join("&");
  const out = $("explain-result");
  out.textContent = "asking…";
  api("GET", "explain?" + q).then((r) => {
    out.textContent = "";
    const d = r.decision || {};
    const head = r.refused ? "Refused: " + r.refused.message :
      d.account ? "Next turn goes to " + d.account + " (" + (d.layer || "") + (d.health_state ? ", " + d.health_state : "") + ")" :
      "No account: " + (d.message || d.code || "none");
    out.appendChild(el("p", {id: "explain-decision", "class": r.refused || !d.account ? "bad" : "good"}, head));
    (r.warnings || []).forEach((w) => out.appendChild(el("p", {"class": "warn explain-warning", "data-code": w.code}, w.message)));
    const t = el("table", {"class": "plain", id: "explain-accounts"});
    const hr = el("tr");
    ["Account", "Verdict", "Why", "Health", "Load", "Quota"].forEach((h) => hr.appendChild(el("th", null, h)));
    t.appendChild(hr);
    (r.accounts || []).forEach((a) => {
      const tr = el("tr", {"class": "explain-row" + (a.id === d.account ? " chosen" : ""), "data-account-id": a.id});
      [a.id, a.verdict || "", a.why || "", a.health ? a.health.state + (a.health.why ? ": " + a.health.why : "") : "",
       a.in_use + " / " + a.concurrency + (a.waiting ? " (+" + a.waiting + ")" : ""),
       a.quota_used_percent === null || a.quota_used_percent === undefined ? "" : a.quota_used_percent + "%"]
        .forEach((v) => tr.appendChild(el("td", null, v)));
      t.appendChild(tr);
    });
    out.appendChild(t);
    document.body.setAttribute("data-explained", "1");
  }).catch((e) => { out.textContent = "Explain failed: " + e.message; });
}
