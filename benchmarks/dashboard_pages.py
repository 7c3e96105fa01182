"""Server time of every dashboard page with 1,000 jobs and 50,000 trials (a benchmark, not a test).

Seeds a fresh database through the service's models (``service.store.models``; specs through
``service.store.spec_store.ensure_spec``, so each carries its real derivation report): the catalog's specs,
``--jobs`` jobs over them in every status, ``--trials`` trials (one job holds ``--max-trials``
of them, the largest job page there can be; the rest are spread over the others), a kernel
with its bundle for each succeeded job, and a few workers. Then it times, in-process through
the real app (``service.api.create_app``, dashboard mounted), every API call each page makes,
and prints a Markdown table: per call the median and worst of ``--repeat`` runs, and per page
the sum of its calls' medians (the page's requests run in parallel in the browser, so the sum
is an upper bound on what a page waits for). The issue's target: every page under 300 ms.

SQLite (default: a fresh file in a temporary directory) or PostgreSQL (``--postgres URL``: a
temporary database is created next to the one named, and dropped afterwards):

    python benchmarks/dashboard_pages.py [--jobs 1000] [--trials 50000] [--repeat 7]
    python benchmarks/dashboard_pages.py --postgres postgresql+psycopg://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import sqlalchemy as sa

from fuser_core.catalog import PACKAGED_DIR

CATALOG = PACKAGED_DIR
STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
PAGE = 50  # rows per list page, as the dashboard asks (it requests PAGE + 1 to know if there are more)


# ----------------------------------------------------------------------------- seeding


def seed(url: str, *, n_jobs: int, n_trials: int, max_trials: int, seed_value: int = 0) -> dict:
    """Fill a migrated database; returns ids the page timings need."""
    from fuser_core.canonical import canonical_names
    from fuser_core.spec import load_spec
    from service.store import spec_store
    from service.store.db import make_engine, session_factory
    from service.store.models import Bundle, Job, KernelRecord, TrialRecord, WorkerRecord

    rng = random.Random(seed_value)
    engine = make_engine(url)
    sessions = session_factory(engine)
    specs = []
    t0 = time.perf_counter()
    with sessions() as s:
        for path in sorted(CATALOG.glob("*.json")):
            if path.name == "suites.json":
                continue
            text = path.read_text()
            spec = load_spec(text)
            record = spec_store.ensure_spec(s, spec, text)
            names = canonical_names(spec)
            canon_dims = [names[d] for d in spec.dims if not any(st.as_dim == d for st in spec.steps)]
            specs.append((record.spec_hash, canon_dims))
    print(f"seeded {len(specs)} specs (with derivations) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    t0 = time.perf_counter()
    now = datetime.now(UTC)
    job_rows, kernel_rows, bundle_rows = [], [], []
    used: set[tuple[str, str, str, str]] = set()
    for i in range(n_jobs):
        spec_hash, dims = specs[i % len(specs)]
        dtype, target = rng.choice(["float16", "bfloat16"]), rng.choice(["h100", "h200", "a100"])
        while True:  # one kernel per cache key: draw until the key is new
            shape = {d: 2 ** rng.randint(2, 12) for d in dims}
            if math.prod(shape.values()) > 2**26:  # keep every tensor within the generator's limits
                continue
            skey = ",".join(f"{d}={shape[d]}" for d in sorted(shape))
            if (spec_hash, skey, dtype, target) not in used:
                used.add((spec_hash, skey, dtype, target))
                break
        status = STATUSES[i % len(STATUSES)] if i else "succeeded"
        created = now - timedelta(seconds=10 * (n_jobs - i))
        job_id = uuid.uuid4().hex
        row = {
            "id": job_id, "spec_hash": spec_hash, "shape": shape, "shape_key": skey, "dtype": dtype,
            "target": target, "measurer": "model", "budget_trials": max_trials, "budget_seconds": 3600.0,
            "status": status,
            "error": "no valid configuration" if status == "failed" else None,
            "dedupe_key": None if status in ("failed", "cancelled") else hashlib.sha256(job_id.encode()).hexdigest(),
            "cancel_requested": False, "worker_id": "bench-worker-0" if status != "queued" else None,
            "lease_expires_at": None, "attempts": 1 if status != "queued" else 0, "trials_done": 0, "best": None,
            "kernel_id": None, "study_name": f"bench:{job_id}", "created_at": created,
            "started_at": created + timedelta(seconds=1) if status != "queued" else None,
            "finished_at": created + timedelta(seconds=5) if status in ("succeeded", "failed", "cancelled") else None,
            "updated_at": created,
        }
        if status == "succeeded":
            kernel_id = uuid.uuid4().hex
            content = json.dumps({"format": "foldwise-bundle/1", "job": job_id, "pad": "x" * 4000}).encode()
            digest = hashlib.sha256(content).hexdigest()
            bundle_rows.append({"sha256": digest, "content": content, "size": len(content), "created_at": created})
            t = rng.uniform(0.005, 2.0)
            kernel_rows.append({
                "id": kernel_id, "spec_hash": spec_hash, "shape": shape, "shape_key": skey, "dtype": row["dtype"],
                "target": row["target"],
                "triton_version": "bench", "generator_version": "bench", "strategy": "streaming_fused",
                "config": {"blocks": {dims[-1]: 64}, "num_warps": 4, "num_stages": 2, "split": 1}, "time_ms": t,
                "measurer": "model", "predicted": True, "bundle_sha256": digest, "job_id": job_id,
                "baselines": {"unfused_chain": {"time_ms": t * rng.uniform(1.2, 3.0), "predicted": True}},
                "created_at": created, "updated_at": created})
            row["kernel_id"] = kernel_id
        job_rows.append(row)
    # trials: the first job gets max_trials, the others share the rest
    counts = [0] * n_jobs
    counts[0] = min(max_trials, n_trials)
    left = n_trials - counts[0]
    for k in range(left):
        counts[1 + k % (n_jobs - 1)] += 1
    trial_rows = []
    for job, count in zip(job_rows, counts):
        best = None
        for number in range(count):
            ok = rng.random() > 0.1
            t = rng.uniform(0.005, 2.0) if ok else None
            trial_rows.append({
                "job_id": job["id"], "number": number, "worker_id": "bench-worker-0",
                "strategy": rng.choice(["streaming_fused", "split_fused", "row_resident", "multi_pass"]),
                "config": {"blocks": {"d1": 2 ** rng.randint(4, 10)}, "num_warps": 4, "num_stages": 2, "split": 1},
                "time_ms": t, "error": None if ok else "tile too large for shared memory",
                "state": "complete" if ok else "failed",
                "predicted": True, "source": "tpe", "created_at": job["created_at"] + timedelta(milliseconds=number)})
            if ok and (best is None or t < best["time_ms"]):
                best = {"strategy": trial_rows[-1]["strategy"], "config": trial_rows[-1]["config"], "time_ms": t,
                        "trial": number, "predicted": True}
        job["trials_done"] = count
        job["best"] = best
    with sessions() as s:
        s.execute(sa.insert(Bundle), bundle_rows)
        # kernels reference jobs loosely (no FK); jobs reference kernels: kernels first
        s.execute(sa.insert(KernelRecord), kernel_rows)
        s.execute(sa.insert(Job), job_rows)
        for start in range(0, len(trial_rows), 5000):
            s.execute(sa.insert(TrialRecord), trial_rows[start:start + 5000])
        s.execute(sa.insert(WorkerRecord), [
            {"id": f"bench-worker-{w}", "hostname": f"gpu-node-{w}", "gpu_name": "NVIDIA H100 80GB HBM3",
             "target": "h100", "measurer": "model",
             "versions": {"python": "3.11", "torch": "2.13.0", "triton": "3.x", "foldwise": "0.1.0"},
             "current_job_id": job_rows[1]["id"] if w == 0 else None, "started_at": now, "last_heartbeat": now}
            for w in range(8)])
        s.commit()
    print(f"seeded {n_jobs} jobs, {len(trial_rows)} trials, {len(kernel_rows)} kernels in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    engine.dispose()
    return {"big_job": job_rows[0]["id"], "spec": job_rows[0]["spec_hash"], "spec_hashes": [h for h, _ in specs],
            "running_spec": job_rows[1]["spec_hash"]}


# ----------------------------------------------------------------------------- timing


def page_calls(ids: dict) -> dict[str, list[tuple[str, str]]]:
    """page -> the (label, path) of every API call the dashboard's page makes."""
    names = "&".join(f"hash={h}" for h in ids["spec_hashes"])
    limit = f"limit={PAGE + 1}"
    return {
        "shell (/, auth)": [("GET /", "/"), ("auth/me", "/v1/auth/me")],
        "jobs": [("jobs list", f"/v1/jobs?{limit}&offset=0"), ("spec names", f"/v1/dashboard/specs?{names}")],
        "jobs, status=running": [("jobs list", f"/v1/jobs?status=running&{limit}&offset=0")],
        "jobs, spec filter": [("jobs list", f"/v1/jobs?spec_hash={ids['spec']}&{limit}&offset=0")],
        "jobs, target=h100, page 10": [("jobs list", f"/v1/jobs?target=h100&{limit}&offset=450")],
        "job (1000 trials)": [("job", f"/v1/jobs/{ids['big_job']}"), ("trials", f"/v1/jobs/{ids['big_job']}/trials"),
                              ("spec names", f"/v1/dashboard/specs?hash={ids['spec']}")],
        "spec": [("math", f"/v1/specs/{ids['spec']}/math"), ("source", f"/v1/specs/{ids['spec']}/source")],
        "kernels": [("kernels", f"/v1/dashboard/kernels?{limit}&offset=0"),
                    ("spec names", f"/v1/dashboard/specs?{names}")],
        "kernels, spec filter": [("kernels", f"/v1/dashboard/kernels?spec_hash={ids['spec']}&{limit}&offset=0")],
        "workers": [("workers", "/v1/workers")],
        "submit": [("catalog", "/v1/catalog"), ("options", "/v1/dashboard/options")],
    }


