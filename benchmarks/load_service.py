"""Loopback load benchmark of the API: bundle downloads and idempotent job submissions.

    python benchmarks/load_service.py [--clients 64] [--requests 6000] [--seconds 20] [--rate 1000]

What it does (bounded in count and time):

1. prepares an SQLite database in a temporary directory: one catalog spec tuned once by an
   in-process worker (model measurer, a few trials), so one kernel and its bundle exist;
2. starts ``foldwise serve --workers 0 --processes N`` (``--processes``, default 1) on a free
   loopback port (API only, so no tuning competes for the CPU) and waits for ``/healthz``;
3. runs each scenario with ``--clients`` concurrent clients (asyncio, one ``httpx.AsyncClient``
   and one keep-alive connection per client; a single shared AsyncClient pool is much slower
   at this concurrency), each until ``--requests`` requests or ``--seconds`` have passed:

   - ``bundle``: ``GET /v1/kernels/{id}/bundle`` (200, the full bundle);
   - ``bundle-304``: the same with ``If-None-Match`` (304, what a warm client sends);
   - ``submit``: ``POST /v1/jobs`` with the request that created the kernel's job (200: the same job);

   in two modes: **closed loop** (every client sends its next request when the previous one
   answers: the most the server does; by Little's law the latency is then about
   clients / throughput) and, with ``--rate``, **open loop** (requests start on a fixed
   schedule of ``--rate`` per second over all clients; latency is measured from the
   scheduled start, so a stalled server is not hidden);
4. prints a table: requests, errors, requests/s, client-side p50/p99 latency, and the
   server-side p50/p99 (from the ``foldwise_http_request_duration_seconds`` histogram,
   bucket upper bounds: request handling inside the app, without the client and the
   HTTP parsing).

The client and the server share this machine's cores: on a 2-core machine the client (httpx
is pure Python) takes about as much CPU as the server, so the numbers are a lower bound of
what the server does with the machine to itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from fuser_core.catalog import PACKAGED_DIR

ROOT = Path(__file__).resolve().parents[1]
CATALOG = PACKAGED_DIR
SPEC, SHAPE = "safe_softmax.json", {"m": 4, "n": 64}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare(db_url: str) -> dict:
    """Tune the benchmark's job once (in this process) and return its submission request."""
    from service.store.db import make_engine, session_factory, upgrade
    from service.worker import run_worker

    upgrade(db_url)
    request = {"spec": json.loads((CATALOG / SPEC).read_text()), "shape": SHAPE, "dtype": "float32",
               "target": "h100", "measurer": "model", "budget": {"trials": 4, "seconds": 600}}
    from fastapi.testclient import TestClient

    from service.api import create_app
    from service.settings import get_settings

    with TestClient(create_app(get_settings(db_url=db_url), dashboard=False)) as client:
        r = client.post("/v1/jobs", json=request)
        assert r.status_code == 202, r.text
    run_worker(db_url, measurer="model", target="h100", once=True)
    engine = make_engine(db_url)
    with session_factory(engine)() as s:
        from service.store import job_queue

        job = job_queue.get_job(s, r.json()["id"])
        assert job.status == "succeeded", job.error
    engine.dispose()
    return request


def start_server(db_url: str, port: int, workdir: Path, processes: int = 1) -> subprocess.Popen:
    log = open(workdir / "serve.log", "wb")  # noqa: SIM115 (the server writes it while it runs)
    more = ["--processes", str(processes)] if processes != 1 else []  # (a server from before the option)
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--db", db_url, "--port", str(port),
                             "--workers", "0", *more, "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
                            cwd=workdir)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); see {workdir / 'serve.log'}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not answer /healthz within 60 s")


def importable(name: str) -> bool:
    """Whether uvicorn's ``auto`` would take ``name`` (it tries the import)."""
    import importlib

    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


def quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


