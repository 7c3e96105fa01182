// Submit a spec (pasted, or picked from the catalog) with shape / dtype / target / budget.
// Errors are shown next to the field they name, whether found here or by the server.
import { api, ApiError, fieldErrors } from "../api.js";
import { errorBox, fmtDtype, fmtShape, h, replace } from "../util.js";

const FIELDS = ["spec", "shape", "dtype", "target", "measurer", "budget.trials", "budget.seconds"];

export async function render(ctx) {
  if (!ctx.can("jobs:write")) {
    replace(ctx.root, h("h1", {}, "Submit a spec"),
      h("p", { class: "error-box", id: "read-only-note" }, "This token cannot submit jobs (it lacks the jobs:write scope). Sign in with another token to submit."));
    return null;
  }
  const [catalog, options] = await Promise.all([
    api("v1/catalog").catch(() => ({ specs: [] })),
    api("v1/dashboard/options").catch(() => ({})),
  ]);
  if (!ctx.alive()) return null;
  const specs = catalog.specs || [];
  const targets = options.targets || ["h100", "h200", "a100"];
  const measurers = options.measurers || ["model", "cuda"];
  const dtypes = options.dtypes || ["float32", "float16", "bfloat16"];

  const errors = Object.fromEntries(FIELDS.map((f) => [f, h("p", { class: "field-error", id: `error-${f.replace(".", "-")}`, "data-field": f })]));
  const formError = h("div", { id: "form-error" });
  const preview = h("div", { id: "spec-preview", class: "muted" });

  const pick = h("select", { id: "catalog-pick", name: "catalog" },
    h("option", { value: "" }, specs.length ? "— pick a catalog spec —" : "(no catalog on this server)"),
    specs.map((s) => h("option", { value: s.name }, `${s.name}${s.doc ? ` — ${s.doc}` : ""}`)));
  const caseSelect = h("select", { id: "catalog-case", name: "case", hidden: true });
  const specText = h("textarea", { id: "spec-text", name: "spec", rows: 16, spellcheck: "false", placeholder: '{"foldwise": 1, "name": ..., "inputs": ..., "steps": ..., "outputs": ...}' });
  const shape = h("input", { id: "shape", name: "shape", placeholder: "m=4096,n=1024", size: 40, spellcheck: "false" });
  const dtype = h("input", { id: "dtype", name: "dtype", value: "float32", list: "dtype-list", size: 40, spellcheck: "false" });
  const dtypeList = h("datalist", { id: "dtype-list" }, dtypes.map((d) => h("option", { value: d })));
  const target = h("select", { id: "target", name: "target" }, targets.map((t) => h("option", { value: t, selected: t === options.default_target }, t)));
  const measurer = h("select", { id: "measurer", name: "measurer" }, measurers.map((m) => h("option", { value: m, selected: m === (options.default_measurer || "model") }, m)));
  const trials = h("input", { id: "budget-trials", name: "budget.trials", type: "number", min: 1, max: options.max_trials || 1000, value: 40 });
  const seconds = h("input", { id: "budget-seconds", name: "budget.seconds", type: "number", min: 1, max: options.max_seconds || 21600, value: 600 });

  const setCase = (entry, i) => {
    const c = (entry.cases || [])[i];
    if (!c) return;
    shape.value = fmtShape(c.shape);
    dtype.value = typeof c.dtype === "string" ? c.dtype : JSON.stringify(c.dtype);
  };
  pick.addEventListener("change", () => {
    const entry = specs.find((s) => s.name === pick.value);
    if (!entry) return;
    specText.value = JSON.stringify(entry.spec, null, 2);
    replace(caseSelect, (entry.cases || []).map((c, i) => h("option", { value: i }, `${c.suite}: ${fmtShape(c.shape)} ${fmtDtype(c.dtype)}${c.note ? ` — ${c.note}` : ""}`)));
    caseSelect.hidden = !(entry.cases || []).length;
    setCase(entry, 0);
    clearErrors();
    checkSpec();
  });
  specText.addEventListener("input", () => replace(preview));
  caseSelect.addEventListener("change", () => setCase(specs.find((s) => s.name === pick.value), Number(caseSelect.value)));

  const clearErrors = () => { for (const el of Object.values(errors)) el.textContent = ""; replace(formError); };
  // field: where the error is ("shape.q", "spec.steps.1.expr"); path: how to name it ("spec.steps[1] (den).expr")
  const show = (field, msg, path = field) => {
    const key = FIELDS.find((f) => field === f || field.startsWith(`${f}.`) || field.startsWith(`${f}[`))
      || (field.startsWith("budget") ? "budget.trials" : null);
    if (key && path.length > key.length && path.startsWith(key) && !["shape", "dtype"].includes(key)) {
      msg = `${path.slice(key.length).replace(/^\./, "")}: ${msg}`;
    }
    if (key) {
      errors[key].textContent = errors[key].textContent ? `${errors[key].textContent}; ${msg}` : msg;
      errors[key].closest(".field").classList.add("invalid");
    } else {
      formError.appendChild(h("div", { class: "error-box" }, field ? `${field}: ${msg}` : msg));
    }
  };

  const parseSpec = () => {
    try { return JSON.parse(specText.value); } catch (err) { show("spec", `not valid JSON: ${err.message}`); return undefined; }
  };

  const checkSpec = async () => {
    replace(preview);
    const spec = parseSpec();
    if (spec === undefined) return;
    try {
      const d = await api("v1/derivations", { method: "POST", body: { spec } });
      replace(preview, `${d.name}: ${d.fusible ? "fusible" : "not fully fusible"}; ${d.reductions.map((r) => `${r.name} ${r.op} over ${r.over}${r.fused ? "" : " (not fused)"}`).join(", ")}`,
        d.certificate && !d.certificate.holds ? h("p", { class: "field-error", id: "cert-fails" }, `certificate ${d.certificate.verdict}`) : null);
    } catch (err) {
      showServerErrors(err, "spec");
    }
  };

  const showServerErrors = (err, fallback) => {
    const found = err instanceof ApiError ? fieldErrors(err.body) : [];
    if (found.length) for (const e of found) show(e.field || fallback, e.message, e.path || e.field || fallback);
    else if (err instanceof ApiError && err.status === 422) show(fallback, err.message);
    else formError.appendChild(errorBox(err));
  };

  const parseShape = () => {
    const out = {};
    for (const part of shape.value.split(",").map((s) => s.trim()).filter(Boolean)) {
      const m = /^([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\d+)$/.exec(part);
      if (!m) { show("shape", `expected dim=size pairs like m=4,n=300; got "${part}"`); return undefined; }
      out[m[1]] = Number(m[2]);
    }
    if (!Object.keys(out).length) { show("shape", "give a size for every dim, like m=4,n=300"); return undefined; }
    return out;
  };

  const parseDtype = () => {
    const v = dtype.value.trim();
    if (!v) { show("dtype", "required, e.g. float16, or a JSON object of input -> dtype"); return undefined; }
    if (v.startsWith("{")) {
      try { return JSON.parse(v); } catch (err) { show("dtype", `not valid JSON: ${err.message}`); return undefined; }
    }
    return v;
  };

  const positive = (el, field) => {
    const n = Number(el.value);
    if (!el.value || !Number.isFinite(n) || n <= 0) { show(field, "must be a positive number"); return undefined; }
    return n;
  };

  const submit = h("button", { type: "submit", class: "primary", id: "submit-button" }, "Submit job");
  const form = h("form", { id: "submit-form", novalidate: true, onsubmit: async (e) => {
    e.preventDefault();
    clearErrors();
    replace(preview); // it described the spec as last checked, which may have changed since
    for (const el of form.querySelectorAll(".field.invalid")) el.classList.remove("invalid");
    const body = { spec: parseSpec(), shape: parseShape(), dtype: parseDtype(), target: target.value, measurer: measurer.value,
      budget: { trials: positive(trials, "budget.trials"), seconds: positive(seconds, "budget.seconds") } };
    if ([body.spec, body.shape, body.dtype, body.budget.trials, body.budget.seconds].includes(undefined)) return;
    if (!Number.isInteger(body.budget.trials)) { show("budget.trials", "must be a whole number"); return; }
    submit.disabled = true;
    try {
      const job = await api("v1/jobs", { method: "POST", body });
      ctx.navigate(`#/jobs/${encodeURIComponent(job.id)}`);
    } catch (err) {
      showServerErrors(err, "spec");
    } finally {
      submit.disabled = false;
    }
  } },
    field("Catalog", pick, null, caseSelect),
    field("Spec (JSON)", specText, errors.spec, h("div", {}, h("button", { type: "button", id: "check-spec", onclick: () => { clearErrors(); checkSpec(); } }, "Check spec"), " ", preview)),
    field("Shape", shape, errors.shape, h("span", { class: "muted small" }, "every dim of the spec: m=4096,n=1024")),
    field("Dtype", dtype, errors.dtype, dtypeList, h("span", { class: "muted small" }, "one dtype, or a JSON object input -> dtype")),
    h("div", { class: "row" },
      field("Target", target, errors.target),
      field("Measurer", measurer, errors.measurer),
      field("Trials", trials, errors["budget.trials"]),
      field("Seconds", seconds, errors["budget.seconds"])),
    formError,
    h("div", { class: "buttons" }, submit));

  replace(ctx.root, h("h1", {}, "Submit a spec"), form);
  return null;
}

function field(label, input, error, ...extra) {
  return h("div", { class: "field" }, h("label", { for: input.id }, label), input, ...extra, error);
}