def time_pages(url: str, ids: dict, repeat: int) -> list[dict]:
    from fastapi.testclient import TestClient

    from service.api import create_app
    from service.settings import get_settings

    rows = []
    with TestClient(create_app(get_settings(db_url=url))) as client:
        for page, calls in page_calls(ids).items():
            medians = []
            for label, path in calls:
                first = _timed(client, path)  # cold: caches (derivation, LaTeX, generated source) empty
                times = [_timed(client, path) for _ in range(repeat)]
                med = statistics.median(times)
                medians.append(med)
                rows.append({"page": page, "call": label, "cold_ms": first, "median_ms": med, "max_ms": max(times)})
            rows.append({"page": page, "call": "**page total**", "cold_ms": None, "median_ms": sum(medians),
                         "max_ms": None})
    return rows


def _timed(client, path: str) -> float:
    start = time.perf_counter()
    r = client.get(path)
    elapsed = (time.perf_counter() - start) * 1000
    if r.status_code != 200:
        raise SystemExit(f"{path}: {r.status_code} {r.text[:300]}")
    return elapsed


def _fmt(v: float | None) -> str:
    return "" if v is None else f"{v:.1f}"


def table(rows: list[dict], title: str) -> str:
    out = [f"### {title}", "", "| page | call | cold ms | median ms | max ms |", "|---|---|---:|---:|---:|"]
    for r in rows:
        times = " | ".join(_fmt(r[k]) for k in ("cold_ms", "median_ms", "max_ms"))
        out.append(f"| {r['page']} | {r['call']} | {times} |")
    return "\n".join(out)