class RawConnection:
    """A minimal HTTP/1.1 keep-alive client on asyncio streams (``--client raw``): a few
    microseconds per request, so the server, not the client, is what is measured."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, headers: dict | None = None, content: bytes = b"") -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", f"Content-Length: {len(content)}"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + content)
        assert self.reader is not None
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        length = next((int(x.split(":", 1)[1]) for x in lines[1:] if x.lower().startswith("content-length:")), 0)
        if length:
            await self.reader.readexactly(length)
        return status

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def scenario(base: str, make_request, expect: int, *, clients: int, total: int, seconds: float,
                   rate: float | None, client: str = "httpx") -> dict:
    """Run one scenario; returns counts, throughput and client-side latencies (seconds)."""
    latencies: list[float] = []
    errors: dict[str, int] = {}
    issued = 0
    start = deadline = 0.0  # set once every client is ready (below)
    host, port = base.removeprefix("http://").split(":")

    def next_slot() -> float | None:
        nonlocal issued
        if issued >= total or time.perf_counter() >= deadline:
            return None
        slot = start + issued / rate if rate else time.perf_counter()
        issued += 1
        return slot

    def count(status: int) -> None:
        if status != expect:
            errors[str(status)] = errors.get(str(status), 0) + 1

    async def client_loop(http: httpx.AsyncClient | None) -> None:
        raw = RawConnection(host, int(port)) if http is None else None
        while (slot := next_slot()) is not None:
            delay = slot - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            method, path, kwargs = make_request()
            try:
                if raw is not None:
                    count(await raw.request(method, path, kwargs.get("headers"), kwargs.get("content", b"")))
                else:
                    assert http is not None
                    r = await http.request(method, path, **kwargs)
                    _ = r.content
                    count(r.status_code)
            except (httpx.HTTPError, OSError, asyncio.IncompleteReadError) as err:
                errors[type(err).__name__] = errors.get(type(err).__name__, 0) + 1
                if raw is not None:
                    await raw.close()
                    raw = RawConnection(host, int(port))
            latencies.append(time.perf_counter() - slot)
        if raw is not None:
            await raw.close()

    # the clients are made before the clock starts: making 64 httpx clients takes seconds on a
    # busy 2-core machine, which an open loop would otherwise count as the first requests' latency
    https = [httpx.AsyncClient(base_url=base, timeout=30,
                               limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
             if client != "raw" else None for _ in range(clients)]
    start = time.perf_counter()
    deadline = start + seconds
    try:
        await asyncio.gather(*(client_loop(http) for http in https))
    finally:
        for http in https:
            if http is not None:
                await http.aclose()
    elapsed = time.perf_counter() - start
    latencies.sort()
    return {"requests": len(latencies), "errors": errors, "seconds": elapsed, "rps": len(latencies) / elapsed,
            "p50": quantile(latencies, 0.5), "p99": quantile(latencies, 0.99)}


def server_quantiles(base: str, route: str, before: dict[float, float]) -> tuple[dict[float, float], str]:
    """Bucket counts of the server's latency histogram for ``route`` (cumulative), and p50/p99
    of the requests since ``before`` as bucket upper bounds."""
    text = httpx.get(base + "/metrics", timeout=10).text
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("foldwise_http_request_duration_seconds_bucket{") and f'route="{route}"' in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            bound = float("inf") if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    delta = {b: c - before.get(b, 0.0) for b, c in buckets.items()}
    total = delta.get(float("inf"), 0.0)
    if total <= 0:
        return buckets, "-"

    def q(p: float) -> str:
        for bound in sorted(delta):
            if delta[bound] >= p * total:
                return "<=" + (f"{bound * 1e3:g} ms" if bound != float("inf") else "inf")
        return "?"

    return buckets, f"{q(0.5)} / {q(0.99)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=6000, help="per scenario (bounded)")
    parser.add_argument("--seconds", type=float, default=20.0, help="per scenario (bounded)")
    parser.add_argument("--rate", type=float, default=None,
                        help="also run open-loop scenarios at this many requests/s (e.g. 1000)")
    parser.add_argument("--open-rate-submit", type=float, default=None,
                        help="open-loop rate for submissions (default: --rate / 5)")
    parser.add_argument("--client", choices=("httpx", "raw", "both"), default="httpx",
                        help="httpx.AsyncClient per client (default), a minimal asyncio HTTP/1.1 client (the "
                             "server's capacity, without httpx's own CPU cost), or both")
    parser.add_argument("--processes", type=int, default=1, help="the server's HTTP processes (serve --processes)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")

    load_start = os.getloadavg()[0]
    workdir = Path(tempfile.mkdtemp(prefix="foldwise-load-"))
    db_url = f"sqlite:///{workdir / 'load.db'}"
    request = prepare(db_url)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(db_url, port, workdir, args.processes)
    try:
        first = httpx.post(base + "/v1/jobs", json=request, timeout=30)
        assert first.status_code == 200, first.text  # the job already succeeded: the same job again
        kernel_id = first.json()["kernel_id"]
        bundle = httpx.get(f"{base}/v1/kernels/{kernel_id}/bundle", timeout=30)
        etag = bundle.headers["etag"]
        body = json.dumps(request).encode()
        scenarios = [
            ("bundle", "/v1/kernels/{kernel_id}/bundle", 200,
             lambda: ("GET", f"/v1/kernels/{kernel_id}/bundle", {})),
            ("bundle-304", "/v1/kernels/{kernel_id}/bundle", 304,
             lambda: ("GET", f"/v1/kernels/{kernel_id}/bundle", {"headers": {"If-None-Match": etag}})),
            ("submit", "/v1/jobs", 200,
             lambda: ("POST", "/v1/jobs", {"content": body, "headers": {"Content-Type": "application/json"}})),
        ]
        modes = [("closed", None)]
        if args.rate:
            modes.append(("open", args.rate))
        kinds = ("httpx", "raw") if args.client == "both" else (args.client,)
        rows = []
        for kind in kinds:
            for mode, rate in modes:
                for name, route, expect, make in scenarios:
                    r_rate = rate if rate is None or name != "submit" else (args.open_rate_submit or rate / 5)
                    before, _ = server_quantiles(base, route, {})
                    result = asyncio.run(scenario(base, make, expect, clients=args.clients, total=args.requests,
                                                  seconds=args.seconds, rate=r_rate, client=kind))
                    _, server_q = server_quantiles(base, route, before)
                    rows.append({"scenario": name, "client": kind,
                                 "mode": mode if rate is None else f"open {r_rate:g}/s", **result,
                                 "server_p50_p99": server_q})
    finally:
        server.terminate()
        server.wait(timeout=30)
    fast = [m for m in ("httptools", "uvloop") if importable(m)]
    load = os.getloadavg()[0]
    print(f"\nload average at the start {load_start:.1f}")
    print(f"\n{' '.join(['python', *sys.argv])}")
    print(f"\nloopback load, serve --processes {args.processes}, {args.clients} clients, bundle {len(bundle.content)} bytes, "
          f"{os.cpu_count()} CPUs shared by client and server (load average {load:.1f} at the end), "
          f"uvicorn with {' + '.join(fast) if fast else 'h11 + asyncio (no httptools/uvloop installed)'}\n")
    print("| scenario | client | mode | requests | errors | req/s | p50 ms | p99 ms | server p50 / p99 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        errs = sum(r["errors"].values())
        print(f"| {r['scenario']} | {r['client']} | {r['mode']} | {r['requests']} | {errs} | {r['rps']:.0f} | "
              f"{r['p50'] * 1e3:.1f} | {r['p99'] * 1e3:.1f} | {r['server_p50_p99']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
