// One spec: the spec itself, its derivation as math (terms, correction, merge rule), the
// certificate, and the generated Triton source, highlighted.
import { api } from "../api.js";
import { errorBox, fmtShape, h, renderMath, replace, highlighted } from "../util.js";

export async function render(ctx) {
  const asked = ctx.parts[1];
  // a full hash or a prefix of 12+ hex characters (the CLI prints 16): the server resolves it
  if (!/^[0-9a-f]{12,64}$/.test(asked)) throw new Error(`not a spec hash (12 to 64 hex characters): ${asked}`);
  const m = await api(`v1/specs/${asked}/math`);
  if (!ctx.alive()) return null;
  const hash = m.spec_hash || asked;

  const sourceBox = h("div", { id: "spec-source" }, h("p", { class: "muted" }, "Generating…"));
  replace(ctx.root,
    h("div", { class: "page-head" },
      h("h1", {}, "Spec ", h("span", { id: "spec-name" }, m.name), " ",
        h("span", { class: `badge ${m.fusible ? "status-succeeded" : "status-failed"}` }, m.fusible ? "fusible" : "not fully fusible"), " ",
        certificateBadge(m.certificate)),
      h("a", { href: `#/jobs?spec_hash=${hash}`, class: "button-link" }, "Jobs"), " ",
      h("a", { href: `#/kernels?spec_hash=${hash}`, class: "button-link" }, "Kernels")),
    h("p", { class: "mono muted" }, hash),
    h("div", { class: "two-col" },
      h("div", {}, h("h2", {}, "Spec"), highlighted(JSON.stringify(m.spec, null, 2), "json")),
      h("div", {}, h("h2", {}, "Certificate"), certificate(m.certificate), axes(m))),
    h("h2", {}, "Derivation"),
    h("div", { id: "derivation" }, m.reductions.map(reduction)),
    m.epilogue && m.epilogue.length ? epilogue(m.epilogue) : null,
    h("h2", {}, "Generated Triton source"),
    sourceBox);

  await showSource(sourceBox, hash, ctx, new URLSearchParams());
  return null;
}

// red when the certificate fails: the fused forms missed the float64 reference, and jobs for the
// spec are refused unless they set allow_uncertified (docs/THEORY.md section 7)
function certificateBadge(c) {
  if (!c) return null;
  return h("span", { id: "cert-verdict", class: `badge ${c.holds ? "status-succeeded" : "status-failed"}`, title: c.verdict || "" },
    c.holds ? "certificate holds" : "certificate FAILS");
}

