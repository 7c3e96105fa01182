// The JSON API, called with the bearer token kept in local storage. Paths are relative
// ("v1/jobs"), so the dashboard also works behind a reverse proxy that adds a prefix.

const TOKEN_KEY = "foldwise.token";

export function getToken() {
  try { return localStorage.getItem(TOKEN_KEY) || ""; } catch { return ""; }
}

export function setToken(token) {
  if (token) localStorage.setItem(TOKEN_KEY, token);
  else localStorage.removeItem(TOKEN_KEY);
}

export class ApiError extends Error {
  constructor(status, body, message) {
    super(message);
    this.status = status;
    this.body = body;
  }
}

function headers(extra = {}) {
  const out = { Accept: "application/json", ...extra };
  const token = getToken();
  if (token) out.Authorization = `Bearer ${token}`;
  return out;
}

export async function api(path, { method = "GET", body, signal } = {}) {
  const init = { method, headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }), signal };
  if (body !== undefined) init.body = JSON.stringify(body);
  const response = await fetch(path, init);
  const text = await response.text();
  let data = null;
  if (text) {
    try { data = JSON.parse(text); } catch { data = text; }
  }
  if (!response.ok) {
    const error = new ApiError(response.status, data, problemMessage(data, response));
    if (response.status === 401) window.dispatchEvent(new CustomEvent("foldwise:unauthorized", { detail: error }));
    throw error;
  }
  return data;
}

// One line for an error body: problem+json (title/detail), FastAPI's {detail: ...}, or text.
export function problemMessage(data, response) {
  if (data && typeof data === "object") {
    if (typeof data.detail === "string") return data.detail;
    const errs = fieldErrors(data);
    if (errs.length) return errs.map((e) => (e.path ? `${e.path}: ${e.message}` : e.message)).join("; ");
    if (typeof data.title === "string") return data.title;
  }
  if (typeof data === "string" && data) return data.slice(0, 300);
  return `${response.status} ${response.statusText}`;
}

// Errors with a location, from problem+json ("errors": [{loc|location|pointer|field, msg|message|detail}])
// or FastAPI's default ({"detail": [{"loc": ["body", "shape"], "msg": ...}]}).
// field: the location joined with dots, without the leading "body" ("budget.trials", "spec.steps.0.expr").
export function fieldErrors(data) {
  if (!data || typeof data !== "object") return [];
  const lists = [data.errors, data.invalid_params, Array.isArray(data.detail) ? data.detail : null];
  const out = [];
  for (const list of lists) {
    if (!Array.isArray(list)) continue;
    for (const e of list) {
      if (!e || typeof e !== "object") { out.push({ field: "", path: "", message: String(e) }); continue; }
      let loc = e.loc ?? e.location ?? e.field ?? e.name ?? e.pointer ?? "";
      if (typeof loc === "string") loc = loc.replace(/^#?\//, "").split(/[./]/).filter(Boolean);
      if (!Array.isArray(loc)) loc = [String(loc)];
      loc = loc.map(String);
      if (loc[0] === "body") loc = loc.slice(1);
      const field = loc.join(".");
      // path: the server's readable location ("spec.steps[2].expr"), with the step's name when given
      let path = typeof e.field === "string" && e.field ? e.field : field;
      if (e.step) path = path.replace(/(\[\d+\])/, `$1 (${e.step})`);
      out.push({ field, path, message: String(e.msg ?? e.message ?? e.detail ?? e.reason ?? "invalid") });
    }
  }
  if (!out.length && typeof data.detail === "string" && (data.location || data.field || data.loc)) {
    let loc = data.location ?? data.field ?? data.loc;
    if (Array.isArray(loc)) loc = loc.filter((x) => x !== "body").join(".");
    const field = String(loc).replace(/^body\.?/, "");
    out.push({ field, path: field, message: data.detail });
  }
  return out;
}

// Fetches a file with the token and hands it to the browser as a download.
export async function download(path, filename) {
  const response = await fetch(path, { headers: headers({ Accept: "application/json" }) });
  if (!response.ok) {
    const text = await response.text();
    let data = text;
    try { data = JSON.parse(text); } catch { /* text */ }
    throw new ApiError(response.status, data, problemMessage(data, response));
  }
  const blob = await response.blob();
  const url = URL.createObjectURL(blob);
  const a = document.createElement("a");
  a.href = url;
  a.download = filename;
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}
