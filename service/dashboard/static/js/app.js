// The dashboard's shell: hash routing, the token login, and which controls a token may see.
import { api, ApiError, getToken, setToken } from "./api.js";
import { errorBox, h, parseHash, replace } from "./util.js";
import * as jobs from "./pages/jobs.js";
import * as job from "./pages/job.js";
import * as spec from "./pages/spec.js";
import * as kernels from "./pages/kernels.js";
import * as kernel from "./pages/kernel.js";
import * as workers from "./pages/workers.js";
import * as submit from "./pages/submit.js";

// What the current token may do: {auth_enabled, name, scopes}. Reads need kernels:read (or
// nothing when auth is off); submit and cancel need jobs:write.
export const session = { authEnabled: true, name: null, scopes: new Set(), signedIn: false, problem: null };

export function can(scope) {
  return session.scopes.has(scope) || session.scopes.has("admin");
}

async function loadSession() {
  try {
    const me = await api("v1/auth/me");
    session.authEnabled = me.auth_enabled !== false;
    session.name = me.name ?? null;
    session.scopes = new Set(me.scopes || []);
    session.signedIn = Boolean(me.name) || !session.authEnabled;
    session.problem = null;
  } catch (err) {
    session.scopes = new Set();
    session.signedIn = false;
    session.name = null;
    session.problem = err instanceof ApiError && err.status === 401
      ? (getToken() ? "The token was refused: sign in again." : "Sign in with an API token to see this server.")
      : `Cannot reach the API: ${err.message}`;
  }
  renderAuth();
}

function renderAuth() {
  const status = document.getElementById("auth-status");
  if (!session.authEnabled) status.textContent = "auth off";
  else if (session.signedIn) status.textContent = `${session.name || "token"} · ${[...session.scopes].join(" ") || "no scopes"}`;
  else status.textContent = "signed out";
  document.body.classList.toggle("read-only", !can("jobs:write"));
  for (const a of document.querySelectorAll("#nav [data-needs]")) a.hidden = !can(a.dataset.needs);
  const banner = document.getElementById("banner");
  banner.hidden = !session.problem;
  banner.textContent = session.problem || "";
}

const ROUTES = [
  { match: (p) => p.length === 0 || (p[0] === "jobs" && p.length === 1), page: jobs, nav: "jobs" },
  { match: (p) => p[0] === "jobs" && p.length === 2, page: job, nav: "jobs" },
  { match: (p) => p[0] === "specs" && p.length === 2, page: spec, nav: null },
  { match: (p) => p[0] === "kernels" && p.length === 1, page: kernels, nav: "kernels" },
  { match: (p) => p[0] === "kernels" && p.length === 2, page: kernel, nav: "kernels" },
  { match: (p) => p[0] === "workers" && p.length === 1, page: workers, nav: "workers" },
  { match: (p) => p[0] === "submit" && p.length === 1, page: submit, nav: "submit" },
];

let cleanup = null;
let generation = 0;

async function route() {
  const { parts, query } = parseHash(location.hash);
  if (cleanup) { try { cleanup(); } catch (err) { console.warn(err); } cleanup = null; }
  const mine = ++generation;
  const main = document.getElementById("main");
  const found = ROUTES.find((r) => r.match(parts));
  for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", found && a.dataset.route === found.nav);
  if (!found) {
    replace(main, h("section", { class: "page" }, h("h1", {}, "Not found"), h("p", {}, "No page at ", h("code", {}, location.hash), ". ", h("a", { href: "#/jobs" }, "Jobs"))));
    return;
  }
  const page = h("section", { class: "page", "data-page": found.nav || parts[0] });
  replace(main, page);
  const ctx = {
    root: page, parts, query, can, session,
    navigate: (hash) => { location.hash = hash; },
    alive: () => mine === generation,
  };
  try {
    cleanup = (await found.page.render(ctx)) || null;
    if (mine !== generation && cleanup) { cleanup(); cleanup = null; }
  } catch (err) {
    console.warn(err);
    if (mine === generation) replace(page, errorBox(err));
  }
}

function setupLogin() {
  const dialog = document.getElementById("login-dialog");
  const input = document.getElementById("login-token");
  const error = document.getElementById("login-error");
  document.getElementById("login-button").addEventListener("click", () => {
    input.value = getToken();
    error.textContent = "";
    dialog.showModal();
  });
  document.getElementById("login-form").addEventListener("submit", async (event) => {
    const action = event.submitter ? event.submitter.value : "save";
    if (action === "cancel") return;
    event.preventDefault();
    if (action === "clear") {
      setToken("");
      dialog.close();
    } else {
      const token = input.value.trim();
      if (!token) { error.textContent = "Paste a token first."; return; }
      setToken(token);
      await loadSession();
      if (!session.signedIn && session.authEnabled) { error.textContent = session.problem || "The token was refused."; return; }
      dialog.close();
    }
    await loadSession();
    route();
  });
  window.addEventListener("foldwise:unauthorized", () => {
    if (session.signedIn || !session.problem) loadSession();
  });
}

async function start() {
  setupLogin();
  await loadSession();
  window.addEventListener("hashchange", route);
  if (!location.hash) history.replaceState(null, "", "#/jobs");
  await route();
}

start();
