"""Writing a bench's results: ``bench_<suite>.json`` (every number and setting), ``.md`` (the
times, ratios, targets and failures as tables) and ``.png`` (speed-ups as grouped bars,
matplotlib with the Agg backend); CPU-interpreter results are labelled as such in each.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tuner.bench.targets import TARGETS
from tuner.bench.variants import BASELINES, EXPERT_PREFIX, LABELS, label_of
from tuner.device.timing import CPU_LABEL


def write_outputs(results: Mapping[str, Any], out_dir: Path) -> dict[str, Path]:
    """``bench_<suite>.json``, ``.md`` and ``.png`` in ``out_dir`` (created)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench_{results['suite']}"
    paths = {"json": out_dir / f"{stem}.json", "markdown": out_dir / f"{stem}.md", "png": out_dir / f"{stem}.png"}
    write_json(results, paths["json"])
    paths["markdown"].write_text(markdown(results))
    write_plot(results, paths["png"])
    return paths


def write_json(results: Mapping[str, Any], path: Path) -> None:
    body = {k: v for k, v in results.items() if k != "files"}
    Path(path).write_text(json.dumps(body, indent=2, sort_keys=False, default=str) + "\n")


def _ms(v: Mapping[str, Any] | None) -> str:
    if not v:
        return "-"
    status = v.get("status")
    if status == "ok":
        return f"{v['time_ms']:.4g}"
    if status == "none":
        return "none"
    if status == "skipped":
        return "skipped"
    if status == "wrong":
        err = (v.get("check") or {}).get("max_rel_err")
        return f"WRONG (err {err:.2g})" if isinstance(err, float) else "WRONG"
    return f"FAILED ({v.get('failure') or 'error'})"


def _percent(bw: Mapping[str, Any] | None) -> str:
    return "-" if not bw else f"{100 * bw['fraction_of_copy']:.0f}%"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}x"


_MARK = {"met": "met", "missed": "**missed**", "n/a": "n/a", "not measured": "not measured",
         "not evaluated": "not evaluated"}


