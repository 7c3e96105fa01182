"""A range job for rmsnorm over t in [1, 16384] (issue 24, item 3), end to end on the CPU.

    python benchmarks/range_job_rmsnorm.py [--c 64] [--trials 2] [--out benchmarks/results/range_job_rmsnorm.md]

Runs the service's app in-process (Starlette's TestClient over a fresh SQLite database) with
one worker thread on the ``model`` measurer (predictions from the h100 profile: no GPU), submits
``POST /v1/jobs`` with ``"shape": {"t": {"min": 1, "max": 16384}, "c": C}`` (the default buckets:
powers of two, 15 of them) and waits for it. Then a ``KernelCache`` makes one ``get()`` for
t = 37 and calls the kernel at t = 1, 37, 1000 and 16384 through Triton's interpreter, counting
the HTTP requests the client sends after that first ``get()``, checking each result against a
float64 reference, and recording which bucket ran. Writes a Markdown table: per bucket the
chosen strategy and config and the predicted time; per call the bucket, the error and the
requests. Times are the cost model's predictions: not measured on GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors run through Triton's interpreter

import httpx  # noqa: E402


class Counting(httpx.BaseTransport):
    """Counts the requests sent through a TestClient (wraps its transport)."""

    def __init__(self, inner: httpx.BaseTransport):
        self.inner, self.count = inner, 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.count += 1
        return self.inner.handle_request(request)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--c", type=int, default=64, help="the hidden size (fixed)")
    ap.add_argument("--trials", type=int, default=2, help="budget.trials, per bucket")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/range_job_rmsnorm.md")
    args = ap.parse_args()

    import torch
    from fastapi.testclient import TestClient

    from fuser_core import spec_source
    from service.api import create_app
    from service.client import KernelCache
    from service.store.db import upgrade
    from service.settings import get_settings
    from service.worker.tuning import quiet_optuna
    from service.worker import run_worker

    quiet_optuna()
    raw = json.loads(spec_source("rmsnorm"))
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/foldwise.db"
        upgrade(url)
        settings = get_settings(db_url=url, lease_seconds=60.0, heartbeat_seconds=1.0, compile_binaries=False)
        stop = threading.Event()
        with TestClient(create_app(settings)) as http:
            body = {"spec": raw, "shape": {"t": {"min": 1, "max": 16384}, "c": args.c}, "measurer": "model",
                    "target": "h100", "budget": {"trials": args.trials, "seconds": 3600}}
            job = http.post("/v1/jobs", json=body).json()
            worker = threading.Thread(target=run_worker, args=(url,), daemon=True,
                                      kwargs={"measurer": "model", "target": "h100", "stop": stop, "poll_s": 0.05,
                                              "settings": settings})
            started = time.perf_counter()
            worker.start()
            try:
                while (view := http.get(f"/v1/jobs/{job['id']}").json())["status"] in ("queued", "running"):
                    time.sleep(0.2)
            finally:
                stop.set()
                worker.join(60)
            tuned_s = time.perf_counter() - started
            if view["status"] != "succeeded":
                print(f"job {view['status']}: {view.get('error')}", file=sys.stderr)
                return 1
            lookup = http.get("/v1/kernels", params={"spec_hash": job["spec_hash"], "shape": f"t=37,c={args.c}"}).json()

            counting = Counting(http._transport)
            http._transport = counting
            cache = KernelCache("http://testserver", cache_dir=Path(tmp) / "client", http_client=http)
            kernel = cache.get(raw, {"t": 37, "c": args.c})
            first = counting.count
            torch.manual_seed(0)
            w = torch.randn(args.c)
            calls = []
            for t in (1, 37, 1000, 16384):
                x = torch.randn(t, args.c)
                t0 = time.perf_counter()
                y = kernel(x=x, w=w)["y"]
                run_s = time.perf_counter() - t0
                ref = x.double() * torch.rsqrt((x.double() ** 2).mean(1, keepdim=True) + 1e-6) * w.double()
                err = float((y.double() - ref).norm() / ref.norm())
                calls.append((t, dict(kernel.last_bucket), err, counting.count - first, run_s))
            cache.close()

    lines = [
        "# Range job: rmsnorm over t ∈ [1, 16384]",
        "",
        f"Produced by `python benchmarks/range_job_rmsnorm.py --c {args.c} --trials {args.trials}` on "
        f"{platform.machine()} ({os.cpu_count()} CPUs), Python {platform.python_version()}, torch {torch.__version__}.",
        "",
        f"The job: `\"shape\": {{\"t\": {{\"min\": 1, \"max\": 16384}}, \"c\": {args.c}}}`, dtype float32, target h100, "
        f"measurer `model`, `budget.trials` {args.trials} per bucket ({view['progress']['trials_budget']} trials in "
        f"all, {view['progress']['trials_done']} run), tuned in {tuned_s:.1f} s by one worker thread on this host "
        "(each trial compiles its candidate for sm_90 on the CPU). **Times are the cost model's predictions for "
        "an H100: not measured on GPU.**",
        "",
        "## Buckets (default rule: powers of two within [min, max], plus max)",
        "",
        "| bucket t | strategy | config | predicted time (ms) |",
        "|---:|---|---|---:|",
    ]
    for b in lookup["range"]["buckets"]:
        cfg = b["config"]
        blocks = ", ".join(f"{k}={v}" for k, v in sorted(cfg.get("blocks", {}).items()))
        lines.append(f"| {b['shape']['d1']} | {b['strategy']} | blocks {blocks}; num_warps {cfg.get('num_warps')} "
                     f"| {b['time_ms']:.5f} |")
    lines += [
        "",
        "(Canonical names: d0 = c, d1 = t.)",
        "",
        f"## Calls: one `get(rmsnorm, t=37, c={args.c})`, then the kernel at each t",
        "",
        f"The first `get()` sent {first} requests (one lookup, one bundle download per bucket). Each call "
        "picks the smallest bucket ≥ t on the host and runs it through Triton's interpreter (CPU).",
        "",
        "| t | bucket run | normwise error vs float64 | HTTP requests since the get() | interpreter time (s) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for t, bucket, err, requests, run_s in calls:
        lines.append(f"| {t} | t={bucket['t']} | {err:.1e} | {requests} | {run_s:.2f} |")
    lines += ["", "Not measured on GPU.", ""]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
