"""Timing a variant on the device: events, an L2 flush before every timed run, rotated input sets.

``triton.testing.do_bench`` style: a warm-up (the first call also compiles), an estimate from
a few runs, then ``rep_ms`` worth of runs (at least ``min_reps``); before each timed run the
L2 cache is flushed by zeroing a buffer of ``max(256 MiB, 2 x L2)`` (:func:`flush_bytes`), and
the runs rotate over several input sets whose total size exceeds 4 x L2 (as far as memory
allows; :meth:`tuner.device.inputs.DeviceProblem.timing_sets`), so nothing is timed from cache.
The time is the median; min, p20, p80, max, mean and the counts are in the result
(:func:`summarize`).

Not CUDA-specific: :func:`time_gpu` uses ``torch.cuda`` events and synchronisation, which
PyTorch's ROCm build provides as well (HIP events under the same ``torch.cuda`` API), so the
same code times an AMD GPU. :func:`time_cpu` times Triton's interpreter with
``time.perf_counter``; such times carry :data:`CPU_LABEL` everywhere, never a GPU's.

Contract: ``fn(inputs)`` runs the variant once on one input set; each timer returns
:func:`summarize`'s dict with ``median_ms`` and the clock's label.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuser_core.sampled_reference import REFERENCE_BUDGET

CPU_LABEL = "CPU interpreter (TRITON_INTERPRET=1), not GPU"
GPU_LABEL = "GPU, CUDA events, L2 flushed, inputs rotated"  # the recorded label: torch.cuda's events (HIP's on ROCm)


@dataclass
class TimingSettings:
    """How a variant is timed (see the module docstring), and the reference budget and seed of
    the inputs it is checked and timed on (:mod:`tuner.device.inputs`)."""

    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    min_reps: int = 10
    max_reps: int = 1000
    cpu_warmup: int = 1  # interpreter: runs before timing
    cpu_reps: int = 3  # interpreter: timed runs
    max_sets: int = 32  # input sets rotated through
    reference_budget: int = REFERENCE_BUDGET
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def flush_bytes(l2_bytes: int) -> int:
    """The size of the buffer zeroed before each timed run: at least twice the L2 cache."""
    return max(256 << 20, 2 * int(l2_bytes))


def time_gpu(fn: Callable[[Any], Any], sets: list[dict[str, Any]], settings: Mapping[str, Any],
             flush: Any) -> dict[str, Any]:
    """do_bench-style timing with ``torch.cuda`` events (CUDA, or HIP on ROCm; module docstring);
    ``flush`` is the device buffer zeroed before each timed run."""
    import torch

    n = len(sets)
    fn(sets[0])  # warm (the first call compiled already; this settles allocations)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(5):
        flush.zero_()
        fn(sets[i % n])
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-4)
    warmup = max(1, int(float(settings.get("warmup_ms", 25.0)) / estimate))
    reps = int(float(settings.get("rep_ms", 100.0)) / estimate)
    reps = max(int(settings.get("min_reps", 10)), min(int(settings.get("max_reps", 1000)), reps))
    for i in range(warmup):
        fn(sets[i % n])
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.zero_()  # evict L2: the timed run reads its inputs from HBM
        starts[i].record()
        fn(sets[i % n])
        ends[i].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return summarize(times, clock=GPU_LABEL, warmup=warmup, sets=n, flush_bytes=flush.numel() * 4)


def time_cpu(fn: Callable[[Any], Any], sets: list[dict[str, Any]], settings: Mapping[str, Any]) -> dict[str, Any]:
    """Wall time of interpreter runs (labelled: never a GPU number)."""
    n = len(sets)
    warmup = int(settings.get("cpu_warmup", 1))
    for i in range(warmup):
        fn(sets[i % n])
    times = []
    for i in range(max(1, int(settings.get("cpu_reps", 3)))):
        t0 = time.perf_counter()
        fn(sets[i % n])
        times.append((time.perf_counter() - t0) * 1e3)
    return summarize(times, clock=CPU_LABEL, warmup=warmup, sets=n, flush_bytes=0)


def summarize(times_ms: list[float], **extra: Any) -> dict[str, Any]:
    a = np.asarray(times_ms, dtype=np.float64)
    return {
        "median_ms": float(np.median(a)), "min_ms": float(a.min()), "p20_ms": float(np.percentile(a, 20)),
        "p80_ms": float(np.percentile(a, 80)), "max_ms": float(a.max()), "mean_ms": float(a.mean()),
        "reps": int(a.size), **extra,
    }

