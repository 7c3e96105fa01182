"""Cost of a warm ``KernelCache.get()`` on the host: the in-process memo's answer (issue 24, item 5).

    python benchmarks/client_warm_call.py [--calls 10000] [--out benchmarks/results/client_warm_call_cpu.md]

A fake server (``httpx.MockTransport``) serves real bundles (safe_softmax, attention); each case
asks once (cold: lookup, download, verify, store, load), then times ``--calls`` more calls of the
same request one by one with ``time.perf_counter_ns`` (the timer's own ~0.1 µs included) and
reports the median and the 99th percentile. The server counts its requests: a warm call must
make none (the table says how many the timed calls made). Cases: the spec as a catalog name, a
loaded Spec, a dict and JSON text; the shape as a dict and as text; and, for comparison, the
synchronous mode (``revalidate_after=0``: every call asks the server, as before the memo) on
fewer calls. The kernel is not launched: this is the call's overhead, not the kernel's.

The second table is what a forward pass pays per Foldwise layer through the torch operator
(``KernelCache.torch_op``, issue 24's "warm-call cost of the torch op, launch stubbed"): the
lookup, the operator's call (a plain call runs the kernel directly, skipping torch's dispatcher,
which cost 20-60 µs; then the kernel's checks of names, dtypes, sizes and device, the outputs'
allocation) with the generated module's ``launch`` replaced by a stub that returns the outputs
it is handed, and both; the BundleKernel's own call for comparison. Inputs
are CPU tensors of the bundle's shape; files opened during the timed calls are counted too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
os.environ.setdefault("TRITON_INTERPRET", "1")  # bundles load as source; nothing launches here

import httpx  # noqa: E402

from fuser_core import load_spec, spec_source  # noqa: E402
from fuser_core.problem import make_problem  # noqa: E402
from service.bundle import canonical_bytes  # noqa: E402
from service.bundle_maker import make_bundle  # noqa: E402
from service.client import KernelCache  # noqa: E402

CASES = {  # spec name -> (shape, strategy, config) of the served bundle
    "safe_softmax": ({"m": 64, "n": 4096}, "streaming_fused", {"blocks": {"n": 1024}}),
    "attention": ({"b": 8, "h": 16, "m": 1024, "n": 1024, "d": 64, "e": 64}, "streaming_fused", {}),
}


class Server:
    """``GET /v1/kernels`` and ``GET /v1/kernels/{id}/bundle`` over the bundles; counts requests."""

    def __init__(self, bundles: dict[str, dict]):
        self.by_hash = {b["spec_hash"]: (kid, b) for kid, b in bundles.items()}
        self.by_id = bundles
        self.requests = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        if request.url.path == "/v1/kernels":
            kid, b = self.by_hash[request.url.params["spec_hash"]]
            return httpx.Response(200, json={"id": kid, "exact_match": True, "bundle_sha256": b["sha256"]})
        kid = request.url.path.split("/")[3]
        b = self.by_id[kid]
        if request.headers.get("if-none-match") == f'"{b["sha256"]}"':
            return httpx.Response(304, headers={"ETag": f'"{b["sha256"]}"'})
        return httpx.Response(200, content=canonical_bytes(b), headers={"ETag": f'"{b["sha256"]}"'})


def bundle_for(name: str) -> dict:
    shape, strategy, config = CASES[name]
    spec = load_spec(spec_source(name))
    return make_bundle(make_problem(spec, shape, "float16"), target="h100", strategy=strategy, config=config,
                       measured={"time_ms": 0.01, "measurer": "model"})


def time_calls(call, calls: int) -> tuple[float, float]:
    """(median, p99) of ``calls`` timed calls, in µs."""
    times = []
    clock = time.perf_counter_ns
    for _ in range(calls):
        t0 = clock()
        call()
        times.append(clock() - t0)
    times.sort()
    return statistics.median(times) / 1e3, times[int(0.99 * (len(times) - 1))] / 1e3


class StubModule:
    """A generated module whose launch does nothing: returns the outputs it is handed."""

    @staticmethod
    def launch(inputs, shape, out=None, scalars=None):
        return out


_opened: list[str] = []
sys.addaudithook(lambda event, args: _opened.append(str(args[0])) if event == "open" else None)


def op_rows(cache: KernelCache, server: Server, calls: int) -> list[tuple]:
    """(spec, what, calls, median µs, p99 µs, HTTP requests, files opened) of warm torch-op calls."""
    import torch

    rows = []
    for name, (shape, _, _) in CASES.items():
        op = cache.torch_op(name, shape, "float16", "h100")
        op.kernel._module = StubModule  # the registered kernel is this object: the operator runs the stub
        spec = load_spec(spec_source(name))
        inputs = {i.name: torch.randn([shape[d] for d in i.dims], dtype=torch.float16) for i in spec.inputs}
        op(**inputs)
        cases = [("torch_op() lookup", lambda: cache.torch_op(name, shape, "float16", "h100")),
                 ("op(**inputs), launch stubbed", lambda: op(**inputs)),
                 ("torch_op() + op(**inputs), launch stubbed",
                  lambda: cache.torch_op(name, shape, "float16", "h100")(**inputs)),
                 ("BundleKernel(**inputs), launch stubbed (no operator)", lambda: op.kernel(**inputs))]
        for what, call in cases:
            before, _opened[:] = server.requests, []
            median, p99 = time_calls(call, calls)
            rows.append((name, what, calls, median, p99, server.requests - before, len(_opened)))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=10_000)
    ap.add_argument("--sync-calls", type=int, default=200, help="calls timed with revalidate_after=0")
    ap.add_argument("--op-calls", type=int, default=2_000, help="calls timed through the torch operator")
    ap.add_argument("--out", type=Path, help="also write the table (Markdown) here")
    args = ap.parse_args(argv)

    bundles = {f"k{i}": bundle_for(name) for i, name in enumerate(CASES)}
    server = Server(bundles)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for revalidate_after, calls in ((60.0, args.calls), (0, args.sync_calls)):
            cache = KernelCache("http://bench.test", cache_dir=tmp, transport=httpx.MockTransport(server),
                                revalidate_after=revalidate_after)
            for name, (shape, _, _) in CASES.items():
                spec_obj = load_spec(spec_source(name))
                spec_dict = json.loads(spec_source(name))
                shape_text = ",".join(f"{d}={n}" for d, n in shape.items())
                forms = [("catalog name", name, shape), ("loaded Spec", spec_obj, shape),
                         ("dict", spec_dict, shape), ("JSON text", json.dumps(spec_dict), shape),
                         ("catalog name, shape as text", name, shape_text)]
                if revalidate_after == 0:
                    forms = forms[:2]
                for form, spec, shp in forms:
                    def call(spec=spec, shp=shp):
                        return cache.get(spec, shp, dtype="float16", target="h100")

                    call()  # cold (the first form of a spec) or warm: outside the timing
                    before = server.requests
                    median, p99 = time_calls(call, calls)
                    rows.append((name, form, revalidate_after, calls, median, p99, server.requests - before))
            if revalidate_after:
                ops = op_rows(cache, server, args.op_calls)
            cache.close()

    head = ("| spec | spec argument | revalidate_after | calls | median µs | p99 µs "
            "| HTTP requests in the timed calls |\n|---|---|---|---|---|---|---|")
    lines = [head] + [f"| {n} | {f} | {r:g} | {c} | {m:.2f} | {p:.2f} | {h} |" for n, f, r, c, m, p, h in rows]
    lines += ["", "Through the torch operator (`KernelCache.torch_op`), revalidate_after 60:", "",
              "| spec | call | calls | median µs | p99 µs | HTTP requests | files opened |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {n} | {w} | {c} | {m:.2f} | {p:.2f} | {h} | {o} |" for n, w, c, m, p, h, o in ops]
    facts = (f"{platform.python_implementation()} {platform.python_version()}, {platform.machine()}, "
             f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}")
    table = "\n".join(lines)
    print(table)
    print(f"\n{facts}")
    if args.out:
        args.out.write_text(f"# Warm `KernelCache.get()` on the host\n\n`python benchmarks/client_warm_call.py`; "
                            f"{facts}.\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
