// One job: its facts, best-so-far vs trial chart, a range job's buckets, every trial, and the cancel button.
import { api, download } from "../api.js";
// configs (best, trials) come from the API in the spec's own dim names already; shapes are renamed here
import { displayShape, lookupSpecs, specName } from "../names.js";
import {
  FINISHED, errorBox, fmtDtype, fmtDuration, fmtJson, fmtMs, fmtShape, fmtTime, h, items, poller, progressBar, replace, short,
  statusBadge,
} from "../util.js";

// The compile gate's facts of one trial, one line per kernel: registers, shared memory, spills
// (the full facts, and the compiler's error, in the tooltip); "—" for a trial tuned without it.
const fmtBytes = (n) => (n >= 1024 ? `${+(n / 1024).toPrecision(3)} KiB` : `${n} B`);
// Kernels are compiled from the canonical spec (named "canonical"): "canonical_split_fused_combine_kernel"
// reads as "split_fused combine".
export function kernelLabel(kernel) {
  const name = String(kernel || "").replace(/^canonical_/, "").replace(/_kernel$/, "");
  return name.replace(/_combine$/, " combine");
}
function compileCell(kernels) {
  if (!Array.isArray(kernels) || !kernels.length) return h("td", { class: "muted compile" }, "—");
  const lines = kernels.map((k) => {
    const name = kernelLabel(k.kernel);
    if (!k.ok) return h("div", { class: "error-text" }, `${name}: does not compile`);
    const spill = k.spill_bytes ? h("span", { class: "error-text" }, `, spills ${fmtBytes(k.spill_bytes)}`) : null;
    return h("div", {}, `${kernels.length > 1 ? `${name}: ` : ""}${k.registers} regs, ${fmtBytes(k.shared_bytes || 0)} smem`, spill);
  });
  return h("td", { class: "compile", title: JSON.stringify(kernels, null, 1) }, lines);
}

