"""``foldwise serve --processes 2`` with real processes on SQLite (service/serve.py).

The server runs two HTTP processes and one tuning process, all children of ``serve``; both
HTTP processes answer on the one port; the tuning worker (in its own process) registers in
the shared database; SIGTERM to ``serve`` stops every one of its processes (no orphans).
"""

from __future__ import annotations

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


def start_serve(tmp_path: Path, processes: int) -> tuple[subprocess.Popen, str, int]:
    """``foldwise serve --processes N --workers 1`` answering: (process, base URL, tuning process pid)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "FOLDWISE_MEASURER": "model", "TRITON_INTERPRET": "1"}
    with open(tmp_path / "serve.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--db",
                                   f"sqlite:///{tmp_path / 'f.db'}", "--port", str(port), "--processes",
                                   str(processes), "--workers", "1"],
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
    return server, base, int(workers[0]["id"].split("-")[-3])  # host-pid-random-tN (service.worker.new_worker_id)


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
