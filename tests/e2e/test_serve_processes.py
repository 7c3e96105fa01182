"""``foldwise serve --processes 2`` with real processes on SQLite (service/serve.py).

The server runs two HTTP processes and one tuning process, all children of ``serve``; both
HTTP processes answer on the one port; the tuning worker (in its own process) registers in
the shared database; SIGTERM to ``serve`` stops every one of its processes (no orphans).
``serve --targets h100,a100`` runs a worker per target and gives their jobs back when it
stops; SIGTERM to a worker's whole process group (systemd's default) gives its job back.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.servers import free_port

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
ROOT = Path(__file__).resolve().parents[2]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (read from /proc; zombies are not counted)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def start_serve(tmp_path: Path, processes: int, *extra: str) -> tuple[subprocess.Popen, str, int]:
    """``foldwise serve --processes N --workers 1`` answering: (process, base URL, tuning process pid)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "FOLDWISE_MEASURER": "model", "TRITON_INTERPRET": "1"}
    with open(tmp_path / "serve.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--db",
                                   f"sqlite:///{tmp_path / 'f.db'}", "--port", str(port), "--processes",
                                   str(processes), "--workers", "1", *extra],
                                  stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=env)
    deadline = time.monotonic() + 90
    while True:
        assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        try:
            if httpx.get(base + "/healthz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "serve did not answer /healthz within 90 s"
        time.sleep(0.3)
    # the tuning worker runs in its own process and registers in the shared database
    deadline = time.monotonic() + 60
    while not httpx.get(base + "/v1/workers", timeout=5).json()["workers"]:
        assert time.monotonic() < deadline, "the tuning worker did not register within 60 s"
        time.sleep(0.5)
    workers = httpx.get(base + "/v1/workers", timeout=5).json()["workers"]
    # host-pid-random-target-tN (service.worker.new_worker_id, service.serve.tuning_process)
    return server, base, int(workers[0]["id"].split("-")[-4])


def test_serve_with_two_processes_stops_all_of_them(tmp_path: Path) -> None:
    server, base, worker_pid = start_serve(tmp_path, 2)
    try:

        spawned = [p for p in descendants(server.pid) if "multiprocessing.spawn" in cmdline(p)]
        assert len(spawned) == 3, [cmdline(p) for p in descendants(server.pid)]  # 2 HTTP + 1 tuning
        assert worker_pid in spawned

        # new connections are spread over both HTTP processes: both answer
        for _ in range(20):
            assert httpx.get(base + "/healthz", timeout=5).status_code == 200

        before = descendants(server.pid)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while alive := [p for p in before if running(p)]:
            assert time.monotonic() < deadline, f"left running after serve stopped: {[cmdline(p) for p in alive]}"
            time.sleep(0.2)
        with pytest.raises(httpx.HTTPError):
            httpx.get(base + "/healthz", timeout=2)
    finally:
        if server.poll() is None:
            server.kill()


def test_the_tuning_process_of_a_killed_serve_stops_by_itself(tmp_path: Path) -> None:
    server, base, worker_pid = start_serve(tmp_path, 1)
    try:
        assert worker_pid != server.pid and worker_pid in descendants(server.pid)
        server.kill()  # SIGKILL: serve cannot stop it
        server.wait(timeout=10)
        deadline = time.monotonic() + 15
        while running(worker_pid):
            assert time.monotonic() < deadline, "the tuning process outlived a killed serve"
            time.sleep(0.2)
    finally:
        if server.poll() is None:
            server.kill()
        if running(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)


def test_serve_targets_runs_a_worker_per_target_and_gives_jobs_back_on_stop(tmp_path: Path) -> None:
    """``serve --targets h100,a100``: a worker for each target takes that target's job; SIGTERM
    to serve stops it and both running jobs go back to the queue (not failed, no lost worker)."""
    from tests.support.catalog import load_catalog

    server, base, _ = start_serve(tmp_path, 1, "--targets", "h100,a100")
    try:
        deadline = time.monotonic() + 60
        while len(workers := httpx.get(base + "/v1/workers", timeout=5).json()["workers"]) < 2:
            assert time.monotonic() < deadline, f"two workers did not register: {workers}"
            time.sleep(0.5)
        assert sorted(w["target"] for w in workers) == ["a100", "h100"]
        raw = load_catalog()["safe_softmax"]
        jobs = []
        for target in ("h100", "a100"):
            r = httpx.post(base + "/v1/jobs", timeout=30, json={
                "spec": raw, "shape": {"m": 4, "n": 64}, "dtype": "float32", "target": target,
                "measurer": "model", "budget": {"trials": 400, "seconds": 600}})
            assert r.status_code == 202, r.text
            jobs.append(r.json()["id"])

        def view(job_id: str) -> dict:
            return httpx.get(f"{base}/v1/jobs/{job_id}", timeout=5).json()

        deadline = time.monotonic() + 120
        while not all(view(j)["status"] == "running" and view(j)["progress"]["trials_done"] >= 1 for j in jobs):
            assert time.monotonic() < deadline, [view(j) for j in jobs]
            time.sleep(0.5)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
    import sqlalchemy as sa

    engine = sa.create_engine(f"sqlite:///{tmp_path / 'f.db'}")
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT status, attempts, worker_id FROM jobs")).all()
    engine.dispose()
    assert sorted(rows) == [("queued", 0, None)] * 2, rows


def test_sigterm_to_a_workers_process_group_gives_its_job_back(tmp_path: Path) -> None:
    """systemd's default stop: SIGTERM to every process of the worker's group, its compile
    pool's processes included (killed here one by one too, as a cgroup kill does). The job goes
    back to the queue, as with SIGTERM to the worker alone (issue 26)."""
    import json as _json

    from fuser_core.spec import load_spec
    from service.store import job_queue
    from service.store.db import make_engine, session_factory, upgrade
    from service.tuning_request import tuning_request
    from tests.support.catalog import load_catalog

    url = f"sqlite:///{tmp_path / 'w.db'}"
    upgrade(url)
    engine = make_engine(url)
    sessions = session_factory(engine)
    raw = load_catalog()["safe_softmax"]
    with sessions() as s:
        job, _ = job_queue.submit_job(s, tuning_request(load_spec(raw), _json.dumps(raw), {"m": 4, "n": 64},
                                                        "float32", "h100", "model", 400, 600))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TRITON_INTERPRET": "1"}
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen([sys.executable, "-m", "service.cli", "worker", "--db", url, "--measurer", "model",
                                   "--target", "h100"], stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=env,
                                  start_new_session=True)  # its own group, as under systemd
    try:
        deadline = time.monotonic() + 120
        while True:
            with sessions() as s:
                row = job_queue.get_job(s, job.id)
            if row.status == "running" and row.trials_done >= 2 and descendants(worker.pid):
                break
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the worker did not start the job"
            time.sleep(0.3)
        children = descendants(worker.pid)
        os.killpg(worker.pid, signal.SIGTERM)
        for pid in children:  # a cgroup kill reaches the pool's processes even outside the group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        assert worker.wait(timeout=60) == 0, (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
    with sessions() as s:
        row = job_queue.get_job(s, job.id)
    engine.dispose()
    assert (row.status, row.worker_id, row.attempts, row.error) == ("queued", None, 0, None), row.error


def test_serve_refuses_an_unknown_name_in_targets(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--db", f"sqlite:///{tmp_path / 'f.db'}",
                           "--targets", "h100,z999"], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=120)
    assert done.returncode == 2 and "--targets" in done.stderr and "'z999'" in done.stderr, done.stderr
    assert not (tmp_path / "f.db").exists()  # refused before touching the database
