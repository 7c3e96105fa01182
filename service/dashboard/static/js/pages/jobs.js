// Jobs: the list, filtered by status / spec / target, refreshed in place every 1.5 s.
import { api } from "../api.js";
import { displayShape, lookupSpecs, specName } from "../names.js";
import {
  STATUSES, errorBox, fmtDtype, fmtMs, fmtShape, fmtTime, h, hashFor, items, poller, progressBar, replace, short, statusBadge,
} from "../util.js";

const PAGE = 50;

export async function render(ctx) {
  const q = ctx.query;
  const filters = { status: q.get("status") || "", spec_hash: q.get("spec_hash") || "", target: q.get("target") || "" };
  const offset = Math.max(0, parseInt(q.get("offset") || "0", 10) || 0);

  const status = h("select", { name: "status", id: "filter-status" },
    h("option", { value: "" }, "any status"), STATUSES.map((s) => h("option", { value: s, selected: s === filters.status }, s)));
  const specHash = h("input", { name: "spec_hash", id: "filter-spec", placeholder: "spec hash", value: filters.spec_hash, size: 20, spellcheck: "false" });
  const target = h("input", { name: "target", id: "filter-target", placeholder: "target", value: filters.target, size: 8 });
  const apply = (extra = {}) => {
    const query = new URLSearchParams({ status: status.value, spec_hash: specHash.value.trim(), target: target.value.trim(), ...extra });
    ctx.navigate(hashFor(["jobs"], query));
  };
  const form = h("form", { class: "filters", onsubmit: (e) => { e.preventDefault(); apply(); } },
    h("label", {}, "Status ", status), h("label", {}, "Spec ", specHash), h("label", {}, "Target ", target),
    h("button", { type: "submit" }, "Filter"),
    h("a", { href: "#/jobs", class: "button-link" }, "Clear"));
  status.addEventListener("change", () => apply());

  const tbody = h("tbody", { id: "jobs-body" });
  const table = h("table", { class: "grid", id: "jobs-table" },
    h("thead", {}, h("tr", {}, ["job", "spec", "shape", "dtype", "target", "measurer", "status", "progress", "best", "created"].map((c) => h("th", {}, c)))),
    tbody);
  const info = h("span", { class: "muted", id: "jobs-info" });
  const prev = h("button", { type: "button", disabled: offset === 0, onclick: () => apply({ offset: String(Math.max(0, offset - PAGE)) }) }, "← newer");
  const next = h("button", { type: "button", disabled: true, onclick: () => apply({ offset: String(offset + PAGE) }) }, "older →");
  const updated = h("span", { class: "muted live", id: "jobs-updated" });
  // a refusal of the filters (a malformed or ambiguous spec hash) shows here, keeping the page and its form
  const message = h("div", { id: "jobs-message" });

  replace(ctx.root,
    h("div", { class: "page-head" }, h("h1", {}, "Jobs"), ctx.can("jobs:write") ? h("a", { href: "#/submit", class: "button-link primary" }, "Submit a spec") : null),
    form, message, table, h("div", { class: "pager" }, prev, next, info, updated));

  const params = new URLSearchParams({ limit: String(PAGE + 1), offset: String(offset) });
  for (const [k, v] of Object.entries(filters)) if (v) params.set(k, v);
  const rows = new Map(); // job id -> {sig, tr}

  let failed = false;
  const refresh = async () => {
    let data;
    try {
      data = await api(`v1/jobs?${params}`);
    } catch (err) {
      if (!ctx.alive()) return;
      replace(message, errorBox(err));
      for (const entry of rows.values()) entry.tr.remove();
      rows.clear();
      info.textContent = "";
      failed = true;
      return;
    }
    if (!ctx.alive()) return;
    if (failed) { replace(message); failed = false; }
    const list = items(data, "jobs");
    next.disabled = list.length <= PAGE;
    const shown = list.slice(0, PAGE);
    await lookupSpecs(shown.map((j) => j.spec_hash));
    if (!ctx.alive()) return;
    info.textContent = shown.length ? `${offset + 1}–${offset + shown.length}` : "no jobs match";
    const keep = new Set();
    const ordered = [];
    for (const j of shown) {
      const sig = JSON.stringify([j.status, j.progress, j.best, j.kernel_id, j.error, j.warnings, specName(j.spec_hash)]);
      let entry = rows.get(j.id);
      if (!entry || entry.sig !== sig) {
        const tr = jobRow(j);
        if (entry) entry.tr.replaceWith(tr);
        entry = { sig, tr };
        rows.set(j.id, entry);
      }
      keep.add(j.id);
      ordered.push(entry.tr);
    }
    for (const [id, entry] of rows) if (!keep.has(id)) { entry.tr.remove(); rows.delete(id); }
    ordered.forEach((tr, i) => { if (tbody.children[i] !== tr) tbody.insertBefore(tr, tbody.children[i] || null); });
    updated.textContent = `updated ${new Date().toLocaleTimeString()}`;
  };
  await refresh();
  return poller(refresh, 1500, false);
}

// A queued job nobody can run (no live worker takes its target) is marked in the list; the
// warning's text is the tooltip, and the job page shows it in full.
function warningsMark(warnings) {
  if (!Array.isArray(warnings) || !warnings.length) return null;
  return h("span", { class: "badge warning", title: warnings.join("\n"), "data-warning": "true" }, " ⚠ no worker");
}

function jobRow(j) {
  const progress = j.progress || {};
  const best = j.best && j.best.time_ms !== undefined ? fmtMs(j.best.time_ms) : "";
  return h("tr", { "data-job": j.id, "data-status": j.status },
    h("td", {}, h("a", { href: `#/jobs/${encodeURIComponent(j.id)}`, class: "mono" }, short(j.id))),
    h("td", {}, h("a", { href: `#/specs/${encodeURIComponent(j.spec_hash)}`, title: j.spec_hash }, j.spec_name || specName(j.spec_hash) || h("span", { class: "mono" }, short(j.spec_hash, 12)))),
    h("td", { class: "mono" }, fmtShape(j.display_shape || displayShape(j.spec_hash, j.shape))),
    h("td", {}, fmtDtype(j.dtype)),
    h("td", {}, j.target),
    h("td", {}, j.measurer),
    h("td", {}, statusBadge(j.status), warningsMark(j.warnings)),
    h("td", {}, progressBar(progress.trials_done ?? 0, progress.trials_budget ?? (j.budget ? j.budget.trials : 0))),
    h("td", { class: "num" }, best, j.best && j.best.predicted ? h("span", { class: "muted" }, " (model)") : null),
    h("td", { class: "muted" }, fmtTime(j.created_at)));
}
