// Audit: every admin change (who: the operator or admin-key, from where, what), searchable and
// filtered by kind, CSV.
"use strict";
import {el, ago, iso, settled} from "../dom.js";
import {api} from "../api.js";
import {makeTable} from "../table.js";

let table = null;

function detailText(e) {
  const d = e.detail || {};
  return [d.fields ? "fields: " + d.fields.join(", ") : "", d.flow ? d.flow + " login" : "",
          d.reason ? "reason: " + d.reason : "", d.ok === false ? "failed" : ""].filter(Boolean).join(" · ");
}

function build(root) {
  root.appendChild(el("h2", null, "Admin changes"));
  table = makeTable({
    id: "audit", csv: "audit", empty: "no admin changes yet", rowKey: (e) => String(e.id || e.at + e.action + (e.account || e.target || "")),
    sortBy: "when", sortDir: -1,
    rowAttrs: (e) => ({"class": "audit-row", "data-action": e.action}),
    columns: [
      {id: "when", title: "When", width: "12%", value: (e) => e.at, render: (e) => { const s = el("span", {title: iso(e.at)}, ago(e.at)); return s; }, csv: (e) => iso(e.at)},
      {id: "who", title: "Who", width: "10%", value: (e) => e.actor || "–"},
      {id: "action", title: "Change", width: "16%"},
      {id: "account", title: "Account / target", width: "18%", value: (e) => e.account || e.target || "–"},
      {id: "from", title: "From", width: "14%", value: (e) => e.address || "–"},
      {id: "status", title: "Status", width: "8%", value: (e) => e.status === null || e.status === undefined ? "–" : e.status},
      {id: "detail", title: "Detail", value: detailText},
    ],
    filters: [{id: "kind", title: "Kind", options: [["", "any"], ["account", "accounts"], ["key", "keys"], ["login", "logins"],
      ["group", "groups"], ["prices", "prices"], ["settings", "settings"], ["operator", "operators"]], test: (e, v) => String(e.action).indexOf(v) === 0}],
  });
  root.appendChild(table.root);
}

function refresh() {
  return api("GET", "audit?limit=200").then((data) => settled(() => {
    table.setRows(data.audit || []);
    document.body.setAttribute("data-audit-loaded", "1");
  }));
}

export default {id: "audit", title: "Audit", build, refresh, refreshMs: 5000};
