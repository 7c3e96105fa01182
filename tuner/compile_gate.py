"""The compile gate: every candidate goes through Triton's GPU compiler for the target before
it is measured or predicted.

:meth:`SearchSpace.check` judges a candidate from estimates (registers from live values,
shared memory from tile sizes); the compiler knows. :class:`CompileGate` compiles a
candidate's module(s) for the profile's target (``GpuProfile.target``: ``sm_90`` gives a cubin,
``gfx942`` an hsaco) with :mod:`fuser_core.codegen.gpu_compile`, which needs no GPU, and
answers with a :class:`CompileVerdict`:

- a kernel does not compile: **pruned**, the reason is the compiler's message, with the Triton
  version that gave it (``does not compile for sm_90 with Triton 3.6.0: <kernel>: line N: ...``):
  the installed Triton decides (3.6 rejects some float32 multi_pass configs that 3.9 compiles);
- a kernel needs more shared memory than a block may have (``profile.smem_per_block_max``: the
  LDS of a CU on AMD), or more registers per thread than the target allows, or its registers for
  ``num_warps`` warps (64-lane wavefronts on AMD) exceed an SM's register file (a CU's VGPR
  file): **pruned**, naming the kernel and the numbers (a launch would fail with "out of
  resources");
- a kernel spills (stack or local bytes > 0): **not pruned**, its facts are kept and the model
  measurer charges the local-memory traffic (:mod:`tuner.cost_model`); the cuda measurer times
  it as it is.

Decisions: a strategy the generator refuses (``ModuleBuild.refused``) is pruned with the
generator's reason (the space already checks validity, so this is a disagreement between the
two, reported rather than hidden). Verdicts are cached per :meth:`Candidate.key` in the gate,
and the compiler's results per kernel in memory and on disk
(``$FOLDWISE_CACHE_DIR/compiled``) by :mod:`fuser_core.codegen.gpu_compile`, so a candidate
that several trials or workers on one machine propose is compiled once. Compiles run in a
process pool with Triton's interpreter off: a gate given no pool uses one pool per process
(:func:`shared_compile_pool`, ``$FOLDWISE_COMPILE_WORKERS`` workers, default up to 2), started
on the first compile and kept for later gates (a job-queue worker tunes many jobs; each pool
start costs seconds of imports).

Example (on a machine without a GPU; the main module must be import-safe, as pytest and the
``foldwise`` command are, since the pool starts processes with ``spawn``)::

    space = SearchSpace(make_problem(spec, {"m": 64, "n": 4096}, "float16"), derivation, get_profile("h100"))
    gate = CompileGate.for_space(space)
    verdict = gate.check(space.candidate(STREAMING_FUSED.name, {"block_n": 1024, "num_warps": 4}))
    verdict.pruned, verdict.reason, verdict.facts()[0]["registers"]
    # (False, None, 26)
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fuser_core import is_host_fault
from fuser_core.codegen.gpu_compile import CompilePool, CompileRequest, KernelBuild, ModuleBuild
from fuser_core.spec import Spec
from tuner.profiles import GpuProfile

__all__ = ["CompileGate", "CompileVerdict", "shared_compile_pool", "WORKERS_ENV"]

WORKERS_ENV = "FOLDWISE_COMPILE_WORKERS"
DEFAULT_WORKERS = 2  # compiles are single-threaded; two keep a tuning job from waiting on one slow kernel
FACT_FIELDS = ("kernel", "ok", "registers", "spill_bytes", "shared_bytes", "num_warps", "num_stages")


@dataclass(frozen=True)
class CompileVerdict:
    """What the compiler said about one candidate, judged against the target.

    ``reason`` is set when the candidate is pruned (it cannot run on the target); ``kernels``
    are the compiler's facts per kernel launch (empty when the generator refused the module).
    """

    arch: str
    kernels: tuple[KernelBuild, ...]
    reason: str | None = None

    @property
    def pruned(self) -> bool:
        return self.reason is not None

    def without_sass(self) -> CompileVerdict:
        """The same verdict with no SASS facts: what the cost model charges from registers and the
        plan alone (the calibration's "before" column, the tests' contrast)."""
        return replace(self, kernels=tuple(replace(k, sass=None) for k in self.kernels))

    @property
    def spill_bytes(self) -> int:
        """The most bytes per thread any kernel spilled (0: none spilled)."""
        return max((k.spill_bytes or 0 for k in self.kernels), default=0)

    def facts(self) -> list[dict[str, Any]]:
        """Per kernel: name, ok, registers, spill and shared bytes, warps, stages (and the
        compiler's error where it failed): what a trial records."""
        out = []
        for k in self.kernels:
            row = {name: getattr(k, name) for name in FACT_FIELDS}
            if not k.ok:
                row["error"] = k.error
            out.append(row)
        return out


def judge(build: ModuleBuild, profile: GpuProfile) -> CompileVerdict:
    """The verdict on one compiled module for ``profile`` (see the module docstring)."""
    arch = profile.arch
    if build.refused is not None:
        return CompileVerdict(arch, (), f"the generator refuses {build.strategy} here: {build.refused}")
    for k in build.kernels:
        if not k.ok:
            by = f" with Triton {build.triton_version}" if build.triton_version else ""
            return CompileVerdict(arch, build.kernels, f"does not compile for {arch}{by}: {k.error}")
    for k in build.kernels:
        shared, regs, warps = k.shared_bytes or 0, k.registers or 0, k.num_warps or 1
        if shared > profile.smem_per_block_max:
            return CompileVerdict(arch, build.kernels, (
                f"shared memory ({k.kernel}): the compiler allocates {shared} bytes > {profile.smem_per_block_max} "
                f"{profile.smem_limit_words} on {profile.name} ({arch})"))
        if regs > profile.regs_per_thread_max:
            return CompileVerdict(arch, build.kernels, (
                f"registers ({k.kernel}): {regs} per thread > {profile.regs_per_thread_max} on {profile.name}"))
        held = profile.registers_per_program(regs, warps)
        if held > profile.regs_per_sm:
            return CompileVerdict(arch, build.kernels, (
                f"registers ({k.kernel}): {regs} per thread x {profile.warp_size * warps} threads need {held} > "
                f"{profile.regs_per_sm} per {profile.sm_word} on {profile.name}"))
    return CompileVerdict(arch, build.kernels)


_SHARED: dict[str, CompilePool] = {}
_SHARED_LOCK = threading.Lock()


def shared_compile_pool() -> CompilePool:
    """This process's compile pool, started on first use (``$FOLDWISE_COMPILE_WORKERS``
    workers, default min(2, cores)) and shut down at exit."""
    with _SHARED_LOCK:
        pool = _SHARED.get("pool")
        if pool is None:
            workers = int(os.environ.get(WORKERS_ENV) or min(DEFAULT_WORKERS, os.cpu_count() or 1))
            pool = _SHARED["pool"] = CompilePool(max(1, workers))
            atexit.register(pool.close)
        return pool


class CompileGate:
    """Compile candidates for ``profile``'s arch before they are measured; one verdict per candidate.

    ``pool``: a :class:`CompilePool` to use (not closed by the gate); default the process's
    :func:`shared_compile_pool`. Thread-safe: the job-queue worker's trials run in one thread,
    but a gate may be shared.
    """

    def __init__(self, spec: Spec, shape: Mapping[str, int], dtypes: Mapping[str, str], profile: GpuProfile, *,
                 pool: CompilePool | None = None):
        self.spec = spec
        self.shape = dict(shape)
        self.dtypes = dict(dtypes)
        self.profile = profile
        self.pool = pool
        self.compiled = 0  # candidates this gate sent to the compiler (not answered from its own cache)
        self._verdicts: dict[str, CompileVerdict] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_space(cls, space: Any, *, pool: CompilePool | None = None) -> CompileGate:
        """A gate for a :class:`tuner.space.SearchSpace`'s spec, bound shape, dtypes and profile."""
        return cls(space.spec, space.shape, space.dtypes, space.profile, pool=pool)

    def check(self, candidate: Any) -> CompileVerdict:
        """The verdict on one :class:`tuner.space.Candidate` (compiled at most once per gate)."""
        return self.check_many([candidate])[0]

    def check_many(self, candidates: Iterable[Any]) -> list[CompileVerdict]:
        """Verdicts in order; the candidates not seen before compile in parallel in the pool."""
        candidates = list(candidates)
        with self._lock:
            missing = {c.key(): c for c in candidates if c.key() not in self._verdicts}
        if missing:
            requests = [CompileRequest(self.spec, self.shape, self.dtypes, c.strategy, c.config.to_dict(),
                                       target=self.profile.target, sass=True) for c in missing.values()]
            builds = (self.pool or shared_compile_pool()).compile(requests)
            fresh = {key: judge(build, self.profile) for key, build in zip(missing, builds)}
            with self._lock:
                for key, verdict in fresh.items():
                    if not is_host_fault(verdict.reason):  # a full disk says nothing of the candidate
                        self._verdicts[key] = verdict
                self.compiled += len(missing)
                return [fresh.get(c.key()) or self._verdicts[c.key()] for c in candidates]
        with self._lock:
            return [self._verdicts[c.key()] for c in candidates]


def kernel_facts_for(sketch_names: Sequence[str], verdict: CompileVerdict | None) -> list[KernelBuild | None]:
    """The compiled kernel for each of the cost model's kernel sketches, by the kernel's name
    (the structure's, :func:`fuser_core.codegen.structure.kernel_names`). None where no compiled
    kernel matches (the model then keeps its own estimate)."""
    if verdict is None:
        return [None] * len(sketch_names)
    out: list[KernelBuild | None] = []
    for name in sketch_names:
        out.append(next((k for k in verdict.kernels if k.ok and k.kernel == name), None))
    return out
