"""Soak test of the service: a server and N workers against PostgreSQL, for a bounded time.

    python benchmarks/soak.py --minutes 10 [--db postgresql+psycopg://postgres@127.0.0.1:5432/test]
                              [--workers 3] [--interval 2] [--kill-every 40] [--lease 6]

Creates a fresh database on the server of ``--db`` (dropped at the end unless ``--keep``),
migrates it, starts ``foldwise serve --workers 0`` and N ``foldwise worker --measurer model``
subprocesses (this checkout's code: PYTHONPATH is set to it), then for ``--minutes``:

- submits a job every ``--interval`` s: catalog specs x small shapes, budgets of 3-12 or 30-60 trials,
  about one in five an exact duplicate of an earlier request (must answer the same job);
- asks about one in eight known jobs to cancel;
- every ``--kill-every`` s SIGKILLs a worker that holds a running job (any worker when none
  does) and starts a new one (its job is taken over once the lease expires);
- samples the server's RSS every 5 s.

Then it stops submitting, waits for the queue to drain, and checks:

- every job is succeeded (with a kernel), failed (with a reason) or cancelled;
- duplicate submissions answered the job of the first (while it was live);
- no trial is orphaned: no Optuna trial still RUNNING, and no trial row of ours whose job
  is not terminal;
- the server's RSS is flat: the mean of the last third of the samples grew less than
  ``--rss-growth`` % over the mean of the first third.

Prints the samples, a summary table and a verdict; exit 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import sqlalchemy as sa

from fuser_core.catalog import PACKAGED_DIR

REPO = Path(__file__).resolve().parents[1]
CATALOG = PACKAGED_DIR
SPECS = ["safe_softmax", "layernorm", "rmsnorm", "logsumexp", "moe_routing"]
TERMINAL = ("succeeded", "failed", "cancelled")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Soak:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        self.dir = Path(args.log_dir or f"/tmp/foldwise-soak-{uuid.uuid4().hex[:8]}")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1"),
                    "FOLDWISE_LEASE_SECONDS": str(args.lease), "FOLDWISE_HEARTBEAT_SECONDS": str(max(0.5, args.lease / 6)),
                    "FOLDWISE_CACHE_DIR": str(self.dir / "kernel-cache")}
        self.n = 0
        self.worker_ids: dict[int, str] = {}  # pid -> --worker-id
        self.workers: list[subprocess.Popen] = []
        self.specs = {name: json.loads((CATALOG / f"{name}.json").read_text()) for name in SPECS}
        self.counts: Counter[str] = Counter()
        self.sent: list[tuple[dict, str, str]] = []  # (body, job id, status at submission)
        self.duplicate_mismatch: list[str] = []
        self.rss: list[tuple[float, float]] = []
        self.rejected: list[str] = []

    def start(self, *args: str) -> subprocess.Popen:
        self.n += 1
        log = open(self.dir / f"{self.n:03d}-{args[0]}.log", "wb")  # noqa: SIM115 (the child writes it)
        return subprocess.Popen([sys.executable, "-m", "service.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                env=self.env, cwd=self.dir)

    def create_database(self) -> None:
        admin_url = self.args.db
        self.name = f"fw_soak_{uuid.uuid4().hex[:10]}"
        self.admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
        with self.admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{self.name}"'))
        self.url = sa.engine.make_url(admin_url).set(database=self.name).render_as_string(hide_password=False)
        subprocess.run([sys.executable, "-m", "service.cli", "db", "upgrade", "--db", self.url], env=self.env,
                       cwd=self.dir, check=True, capture_output=True, timeout=120)

    def drop_database(self) -> None:
        if not self.args.keep:
            with self.admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))
        self.admin.dispose()

    def start_worker(self, i: int) -> None:
        proc = self.start("worker", "--db", self.url, "--measurer", "model", "--target", "h100",
                          "--worker-id", f"soak-{i}", "--poll", "0.3")
        self.worker_ids[proc.pid] = f"soak-{i}"
        self.workers.append(proc)

    def pick_victim(self, client: httpx.Client) -> int:
        """A worker that holds a running job when there is one (so that its job is taken over),
        else any."""
        give_up = time.monotonic() + 5  # model-measured jobs run for about a second: wait for one
        while True:
            running = client.get("/v1/jobs", params={"status": "running"}).json()["jobs"]
            holders = {j["worker_id"] for j in running}
            busy = [i for i, proc in enumerate(self.workers) if self.worker_ids[proc.pid] in holders]
            if busy:
                self.counts["SIGKILLs of a worker holding a job"] += 1
                return self.rng.choice(busy)
            if time.monotonic() > give_up:
                return self.rng.randrange(len(self.workers))
            time.sleep(0.05)

    def body(self) -> dict:
        name = self.rng.choice(SPECS)
        raw = self.specs[name]
        dims = sorted({d for inp in raw["inputs"].values() for d in inp["dims"]})
        shape = {d: self.rng.choice([4, 8, 16, 32, 64, 96]) for d in dims}
        return {"spec": raw, "shape": shape, "dtype": "float32", "target": "h100", "measurer": "model",
                "budget": {"trials": self.rng.choice([self.rng.randint(3, 12), self.rng.randint(30, 60)]),
                           "seconds": 300}}  # the longer jobs are the ones a SIGKILL catches running

    # ------------------------------------------------------------------------- phases
    def run(self) -> int:
        a = self.args
        self.create_database()
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        server = self.start("serve", "--workers", "0", "--port", str(port), "--db", self.url)
        client = httpx.Client(base_url=base, timeout=60)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit(f"the server did not start; see {self.dir}")
                time.sleep(0.2)
            for i in range(a.workers):
                self.start_worker(i)
            t0 = time.monotonic()
            end = t0 + a.minutes * 60
            next_kill, next_sample, next_submit = t0 + a.kill_every, t0, t0
            print(f"soak: {a.minutes:g} min, {a.workers} workers, database {self.name}, logs {self.dir}", flush=True)
            while time.monotonic() < end:
                now = time.monotonic()
                if now >= next_sample:
                    self.rss.append((now - t0, rss_mib(server.pid)))
                    next_sample += 5
                if now >= next_submit:
                    self.submit(client)
                    next_submit += a.interval
                if now >= next_kill and self.workers:
                    proc = self.workers.pop(self.pick_victim(client))
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(10)
                    self.counts["workers SIGKILLed"] += 1
                    self.start_worker(100 + self.n)
                    next_kill += a.kill_every
                for proc in list(self.workers):  # a worker that exited by itself is a finding
                    if proc.poll() is not None:
                        self.counts["workers exited unasked"] += 1
                        self.workers.remove(proc)
                        self.start_worker(200 + self.n)
                time.sleep(0.05)
            print(f"submissions over after {time.monotonic() - t0:.0f} s; draining", flush=True)
            drained = self.drain(client, t0)
            self.rss.append((time.monotonic() - t0, rss_mib(server.pid)))
            return self.report(drained)
        finally:
            client.close()
            for proc in [*self.workers, server]:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in [*self.workers, server]:
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
            self.drop_database()

    def submit(self, client: httpx.Client) -> None:
        if self.sent and self.rng.random() < 0.2:
            body, first_id, _ = self.rng.choice(self.sent)
            duplicate = True
        else:
            body, first_id, duplicate = self.body(), None, False
        r = client.post("/v1/jobs", json=body)
        self.counts[f"POST /v1/jobs {r.status_code}"] += 1
        if r.status_code not in (200, 202):
            self.rejected.append(r.text[:160])
            return
        view = r.json()
        if duplicate:
            self.counts["duplicate submissions"] += 1
            live = client.get(f"/v1/jobs/{first_id}").json()["status"]
            if live in ("queued", "running", "succeeded") and view["id"] != first_id:
                # the first job is live: the same request must answer it (unless it ended just now)
                again = client.get(f"/v1/jobs/{first_id}").json()["status"]
                if again in ("queued", "running") or (again == "succeeded" and view["status"] != "succeeded"):
                    self.duplicate_mismatch.append(f"{first_id} -> {view['id']}")
        else:
            self.sent.append((body, view["id"], view["status"]))
        if self.sent and self.rng.random() < 0.125:  # cancel a recent job (likely queued or running)
            _, job_id, _ = self.rng.choice(self.sent[-4:])
            c = client.post(f"/v1/jobs/{job_id}/cancel")
            self.counts[f"cancel {c.status_code}"] += 1

    def drain(self, client: httpx.Client, t0: float) -> bool:
        deadline = time.monotonic() + self.args.drain_minutes * 60
        engine = sa.create_engine(self.url)
        try:
            while time.monotonic() < deadline:
                with engine.connect() as conn:
                    open_jobs = conn.execute(sa.text("SELECT count(*) FROM jobs WHERE status NOT IN "
                                                     "('succeeded','failed','cancelled')")).scalar()
                if open_jobs == 0:
                    print(f"drained at {time.monotonic() - t0:.0f} s", flush=True)
                    return True
                time.sleep(1)
            return False
        finally:
            engine.dispose()

    def report(self, drained: bool) -> int:
        engine = sa.create_engine(self.url)
        checks: dict[str, bool] = {"drained": drained}
        with engine.connect() as conn:
            statuses = dict(conn.execute(sa.text("SELECT status, count(*) FROM jobs GROUP BY status")).all())
            bad_success = conn.execute(sa.text("SELECT count(*) FROM jobs WHERE status='succeeded' AND "
                                               "kernel_id IS NULL")).scalar()
            bad_failed = conn.execute(sa.text("SELECT count(*) FROM jobs WHERE status='failed' AND "
                                              "(error IS NULL OR error = '')")).scalar()
            our_orphans = conn.execute(sa.text("SELECT count(*) FROM trials t JOIN jobs j ON j.id = t.job_id "
                                               "WHERE j.status NOT IN ('succeeded','failed','cancelled')")).scalar()
            optuna_running = conn.execute(sa.text(
                "SELECT s.study_name FROM optuna.trials t JOIN optuna.studies s ON s.study_id = t.study_id "
                "WHERE t.state = 'RUNNING'")).scalars().all()
            trials = conn.execute(sa.text("SELECT count(*) FROM trials")).scalar()
            kernels = conn.execute(sa.text("SELECT count(*) FROM kernels")).scalar()
            attempts = dict(conn.execute(sa.text("SELECT attempts, count(*) FROM jobs GROUP BY attempts")).all())
            failures = conn.execute(sa.text("SELECT left(error, 120), count(*) FROM jobs WHERE status='failed' "
                                            "GROUP BY 1 ORDER BY 2 DESC LIMIT 5")).all()
        engine.dispose()
        total = sum(statuses.values())
        checks["every job terminal"] = all(s in TERMINAL for s in statuses)
        checks["succeeded jobs have a kernel"] = bad_success == 0
        checks["failed jobs say why"] = bad_failed == 0
        checks["no trial of a non-terminal job"] = our_orphans == 0
        checks["no Optuna trial left RUNNING"] = not optuna_running
        checks["duplicates answered the same job"] = not self.duplicate_mismatch
        checks["no 5xx"] = not any(k.startswith("POST /v1/jobs 5") or k.startswith("cancel 5") for k in self.counts)
        values = [v for _, v in self.rss]
        third = max(1, len(values) // 3)
        first, last = sum(values[:third]) / third, sum(values[-third:]) / third
        growth = 100 * (last - first) / first
        checks[f"server RSS flat (< {self.args.rss_growth:g} % growth)"] = growth < self.args.rss_growth

        print("\nserver RSS samples (s: MiB): " + ", ".join(f"{t:.0f}: {v:.0f}" for t, v in self.rss))
        rows = [("jobs", total), *[(f"  {k}", v) for k, v in sorted(statuses.items())],
                ("trials recorded", trials), ("kernels", kernels),
                ("jobs by attempts", json.dumps(attempts, sort_keys=True)),
                *[(k, v) for k, v in sorted(self.counts.items())],
                ("duplicate mismatches", len(self.duplicate_mismatch)),
                ("Optuna trials RUNNING", len(optuna_running)),
                ("RSS first third / last third (MiB)", f"{first:.1f} / {last:.1f} ({growth:+.1f} %)")]
        width = max(len(r[0]) for r in rows)
        print("\n| what".ljust(width + 3) + " | value |")
        print("|" + "-" * (width + 2) + "|-------|")
        for name, value in rows:
            print(f"| {name.ljust(width)} | {value} |")
        if failures:
            print("\nfailure reasons (top 5):")
            for text, n in failures:
                print(f"  {n} x {text}")
        if self.rejected:
            print("\nrejected submissions (first 3):", *self.rejected[:3], sep="\n  ")
        if optuna_running:
            print("RUNNING Optuna trials in studies:", Counter(optuna_running).most_common(5))
        print("\nchecks:")
        for name, ok in checks.items():
            print(f"  {'PASS' if ok else 'FAIL'}  {name}")
        verdict = all(checks.values())
        print(f"\nverdict: {'PASS' if verdict else 'FAIL'}  (logs in {self.dir})")
        return 0 if verdict else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--db", default=os.environ.get("FOLDWISE_TEST_POSTGRES_URL",
                                                  "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
                   help="a PostgreSQL URL; a fresh database is created on its server")
    p.add_argument("--minutes", type=float, default=10.0, help="how long to submit (default 10)")
    p.add_argument("--drain-minutes", type=float, default=5.0, help="how long to wait for the queue to drain")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--interval", type=float, default=2.0, help="seconds between submissions")
    p.add_argument("--kill-every", type=float, default=40.0, help="seconds between worker SIGKILLs")
    p.add_argument("--lease", type=float, default=6.0, help="job lease seconds (how soon a dead worker's job moves)")
    p.add_argument("--rss-growth", type=float, default=20.0, help="allowed RSS growth, last vs first third, in %%")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir")
    p.add_argument("--keep", action="store_true", help="keep the database")
    args = p.parse_args(argv)
    if not args.db.startswith("postgresql"):
        p.error("--db: a PostgreSQL URL is needed (workers share the database)")
    return Soak(args).run()


if __name__ == "__main__":
    sys.exit(main())
