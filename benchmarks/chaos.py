"""Chaos run of the service on a PRIVATE PostgreSQL: database outage, worker and API kills.

    python benchmarks/chaos.py [--jobs 6] [--workers 3] [--trials 40] [--outage 20] [--max-minutes 10]
                               [--lease 12] [--out benchmarks/results/chaos_cpu.md]
                               [--phases outage,flaps,kills,serve] [--flaps 45] [--flap-window 134]

Everything runs on loopback, in a temporary directory, and is removed at the end:

- a PostgreSQL of its own (``initdb`` + ``pg_ctl`` from /usr/lib/postgresql/*/bin, on a free
  port, ``listen_addresses=127.0.0.1``, trust auth; run as the ``postgres`` user when started as
  root). The shared server on 5432 is never touched: stopping the database is the point.
- ``foldwise serve --workers 0`` (the API) and ``--workers`` ``foldwise worker --measurer model``
  processes (CPU only), each worker in a process group of its own, as systemd runs a service,
  so that a signal can go to its pid or to its whole group.

Then, in order, with a deadline of ``--max-minutes`` for the whole run:

1. submits ``--jobs`` jobs (safe_softmax at distinct shapes, ``--trials`` trials each);
2. once every worker holds a job that has recorded trials: **stops PostgreSQL** (``pg_ctl stop
   -m fast``) for ``--outage`` seconds, starts it again, and counts worker exits and failed jobs;
   With ``flaps`` among ``--phases``: **stops and starts PostgreSQL** ``--flaps`` times within
   ``--flap-window`` seconds (issue 37, 5: 45 in 134 s failed the running jobs), down half of each
   cycle; every job must go on and none fail;
3. **SIGTERM to a worker's pid**, then **SIGTERM to another worker's process group** (each
   holding a job): its job must go back to the queue (status queued, or claimed again, with the
   same ``attempts``, no error); a new worker is started for each (before each kill, when fewer
   jobs are live than workers, one more job is submitted per idle worker, so there is one to hold);
4. **SIGKILL** a worker holding a job (its job is taken over when the lease expires: one lost
   worker) and starts a new one;
5. **SIGKILL the API**, starts it again, and resubmits every request (a client's retry): each
   must answer its first job;
6. waits for every job to end (or the deadline);
7. starts ``foldwise serve --workers 1 --targets h100,a100`` (the API with a tuning process),
   submits a long job for each target, and once both are tuning sends ``serve`` SIGTERM: it
   must stop within 5 s and both jobs must be back in the queue (attempts unchanged).

It prints (and writes to ``--out``) a table: jobs, kills, restarts, lost, duplicated,
over-budget, worker exits, failed jobs, and the per-phase checks. Exit 0 when all checks hold.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import sqlalchemy as sa

REPO = Path(__file__).resolve().parents[1]
TERMINAL = ("succeeded", "failed", "cancelled")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivatePostgres:
    """initdb/pg_ctl in ``root``, on ``port``, loopback only."""

    def __init__(self, root: Path, port: int):
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl")) or [shutil.which("pg_ctl") or ""]
        if not found[-1]:
            raise SystemExit("pg_ctl not found (install postgresql)")
        self.bin, self.root, self.port = Path(found[-1]).parent, root, port
        self.data, self.log = root / "pgdata", root / "postgres.log"
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:  # initdb refuses root: the directory is the postgres user's
            shutil.chown(root, "postgres")

    def _run(self, *args: str) -> None:
        subprocess.run([*self.as_user, *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                       timeout=120)

    def init(self) -> None:
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")

    def start(self) -> None:
        opts = f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root} " \
               "-c fsync=off -c max_connections=200"
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "start")

    def stop(self) -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def url(self, db: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{db}"


class Chaos:
    def __init__(self, args: argparse.Namespace, root: Path):
        self.args, self.root = args, root
        self.pg = PrivatePostgres(root, free_port())
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.deadline = time.monotonic() + 60 * args.max_minutes
        self.env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                    "TRITON_INTERPRET": "1", "FOLDWISE_LEASE_SECONDS": str(args.lease),
                    "FOLDWISE_HEARTBEAT_SECONDS": str(max(0.5, args.lease / 6)),
                    "FOLDWISE_CACHE_DIR": os.environ.get("FOLDWISE_CACHE_DIR", str(root / "cache"))}
        self.api: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self.killed: set[int] = set()  # pids we signalled: their exit is not a "worker exit"
        self.counts = {"worker SIGKILL": 0, "worker SIGTERM (pid)": 0, "worker SIGTERM (group)": 0,
                       "API SIGKILL": 0, "worker restarts": 0, "API restarts": 0, "database stops": 0}
        self.checks: list[tuple[str, bool, str]] = []
        self.requests: list[dict] = []
        self.job_ids: list[str] = []
        self.log_no = 0

    # ------------------------------------------------------------------ processes
    def start(self, *args: str, group: bool = False) -> subprocess.Popen:
        self.log_no += 1
        log = open(self.root / f"{args[0]}-{self.log_no}.log", "wb")  # noqa: SIM115 - lives with the process
        return subprocess.Popen([sys.executable, "-m", "service.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                env=self.env, cwd=self.root, start_new_session=group)

    def start_api(self) -> None:
        self.api = self.start("serve", "--workers", "0", "--port", str(self.port), "--db", self.url)
        self.start_api_wait()

    def start_api_wait(self) -> None:
        assert self.api is not None
        until = time.monotonic() + 90
        while time.monotonic() < until:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base + "/healthz", timeout=2).status_code == 200:
                    return
            if self.api.poll() is not None:
                raise SystemExit(f"the API exited: see {self.root}")
            time.sleep(0.3)
        raise SystemExit("the API did not answer within 90 s")

    def start_worker(self) -> None:
        self.workers.append(self.start("worker", "--db", self.url, "--measurer", "model", "--target", "h100",
                                       group=True))

    def worker_exits(self) -> list[tuple[int, int]]:
        """(pid, rc) of workers that exited without being signalled by us."""
        return [(w.pid, w.returncode) for w in self.workers if w.poll() is not None and w.pid not in self.killed]

    # ------------------------------------------------------------------ database
    def db(self) -> sa.Engine:
        return sa.create_engine(self.url, pool_pre_ping=True)

    def jobs(self) -> dict[str, dict]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT id, status, attempts, worker_id, trials_done, budget_trials, error "
                                        "FROM jobs")).mappings().all()
        return {r["id"]: dict(r) for r in rows}

    def holder_job(self, worker: subprocess.Popen) -> dict | None:
        """The job a worker process holds (worker ids are host-pid-random)."""
        for job in self.jobs().values():
            if job["status"] == "running" and job["worker_id"] and f"-{worker.pid}-" in job["worker_id"]:
                return job
        return None

    def wait(self, what: str, predicate, timeout: float) -> bool:
        until = min(self.deadline, time.monotonic() + timeout)
        while time.monotonic() < until:
            with contextlib.suppress(sa.exc.OperationalError):
                if predicate():
                    return True
            time.sleep(0.5)
        print(f"  (timed out waiting for {what})", flush=True)
        return False

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append((name, ok, detail))
        print(f"  {'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)

    # ------------------------------------------------------------------ phases
    def run(self) -> int:
        a = self.args
        print(f"private PostgreSQL on 127.0.0.1:{self.pg.port} in {self.root}", flush=True)
        self.pg.init()
        self.pg.start()
        admin = sa.create_engine(self.pg.url(), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text('CREATE DATABASE "chaos"'))
        admin.dispose()
        self.url = self.pg.url("chaos")
        from service.store.db import upgrade

        upgrade(self.url)
        self.engine = self.db()
        try:
            self.start_api()
            for _ in range(a.workers):
                self.start_worker()
            self.submit()
            phases = a.phases.split(",")
            if "outage" in phases:
                self.outage()
            if "flaps" in phases:
                self.flapping()
            if "kills" in phases:
                self.sigterm(group=False)
                self.sigterm(group=True)
                self.sigkill_worker()
                self.kill_api()
            self.wait("every job to end", lambda: all(j["status"] in TERMINAL for j in self.jobs().values()),
                      timeout=1e9)
            if "serve" in phases:
                self.serve_stop()
            return self.report()
        finally:
            for p in [*self.workers, self.api]:
                if p is not None and p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL) if p in self.workers else p.kill()
            self.engine.dispose()
            with contextlib.suppress(Exception):
                self.pg.stop()

    def body(self, i: int) -> dict:
        from fuser_core.catalog import PACKAGED_DIR

        raw = json.loads((Path(PACKAGED_DIR) / "safe_softmax.json").read_text())
        return {"spec": raw, "shape": {"m": 4 * (1 + i % 4), "n": 64 * (1 + i // 4)}, "dtype": "float32",
                "target": "h100", "measurer": "model", "budget": {"trials": self.args.trials, "seconds": 3600}}

    def submit(self, n: int | None = None) -> None:
        print("submitting", flush=True)
        for _ in range(self.args.jobs if n is None else n):
            body = self.body(len(self.requests))
            r = httpx.post(self.base + "/v1/jobs", json=body, timeout=60)
            r.raise_for_status()
            self.requests.append(body)
            self.job_ids.append(r.json()["id"])

    def top_up(self) -> None:
        """A kill needs a worker holding a job: when the queue ran dry, one more job per worker."""
        live = sum(j["status"] in ("queued", "running") for j in self.jobs().values())
        if live < self.args.workers:
            self.submit(self.args.workers - live)

    def busy(self, n: int) -> bool:
        jobs = self.jobs().values()
        return sum(1 for j in jobs if j["status"] == "running" and j["trials_done"] >= 2) >= n

    def outage(self) -> None:
        a = self.args
        print(f"phase: database stopped for {a.outage} s during tuning", flush=True)
        self.wait("the workers to be tuning", lambda: self.busy(min(a.workers, a.jobs)), timeout=300)
        before = self.jobs()
        running = sorted(j["id"][:8] for j in before.values() if j["status"] == "running")
        self.pg.stop()
        self.counts["database stops"] += 1
        time.sleep(a.outage)
        exits_during = self.worker_exits()
        self.pg.start()
        # after the outage: every job that was running goes on (trials recorded again), none failed
        progressed = self.wait("tuning to go on after the outage", lambda: any(
            j["trials_done"] > before[i]["trials_done"] for i, j in self.jobs().items() if i in before), timeout=120)
        time.sleep(a.lease + 2)  # a lease after the database is back: a wrongful takeover would show by now
        after = self.jobs()
        failed = [i[:8] for i, j in after.items() if j["status"] == "failed"]
        taken = [i[:8] for i, j in after.items() if i in before and before[i]["status"] == "running"
                 and j["attempts"] > before[i]["attempts"]]
        self.check("outage: no worker exited", not exits_during and not self.worker_exits(),
                   f"exits={exits_during or self.worker_exits()} jobs running during it: {running}")
        self.check("outage: no job failed", not failed, f"failed={failed}")
        self.check("outage: no job counted a lost worker", not taken, f"taken over={taken}")
        self.check("outage: tuning went on", progressed)

    def flapping(self) -> None:
        """``--flaps`` stops and starts of PostgreSQL within ``--flap-window`` seconds while the
        workers tune (issue 37, 5: 45 in 134 s failed 2 of 2 running jobs): every job goes on."""
        a = self.args
        print(f"phase: database stopped and started {a.flaps} times in {a.flap_window:g} s during tuning", flush=True)
        self.top_up()
        self.wait("the workers to be tuning", lambda: self.busy(min(a.workers, a.jobs)), timeout=300)
        before = self.jobs()
        started = time.monotonic()
        for i in range(a.flaps):
            cycle_end = started + (i + 1) * a.flap_window / a.flaps
            self.pg.stop()
            self.counts["database stops"] += 1
            time.sleep(max(0.0, (cycle_end - time.monotonic()) / 2))  # down for half of what is left of the cycle
            self.pg.start()
            time.sleep(max(0.0, cycle_end - time.monotonic()))
        took = time.monotonic() - started
        progressed = self.wait("tuning to go on after the flapping", lambda: any(
            j["trials_done"] > before[i]["trials_done"] for i, j in self.jobs().items() if i in before), timeout=120)
        after = self.jobs()
        failed = [(i[:8], (j["error"] or "")[:80]) for i, j in after.items() if j["status"] == "failed"]
        self.check(f"flaps: {a.flaps} stops and starts in {took:.0f} s", took <= a.flap_window * 1.2 + 5)
        self.check("flaps: no worker exited", not self.worker_exits(), f"exits={self.worker_exits()}")
        self.check("flaps: no job failed", not failed, f"failed={failed}")
        self.check("flaps: tuning went on", progressed)

    def sigterm(self, *, group: bool) -> None:
        how = "group" if group else "pid"
        print(f"phase: SIGTERM to a worker's {how}", flush=True)
        pick: list = []

        def holding() -> bool:
            pick[:] = [(w, j) for w in self.workers if w.poll() is None and (j := self.holder_job(w))]
            return bool(pick)

        self.top_up()
        if not self.wait("a worker holding a job", holding, timeout=120):
            self.check(f"SIGTERM ({how}) gives the job back", False, "no worker held a job")
            return
        worker, job = pick[0]
        self.killed.add(worker.pid)
        if group:
            os.killpg(worker.pid, signal.SIGTERM)
        else:
            worker.send_signal(signal.SIGTERM)
        self.counts[f"worker SIGTERM ({how})"] += 1
        try:
            rc = worker.wait(60)
        except subprocess.TimeoutExpired:
            rc = None
        now = self.jobs()[job["id"]]
        back = now["error"] is None and now["attempts"] <= job["attempts"] and (
            now["status"] == "queued" or (now["status"] in ("running", "succeeded")
                                          and f"-{worker.pid}-" not in (now["worker_id"] or "")))
        self.check(f"SIGTERM ({how}) gives the job back", back and rc == 0,
                   f"rc={rc} job {job['id'][:8]}: {job['status']} attempts {job['attempts']} -> "
                   f"{now['status']} attempts {now['attempts']}")
        self.start_worker()
        self.counts["worker restarts"] += 1

    def sigkill_worker(self) -> None:
        print("phase: SIGKILL a worker", flush=True)
        pick: list = []

        def holding() -> bool:
            pick[:] = [w for w in self.workers if w.poll() is None and self.holder_job(w)]
            return bool(pick)

        self.top_up()
        self.wait("a worker holding a job", holding, timeout=120)
        victim = pick[0] if pick else next(w for w in self.workers if w.poll() is None)
        self.killed.add(victim.pid)
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(30)
        self.counts["worker SIGKILL"] += 1
        self.start_worker()
        self.counts["worker restarts"] += 1

    def kill_api(self) -> None:
        print("phase: SIGKILL the API, restart it, resubmit every request", flush=True)
        assert self.api is not None
        self.api.kill()
        self.api.wait(30)
        self.counts["API SIGKILL"] += 1
        self.start_api()
        self.counts["API restarts"] += 1
        same = 0
        for body, job_id in zip(self.requests, self.job_ids):
            r = httpx.post(self.base + "/v1/jobs", json=body, timeout=60)
            view = r.json()
            # a live or succeeded job answers the retry with itself; a failed one would start afresh
            same += view.get("id") == job_id
        self.resubmitted = same

    def serve_stop(self) -> None:
        print("phase: serve --targets h100,a100 with tuning workers, SIGTERM while both tune", flush=True)
        for w in self.workers:  # the API-only serve and the separate workers are done with
            if w.poll() is None:
                self.killed.add(w.pid)
                os.killpg(w.pid, signal.SIGTERM)
                w.wait(60)
        assert self.api is not None
        self.api.terminate()
        self.api.wait(60)
        self.api = self.start("serve", "--workers", "1", "--targets", "h100,a100", "--measurer", "model",
                              "--port", str(self.port), "--db", self.url)
        self.start_api_wait()
        ids = []
        for target in ("h100", "a100"):
            body = {**self.body(1000), "target": target, "budget": {"trials": 1000, "seconds": 3600}}
            ids.append(httpx.post(self.base + "/v1/jobs", json=body, timeout=60).json()["id"])
        ok = self.wait("both targets' jobs to tune", lambda: all(
            (j := self.jobs()[i])["status"] == "running" and j["trials_done"] >= 1 for i in ids), timeout=180)
        before = {i: self.jobs()[i]["attempts"] for i in ids}
        t0 = time.monotonic()
        self.api.send_signal(signal.SIGTERM)
        try:
            self.api.wait(60)
        except subprocess.TimeoutExpired:
            pass
        took = time.monotonic() - t0
        after = {i: self.jobs()[i] for i in ids}
        back = all(j["status"] == "queued" and j["attempts"] == before[i] - 1 for i, j in after.items())
        self.serve_stop_s = took
        self.check("serve --targets h100,a100: both targets' jobs were tuning", ok)
        self.check("serve stops within 5 s", took <= 5.0, f"{took:.1f} s")
        self.check("serve's stop gives both jobs back", back,
                   str({i[:8]: (j["status"], j["attempts"]) for i, j in after.items()}))
        with self.engine.begin() as conn:  # not part of the run's jobs: cancel them so the tables stay clean
            conn.execute(sa.text("UPDATE jobs SET status = 'cancelled', dedupe_key = NULL WHERE id = ANY(:ids)"),
                         {"ids": ids})

    # ------------------------------------------------------------------ report
    def budget_used(self, job: dict) -> int:
        """The trials of the job's study that used its budget, as the tuner counts them
        (tuner.budget_used: complete, pruned, and measurement failures; not a trial cut off by
        a dead worker or an outage, which is retried)."""
        import optuna

        from tuner import budget_used, make_storage

        with self.engine.connect() as conn:
            name = conn.execute(sa.text("SELECT study_name FROM jobs WHERE id = :i"), {"i": job["id"]}).scalar_one()
        storage = make_storage(self.url, heartbeat_interval=None)
        try:
            return budget_used(optuna.load_study(study_name=name, storage=storage))
        finally:
            storage.engine.dispose()

    def report(self) -> int:
        jobs = self.jobs()
        ours = [jobs[i] for i in self.job_ids if i in jobs]
        lost = [i[:8] for i in self.job_ids if i not in jobs or jobs[i]["status"] not in TERMINAL]
        # rows beyond one per request (serve_stop adds 2 of its own)
        duplicated = len(jobs) - len(self.job_ids) - (2 if "serve" in self.args.phases.split(",") else 0)
        over = [j["id"][:8] for j in ours if self.budget_used(j) > j["budget_trials"]]
        failed = [(j["id"][:8], (j["error"] or "")[:80]) for j in ours if j["status"] == "failed"]
        lost_workers = sum(max(0, j["attempts"] - 1) for j in ours)
        rows = [
            ("jobs", f"{len(self.job_ids)} submitted; " + ", ".join(
                f"{s} {sum(j['status'] == s for j in ours)}" for s in ("succeeded", "failed", "cancelled", "queued",
                                                                       "running"))),
            ("kills", f"database stops {self.counts['database stops']} (phases {self.args.phases}; outage "
                      f"{self.args.outage:g} s, {self.args.flaps} flaps in {self.args.flap_window:g} s), worker SIGKILL "
                      f"{self.counts['worker SIGKILL']}, SIGTERM pid {self.counts['worker SIGTERM (pid)']}, SIGTERM "
                      f"group {self.counts['worker SIGTERM (group)']}, API SIGKILL {self.counts['API SIGKILL']}"),
            ("restarts", f"workers {self.counts['worker restarts']}, API {self.counts['API restarts']}"),
            ("lost", f"{len(lost)} {lost or ''}"),
            ("duplicated", f"{duplicated} (resubmitted after the API kill: {getattr(self, 'resubmitted', 0)} of "
                           f"{len(self.job_ids)} answered their first job)"),
            ("over-budget", f"{len(over)} {over or ''} (trials that used the budget, as the tuner counts them, "
                            "beyond budget.trials)"),
            ("worker exits", f"{len(self.worker_exits())} {self.worker_exits() or ''}"),
            ("failed jobs", f"{len(failed)} {failed or ''}"),
            ("serve stop", f"{getattr(self, 'serve_stop_s', float('nan')):.1f} s (SIGTERM with a job tuning "
                           "for each of h100, a100)"),
            ("lost workers counted", f"{lost_workers} (attempts - 1 summed; the SIGKILL's takeover counts 1)"),
        ]
        self.check("end: no job lost", not lost)
        self.check("end: no duplicated job", duplicated == 0)
        self.check("end: no job over budget", not over)
        self.check("end: no worker exited by itself", not self.worker_exits())
        self.check("end: no failed job", not failed)
        width = max(len(k) for k, _ in rows)
        lines = ["| what | count |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows], "",
                 "| check | result | detail |", "|---|---|---|",
                 *[f"| {name} | {'ok' if ok else 'FAIL'} | {detail} |" for name, ok, detail in self.checks]]
        print()
        for k, v in rows:
            print(f"{k:<{width}}  {v}")
        verdict = all(ok for _, ok, _ in self.checks)
        print(f"\nverdict: {'all checks hold' if verdict else 'FAILED'}")
        if self.args.out:
            out = Path(self.args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            cmd = " ".join(["python benchmarks/chaos.py", *sys.argv[1:]])
            out.write_text(f"# Chaos run (CPU, model measurer, private PostgreSQL)\n\n`{cmd}`, "
                           f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n" + "\n".join(lines)
                           + f"\n\nverdict: {'all checks hold' if verdict else 'FAILED'}\n")
        return 0 if verdict else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=6)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--trials", type=int, default=40, help="each job's budget.trials")
    p.add_argument("--outage", type=float, default=20.0, help="seconds PostgreSQL stays stopped")
    p.add_argument("--lease", type=float, default=12.0, help="the workers' lease (heartbeat: a sixth)")
    p.add_argument("--phases", default="outage,kills,serve",
                   help="comma-separated, in this order: outage, flaps, kills, serve (default: all but flaps)")
    p.add_argument("--flaps", type=int, default=45, help="database stops and starts in the flaps phase")
    p.add_argument("--flap-window", type=float, default=134.0, help="seconds the flaps phase takes")
    p.add_argument("--max-minutes", type=float, default=10.0, help="deadline of the whole run")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "chaos_cpu.md"),
                   help="markdown table written here ('' for none)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="foldwise-chaos-"))
    os.chmod(root, 0o755)
    try:
        return Chaos(args, root).run()
    finally:
        if args.keep:
            print(f"logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
