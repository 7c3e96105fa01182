// Small DOM and formatting helpers. Every value from the server reaches the page through
// text nodes or attributes set here, never through innerHTML, so data cannot inject markup.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key.startsWith("on") && typeof value === "function") el.addEventListener(key.slice(2), value);
    else if (value === true) el.setAttribute(key, "");
    else el.setAttribute(key, String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else if (child instanceof Node) el.appendChild(child);
    else el.appendChild(document.createTextNode(String(child)));
  }
}

export function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

export function replace(el, ...children) {
  clear(el);
  append(el, children);
  return el;
}

export function short(id, n = 8) {
  return id ? String(id).slice(0, n) : "";
}

export function fmtMs(ms) {
  if (ms === null || ms === undefined || Number.isNaN(ms)) return "";
  const v = Number(ms);
  if (v >= 100) return `${v.toFixed(1)} ms`;
  if (v >= 1) return `${v.toFixed(3)} ms`;
  if (v >= 0.001) return `${(v * 1000).toFixed(2)} µs`;
  return `${v.toExponential(2)} ms`;
}

export function fmtRatio(x) {
  if (x === null || x === undefined || !Number.isFinite(x)) return "";
  return `${x.toFixed(2)}×`;
}

export function fmtShape(shape) {
  if (!shape) return "";
  if (typeof shape === "string") return shape;
  return Object.keys(shape).sort().map((k) => `${k}=${shape[k]}`).join(",");
}

export function fmtDtype(dtype) {
  if (!dtype) return "";
  if (typeof dtype === "string") {
    if (dtype.startsWith("{")) {
      try { return fmtDtype(JSON.parse(dtype)); } catch { return dtype; }
    }
    return dtype;
  }
  return Object.keys(dtype).sort().map((k) => `${k}:${dtype[k]}`).join(" ");
}

export function fmtJson(obj) {
  if (obj === null || obj === undefined) return "";
  return JSON.stringify(obj);
}

export function parseTime(value) {
  if (!value) return null;
  // Naive ISO timestamps from the server are UTC.
  const s = /[zZ]|[+-]\d\d:?\d\d$/.test(value) ? value : `${value}Z`;
  const t = Date.parse(s);
  return Number.isNaN(t) ? null : t;
}

export function fmtTime(value) {
  const t = parseTime(value);
  if (t === null) return "";
  const d = new Date(t);
  const pad = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

export function fmtAge(value, now = Date.now()) {
  const t = parseTime(value);
  if (t === null) return "";
  const s = Math.max(0, Math.round((now - t) / 1000));
  if (s < 60) return `${s} s ago`;
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
  return `${Math.floor(s / 86400)} d ago`;
}

export function fmtDuration(startValue, endValue) {
  const a = parseTime(startValue);
  const b = endValue ? parseTime(endValue) : Date.now();
  if (a === null || b === null) return "";
  const s = Math.max(0, Math.round((b - a) / 1000));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

export const STATUSES = ["queued", "running", "succeeded", "failed", "cancelled"];
export const FINISHED = new Set(["succeeded", "failed", "cancelled"]);

export function statusBadge(status) {
  return h("span", { class: `badge status-${status}`, "data-status": status }, status || "?");
}

export function progressBar(done, total) {
  const pct = total > 0 ? Math.min(100, Math.round((100 * done) / total)) : 0;
  return h("div", { class: "progress", title: `${done} / ${total} trials` },
    h("div", { class: "progress-fill", style: `width:${pct}%` }),
    h("span", { class: "progress-text" }, `${done} / ${total}`));
}

// The list in a response that is either a bare array or an object holding one.
export function items(data, ...keys) {
  if (Array.isArray(data)) return data;
  if (data && typeof data === "object") {
    for (const k of [...keys, "items", "results", "data"]) if (Array.isArray(data[k])) return data[k];
  }
  return [];
}

// Hash routes: "#/jobs/abc?status=running" -> {parts: ["jobs", "abc"], query: URLSearchParams}
export function parseHash(hash) {
  const raw = (hash || "").replace(/^#\/?/, "");
  const [path, qs] = raw.split("?", 2);
  return { parts: path.split("/").filter(Boolean).map(decodeURIComponent), query: new URLSearchParams(qs || "") };
}

export function hashFor(parts, query) {
  const qs = query ? new URLSearchParams([...query].filter(([, v]) => v !== "" && v !== null)).toString() : "";
  return `#/${parts.map(encodeURIComponent).join("/")}${qs ? `?${qs}` : ""}`;
}

// Runs fn now and then every ms after each run completes, until stopped; skips while the tab is hidden.
export function poller(fn, ms, immediate = true) {
  let stopped = false;
  let timer = null;
  const tick = async () => {
    if (stopped) return;
    if (!document.hidden) {
      try { await fn(); } catch (err) { console.warn("poll failed", err); }
    }
    if (!stopped) timer = setTimeout(tick, ms);
  };
  if (immediate) tick(); else timer = setTimeout(tick, ms);
  return () => { stopped = true; if (timer) clearTimeout(timer); };
}

export function renderMath(el, latex, display = false) {
  if (window.katex) {
    window.katex.render(latex, el, { displayMode: display, throwOnError: false, trust: false, strict: "ignore", output: "html" });
  } else {
    el.textContent = latex;
  }
  return el;
}

export function highlighted(code, language) {
  const el = h("code", { class: `hljs language-${language}` });
  if (window.hljs && code.length < 500000) {
    el.innerHTML = window.hljs.highlight(code, { language, ignoreIllegals: true }).value; // hljs escapes the text
  } else {
    el.textContent = code;
  }
  return h("pre", { class: "code" }, el);
}

export function errorBox(err) {
  const status = err && typeof err.status === "number" ? err.status : null;
  const hint = status === 401 ? "Sign in with a token (top right)." : status === 403 ? "This token lacks the scope this needs." : "";
  return h("div", { class: "error-box", role: "alert" },
    h("strong", {}, status ? `Error ${status}: ` : "Error: "), (err && err.message) || String(err), hint ? h("div", {}, hint) : null);
}