export async function render(ctx) {
  const id = ctx.parts[1];
  const facts = h("dl", { class: "facts", id: "job-facts" });
  const head = h("div", { class: "page-head" });
  const message = h("div", { id: "job-message" });
  const warningsBox = h("div", { id: "job-warnings" });
  const chartBox = h("div", { class: "chart", id: "job-chart" });
  const chartNote = h("p", { class: "muted", id: "chart-note" });
  const tbody = h("tbody", { id: "trials-body" });
  // a range job (one search per bucket): each bucket's trials and best, from the trials' numbers
  const bucketsBox = h("div", { id: "job-buckets" });
  const trialsTable = h("table", { class: "grid", id: "trials-table" },
    h("thead", {}, h("tr", {}, ["#", "state", "strategy", "config", "time / failure", "compiled", "source", "worker"].map((c) => h("th", {}, c)))),
    tbody);
  replace(ctx.root, head, message, warningsBox, facts,
    bucketsBox, h("h2", {}, "Best so far vs trial"), chartBox, chartNote,
    h("h2", {}, "Trials ", h("span", { class: "muted", id: "trials-count" })), trialsTable);

  let chart = null;
  let lastTrialsSig = "";
  let lastJobSig = "";
  let stop = null;
  let finishedSeen = false;
  let hash = null;
  let range = null; // the job view's range: {buckets, trial_number_stride}, or null

  const renderBuckets = (trials) => {
    if (!range) { replace(bucketsBox); return; }
    const stride = range.trial_number_stride;
    const rows = range.buckets.map((shape, i) => {
      const mine = trials.filter((t) => Math.floor(t.number / stride) === i);
      const done = mine.filter((t) => t.time_ms !== null && t.time_ms !== undefined && (t.state === undefined || t.state === "complete"));
      const best = done.reduce((b, t) => (b === null || t.time_ms < b.time_ms ? t : b), null);
      return h("tr", { "data-bucket": i },
        h("td", { class: "mono" }, fmtShape(displayShape(hash, shape))),
        h("td", { class: "num" }, mine.length),
        h("td", { class: "num" }, best ? fmtMs(best.time_ms) : "—"),
        h("td", {}, best ? best.strategy || "" : ""),
        h("td", {}, best ? h("code", { class: "config" }, fmtJson(best.config)) : ""));
    });
    replace(bucketsBox, h("h2", {}, "Buckets ", h("span", { class: "muted" }, `(${range.buckets.length}: a search each, largest first)`)),
      h("table", { class: "grid", id: "buckets-table" },
        h("thead", {}, h("tr", {}, ["bucket", "trials", "best", "strategy", "config"].map((c) => h("th", {}, c)))),
        h("tbody", {}, rows)));
  };

  // Times on a log axis (an outlier 100x slower does not flatten the best-so-far curve), all in one
  // unit: µs when the best so far is under 1 ms, else ms; the legend and the axis say which.
  const chartUnit = (values) => {
    const finite = values.filter((v) => v !== null && v > 0);
    const low = finite.length ? Math.min(...finite) : 1;
    return low < 1 ? { name: "µs", scale: 1000 } : { name: "ms", scale: 1 };
  };
  let unit = null;
  const drawChart = (trials) => {
    const xs = [];
    const times = [];
    const best = [];
    let b = null;
    const sorted = [...trials].sort((a, c) => a.number - c.number);
    for (const t of sorted) {
      const ok = t.time_ms !== null && t.time_ms !== undefined && t.time_ms > 0 && (t.state === undefined || t.state === "complete");
      xs.push(t.number);
      times.push(ok ? t.time_ms : null);
      if (ok && (b === null || t.time_ms < b)) b = t.time_ms;
      best.push(b);
    }
    const want = chartUnit(best);
    if (chart && unit && want.name !== unit.name) { chart.destroy(); chart = null; replace(chartBox); }
    unit = want;
    const inUnit = (v) => (v === null ? null : v * unit.scale);
    const data = [xs, times.map(inUnit), best.map(inUnit)];
    const width = Math.max(320, chartBox.clientWidth || 800);
    if (chart) { chart.setData(data); chart.setSize({ width, height: 280 }); return; }
    if (!window.uPlot) { chartBox.textContent = "chart library missing"; return; }
    const fmt = (v) => (v === null || v === undefined ? "—" : `${+v.toPrecision(3)} ${unit.name}`);
    chartBox.dataset.unit = unit.name;
    chartBox.dataset.scale = "log";
    chart = new window.uPlot({
      width, height: 280,
      scales: { x: { time: false }, y: { distr: 3, log: 10 } },
      axes: [{ label: "trial", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000], values: (u, vals) => vals.map((v) => String(Math.round(v))) },
        { label: `time (${unit.name}, log scale)`, size: 70, values: (u, vals) => vals.map((v) => (v === null ? "" : String(+v.toPrecision(3)))) }],
      series: [
        { label: "trial" },
        { label: "trial time", stroke: "#8aa4c8", width: 0, paths: () => null, points: { show: true, size: 6, fill: "#8aa4c8" }, value: (u, v) => fmt(v) },
        { label: "best so far", stroke: "#c0392b", width: 2, points: { show: false }, value: (u, v) => fmt(v) },
      ],
      legend: { live: true },
    }, data, chartBox);
  };

  const renderJob = async (j) => {
    await lookupSpecs([j.spec_hash]);
    if (!ctx.alive()) return;
    hash = j.spec_hash;
    range = j.range || null;
    const canCancel = ctx.can("jobs:write") && !FINISHED.has(j.status);
    const cancel = canCancel ? h("button", { type: "button", class: "danger", id: "cancel-button", disabled: j.cancel_requested === true, onclick: async (e) => {
      e.target.disabled = true;
      try { await api(`v1/jobs/${encodeURIComponent(id)}/cancel`, { method: "POST" }); await refresh(); } catch (err) { replace(message, errorBox(err)); e.target.disabled = false; }
    } }, j.cancel_requested ? "Cancelling…" : "Cancel") : null;
    replace(head, h("h1", {}, "Job ", h("span", { class: "mono" }, short(j.id, 12)), " ", statusBadge(j.status)), cancel);
    const p = j.progress || {};
    const budget = j.budget || {};
    const best = j.best;
    const rows = [
      ["spec", h("a", { href: `#/specs/${encodeURIComponent(j.spec_hash)}`, id: "job-spec-link" }, (j.spec_name || specName(j.spec_hash)) ? `${j.spec_name || specName(j.spec_hash)} ` : "", h("span", { class: "mono muted" }, short(j.spec_hash, 16)))],
      ["shape", h("span", { class: "mono", id: "job-shape" }, fmtShape(j.display_shape || displayShape(j.spec_hash, j.shape)))],
      ["dtype", fmtDtype(j.dtype)],
      ["target / measurer", `${j.target} / ${j.measurer}`],
      ["budget", `${budget.trials ?? "?"} trials, ${budget.seconds ?? "?"} s`],
      ["progress", progressBar(p.trials_done ?? 0, p.trials_budget ?? budget.trials ?? 0)],
      ["created", fmtTime(j.created_at)],
      ["started", j.started_at ? `${fmtTime(j.started_at)} (ran ${fmtDuration(j.started_at, j.finished_at)})` : "not yet"],
      ["finished", fmtTime(j.finished_at) || "—"],
      ["worker", j.worker_id || "—"],
      ["best", best ? h("span", {}, h("strong", { id: "job-best" }, fmtMs(best.time_ms)), ` ${best.strategy || ""} `, h("code", {}, fmtJson(best.config)), best.trial !== undefined ? ` (trial ${best.trial})` : "") : "—"],
    ];
    if (j.kernel_id) {
      rows.push(["kernel", h("span", {},
        h("a", { href: `#/kernels/${encodeURIComponent(j.kernel_id)}`, id: "job-kernel-link" }, h("span", { class: "mono" }, short(j.kernel_id, 12))), " ",
        ctx.can("kernels:read") ? h("button", { type: "button", id: "download-bundle", onclick: () => download(`v1/kernels/${encodeURIComponent(j.kernel_id)}/bundle`, `foldwise-${short(j.spec_hash, 12)}-${j.target}.json`).catch((err) => replace(message, errorBox(err))) }, "Download bundle") : null)]);
    }
    if (j.partial_kernel_id) {
      // a failed job's best kernel so far: never served by a lookup, so labelled as what it is
      const pid = j.partial_kernel_id;
      rows.push(["partial kernel", h("span", { id: "job-partial-kernel" },
        h("span", { class: "badge warning", title: "the best kernel of this failed job; lookups never answer with it" }, "partial"), " ",
        h("a", { href: `#/kernels/${encodeURIComponent(pid)}`, id: "job-partial-kernel-link" }, h("span", { class: "mono" }, short(pid, 12))), " ",
        h("span", { class: "muted" }, "best kernel found before the job failed; not in the kernel cache "),
        ctx.can("kernels:read") ? h("button", { type: "button", id: "download-partial-bundle", onclick: () => download(`v1/kernels/${encodeURIComponent(pid)}/bundle`, `foldwise-${short(j.spec_hash, 12)}-${j.target}-partial.json`).catch((err) => replace(message, errorBox(err))) }, "Download partial bundle") : null)]);
    }
    if (j.error) rows.push(["error", h("span", { class: "error-text", id: "job-error" }, j.error)]);
    // why a queued job may wait forever (no live worker takes its target); computed by the server when read
    replace(warningsBox, ...(j.warnings || []).map((w) => h("div", { class: "warning-box", role: "status", "data-warning": "true" }, h("strong", {}, "Warning: "), w)));
    replace(facts, rows.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
  };

  const renderTrials = (trials) => {
    document.getElementById("trials-count").textContent = `(${trials.length})`;
    const sorted = [...trials].sort((a, b) => b.number - a.number);
    replace(tbody, sorted.map((t) => {
      const failed = t.state && t.state !== "complete";
      return h("tr", { "data-state": t.state || "" },
        h("td", { class: "num" }, t.number),
        h("td", {}, h("span", { class: `badge trial-${t.state}` }, t.state || "")),
        h("td", {}, t.strategy || ""),
        h("td", {}, h("code", { class: "config" }, fmtJson(t.config))),
        h("td", { class: failed ? "error-text" : "num" }, failed ? (t.error || t.state) : [fmtMs(t.time_ms), t.predicted ? h("span", { class: "muted" }, " predicted") : null]),
        compileCell(t.compile),
        h("td", { class: "muted" }, t.source || ""),
        h("td", { class: "mono muted" }, t.worker_id ?? t.worker ?? ""));
    }));
    chartNote.textContent = trials.length ? "" : "No trials yet.";
    renderBuckets(trials);
    drawChart(trials);
  };

  const refresh = async () => {
    const [j, tdata] = await Promise.all([
      api(`v1/jobs/${encodeURIComponent(id)}`),
      api(`v1/jobs/${encodeURIComponent(id)}/trials`),
    ]);
    if (!ctx.alive()) return;
    const jobSig = JSON.stringify(j);
    if (jobSig !== lastJobSig) { lastJobSig = jobSig; await renderJob(j); }
    const trials = items(tdata, "trials");
    const sig = `${trials.length}:${JSON.stringify(trials[trials.length - 1] || null)}`;
    if (sig !== lastTrialsSig) { lastTrialsSig = sig; renderTrials(trials); }
    if (FINISHED.has(j.status)) {
      // one more round after finishing catches trials written just before the status changed
      if (finishedSeen && stop) { stop(); stop = null; }
      finishedSeen = true;
    }
  };
  await refresh();
  const onResize = () => { if (chart) chart.setSize({ width: Math.max(320, chartBox.clientWidth), height: 280 }); };
  window.addEventListener("resize", onResize);
  stop = poller(refresh, 1500, false);
  return () => { if (stop) stop(); window.removeEventListener("resize", onResize); if (chart) chart.destroy(); };
}
