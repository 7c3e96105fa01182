"""What a client can make ``foldwise serve`` hold before authentication, at the sizes issue 37 (3)
measured: one unfinished 200 MB header, and 1,100 slow connections (heads never finished) against
the default limit of 1,000 connections. Before the limits, the header took the server from 89 to
485 MB, and the slow connections refused 90% of other clients while held.

A local ``foldwise serve --workers 0`` on SQLite with the shipped limits (service/http/limits.py:
heads of 64 KiB, 10 s, 1,000 connections). For each phase: the server's RSS before and after, and
a well-behaved client's ``GET /healthz`` one after another meanwhile (statuses, p50/p99).

Run: ``PYTHONPATH=. python3 benchmarks/http_limits.py [--header-mb 200] [--slow 1100] [--seconds 5]``.
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import resource
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.servers import LiveServer  # noqa: E402


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def probe(base: str, seconds: float) -> tuple[Counter, list[float]]:
    """A well-behaved client: GET /healthz one after another for ``seconds``, each on a new
    connection (as another client's would be)."""
    statuses: Counter = Counter()
    times: list[float] = []
    end = time.monotonic() + seconds
    with httpx.Client(base_url=base, timeout=10, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        while time.monotonic() < end:
            started = time.perf_counter()
            try:
                statuses[http.get("/healthz").status_code] += 1
            except httpx.HTTPError as err:
                statuses[type(err).__name__] += 1
            times.append((time.perf_counter() - started) * 1e3)
            time.sleep(0.02)
    return statuses, times


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def big_header(port: int, megabytes: int, result: dict) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
        chunk, sent = b"a" * (1 << 20), 0
        try:
            for _ in range(megabytes):
                sock.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        sock.settimeout(5)
        try:
            result["answer"] = sock.recv(200).split(b"\r\n")[0].decode()
        except (TimeoutError, ConnectionResetError):
            result["answer"] = "(none)"
        result["sent_mb"] = sent / (1 << 20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--header-mb", type=int, default=200)
    ap.add_argument("--slow", type=int, default=1100)
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.slow + 512)), hard))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        live = LiveServer(f"sqlite:///{Path(tmp) / 'foldwise.db'}", Path(tmp))
        try:
            statuses, times = probe(live.base, args.seconds)
            rows.append(("idle", rss_mb(live.proc.pid), rss_mb(live.proc.pid), statuses, times, ""))

            before, result = rss_mb(live.proc.pid), {}
            sender = threading.Thread(target=big_header, args=(live.port, args.header_mb, result))
            sender.start()
            statuses, times = probe(live.base, args.seconds)
            sender.join()
            rows.append((f"one {args.header_mb} MB header", before, rss_mb(live.proc.pid), statuses, times,
                         f"answered {result.get('answer')!r} after {result.get('sent_mb', 0):.1f} MB sent"))

            before, slow = rss_mb(live.proc.pid), []
            for _ in range(args.slow):
                sock = socket.create_connection(("127.0.0.1", live.port))
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never the blank line
                slow.append(sock)
            time.sleep(0.5)
            statuses, times = probe(live.base, args.seconds)
            held_rss = rss_mb(live.proc.pid)
            answers: Counter = Counter()
            for sock in slow:
                sock.settimeout(0.01)
                try:
                    answers[(sock.recv(40).split(b"\r\n")[0] or b"(closed)").decode()] += 1
                except (TimeoutError, ConnectionResetError, BlockingIOError):
                    answers["(held)"] += 1
                sock.close()
            rows.append((f"{args.slow} slow heads", before, held_rss, statuses, times,
                         "slow connections: " + ", ".join(f"{n} x {a}" for a, n in answers.most_common())))
        finally:
            live.stop()
    print("| phase | RSS before MB | RSS during/after MB | /healthz answers | p50 ms | p99 ms | note |")
    print("|---|---|---|---|---|---|---|")
    for phase, a, b, statuses, times, note in rows:
        answered = ", ".join(f"{n} x {s}" for s, n in statuses.most_common())
        print(f"| {phase} | {a:.0f} | {b:.0f} | {answered} | {pct(times, 0.5):.1f} | {pct(times, 0.99):.1f} | {note} |")


if __name__ == "__main__":
    main()
