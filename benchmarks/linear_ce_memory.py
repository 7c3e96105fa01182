"""Peak memory of an LM head's loss, forward and backward (issue 39 item 4's must-show): Foldwise's
``linear_cross_entropy`` (the logits summed tile by tile, never written; its derived backward
recomputes them per tile) against torch eager (``cross_entropy(h @ w.T)``: the logits and their
gradient written whole) and Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` (the logits
written a chunk of tokens at a time, the gradients computed in the forward), at the same shape.

Measured, not modelled: on a GPU (``--device cuda``) the peak of ``torch.cuda.max_memory_allocated``
over the step above what the inputs hold; without one, on the CPU with Triton's interpreter, the
peak of the CPU allocator's total over the step (``torch.profiler`` with ``profile_memory``: every
tensor torch allocates, the kernels' outputs and scratch included; the interpreter's own NumPy
copies are not the kernels' and are not counted). Each row also gives the gradients' largest error
against float64 autograd, and the logits' size at the shape for comparison.

Foldwise's kernels are made in this process as the server would serve them (a bundle of each
spec's default configuration, tests/support/local_kernels.py: the forward that saves the row max and sum, the ``d_h`` and ``d_w``
kernels). While the hidden size fits one block (d <= 1024, the default here) the backward recomputes
the logits per tile; past it a stage writes ``d_logits [t, v]`` and ``d_h`` and ``d_w`` are a GEMM
each (docs/DECISIONS.md, "The backward past d = 1024"): its peak holds that ``[t, v]`` tensor.

    TRITON_INTERPRET=1 python benchmarks/linear_ce_memory.py --tokens 128,512 [--vocab 128256] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

MIB = 1 << 20


def peak_bytes(step: Callable[[], None], device: str) -> int:
    """The most memory ``step`` holds at once beyond what was allocated before it (module doc)."""
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    trace = Path(os.environ.get("TMPDIR", "/tmp")) / f"linear_ce_memory_{os.getpid()}.json"
    prof.export_chrome_trace(str(trace))  # the allocator's running total is in the trace's memory events
    events = json.loads(trace.read_text())["traceEvents"]
    trace.unlink()
    memory = [e["args"] for e in events if e.get("name") == "[memory]"]
    if not memory:
        return 0
    base = memory[0]["Total Allocated"] - memory[0]["Bytes"]  # the running total carries over between profiles
    return max(0, *(m["Total Allocated"] - base for m in memory))


def foldwise_op(shape: dict[str, int], dtype: str) -> Any:
    """The trainable op as a server serves it: its bundles made here (tests/support/local_kernels.py)."""
    from tests.support.local_kernels import LocalCache

    return LocalCache().trainable_op("linear_cross_entropy", shape, dtype)


def losses(shape: dict[str, int], dtype: str) -> dict[str, Callable[..., torch.Tensor]]:
    """name -> loss(h, w, target), summed over the tokens, for each implementation compared."""
    out: dict[str, Callable[..., torch.Tensor]] = {
        "torch eager": lambda h, w, y: torch.nn.functional.cross_entropy(h @ w.T, y, reduction="sum"),
    }
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")
        out["Liger fused linear CE"] = lambda h, w, y: liger(w, h, y)
    except ImportError:
        print("liger-kernel is not installed: its row is left out", file=sys.stderr)
    op = foldwise_op(shape, dtype)
    out["Foldwise linear_cross_entropy"] = lambda h, w, y: op(h=h, w=w, target=y)["loss"].sum()
    return out


def measure(t: int, v: int, d: int, dtype: str, device: str) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    torch_dtype = getattr(torch, dtype)
    h64 = torch.randn(t, d, generator=g, dtype=torch.float64)
    w64 = torch.randn(v, d, generator=g, dtype=torch.float64) * (3 / d ** 0.5)
    y = torch.randint(0, v, (t,), generator=g)
    ref_h, ref_w = (x.clone().requires_grad_() for x in (h64, w64))
    torch.nn.functional.cross_entropy(ref_h @ ref_w.T, y, reduction="sum").backward()
    rows = []
    for name, loss in losses({"t": t, "v": v, "d": d}, dtype).items():
        h = h64.to(device, torch_dtype).requires_grad_()
        w = w64.to(device, torch_dtype).requires_grad_()
        target = y.to(device)

        def step() -> None:
            loss(h, w, target).backward()

        started = time.perf_counter()
        peak = peak_bytes(step, device)
        seconds = time.perf_counter() - started
        errors = [(x.grad.double().cpu() - ref.grad).abs().max().item() for x, ref in ((h, ref_h), (w, ref_w))]
        rows.append({"implementation": name, "t": t, "v": v, "d": d, "dtype": dtype, "device": device,
                     "peak_mib": peak / MIB, "logits_mib": t * v * torch_dtype.itemsize / MIB,
                     "grad_h_err": errors[0], "grad_w_err": errors[1], "seconds": seconds})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="128,512", help="comma-separated token counts t")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("without a GPU the kernels run in Triton's interpreter: set TRITON_INTERPRET=1")
    rows = [r for t in (int(x) for x in args.tokens.split(",")) for r in measure(t, args.vocab, args.hidden,
                                                                               args.dtype, args.device)]
    print("| implementation | t | v | d | dtype | device | peak (MiB) | logits (MiB) | d_h err | d_w err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['implementation']} | {r['t']} | {r['v']} | {r['d']} | {r['dtype']} | {r['device']} | "
              f"{r['peak_mib']:.1f} | {r['logits_mib']:.1f} | {r['grad_h_err']:.2e} | {r['grad_w_err']:.2e} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
