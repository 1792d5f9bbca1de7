// One table of a section: a toolbar (search, filters, bulk actions, CSV
// export) above a sortable table. The toolbar is built once and keeps what
// was typed and chosen; setRows() redraws only the body, so a refresh
// never loses a search, a sort, a selection or an armed confirmation.
"use strict";
import {el, put, button, confirmButton, settled} from "./dom.js";

// spec: {id, columns: [{id, title, value(row) -> text/number for search,
//   sort and CSV, render(row) -> node or text (default value), cls, sort:
//   false, width}], rowKey(row), rowAttrs(row) -> attributes of the <tr>,
//   filters: [{id, title, options: [[value, label]], test(row, value)}],
//   bulk: [{id, label, confirm: "Confirm ...", run(keys) -> Promise}],
//   csv: file name (without .csv), empty: text, onRow(row, tr), pageSize}
export function makeTable(spec) {
  const state = {query: "", filters: {}, sortBy: spec.sortBy || null,
                 sortDir: spec.sortDir || 1, selected: new Set(), rows: []};
  const root = el("div", {"class": "table-block", id: spec.id + "-block"});
  const bar = el("div", {"class": "toolbar"});
  const search = el("input", {type: "search", "class": "search", id: spec.id + "-search",
                              placeholder: "Search", "aria-label": "Search " + spec.id});
  search.addEventListener("input", () => { state.query = search.value.trim().toLowerCase(); draw(); });
  bar.appendChild(search);
  (spec.filters || []).forEach((f) => {
    const select = el("select", {"class": "filter", id: spec.id + "-filter-" + f.id,
                                 "aria-label": f.title});
    f.options.forEach((o) => select.appendChild(el("option", {value: o[0]}, o[1])));
    select.addEventListener("change", () => { state.filters[f.id] = select.value; draw(); });
    bar.appendChild(put(el("label", {"class": "inline"}, f.title + " "), select));
  });
  const bulkBox = el("span", {"class": "bulk", id: spec.id + "-bulk"});
  bar.appendChild(bulkBox);
  bar.appendChild(el("span", {"class": "spacer"}));
  const count = el("span", {"class": "count", id: spec.id + "-count"});
  bar.appendChild(count);
  bar.appendChild(button("CSV", "csv", () => download(), {id: spec.id + "-csv", title: "Export the rows shown as CSV"}));
  root.appendChild(bar);

  const table = el("table", {id: spec.id, "class": "grid"});
  const colgroup = el("colgroup");
  const head = el("tr");
  const bulk = spec.bulk && spec.bulk.length;
  let selectAll = null;
  if (bulk) {
    colgroup.appendChild(el("col", {"class": "c-select"}));
    selectAll = el("input", {type: "checkbox", "class": "select-all", "aria-label": "select all"});
    selectAll.addEventListener("change", () => {
      visible().forEach((r) => { if (selectAll.checked) { state.selected.add(spec.rowKey(r)); } else { state.selected.delete(spec.rowKey(r)); } });
      draw();
    });
    head.appendChild(put(el("th"), selectAll));
  }
  spec.columns.forEach((c) => {
    const col = el("col", {"class": "c-" + c.id});
    if (c.width) { col.style.width = c.width; }
    colgroup.appendChild(col);
    const th = el("th", {"data-col": c.id}, c.title);
    if (c.sort !== false) {
      th.classList.add("sortable");
      th.tabIndex = 0;
      th.title = "Sort by " + c.title;
      const sort = () => {
        state.sortDir = state.sortBy === c.id ? -state.sortDir : 1;
        state.sortBy = c.id;
        draw();
      };
      th.addEventListener("click", sort);
      th.addEventListener("keydown", (ev) => { if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); sort(); } });
    }
    head.appendChild(th);
  });
  table.appendChild(colgroup);
  table.appendChild(put(el("thead"), head));
  const body = el("tbody", {id: spec.id + "-body"});
  table.appendChild(body);
  root.appendChild(put(el("div", {"class": "scroll"}), table));

  function textOf(c, r) {
    const v = c.value ? c.value(r) : r[c.id];
    return v === null || v === undefined ? "" : v;
  }

  function visible() {
    let rows = state.rows.filter((r) => {
      for (const f of spec.filters || []) {
        const v = state.filters[f.id];
        if (v && !f.test(r, v)) { return false; }
      }
      if (!state.query) { return true; }
      return spec.columns.some((c) => String(textOf(c, r)).toLowerCase().indexOf(state.query) >= 0);
    });
    const c = spec.columns.find((x) => x.id === state.sortBy);
    if (c) {
      rows = rows.slice().sort((a, b) => {
        const x = textOf(c, a), y = textOf(c, b);
        const d = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
        return d * state.sortDir;
      });
    }
    return rows;
  }

  function drawBulk() {
    bulkBox.textContent = "";
    if (!bulk) { return; }
    const keys = Array.from(state.selected);
    if (!keys.length) { return; }
    bulkBox.appendChild(el("span", {"class": "selected-count"}, keys.length + " selected:"));
    spec.bulk.forEach((b) => {
      const what = spec.id + ":bulk:" + b.id + ":" + keys.slice().sort().join(",");
      const run = () => Promise.resolve(b.run(keys)).then(() => { state.selected.clear(); draw(); });
      bulkBox.appendChild(b.confirm
        ? confirmButton(what, [b.label, b.confirm + " (" + keys.length + ")"], "bulk-" + b.id + (b.danger ? " danger" : ""), run, draw)
        : button(b.label, "bulk-" + b.id, run));
    });
  }

  function draw() {
    const rows = visible();
    const keys = new Set(state.rows.map(spec.rowKey));
    state.selected.forEach((k) => { if (!keys.has(k)) { state.selected.delete(k); } });
    body.textContent = "";
    rows.forEach((r) => {
      const tr = el("tr", spec.rowAttrs ? spec.rowAttrs(r) : null);
      const key = spec.rowKey(r);
      if (bulk) {
        const box = el("input", {type: "checkbox", "class": "select", "aria-label": "select " + key});
        box.checked = state.selected.has(key);
        box.addEventListener("change", () => {
          if (box.checked) { state.selected.add(key); } else { state.selected.delete(key); }
          drawBulk();
        });
        tr.appendChild(put(el("td", {"class": "select"}), box));
      }
      spec.columns.forEach((c) => {
        const content = c.render ? c.render(r) : textOf(c, r);
        const td = el("td", c.cls ? {"class": c.cls} : null);
        put(td, content);
        tr.appendChild(td);
      });
      if (spec.onRow) { spec.onRow(r, tr); }
      body.appendChild(tr);
    });
    if (!rows.length) {
      const td = el("td", {"class": "empty"}, state.rows.length ? "no row matches" : (spec.empty || "none"));
      td.colSpan = spec.columns.length + (bulk ? 1 : 0);
      body.appendChild(put(el("tr", {"class": "empty"}), td));
    }
    if (selectAll) { selectAll.checked = rows.length > 0 && rows.every((r) => state.selected.has(spec.rowKey(r))); }
    head.querySelectorAll("th[data-col]").forEach((th) => {
      const on = th.getAttribute("data-col") === state.sortBy;
      th.setAttribute("aria-sort", on ? (state.sortDir > 0 ? "ascending" : "descending") : "none");
    });
    count.textContent = rows.length === state.rows.length ? rows.length + (rows.length === 1 ? " row" : " rows")
      : rows.length + " of " + state.rows.length;
    drawBulk();
  }

  // One CSV field, quoted when needed; text a spreadsheet would run as a
  // formula (=, +, -, @ not starting a number) is prefixed with '.
  function csvCell(v) {
    let s = String(v === null || v === undefined ? "" : v);
    if (typeof v === "string" && /^[=+\-@\t\r]/.test(s) && !/^[+-]?\d/.test(s)) { s = "'" + s; }
    return /[",\n\r]/.test(s) ? '"' + s.replace(/"/g, '""') + '"' : s;
  }

  function csvText() {
    const lines = [spec.columns.map((c) => csvCell(c.title)).join(",")];
    visible().forEach((r) => lines.push(spec.columns.map((c) => csvCell(c.csv ? c.csv(r) : textOf(c, r))).join(",")));
    return lines.join("\r\n") + "\r\n";
  }

  function download() {
    const text = csvText();
    document.body.setAttribute("data-last-csv", spec.id);
    root.setAttribute("data-csv-rows", String(visible().length));
    const url = URL.createObjectURL(new Blob([text], {type: "text/csv"}));
    const a = el("a", {href: url, download: (spec.csv || spec.id) + ".csv", "class": "hidden"});
    document.body.appendChild(a);
    a.click();
    setTimeout(() => { URL.revokeObjectURL(url); a.remove(); }, 1000);
  }

  return {
    root, table, body, state, draw, csvText,
    setRows(rows) { settled(() => { state.rows = rows || []; draw(); }); },
    rows() { return state.rows; },
  };
}