def markdown(results: Mapping[str, Any]) -> str:
    """The results as Markdown: a header (device, date, versions), the times and ratios, the
    targets, and every failure with its message."""
    gpu = results.get("gpu")
    dev = results.get("device", {})
    v = results.get("versions", {})
    lines = [f"# foldwise bench: suite `{results['suite']}`", ""]
    if not gpu:
        lines += [(f"> **{CPU_LABEL}.** Kernels ran in Triton's interpreter at reduced shapes: these times "
                   "exercise the "
                   "pipeline and say nothing about GPU performance; targets are not evaluated."), ""]
    copy = results.get("copy_bandwidth", {})
    copy_txt = (f"{copy['bytes_per_s'] / 1e9:.1f} GB/s" if copy.get("bytes_per_s")
                else f"unavailable ({copy.get('error')})")
    lines += [
        f"- device: {dev.get('device_name')} ({'GPU' if gpu else 'CPU'}); target profile `{results.get('target')}`",
        f"- date: {results.get('date')}",
        "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        (f"- timing: {results.get('timing_label')}; median of the timed runs; tuning trials per case: "
         f"{results['settings']['trials']}"),
        f"- copy bandwidth (read + write): {copy_txt}",
        "- speed-ups are baseline time / fused time (above 1: the fused kernel is faster)",
        "",
        ("| case | dtype | fused (strategy) ms | unfused chain ms | torch eager ms | torch.compile ms "
         "| hand-written ms "
         "| chain / fused | compile / fused | hand-written / fused | BW / copy |"),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    skipped = [c for c in results["cases"] if "skipped" in c]
    ran = [c for c in results["cases"] if "skipped" not in c]
    for c in ran:
        var = c["variants"]
        strategy = c.get("tuning", {}).get("strategy")
        fused = _ms(var.get("fused")) + (f" ({strategy})" if strategy else "")
        bw = c.get("bandwidth")
        dtype = sorted(set(c["dtype"].values()))
        name = c["id"] if c["shape"] == c["suite_shape"] else (
            f"{c['id']} run at " + ",".join(f"{k}={v}" for k, v in c["shape"].items()))
        lines.append(
            f"| {name} | {'/'.join(dtype)} | {fused} | {_ms(var.get('chain'))} | {_ms(var.get('eager'))} | "
            f"{_ms(var.get('compile'))} | {_ms(var.get('handwritten'))} | {_ratio(c['speedup'].get('chain'))} | "
            f"{_ratio(c['speedup'].get('compile'))} | {_ratio(c['speedup'].get('handwritten'))} | "
            f"{_percent(bw)} |")
    lines += ["", "## Targets", "", "| case | " + " | ".join(TARGETS[t][0] for t in TARGETS) + " |",
              "|---|" + "---|" * len(TARGETS)]
    for c in ran:
        cells = []
        for name in TARGETS:
            t = c["targets"][name]
            value = t["value"]
            shown = "" if value is None or t["status"] == "n/a" else (
                f" ({100 * value:.0f}%)" if name == "copy_bw_80" else f" ({value:.2f}x)")
            cells.append(_MARK[t["status"]] + shown)
        lines.append(f"| {c['id']} | " + " | ".join(cells) + " |")
    summary = results.get("summary", {})
    lines += ["", "Summary: " + "; ".join(
        f"{TARGETS[n][0]}: " + ", ".join(f"{k} {v}" for k, v in sorted(s.items())) for n, s in summary.items())]
    expert_rows = [(c, kind[len(EXPERT_PREFIX):], val) for c in ran for kind, val in c["variants"].items()
                   if kind.startswith(EXPERT_PREFIX)]
    if expert_rows:
        lines += ["", "## Experts", "", "fused / expert is the fused kernel's time over the expert's (below 1: "
                  "the fused kernel is faster).", "", "| case | expert | expert ms | fused ms | fused / expert |",
                  "|---|---|---|---|---|"]
        for c, name, val in expert_rows:
            up = c.get("expert_speedup", {}).get(name)
            shown = val.get("reason", "") if val.get("status") in ("none", "skipped") else ""
            lines.append(f"| {c['id']} | {name} | {_ms(val)}{' ' + shown if shown else ''} | "
                         f"{_ms(c['variants'].get('fused'))} "
                         f"| {'-' if not up else f'{1 / up:.3g}'} |")
    if skipped:
        lines += ["", "## Not run", "", *(f"- {c['id']}: {c['skipped']}" for c in skipped)]
    problems = []
    for c in ran:
        for kind, val in c["variants"].items():
            if val.get("status") in ("wrong", "failed"):
                problems.append(f"- {c['id']} {label_of(kind)}: {val['status']}: {val.get('error')}")
    if problems:
        lines += ["", "## Failures", "", *problems]
    return "\n".join(lines) + "\n"


def write_plot(results: Mapping[str, Any], path: Path) -> None:
    """Grouped bars: per case, each baseline's time over the fused kernel's (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in results["cases"] if "skipped" not in c]
    kinds = [k for k in BASELINES if any(c["speedup"].get(k) for c in cases)]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(cases) + 2), 4.5))
    width = 0.8 / max(1, len(kinds))
    for j, kind in enumerate(kinds):
        xs = [i + (j - (len(kinds) - 1) / 2) * width for i in range(len(cases))]
        ys = [c["speedup"].get(kind) or float("nan") for c in cases]  # no bar where there is no ratio
        ax.bar(xs, ys, width, label=LABELS[kind])
    ax.axhline(1.0, color="black", linewidth=0.8)
    if "chain" in kinds:
        ax.axhline(TARGETS["chain_2x"][1], color="grey", linewidth=0.8, linestyle="--", label="2x (chain target)")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([c["id"] for c in cases], rotation=30, ha="right", fontsize=7)
    if any((c["speedup"].get(k) or 0) > 0 for c in cases for k in kinds):
        ax.set_yscale("log")
    ax.set_ylabel("baseline time / fused time (higher: fused faster)")
    title = f"foldwise bench {results['suite']}: {results['device'].get('device_name')}"
    if not results.get("gpu"):
        title += f"\n{CPU_LABEL}"
    ax.set_title(title, fontsize=9)
    if kinds:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["markdown", "write_json", "write_outputs", "write_plot"]
