// Kernels: the cache, with speedups over the baselines and prediction vs measurement.
import { api, download } from "../api.js";
import { displayConfig, displayShape, lookupSpecs } from "../names.js";
import { errorBox, fmtDtype, fmtMs, fmtRatio, fmtShape, fmtTime, h, hashFor, items, replace, short } from "../util.js";

const PAGE = 50;

export async function render(ctx) {
  const q = ctx.query;
  const filters = { spec_hash: q.get("spec_hash") || "", target: q.get("target") || "", dtype: q.get("dtype") || "" };
  const offset = Math.max(0, parseInt(q.get("offset") || "0", 10) || 0);
  const inputs = Object.fromEntries(Object.entries(filters).map(([k, v]) => [k, h("input", { name: k, id: `filter-${k}`, value: v, placeholder: k.replace("_", " "), size: k === "spec_hash" ? 20 : 10, spellcheck: "false" })]));
  const apply = (extra = {}) => ctx.navigate(hashFor(["kernels"], new URLSearchParams({
    ...Object.fromEntries(Object.entries(inputs).map(([k, el]) => [k, el.value.trim()])), ...extra })));
  const message = h("div", { id: "kernels-message" });
  const tbody = h("tbody", { id: "kernels-body" });
  const prev = h("button", { type: "button", disabled: offset === 0, onclick: () => apply({ offset: String(Math.max(0, offset - PAGE)) }) }, "← newer");
  const next = h("button", { type: "button", disabled: true, onclick: () => apply({ offset: String(offset + PAGE) }) }, "older →");
  const info = h("span", { class: "muted" });
  replace(ctx.root,
    h("div", { class: "page-head" }, h("h1", {}, "Kernels")),
    h("form", { class: "filters", onsubmit: (e) => { e.preventDefault(); apply(); } },
      h("label", {}, "Spec ", inputs.spec_hash), h("label", {}, "Target ", inputs.target), h("label", {}, "Dtype ", inputs.dtype),
      h("button", { type: "submit" }, "Filter"), h("a", { href: "#/kernels", class: "button-link" }, "Clear")),
    message,
    h("table", { class: "grid", id: "kernels-table" },
      h("thead", {}, h("tr", {}, ["spec", "shape", "dtype", "target", "strategy", "time", "vs unfused chain", "vs torch.compile", "prediction vs measurement", "created", ""].map((c) => h("th", {}, c)))),
      tbody),
    h("div", { class: "pager" }, prev, next, info));

  const params = new URLSearchParams({ limit: String(PAGE + 1), offset: String(offset) });
  for (const [k, v] of Object.entries(filters)) if (v) params.set(k, v);
  const data = await api(`v1/dashboard/kernels?${params}`);
  if (!ctx.alive()) return null;
  const list = items(data, "kernels");
  next.disabled = list.length <= PAGE;
  const shown = list.slice(0, PAGE);
  await lookupSpecs(shown.map((k) => k.spec_hash));
  if (!ctx.alive()) return null;
  info.textContent = shown.length ? `${offset + 1}–${offset + shown.length}` : "no kernels match";
  replace(tbody, shown.map((k) => row(k, ctx, message)));
  return null;
}

function speedup(s) {
  if (!s) return h("span", { class: "muted" }, "not measured");
  return h("span", { title: `baseline ${fmtMs(s.baseline_ms)}` }, fmtRatio(s.speedup), s.predicted ? h("span", { class: "muted" }, " (model)") : null);
}

function prediction(k) {
  const p = k.prediction || {};
  if (k.predicted) return h("span", { class: "muted" }, `model prediction ${fmtMs(k.time_ms)} (not measured)`);
  if (p.predicted_ms !== null && p.predicted_ms !== undefined) {
    const ratio = p.predicted_ms / k.time_ms;
    return h("span", {}, `predicted ${fmtMs(p.predicted_ms)} / measured ${fmtMs(k.time_ms)} `, h("span", { class: "muted" }, `(${fmtRatio(ratio)})`));
  }
  return h("span", {}, `measured ${fmtMs(k.time_ms)}; no prediction stored`);
}

function row(k, ctx, message) {
  const filename = `foldwise-${k.spec_name || short(k.spec_hash, 12)}-${k.shape_key || fmtShape(k.shape)}-${k.target}.json`.replace(/[^A-Za-z0-9_.=,-]/g, "_");
  return h("tr", { "data-kernel": k.id },
    h("td", {}, h("a", { href: `#/specs/${encodeURIComponent(k.spec_hash)}` }, k.spec_name || h("span", { class: "mono" }, short(k.spec_hash, 12)))),
    h("td", { class: "mono" }, fmtShape(displayShape(k.spec_hash, k.shape))),
    h("td", {}, fmtDtype(k.dtype)),
    h("td", {}, k.target),
    h("td", {}, k.strategy, h("div", {}, h("code", { class: "config small" }, JSON.stringify(displayConfig(k.spec_hash, k.config))))),
    h("td", { class: "num" }, fmtMs(k.time_ms), h("div", { class: "muted small" }, k.measurer)),
    h("td", { class: "num" }, speedup(k.speedups && k.speedups.unfused_chain)),
    h("td", { class: "num" }, speedup(k.speedups && k.speedups.torch_compile)),
    h("td", {}, prediction(k)),
    h("td", { class: "muted" }, fmtTime(k.created_at), h("div", {}, h("a", { href: `#/kernels/${encodeURIComponent(k.id)}`, class: "kernel-link" }, "details"),
      k.job_id ? [" · ", h("a", { href: `#/jobs/${encodeURIComponent(k.job_id)}` }, "job")] : null)),
    h("td", {}, ctx.can("kernels:read") ? h("button", { type: "button", class: "download", onclick: () => download(`v1/kernels/${encodeURIComponent(k.id)}/bundle`, filename).catch((err) => replace(message, errorBox(err))) }, "Download") : null));
}
