"""Real server processes for tests: a free loopback port, the environment of a service
subprocess, and ``LiveServer`` (``foldwise serve --workers 0`` on a migrated database), which the
API fuzz, security and data-safety tests all start."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def service_env() -> dict[str, str]:
    """The environment of a service subprocess: this checkout's code first (an editable install
    elsewhere must not be what is tested), Triton on the CPU."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "TRITON_INTERPRET": "1"}


class LiveServer:
    """``foldwise serve --workers 0`` on a free loopback port, over ``db_url`` (migrated here)."""

    def __init__(self, db_url: str, tmp_path: Path, *extra: str):
        self.db_url, self.port = db_url, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"serve-{self.port}.log"
        env = service_env()
        subprocess.run([sys.executable, "-m", "service.cli", "db", "upgrade", "--db", db_url], env=env,
                       cwd=tmp_path, check=True, capture_output=True, timeout=120)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "service.cli", "serve", "--workers", "0", "--port", str(self.port),
                 "--db", db_url, *extra], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()
            try:
                if httpx.get(self.base + "/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"the server did not answer /healthz in 60 s\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
