"""A derivation flood against a local ``foldwise serve`` (SQLite): does a cheap GET stay fast?

Issue 26: ten slow ``POST /v1/derivations`` at once used to raise a cheap GET's p99 from 26 ms
to about 400 ms, for 105 s after the clients had left (derivations ran in the API's threads,
holding the GIL, past their 503 and past their clients). Derivations now run in child
processes, bounded (service/api/derive.py): one deadline, a bounded pool and queue, stopped
when their client leaves.

Phases, each measuring ``GET /v1/jobs`` (a database read; and ``/healthz``) one after another:

1. ``idle``: nothing else, before the floods (and ``idle after``: once more at the end, where
   derivation work that outlived its requests would show);
2. ``flood``: 10 slow specs (tests/support/slow_specs.py, distinct) posted at once, their
   clients waiting for the answers (503 at the deadline, or 429 past the queue); ``--waves``
   times, one after another;
3. ``abandoned``: 10 more posted at once, their clients leaving after 0.5 s; measured from
   then for as long as a flood wave lasted (the work must stop with the clients).

``--flood`` picks what floods (issue 37, 2: each was measured at 6.5x to 59x idle's p99):

- ``derivations`` (the default): ``POST /v1/derivations`` of the slow specs, as above;
- ``jobs``: ``POST /v1/jobs`` of distinct specs (each parsed, derived and stored);
- ``math``: ``GET /v1/specs/{h}/math`` of distinct stored specs never asked before (5 a wave);
- ``source``: ``GET /v1/specs/{h}/source`` of distinct stored specs never asked before (12 a wave).

For ``math`` and ``source`` the specs are stored first (jobs of ``--steps``-step specs, outside
the measurement; ``--steps 12`` derives within the deadline, so the answers are 200).

Run: ``PYTHONPATH=. python3 benchmarks/derivation_flood.py [--deadline 5] [--steps 45] [--flood math]``.
Prints a Markdown table (p50/p99 per phase, the ratio to idle, the answers' statuses) and the
load average (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.servers import LiveServer  # noqa: E402
from tests.support.slow_specs import slow_spec  # noqa: E402


def measure(base: str, seconds: float, gap: float = 0.02) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"/v1/jobs": [], "/healthz": []}
    with httpx.Client(base_url=base, timeout=30) as http:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for path, times in out.items():
                t0 = time.perf_counter()
                r = http.get(path)
                times.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text
            time.sleep(gap)
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] * 1e3


def _flood_clients(base: str, requests: list[tuple[str, str, bytes]], leave_after: float | None, out: Any) -> None:
    """In a process of its own (its GIL is not the measuring client's): one thread per body, on
    a plain socket: an httpx client per request cost ~25 ms of CPU each (its SSL context, even
    for http://), ~270 ms at each wave's start on the server's two cores, which the server's
    probe saw as the API process waiting for a CPU."""
    statuses: Counter = Counter()
    host, port = base.removeprefix("http://").split(":")

    def post(method: str, path: str, body: bytes) -> None:
        with socket.create_connection((host, int(port)), timeout=120) as sock:
            sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                         + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            if leave_after is not None:  # a client that leaves
                time.sleep(leave_after)
                statuses["left"] += 1
                return
            answer = b""
            while chunk := sock.recv(65536):  # "Connection: close": the answer ends with the connection
                answer += chunk
        head, _, payload = answer.partition(b"\r\n\r\n")
        kind = json.loads(payload).get("type", "") if payload else ""
        statuses[f"{int(head.split()[1])} {kind.rsplit(':', 1)[-1] or 'ok'}"] += 1

    threads = [threading.Thread(target=post, args=request) for request in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(dict(statuses))


def job_body(steps: int, tag: int) -> bytes:
    return json.dumps({"spec": slow_spec(steps, tag=tag), "shape": {"m": 4, "n": 64}, "dtype": "float32",
                       "target": "h100", "measurer": "model", "budget": {"trials": 1}}).encode()


def flood_requests(kind: str, steps: int, offset: int, hashes: list[str]) -> list[tuple[str, str, bytes]]:
    """One wave of ``kind`` (module docstring); ``hashes``: stored specs not asked before."""
    if kind == "derivations":
        return [("POST", "/v1/derivations", json.dumps({"spec": slow_spec(steps, tag=offset + i)}).encode())
                for i in range(10)]
    if kind == "jobs":
        return [("POST", "/v1/jobs", job_body(steps, offset + i)) for i in range(10)]
    count = {"math": 5, "source": 12}[kind]
    return [("GET", f"/v1/specs/{hashes.pop()}/{kind}", b"") for _ in range(count)]


def store_specs(base: str, steps: int, count: int) -> list[str]:
    """The hashes of ``count`` distinct specs stored through jobs (outside the measurement)."""
    out = []
    with httpx.Client(base_url=base, timeout=120) as http:
        for i in range(count):
            r = http.post("/v1/jobs", content=job_body(steps, 5000 + i), headers={"Content-Type": "application/json"})
            assert r.status_code in (200, 201, 202), r.text
            out.append(r.json()["spec_hash"])
    return out


def flood(base: str, requests: list[tuple[str, str, bytes]], statuses: Counter, leave_after: float | None) -> list[Any]:
    """``requests`` sent at once from a child process; ``statuses`` counts the answers once it is
    joined (:func:`join`)."""
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    proc = context.Process(target=_flood_clients, args=(base, requests, leave_after, out))
    proc.start()
    proc.out, proc.statuses = out, statuses  # type: ignore[attr-defined]
    return [proc]


def join(procs: list[Any]) -> None:
    for proc in procs:
        proc.statuses.update(proc.out.get(timeout=300))
        proc.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deadline", type=float, default=5.0, help="FOLDWISE_DERIVE_TIMEOUT_SECONDS (issue 26: 5)")
    ap.add_argument("--steps", type=int, default=45, help="the slow spec's steps (45: 6 KB, ~10 s to derive)")
    ap.add_argument("--idle", type=float, default=12.0, help="seconds of idle measurement (half before, half after)")
    ap.add_argument("--repo", default=None, help="run the server from this checkout (e.g. the code before issue 26)")
    ap.add_argument("--waves", type=int, default=3, help="floods of 10, one after another")
    ap.add_argument("--flood", choices=("derivations", "jobs", "math", "source"), default="derivations")
    args = ap.parse_args()
    os.environ["FOLDWISE_DERIVE_TIMEOUT_SECONDS"] = str(args.deadline)
    if args.repo:
        import tests.support.servers as servers

        servers.REPO = Path(args.repo).resolve()  # the server's code (first on its PYTHONPATH)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        server = LiveServer(f"sqlite:///{tmp}/flood.db", Path(tmp))
        try:
            measure(server.base, 1.0)  # warm up
            per_wave = {"math": 5, "source": 12}.get(args.flood, 0)
            hashes = store_specs(server.base, args.steps, per_wave * (args.waves + 1))
            rows, statuses = {}, Counter()
            idle = measure(server.base, args.idle / 2)
            samples: dict[str, list[float]] = {"/v1/jobs": [], "/healthz": []}
            t0 = time.monotonic()
            for wave in range(args.waves):
                wave_requests = flood_requests(args.flood, args.steps, 10 * wave, hashes)
                threads = flood(server.base, wave_requests, statuses, None)  # measured from its start:
                # the API receiving ten specs at once is part of the flood
                while any(t.is_alive() for t in threads):
                    for path, times in measure(server.base, 0.5).items():
                        samples[path] += times
                join(threads)
            flood_s = (time.monotonic() - t0) / args.waves
            rows["flood"] = samples
            join(flood(server.base, flood_requests(args.flood, args.steps, 1000, hashes), statuses, 0.5))
            rows["abandoned"] = measure(server.base, max(flood_s, 3.0))
            rows = {"idle": idle, **rows, "idle after": measure(server.base, args.idle / 2)}
            log = server.log_path.read_text(errors="replace")
        finally:
            server.stop()
    load_after = os.getloadavg()
    idle = {path: pct(times, 0.99) for path, times in rows["idle"].items()}
    print(f"server code: {args.repo or 'this checkout'}")
    print(f"{args.flood} flood: {args.waves} waves of distinct specs of {args.steps} steps at once, deadline "
          f"{args.deadline:g} s, {flood_s:.1f} s a wave; answers: {dict(statuses)}")
    print(f"load average (1, 5, 15 min): before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}; {os.cpu_count()} CPUs\n")
    print("| phase | GET | n | p50 ms | p99 ms | p99 / idle p99 |")
    print("|---|---|---|---|---|---|")
    for phase, by_path in rows.items():
        for path, times in by_path.items():
            p99 = pct(times, 0.99)
            print(f"| {phase} | {path} | {len(times)} | {pct(times, 0.5):.2f} | {p99:.2f} | "
                  f"{p99 / idle[path]:.2f} |")
    workers = re.search(r'"derive_workers": (\d+)', log)
    gone, stopped = log.count("a derivation's client has gone"), log.count("derivation stopped")
    s503, s429 = log.count('"status": 503'), log.count('"status": 429')
    print(f"\nserver log: {workers.group(1) if workers else 'default (not logged)'} derivation workers; {gone} "
          f"clients gone while deriving, {stopped} derivations stopped (killed: deadline or nobody waiting); "
          f"{s503} answers 503, {s429} 429")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
