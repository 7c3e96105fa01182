// One kernel: its facts, its bundle downloads (format 1 source, format 3 with binaries), and the
// compiled variants stored for it (per arch and kernel: sizes, registers, spills, shared memory,
// Triton and compiler versions), each binary (cubin or hsaco) and its assembly (PTX or AMDGCN)
// downloadable. A variant's fields are named by its kind (service.binaries.variant_summaries).
import { api, download } from "../api.js";
import { displayConfig, displayShape, lookupSpecs, specName } from "../names.js";
import { errorBox, fmtDtype, fmtJson, fmtMs, fmtShape, fmtTime, h, replace, short } from "../util.js";

const fmtBytes = (n) => (n === null || n === undefined ? "—" : n >= 1024 ? `${+(n / 1024).toPrecision(3)} KiB` : `${n} B`);

export async function render(ctx) {
  const id = ctx.parts[1];
  const message = h("div", { id: "kernel-message" });
  const facts = h("dl", { class: "facts", id: "kernel-facts" });
  const tbody = h("tbody", { id: "variants-body" });
  const note = h("p", { class: "muted", id: "variants-note" });
  replace(ctx.root,
    h("div", { class: "page-head" }, h("h1", { id: "kernel-title" }, "Kernel ", h("span", { class: "mono" }, short(id, 12)))),
    message, facts,
    h("h2", {}, "Compiled variants"), note,
    h("table", { class: "grid", id: "variants-table" },
      h("thead", {}, h("tr", {}, ["arch", "kernel", "binary", "assembly", "registers", "spills", "shared memory", "warps", "Triton / compiler", ""].map((c) => h("th", {}, c)))),
      tbody));

  const [k, bins] = await Promise.all([
    api(`v1/kernels/${encodeURIComponent(id)}`),
    api(`v1/kernels/${encodeURIComponent(id)}/binaries`),
  ]);
  await lookupSpecs([k.spec_hash]);
  if (!ctx.alive()) return null;
  const fail = (err) => replace(message, errorBox(err));
  const stem = `foldwise-${specName(k.spec_hash) || short(k.spec_hash, 12)}-${k.target}`.replace(/[^A-Za-z0-9_.=,-]/g, "_");
  const bundleButton = (format, label) => h("button", { type: "button", id: `download-bundle-${format}`,
    onclick: () => download(`v1/kernels/${encodeURIComponent(id)}/bundle?format=${format}`, `${stem}-format${format}.json`).catch(fail) }, label);
  if (k.partial) {  // a failed job's best so far: shown as such, never taken for a finished kernel
    document.getElementById("kernel-title").append(" ", h("span", { class: "badge warning", id: "kernel-partial" }, "partial"));
    replace(message, h("div", { class: "warning-box", role: "status" }, h("strong", {}, "Partial: "),
      "the best kernel of a job that failed before it finished; kernel lookups never answer with it."));
  }
  const rows = [
    ["spec", h("a", { href: `#/specs/${encodeURIComponent(k.spec_hash)}` }, specName(k.spec_hash) || short(k.spec_hash, 16))],
    ["shape / dtype", h("span", {}, h("span", { class: "mono" }, fmtShape(displayShape(k.spec_hash, k.shape))), ` ${fmtDtype(k.dtype)}`)],
    ["target", k.target],
    ["strategy / config", h("span", {}, `${k.strategy} `, h("code", {}, fmtJson(displayConfig(k.spec_hash, k.config))))],
    ["time", h("span", {}, fmtMs(k.time_ms), h("span", { class: "muted" }, ` ${k.measurer}${k.predicted ? " (model prediction, not measured)" : ""}`))],
    ["bundle", h("span", {}, h("span", { class: "mono small" }, k.bundle_sha256), " ",
      ctx.can("kernels:read") ? [bundleButton(1, "Download (source)"), " ", bundleButton(3, "Download with binaries")] : null)],
    ["created", h("span", {}, fmtTime(k.created_at), k.job_id ? [" · ", h("a", { href: `#/jobs/${encodeURIComponent(k.job_id)}` }, "job")] : null)],
  ];
  replace(facts, rows.map(([a, b]) => [h("dt", {}, a), h("dd", {}, b)]));

  const variants = bins.variants || [];
  note.textContent = variants.length
    ? "Triton's compile of every kernel of the module, per arch and Triton version, served in format-3 bundles (format 2: the newest Triton's per arch); an inference server on a matching GPU and Triton launches the cubin without compiling (an AMD one compiles the source: loading a stored hsaco has not been run on AMD)."
    : "No compiled binary stored for this kernel: bundles carry the source only (`foldwise binaries backfill` compiles them).";
  const file = (path, name, label) => h("button", { type: "button", class: "download-binary", "data-path": path,
    onclick: () => download(path.replace(/^\//, ""), name).catch(fail) }, label);
  const ASM_LABELS = { ptx: "PTX", amdgcn: "AMDGCN" };
  replace(tbody, variants.flatMap((v) => v.kernels.map((kk, i) => {
    const bin = v.binary_kind || "cubin", asm = v.asm_kind || "ptx";
    const compiler = v.binary_kind === "hsaco" ? `AMD ${v.compiler_version}` : `ptxas ${v.ptxas_version}`;
    return h("tr", { "data-arch": v.arch, "data-kernel-name": kk.name, "data-binary-kind": bin },
    h("td", {}, i === 0 ? v.arch : ""),
    h("td", { class: "mono" }, kk.name),
    h("td", { class: "num", title: `${bin} sha256 ${kk[`${bin}_sha256`]}` }, `${fmtBytes(kk[`${bin}_size`])} ${bin}`),
    h("td", { class: "num", title: `sha256 ${kk[`${asm}_sha256`]}` }, fmtBytes(kk[`${asm}_chars`])),
    h("td", { class: "num" }, kk.registers ?? "—"),
    h("td", { class: kk.spill_bytes ? "num error-text" : "num" }, fmtBytes(kk.spill_bytes)),
    h("td", { class: "num" }, fmtBytes(kk.shared_bytes)),
    h("td", { class: "num" }, kk.num_warps ?? "—"),
    h("td", { class: "muted small" }, `Triton ${v.triton_version}`, h("div", {}, compiler)),
    h("td", {}, ctx.can("kernels:read") ? [file(kk[`${bin}_path`], `${v.arch}-${kk.name}.${bin}`, bin), " ",
      file(kk[`${asm}_path`], `${v.arch}-${kk.name}.${asm}`, ASM_LABELS[asm] || asm)] : null));
  })));
  return null;
}