# ----------------------------------------------------------------------------- databases


@contextmanager
def sqlite_db() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="foldwise-bench-") as d:
        yield f"sqlite:///{Path(d) / 'bench.db'}"


@contextmanager
def postgres_db(admin_url: str) -> Iterator[str]:
    """A temporary database on the server of ``admin_url``, dropped afterwards."""
    name = f"foldwise_bench_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield sa.engine.make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--trials", type=int, default=50000)
    parser.add_argument("--max-trials", type=int, default=1000, help="trials of the largest job (the server's max)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--postgres", metavar="URL", help="run on PostgreSQL (a temporary database on this server)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args()
    if args.jobs < 2 or args.trials < 1:
        parser.error("--jobs must be at least 2 and --trials at least 1")

    from service.store.db import upgrade

    manager = postgres_db(args.postgres) if args.postgres else sqlite_db()
    backend = "PostgreSQL" if args.postgres else "SQLite"
    with manager as url:
        upgrade(url)
        ids = seed(url, n_jobs=args.jobs, n_trials=args.trials, max_trials=args.max_trials)
        rows = time_pages(url, ids, args.repeat)
    title = f"{backend}: {args.jobs} jobs, {args.trials} trials; server time per call (in-process TestClient)"
    print(table(rows, title))
    worst = max(r["median_ms"] for r in rows if r["call"] == "**page total**")
    print(f"\nslowest page (sum of its calls' medians): {worst:.1f} ms; target < 300 ms: "
          f"{'met' if worst < 300 else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"backend": backend, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