function certificate(c) {
  if (!c) return h("p", { class: "muted" }, "no certificate");
  const rows = [
    ["max relative error", h("span", { id: "cert-err" }, Number(c.max_rel_err).toExponential(2))],
    ["trials", c.trials],
    ["exact", c.exact ? "yes: the fused form equals the multi-pass one in real arithmetic" : "no (casts inside the cascade)"],
  ];
  for (const [k, v] of Object.entries(c)) {
    if (["max_rel_err", "trials", "exact", "failed"].includes(k)) continue;
    if (typeof v === "number") rows.push([k.replaceAll("_", " "), Number.isInteger(v) ? String(v) : v.toExponential(2)]);
    else if (typeof v === "string" || typeof v === "boolean") rows.push([k.replaceAll("_", " "), String(v)]);
    else if (v && typeof v === "object" && !Array.isArray(v)) {
      rows.push([k.replaceAll("_", " "), h("span", {}, Object.entries(v).map(([a, b]) => h("div", {}, `${a}: ${typeof b === "number" ? b.toExponential(2) : String(b)}`)))]);
    }
  }
  return h("dl", { class: "facts", id: "certificate" }, rows.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
}

function axes(m) {
  if (!m.axes || !m.axes.length) return null;
  return h("div", {}, h("h3", {}, "Loops"), h("ul", {}, m.axes.map((a) => h("li", {}, `over ${a.axis}${a.dims && a.dims.length > 1 ? ` (one loop over ${a.dims.join(" × ")})` : ""}: ${a.reductions.join(", ")}`))));
}

function math(latex, display = true) {
  return renderMath(h(display ? "div" : "span", { class: display ? "math" : "math-inline" }), latex, display);
}

function reduction(r) {
  const card = h("article", { class: `card reduction ${r.fused ? "" : "not-fused"}`, "data-reduction": r.name },
    h("h3", {}, r.name, " ", h("span", { class: "muted" }, `${r.op} over ${r.over}`), " ",
      h("span", { class: "badge realisation" }, r.realisation),
      r.contraction ? h("span", { class: "badge" }, "contraction") : null,
      r.exact === false ? h("span", { class: "badge status-failed" }, "inexact (cast)") : null),
    h("p", { class: "muted" }, r.realisation_doc, r.depends_on.length ? `; reads ${r.depends_on.join(", ")}` : ""));
  const rows = [["definition", math(r.definition)]];
  if (!r.fused) {
    rows.push(["why not fused", h("p", { class: "error-text reason" }, r.reason)]);
    card.appendChild(mathList(rows));
    return card;
  }
  if (r.terms.length) {
    rows.push([h("span", {}, "terms ", math("G_j(x)\\, H_j(D)", false)), h("table", { class: "grid terms" },
      h("thead", {}, h("tr", {}, h("th", {}, "j"), h("th", {}, "G (streamed)"), h("th", {}, "H (dependencies)"))),
      h("tbody", {}, r.terms.map((t, j) => h("tr", {}, h("td", {}, j + 1), h("td", {}, math(t.G, false)), h("td", {}, math(t.H, false))))))]);
  }
  if (r.correction.length) rows.push(["correction (anchors move)", r.correction.map((c) => math(c))]);
  rows.push(["update per tile", r.update.map((u) => math(u))]);
  if (r.finalize) rows.push(["final value", math(r.finalize)]);
  rows.push(["merge rule (parts a, b)", [r.merge.map((mr) => math(mr)), r.merge_text ? h("p", { class: "muted small" }, r.merge_text) : null]]);
  if (r.guards && r.guards.length) rows.push(["guards", h("ul", { class: "guards muted" }, r.guards.map((g) => h("li", {}, g)))]);
  card.appendChild(mathList(rows));
  return card;
}

function mathList(rows) {
  return h("dl", { class: "mathlist" }, rows.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
}

function epilogue(steps) {
  return h("div", {}, h("h3", {}, "Epilogue"), h("ul", {}, steps.map((e) => h("li", {},
    h("strong", {}, e.name), ` reads ${e.reads.join(", ")}`, e.second_pass ? " (a second pass over the axis)" : ""))));
}

async function showSource(box, hash, ctx, params) {
  let data;
  try {
    data = await api(`v1/specs/${hash}/source${params.toString() ? `?${params}` : ""}`);
  } catch (err) {
    replace(box, errorBox(err), h("button", { type: "button", onclick: () => showSource(box, hash, ctx, new URLSearchParams()) }, "Back to the default"));
    return;
  }
  if (!ctx.alive()) return;
  const select = h("select", { id: "source-strategy" },
    Object.entries(data.strategies || {}).map(([s, why]) => h("option", { value: s, selected: s === data.strategy, disabled: why !== null, title: why || "" }, why ? `${s} (not valid)` : s)));
  const shape = h("input", { id: "source-shape", value: fmtShape(data.shape), size: 30, spellcheck: "false" });
  const form = h("form", { class: "filters", onsubmit: async (e) => {
    e.preventDefault();
    await showSource(box, hash, ctx, new URLSearchParams({ strategy: select.value, shape: shape.value.trim(), dtype: data.dtype_key || "" }));
  } }, h("label", {}, "Strategy ", select), h("label", {}, "Shape ", shape), h("button", { type: "submit" }, "Generate"));
  replace(box, form,
    h("p", { class: "muted" }, `${data.note || ""} config ${JSON.stringify(data.config)}, dtype ${data.dtype_key}, generator ${data.generator_version}`),
    highlighted(data.source, "python"));
}
