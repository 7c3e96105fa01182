// Workers: GPU, target, versions, last heartbeat, current job; refreshed every 2 s.
import { api } from "../api.js";
import { fmtAge, fmtTime, h, items, parseTime, poller, replace, short } from "../util.js";

const STALE_S = 30;

export async function render(ctx) {
  const tbody = h("tbody", { id: "workers-body" });
  const info = h("p", { class: "muted", id: "workers-info" });
  replace(ctx.root,
    h("div", { class: "page-head" }, h("h1", {}, "Workers")),
    h("table", { class: "grid", id: "workers-table" },
      h("thead", {}, h("tr", {}, ["worker", "host", "GPU", "target", "measurer", "versions", "started", "last heartbeat", "current job"].map((c) => h("th", {}, c)))),
      tbody),
    info);
  const refresh = async () => {
    const data = await api("v1/workers");
    if (!ctx.alive()) return;
    const list = items(data, "workers");
    const now = Date.now();
    replace(tbody, list.map((w) => {
      const beat = parseTime(w.last_heartbeat);
      const stale = beat === null || (now - beat) / 1000 > STALE_S;
      const versions = w.versions || {};
      return h("tr", { "data-worker": w.id, class: stale ? "stale" : "" },
        h("td", { class: "mono" }, w.id),
        h("td", {}, w.hostname || ""),
        h("td", {}, w.gpu_name || h("span", { class: "muted" }, "none")),
        h("td", {}, w.target),
        h("td", {}, w.measurer),
        h("td", { class: "small" }, Object.keys(versions).sort().map((k) => h("div", {}, `${k} ${versions[k] ?? "—"}`))),
        h("td", { class: "muted" }, fmtTime(w.started_at)),
        h("td", { title: fmtTime(w.last_heartbeat) }, fmtAge(w.last_heartbeat, now), stale ? h("span", { class: "badge status-failed" }, "stale") : null),
        h("td", {}, w.current_job_id ? h("a", { href: `#/jobs/${encodeURIComponent(w.current_job_id)}`, class: "mono" }, short(w.current_job_id)) : h("span", { class: "muted" }, "idle")));
    }));
    info.textContent = list.length ? `${list.length} worker(s); stale = no heartbeat for ${STALE_S} s` : "No worker has registered.";
  };
  await refresh();
  return poller(refresh, 2000, false);
}
