"""End to end with real processes, on SQLite and on the real PostgreSQL: ``foldwise serve`` and
``foldwise worker`` subprocesses on a free loopback port.

One run per database:

1. (PostgreSQL) ``serve`` refuses a shared database that is not migrated (exit 2, says to run
   ``foldwise db upgrade``), which then migrates it; SQLite is migrated by ``serve`` itself;
2. a catalog spec is submitted over HTTP; worker A tunes it (model measurer, small budget);
3. a second, larger job: worker A is SIGKILLed in the middle of it, and worker B, started at
   once, takes it over after the (short) lease expires and finishes the same study;
4. meanwhile the server is restarted: every job submitted or finished before is still there,
   the same request still answers the same job;
5. the tuned kernel's bundle downloads, its sha256 verifies against the ETag (304 on a
   revalidation), and the client (service.client.KernelCache) loads it and its output matches
   the float64 reference, through Triton's interpreter.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from tests.support.catalog import load_catalog
from tests.support.servers import free_port

RAW = load_catalog()["safe_softmax"]
LEASE_S = 10  # short, so a takeover comes soon; a loaded 2-core CI host delays beats by seconds (at 5 s a
# CI run lost worker B's lease twice and failed the job after 3 claims)


class Procs:
    """The subprocesses of one test, each logging to a file; all killed at the end."""

    def __init__(self, tmp_path: Path):
        self.tmp_path, self.procs, self.n, self.t0 = tmp_path, [], 0, time.monotonic()
        self.env = {**os.environ, "FOLDWISE_LEASE_SECONDS": str(LEASE_S), "FOLDWISE_HEARTBEAT_SECONDS": "0.5",
                    "TRITON_INTERPRET": "1"}

    def mark(self, what: str) -> None:
        """Progress on stdout (shown with -s): where the time of this long test goes."""
        print(f"[e2e {time.monotonic() - self.t0:6.1f} s] {what}", flush=True)

    def start(self, *args: str) -> subprocess.Popen:
        self.n += 1
        log = open(self.tmp_path / f"{self.n:02d}-{args[0]}.log", "wb")  # noqa: SIM115 (the child writes it)
        proc = subprocess.Popen([sys.executable, "-m", "service.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                env=self.env, cwd=self.tmp_path)
        proc.log_path = log.name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)

    def logs(self) -> str:
        out = []
        for proc in self.procs:
            text = Path(proc.log_path).read_text(errors="replace")
            out.append(f"--- {' '.join(proc.args[3:])} (rc {proc.poll()}):\n{text[-3000:]}")
        return "\n".join(out)


def wait_for(predicate, timeout: float, what: str, procs: Procs):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{procs.logs()}")


def serve(procs: Procs, url: str | None, port: int, *extra: str) -> subprocess.Popen:
    db = ["--db", url] if url else []  # none: the default, a SQLite file in the working directory
    proc = procs.start("serve", *db, "--port", str(port), "--log-level", "info", *extra)
    wait_for(lambda: proc.poll() is not None or httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
             .status_code == 200, 60, "the server to answer /healthz", procs)
    assert proc.poll() is None, procs.logs()
    return proc


def worker(procs: Procs, url: str, name: str) -> subprocess.Popen:
    return procs.start("worker", "--db", url, "--measurer", "model", "--target", "h100", "--worker-id", name,
                       "--poll", "0.2", "--log-level", "info")


def job_request(shape: dict, trials: int) -> dict:
    return {"spec": RAW, "shape": shape, "dtype": "float32", "target": "h100", "measurer": "model",
            "budget": {"trials": trials, "seconds": 600}}


def test_service_end_to_end_with_a_killed_worker_and_a_restarted_server(service_db_url, tmp_path, capsys) -> None:
    from service.cli import main

    url, port = service_db_url, free_port()
    base = f"http://127.0.0.1:{port}"
    procs = Procs(tmp_path)
    http = httpx.Client(base_url=base, timeout=30)
    try:
        if url.startswith("sqlite"):
            assert url == f"sqlite:///{tmp_path / 'foldwise.db'}"
            server = serve(procs, None, port, "--workers", "0")  # creates and migrates ./foldwise.db itself
        else:  # a shared database: serve refuses it until `foldwise db upgrade`
            assert main(["serve", "--db", url, "--port", str(port)]) == 2
            assert "run `foldwise db upgrade --db" in capsys.readouterr().err
            assert main(["db", "upgrade", "--db", url]) == 0
            assert "database at revision" in capsys.readouterr().out
            server = serve(procs, url, port, "--workers", "0")
        procs.mark("server ready")
        worker_a = worker(procs, url, "worker-a")

        # a first job, tuned to the end by worker A
        first = http.post("/v1/jobs", json=job_request({"m": 2, "n": 32}, trials=3))
        assert first.status_code == 202 and first.headers["location"] == f"/v1/jobs/{first.json()['id']}"
        done = wait_for(lambda: (j := http.get(first.headers["location"]).json())["status"] == "succeeded" and j,
                        60, "the first job to succeed", procs)
        assert done["progress"] == {"trials_done": 3, "trials_budget": 3} and done["kernel_id"]
        procs.mark("first job done")

        # a second job: worker A dies in the middle of it; worker B (started meanwhile) takes over
        second = http.post("/v1/jobs", json=job_request({"m": 4, "n": 64}, trials=40)).json()
        job_url = f"/v1/jobs/{second['id']}"
        wait_for(lambda: http.get(job_url).json()["worker_id"] == "worker-a", 30, "worker A's claim", procs)
        worker_b = worker(procs, url, "worker-b")
        wait_for(lambda: http.get(job_url).json()["progress"]["trials_done"] >= 2, 60, "worker A's trials", procs)
        os.kill(worker_a.pid, signal.SIGKILL)
        worker_a.wait(timeout=10)
        before = http.get(job_url).json()
        assert before["status"] == "running" and before["worker_id"] == "worker-a", before
        procs.mark("worker A killed")

        # restart the server while the job is running (now with an in-process worker too)
        http.close()
        server.terminate()
        assert server.wait(timeout=30) == 0, procs.logs()
        server = serve(procs, url, port, "--workers", "1", "--measurer", "model")
        http = httpx.Client(base_url=base, timeout=30)
        procs.mark("server restarted")
        after = http.get(job_url).json()
        assert after["id"] == second["id"] and after["status"] in ("running", "succeeded")
        assert after["progress"]["trials_done"] >= before["progress"]["trials_done"]
        assert http.get(f"/v1/jobs/{done['id']}").json()["status"] == "succeeded"
        assert {j["id"] for j in http.get("/v1/jobs").json()["jobs"]} == {done["id"], second["id"]}
        again = http.post("/v1/jobs", json=job_request({"m": 4, "n": 64}, trials=40))
        assert again.json()["id"] == second["id"] and again.headers["foldwise-job-created"] == "false"

        final = wait_for(lambda: (j := http.get(job_url).json())["status"] in ("succeeded", "failed") and j,
                         90, "another worker to finish the job", procs)
        procs.mark("second job finished")
        assert final["status"] == "succeeded", f"{final['error']}\n{final}\n{procs.logs()}"
        assert final["attempts"] == 2 and final["worker_id"] != "worker-a"  # worker B or the server's own
        assert final["progress"]["trials_done"] >= 40
        trials = http.get(f"{job_url}/trials").json()["trials"]
        a_numbers = [t["number"] for t in trials if t["worker_id"] == "worker-a"]
        others = [t["number"] for t in trials if t["worker_id"] != "worker-a"]
        assert len(a_numbers) >= 2 and others and min(others) > min(a_numbers)  # one study, continued
        assert worker_b.poll() is None  # still serving the queue
        workers = {w["id"]: w for w in http.get("/v1/workers").json()["workers"]}
        assert workers["worker-b"]["alive"] and any(w.endswith("-t0") and workers[w]["alive"] for w in workers)

        # the kernel: lookup, bundle, ETag, 304, the client, the reference
        kernel = http.get("/v1/kernels", params={"spec_hash": final["spec_hash"], "shape": "m=4,n=64"}).json()
        assert kernel["id"] == final["kernel_id"] and kernel["exact_match"] is True
        r = http.get(kernel["bundle_url"])
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        bundle = json.loads(r.content)
        body = json.dumps({k: v for k, v in bundle.items() if k != "sha256"}, sort_keys=True, separators=(",", ":"))
        assert hashlib.sha256(body.encode("utf-8")).hexdigest() == bundle["sha256"] == kernel["bundle_sha256"]
        assert r.headers["etag"] == f'"{bundle["sha256"]}"'
        assert http.get(kernel["bundle_url"], headers={"If-None-Match": r.headers["etag"]}).status_code == 304
        assert bundle["measured"]["measurer"] == "model" and bundle["measured"]["predicted"] is True
        check_client(base, tmp_path)
        procs.mark("client checked")

        http.close()
        server.send_signal(signal.SIGTERM)  # a clean stop, in-process worker included
        assert server.wait(timeout=30) == 0, procs.logs()
        lines = [json.loads(x) for x in Path(server.log_path).read_text().splitlines() if x.startswith("{")]
        assert any(x["msg"] == "serving" and x["workers"] == 1 for x in lines)  # structured (JSON) logs
    finally:
        http.close()
        procs.kill_all()


def check_client(base: str, tmp_path: Path) -> None:
    import torch

    from fuser_core.reference import evaluate
    from fuser_core.spec import load_spec
    from service.client import KernelCache

    with KernelCache(base, cache_dir=tmp_path / "client-cache") as cache:
        kernel = cache.get(RAW, {"m": 4, "n": 64}, dtype="float32", target="h100")
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 4
    got = kernel(x=x)["y"].double().numpy()
    ref = evaluate(load_spec(RAW), {"m": 4, "n": 64}, {"x": x.double().numpy()})["y"]
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-7 * np.abs(ref).max())
    with KernelCache(base, cache_dir=tmp_path / "client-cache") as cache:  # a second client: from its disk cache
        again = cache.get(RAW, {"m": 4, "n": 64}, dtype="float32", target="h100")
    np.testing.assert_array_equal(again(x=x)["y"].numpy(), got.astype(np.float32))
