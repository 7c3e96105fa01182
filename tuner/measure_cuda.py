"""``--measurer cuda``: check each candidate against the float64 reference, then time it on the GPU.

**Isolation.** Every trial runs in a worker process (:class:`WorkerProcess`: a ``spawn``ed
child with a pipe, started once and reused, so CUDA initialisation and imports are paid once;
the child leads its own process group). The parent waits with a deadline: a kernel that hangs
is a failed trial ("timed out after 30s compiling"), the child's process group is killed and
the next trial starts a fresh child; a child that dies (an illegal address that takes the
process down, a segfault in a driver, ``os._exit``) fails its trial only ("worker process died
with signal SIGSEGV while running"). A CUDA error that leaves the context unusable (illegal
memory access, device-side assert, launch failure) fails the trial and the child exits after
answering, so the next trial gets a clean context.

**Correctness first.** A trial generates the candidate's module and runs it once on random
inputs (drawn on the device, exactly representable in their dtypes), and compares with the
float64 reference (:mod:`fuser_core.reference`) using the project's error measure and
tolerances (:func:`fuser_core.runner.compare`, ``TOLERANCE``; fused strategies whose derivation
is inexact are judged normwise, as :func:`fuser_core.runner.self_check` does). A wrong kernel
is a failed trial carrying its errors, never a time.

**Bounding the reference.** The reference runs in NumPy float64 on the host, step by step,
materialising every broadcast expression (attention's ``q * k`` over [b, h, m, n, d]), which at
full size would need terabytes. The kernel always runs at the full shape; the reference is
evaluated only on a *sample of independent rows*: for every dim that no step reduces over and
that is not a topk ``as`` dim, a few indices (the first, the last -- tails are where masking
goes wrong -- and random ones), chosen so that the largest expression the evaluator
materialises has at most ``reference_budget`` elements (default 2**24, about 128 MiB of
float64). Rows are independent along such dims, so the sampled reference is exact for the
sampled rows; ``index(dim)`` and ``size(dim)`` keep their full-shape values
(:class:`SampledEvaluator`). Every output element outside the sample must still be finite
whenever the sampled reference is. At the small shapes of tests the sample is every row.

**Timing** (``triton.testing.do_bench`` style, CUDA events): a warm-up (the first call also
compiles), an estimate from a few runs, then ``rep_ms`` worth of runs (at least
``min_reps``); before each timed run the L2 cache is flushed by zeroing a buffer of
``max(256 MiB, 2 x L2)``, and the runs rotate over several input sets whose total size
exceeds 4 x L2 (as far as memory allows), so nothing is timed from cache. The time is the
median; min, p20, p80, max, mean and the counts are in ``details["timing"]``.

**CPU mode** (``device="cpu"``): kernels run through Triton's interpreter
(``TRITON_INTERPRET=1`` in the child), timed with ``time.perf_counter``; such times are
labelled ``"CPU interpreter (TRITON_INTERPRET=1), not GPU"`` everywhere and the measurer calls
itself ``cuda-interpreter``. It exists so that the process machinery, the correctness gate,
timeouts and crash handling are tested for real on machines without a GPU.

**Fault injection (tests only).** When ``FOLDWISE_MEASURE_FAULT_FILE`` names a file, the child
takes (renames, reads and deletes) that file before each job and, if it held a fault name,
injects it once: ``hang`` (while compiling), ``hang_running``, ``segv``, ``exit``, ``raise``,
``cuda_error`` (a fatal-looking CUDA error) or ``corrupt`` (the outputs are perturbed before
the check). Nothing happens when the variable is unset.

Example (on a GPU)::

    m = CudaMeasurer(make_problem(spec, {"m": 4096, "n": 32768}, "float16"), derivation, get_profile("h100"))
    r = m.measure(space.candidate("streaming_fused", {"block_n": 2048, "block_m": 1,
                                                       "num_warps": 8, "num_stages": 3}))
    r.time_ms, r.details["timing"]["p20_ms"], r.details["check"]["max_rel_err"]
    m.close()
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Self

import numpy as np

from fuser_core.accuracy import FormulaEvaluator, TermScales
from fuser_core.derive import Derivation
from fuser_core.merged import consistent
from fuser_core.problem import Problem, tuning_scalars
from fuser_core.reference import Evaluator, index_input_bound
from fuser_core.spec import Spec
from tuner.measure import Measurement
from tuner.profiles import GpuProfile
from tuner.space import Candidate

DEFAULT_TIMEOUT_S = 120.0  # one trial: inputs, compile, check and timing
STARTUP_TIMEOUT_S = 300.0  # the child's imports and CUDA initialisation
REFERENCE_BUDGET = 1 << 24  # elements of the largest array the sampled float64 reference materialises
ROWS_PER_DIM = 16  # at most this many sampled indices per sliceable dim
FAULT_ENV = "FOLDWISE_MEASURE_FAULT_FILE"
FAULTS = ("hang", "hang_running", "segv", "exit", "raise", "cuda_error", "corrupt")
CPU_LABEL = "CPU interpreter (TRITON_INTERPRET=1), not GPU"
GPU_LABEL = "GPU, CUDA events, L2 flushed, inputs rotated"
PHASE_WORDS = {"starting": "starting the worker", "preparing": "preparing inputs and the reference",
               "compiling": "compiling", "checking": "checking", "running": "running", "idle": "between jobs"}
_FATAL_MARKERS = ("illegal memory access", "illegal address", "device-side assert", "unspecified launch failure",
                  "misaligned address", "cuda error: an illegal instruction", "cudaerrorlaunchfailure",
                  "cuda_error_illegal_address", "cuda_error_launch_failed", "operation not permitted when stream is capturing")


@dataclass
class TimingSettings:
    """How a variant is timed (see the module docstring)."""

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


# ============================================================================ parent side


@dataclass
class JobResult:
    """What one job in the worker gave: ``value`` when ``ok``, else ``error`` (and ``kind``:
    timeout, crash, exception, startup)."""

    ok: bool
    value: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    kind: str | None = None
    phase: str | None = None
    traceback: str | None = None


def _shutdown(state: dict[str, Any]) -> None:
    """Stop a worker (idempotent; also run at exit through weakref.finalize)."""
    proc, conn = state.get("proc"), state.get("conn")
    state["proc"] = state["conn"] = None
    if conn is not None:
        try:
            conn.send(("stop",))
        except (OSError, ValueError, BrokenPipeError):
            pass
    if proc is not None:
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            _kill(proc)
    if conn is not None:
        try:
            conn.close()
        except OSError:
            pass


def _kill(proc: Any) -> None:
    """Kill the child's process group (it leads one: compiler subprocesses die with it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass
    try:
        proc.kill()
    except (ProcessLookupError, OSError):
        pass
    try:
        proc.wait(timeout=10.0)
    except subprocess.TimeoutExpired:
        pass


class WorkerProcess:
    """One persistent child process that runs measurement jobs (module docstring).

    :meth:`call` sends a job and waits for its answer until ``timeout_s``; on a timeout or a
    crash the child is killed and the failure returned, and the next call starts a new child.
    A failure to start (no GPU, broken install) is remembered and answered immediately.
    """

    def __init__(self, device: str = "cuda", *, startup_timeout_s: float = STARTUP_TIMEOUT_S,
                 env: Mapping[str, str] | None = None):
        if device not in ("cuda", "cpu"):
            raise ValueError(f"device: expected 'cuda' or 'cpu', got {device!r}")
        self.device = device
        self.env = dict(env or {})  # added to the child's environment (this process's is inherited)
        self.startup_timeout_s = startup_timeout_s
        self.info: dict[str, Any] = {}
        self.starts = 0
        self.startup_error: str | None = None
        self._state: dict[str, Any] = {"proc": None, "conn": None}
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _shutdown, self._state)

    @property
    def pid(self) -> int | None:
        proc = self._state["proc"]
        return proc.pid if proc is not None else None

    def alive(self) -> bool:
        proc = self._state["proc"]
        return proc is not None and proc.poll() is None

    def close(self) -> None:
        with self._lock:
            _shutdown(self._state)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- life cycle
    def _start(self) -> JobResult | None:
        from multiprocessing.connection import Connection

        ours, theirs = socket.socketpair()
        env = {**os.environ, **self.env}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo holding tuner/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tuner.measure_cuda", "--worker", str(theirs.fileno()), self.device],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL, stdout=2,  # never the caller's stdout
                start_new_session=True,  # its own process group: a kill takes compiler subprocesses too
            )
        finally:
            theirs.close()
        self._state.update(proc=proc, conn=Connection(ours.detach()))
        self.starts += 1
        answer = self._receive(self.startup_timeout_s, "starting")
        if not answer.ok:
            self._discard()
            return answer
        if answer.value.get("startup_error"):
            self.startup_error = answer.value["startup_error"]
            self._discard()
            return JobResult(False, error=self.startup_error, kind="startup", phase="starting")
        self.info = answer.value
        return None

    def _discard(self) -> None:
        proc, conn = self._state["proc"], self._state["conn"]
        self._state.update(proc=None, conn=None)
        if proc is not None:
            try:
                proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                _kill(proc)
        if conn is not None:
            try:
                conn.close()
            except OSError:
                pass

    def _receive(self, timeout_s: float, phase: str) -> JobResult:
        """The next answer, following ``("phase", name)`` messages, until the deadline."""
        proc, conn = self._state["proc"], self._state["conn"]
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                _kill(proc)
                self._discard()
                return JobResult(False, error=f"timed out after {timeout_s:g}s {PHASE_WORDS.get(phase, phase)}",
                                 kind="timeout", phase=phase)
            try:
                ready = conn.poll(min(remaining, 0.25))
                message = conn.recv() if ready else None
            except (EOFError, OSError):
                return self._crashed(phase)
            if message is None:
                if proc.poll() is not None and not _poll_quietly(conn):
                    return self._crashed(phase)
                continue
            tag = message[0]
            if tag == "phase":
                phase = message[1]
                continue
            if tag in ("ready", "result"):
                return JobResult(True, value=message[1], phase=phase)
            if tag == "startup_error":
                return JobResult(True, value={"startup_error": message[1]}, phase=phase)
            if tag == "error":
                body = message[1]
                if body.get("fatal"):
                    self._discard()  # the child exits after a fatal CUDA error; the next call starts another
                return JobResult(False, error=body["error"], kind="exception", phase=phase, traceback=body.get("traceback"))
            return JobResult(False, error=f"unexpected message from the worker: {tag!r}", kind="crash", phase=phase)

    def _crashed(self, phase: str) -> JobResult:
        proc = self._state["proc"]
        try:
            code = proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            code = None
        where = PHASE_WORDS.get(phase, phase)
        if code is None:
            what = "worker process stopped answering (its pipe closed)"
        elif code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = str(-code)
            what = f"worker process died with signal {name}"
        else:
            what = f"worker process exited with code {code}"
        self._discard()
        return JobResult(False, error=f"{what} while {where}", kind="crash", phase=phase)

    # -- jobs
    def call(self, job: str, payload: Mapping[str, Any] | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> JobResult:
        """Run ``job`` in the worker (starting one if needed); never raises for the job's failures."""
        with self._lock:
            for attempt in range(2):  # a child that died while idle is replaced, and the job sent again
                if self.startup_error is not None:
                    return JobResult(False, error=self.startup_error, kind="startup", phase="starting")
                if not self.alive():
                    self._discard()
                    failed = self._start()
                    if failed is not None:
                        return failed
                try:
                    self._state["conn"].send(("job", job, dict(payload or {})))
                except (OSError, ValueError):
                    crashed = self._crashed("idle")
                    if attempt == 0:
                        continue
                    return crashed
                return self._receive(timeout_s, "preparing")
            raise AssertionError("unreachable")


def _poll_quietly(conn: Any) -> bool:
    try:
        return bool(conn.poll(0))
    except (EOFError, OSError):
        return False


def problem_payload(problem: Problem, derivation: Derivation) -> dict[str, Any]:
    """What the child needs to rebuild a problem (problems and derivations pickle; a few KB)."""
    from fuser_core.canonical import spec_hash

    spec = problem.spec
    key = f"{spec_hash(spec)}|{spec.name}|{sorted(problem.shape.items())}|{sorted(problem.dtypes.items())}"
    return {"key": key, "problem": problem, "derivation": derivation}


class CudaMeasurer:
    """``--measurer cuda``: a correctness-gated GPU time per candidate (module docstring).

    Same constructor as :class:`tuner.measure.ModelMeasurer`; ``device="cpu"`` runs the kernels
    through Triton's interpreter (for tests; times labelled as such, ``name`` becomes
    ``cuda-interpreter``). ``worker`` shares an existing :class:`WorkerProcess` (the bench
    does); otherwise the measurer owns one, stopped by :meth:`close`.
    """

    name = "cuda"

    def __init__(self, problem: Problem, derivation: Derivation, profile: GpuProfile, *, device: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, startup_timeout_s: float = STARTUP_TIMEOUT_S,
                 timing: TimingSettings | None = None, worker: WorkerProcess | None = None):
        self.problem = problem
        self.spec = problem.spec
        self.derivation = derivation
        self.shape = problem.shape
        self.dtypes = problem.dtypes
        self.profile = profile
        self.device = device or (worker.device if worker is not None else "cuda")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device: expected 'cuda' or 'cpu', got {self.device!r}")
        if worker is not None and worker.device != self.device:
            raise ValueError(f"device {self.device!r} differs from the shared worker's ({worker.device!r})")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be positive, got {timeout_s}")
        self.name = "cuda" if self.device == "cuda" else "cuda-interpreter"
        self.timeout_s = float(timeout_s)
        self.timing = timing or TimingSettings()
        self.worker = worker or WorkerProcess(self.device, startup_timeout_s=startup_timeout_s)
        self._owns_worker = worker is None
        self._problem = problem_payload(problem, derivation)

    def close(self) -> None:
        if self._owns_worker:
            self.worker.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def measure(self, candidate: Candidate) -> Measurement:
        details: dict[str, Any] = {"measurer": self.name, "target": self.profile.name, "predicted": False,
                                   "device": self.device,
                                   "clock": CPU_LABEL if self.device == "cpu" else GPU_LABEL}
        variant = {"kind": "fused", "strategy": candidate.strategy, "config": candidate.config.to_dict()}
        r = self.worker.call("variant", {"problem": self._problem, "variant": variant, "timing": self.timing.to_dict()},
                             timeout_s=self.timeout_s)
        if self.worker.info:
            details["device_name"] = self.worker.info.get("device_name")
            details["device_matches_target"] = self.worker.info.get("profile") == self.profile.name
        if not r.ok:
            details["failure"] = {"kind": r.kind, "phase": r.phase}
            if r.traceback:
                details["traceback"] = r.traceback[-2000:]
            return Measurement(None, r.error, False, details)
        value = r.value
        details["check"] = value.get("check")
        if value.get("accuracy") is not None:  # the accuracy bar's families (fused kernels)
            details["accuracy"] = value["accuracy"]
        if value.get("error"):  # a wrong result: the check's verdict, never a time
            return Measurement(None, value["error"], False, details)
        details["timing"] = value["timing"]
        details["sample"] = value.get("sample")
        return Measurement(float(value["time_ms"]), None, False, details)


    def measured_binary(self, strategy: str, config: Mapping[str, Any]) -> dict[str, Any]:
        """The compiled kernels of the candidate ``(strategy, config)`` as the child launched
        them when it measured it (tuner.measured_binary): ``compile_artifacts``' answer, for
        the kernel store. Raises RuntimeError when the child cannot give them (no GPU, ...)."""
        variant = {"kind": "fused", "strategy": strategy, "config": dict(config)}
        r = self.worker.call("binary", {"problem": self._problem, "variant": variant, "timing": self.timing.to_dict()},
                             timeout_s=self.timeout_s)
        if not r.ok:
            raise RuntimeError(f"the measured binary could not be read: {r.error}")
        return r.value


# ============================================================================ the sampled reference


def sliceable_dims(spec: Spec) -> tuple[str, ...]:
    """Dims along which rows are independent: no step reduces over them, and no topk lays
    its result on them."""
    fixed = {s.over for s in spec.steps if s.is_reduction} | {s.as_dim for s in spec.steps if s.as_dim}
    return tuple(d for d in spec.dims if d not in fixed)


def reference_cost(spec: Spec, sizes: Mapping[str, int]) -> int:
    """Elements of the largest array the reference evaluator materialises at ``sizes``."""
    worst = max((math.prod(sizes[d] for d in i.dims) for i in spec.inputs), default=1)
    for s in spec.steps:
        dims = set(spec.expr_dims(s.expr)) | set(s.dims)
        worst = max(worst, math.prod(sizes[d] for d in dims))
    return worst


def sample_rows(spec: Spec, shape: Mapping[str, int], budget: int = REFERENCE_BUDGET,
                rng: np.random.Generator | None = None, per_dim: int = ROWS_PER_DIM) -> dict[str, np.ndarray]:
    """Sorted indices to check per sliceable dim (a dim absent from the result is whole).

    Each dim starts at ``min(size, per_dim)`` indices, or all of them when the whole problem
    fits the budget; the largest count is halved until the reference fits ``budget``. Raises
    ValueError when even one row is too large."""
    rng = rng or np.random.default_rng(0)
    dims = sliceable_dims(spec)
    if reference_cost(spec, shape) <= budget:
        return {}
    counts = {d: min(shape[d], per_dim) for d in dims}
    while reference_cost(spec, {**shape, **counts}) > budget:
        big = max((d for d in dims if counts[d] > 1), key=lambda d: counts[d], default=None)
        if big is None:
            raise ValueError(f"the float64 reference needs {reference_cost(spec, {**shape, **counts})} elements for a "
                             f"single row of {spec.name} (budget {budget}): the correctness check cannot run at this shape")
        counts[big] = (counts[big] + 1) // 2
    out = {}
    for d in dims:
        n, c = shape[d], counts[d]
        if c >= n:
            continue
        if c == 1:
            chosen = [n - 1]
        else:
            middle = rng.choice(np.arange(1, n - 1), size=c - 2, replace=False) if c > 2 else []
            chosen = [0, n - 1, *middle]
        out[d] = np.array(sorted(int(i) for i in chosen), dtype=np.int64)
    return out


class SampledEvaluator(Evaluator):
    """The reference on sampled rows: shapes are the sample's, but ``size(dim)`` and
    ``index(dim)`` keep their full-shape values (the original indices of the sampled rows)."""

    def __init__(self, spec: Spec, full_shape: Mapping[str, int], rows: Mapping[str, np.ndarray]):
        sampled = {d: (len(rows[d]) if d in rows else n) for d, n in full_shape.items()}
        super().__init__(spec, sampled)
        self.full_shape = dict(full_shape)
        self.rows = {d: np.asarray(v, np.int64) for d, v in rows.items()}

    def size_value(self, dim: str) -> np.float64:
        return np.float64(self.full_shape[dim])

    def index_array(self, dim: str) -> np.ndarray:
        if dim in self.rows:
            return self.rows[dim].astype(np.float64).reshape(self.aligned_shape((dim,)))
        return super().index_array(dim)


class SampledTermScales(TermScales, SampledEvaluator):
    """The terms' magnitudes of each sum (:func:`fuser_core.accuracy.cancellation`) on sampled rows."""


class SampledFormula(SampledEvaluator, FormulaEvaluator):
    """The spec's formula in a dtype (:class:`fuser_core.accuracy.FormulaEvaluator`) on sampled rows
    (:class:`SampledEvaluator`): the accuracy bar's yardstick for a device-sized problem."""

    def __init__(self, spec: Spec, full_shape: Mapping[str, int], rows: Mapping[str, np.ndarray], dtype: str,
                 rng: np.random.Generator | None):
        SampledEvaluator.__init__(self, spec, full_shape, rows)
        self.dtype, self.rng = dtype, rng


def family_tensor(name: str, x: Any, pos: int, generator: Any) -> Any:
    """An affine input family (:class:`fuser_core.accuracy.Family`: scale, shift, a peak per row along
    axis ``pos``) applied to a device tensor, rounded to its dtype: the inputs never leave the device."""
    import torch

    from fuser_core.accuracy import FAMILIES

    fam = FAMILIES[name]
    assert fam.affine, f"{name} is not an affine family"
    out = x.float() * fam.scale + fam.shift
    if fam.peak and out.numel():
        moved = out.movedim(pos, -1)
        at = torch.randint(0, moved.shape[-1], (*moved.shape[:-1], 1), generator=generator, device=x.device)
        moved.scatter_add_(-1, at, torch.full(at.shape, fam.peak, device=x.device))
        out = moved.movedim(-1, pos)
    return out.to(x.dtype)


# ============================================================================ child side


def _select(t: Any, dims: tuple[str, ...], rows: Mapping[str, Any]) -> Any:
    """``t`` (over ``dims``) restricted to the sampled rows. float8 rows are selected as their
    bytes: whether ``index_select`` takes float8 on CUDA depends on the torch release."""
    import torch

    fp8 = t.dtype == torch.float8_e4m3fn
    if fp8:
        t = t.view(torch.uint8)
    for axis, d in enumerate(dims):
        if d in rows:
            t = t.index_select(axis, rows[d])
    return t.view(torch.float8_e4m3fn) if fp8 else t


def _to_numpy(t: Any) -> np.ndarray:
    import torch

    if t.dtype.is_floating_point:
        return t.detach().to("cpu", torch.float32).numpy().astype(np.float64)
    return t.detach().to("cpu", torch.int64).numpy()


class DeviceProblem:
    """One problem (:class:`fuser_core.problem.Problem`) in the child: check inputs on the device,
    the sampled reference (computed once), and the input sets timing rotates through (made once)."""

    def __init__(self, payload: Mapping[str, Any], device: str, timing: Mapping[str, Any]):
        import torch

        self.key = payload["key"]
        self.problem: Problem = payload["problem"]
        self.spec: Spec = self.problem.spec
        self.derivation: Derivation = payload["derivation"]
        self.shape: dict[str, int] = self.problem.shape
        self.dtypes: dict[str, str] = self.problem.dtypes
        self.device = device
        self.seed = int(timing.get("seed", 0))
        self.stores = self.problem.output_dtypes
        self.inputs = self.random_inputs(0)
        self.budget = int(timing.get("reference_budget", REFERENCE_BUDGET))
        self.rows_np = sample_rows(self.spec, self.shape, self.budget, np.random.default_rng(self.seed))
        self.rows = {d: torch.as_tensor(v, device=device) for d, v in self.rows_np.items()}
        self._reference: dict[str, np.ndarray] | None = None
        self._noise: dict[str, np.ndarray] = {}
        self._ties: list[dict[str, np.ndarray]] = []
        self._arrays: dict[str, np.ndarray] = {}  # the sampled inputs the reference read
        self._sets: list[dict[str, Any]] | None = None
        self._families: dict[str, dict[str, Any]] = {}  # the accuracy bar's input sets (family())
        self.input_bytes = sum(t.numel() * t.element_size() for t in self.inputs.values())

    def random_inputs(self, index: int) -> dict[str, Any]:
        """Standard normal values rounded to each input's dtype (as reference.random_inputs),
        index inputs uniform below their bound; drawn on the device."""
        import torch

        g = torch.Generator(device=self.device)
        g.manual_seed(self.seed * 1000 + index)
        out = {}
        for inp in self.spec.inputs:
            size = tuple(self.shape[d] for d in inp.dims)
            dt = self.dtypes[inp.name]
            if inp.is_index:
                bound = index_input_bound(self.spec, inp.name, self.shape)
                out[inp.name] = torch.randint(0, bound, size, generator=g, device=self.device, dtype=getattr(torch, dt))
                continue
            x = torch.randn(size, generator=g, device=self.device, dtype=torch.float32)
            if dt == "float8_e4m3fn":
                x = x.clamp_(-448.0, 448.0)
            out[inp.name] = consistent(self.spec, inp.name, x.to(getattr(torch, dt)), self.shape)
        return out

    def reference(self) -> dict[str, np.ndarray]:
        if self._reference is None:
            from fuser_core.runner import rounding_noise, tie_alternatives

            arrays = {i.name: _to_numpy(_select(self.inputs[i.name], i.dims, self.rows)) for i in self.spec.inputs}
            evaluator = SampledEvaluator(self.spec, self.shape, self.rows_np)
            self._reference = evaluator.outputs(arrays)
            self._noise = rounding_noise(evaluator.outputs, arrays, self._reference)

            def with_ties(k: int) -> dict[str, np.ndarray]:
                tied = SampledEvaluator(self.spec, self.shape, self.rows_np)
                tied.tie_choice = k
                return tied.outputs(arrays)

            self._ties = tie_alternatives(with_ties, self.spec, self._reference)
            self._arrays = arrays
        return self._reference

    def family(self, name: str) -> dict[str, Any]:
        """The checked input set moved to family ``name`` on the device, with the sampled float64 reference
        and the formula's evaluations in the run's dtype on the same rows (computed once per problem: a
        variant only runs its kernel on them). Index inputs are kept; float inputs over the loop axis
        get the family along it, others along their last dim (as fuser_core.accuracy.family_inputs)."""
        if name not in self._families:
            import torch

            from fuser_core.accuracy import cancellation, formula_dtype, formula_outputs
            from fuser_core.codegen.plan import loop_axis

            axis, _ = loop_axis(self.spec)
            g = torch.Generator(device=self.device)
            g.manual_seed(self.seed * 1000 + 999)
            inputs = {}
            for inp in self.spec.inputs:
                x = self.inputs[inp.name]
                pos = inp.dims.index(axis) if axis in inp.dims else x.dim() - 1
                inputs[inp.name] = (x if inp.is_index or x.dim() == 0 else
                                    consistent(self.spec, inp.name, family_tensor(name, x, pos, g), self.shape))
            arrays = {i.name: _to_numpy(_select(inputs[i.name], i.dims, self.rows)) for i in self.spec.inputs}
            with np.errstate(all="ignore"):
                reference = SampledEvaluator(self.spec, self.shape, self.rows_np).outputs(arrays)
            formula = formula_outputs(self.spec, self.shape, arrays, formula_dtype(self.dtypes), self.seed,
                                      make=lambda d, r: SampledFormula(self.spec, self.shape, self.rows_np, d, r))
            cancel = cancellation(self.spec, self.shape, arrays, reference,
                                  SampledTermScales(self.spec, self.shape, self.rows_np))
            self._families[name] = {"inputs": inputs, "reference": reference, "formula": formula, "cancel": cancel}
        return self._families[name]

    def knife_edges(self) -> list[dict[str, np.ndarray]]:
        """The reference's float32-sized evaluations for knife edges (fuser_core.runner.knife_edges)."""
        from fuser_core.runner import knife_edges

        self.reference()

        def rounded(arrays: dict[str, np.ndarray], rounding) -> dict[str, np.ndarray]:
            evaluator = SampledEvaluator(self.spec, self.shape, self.rows_np)
            evaluator.rounding = rounding
            return evaluator.outputs(arrays)

        return knife_edges(rounded, self._arrays)

    def allowances(self) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
        """The reference's float32 rounding noise and tie alternatives (fuser_core.runner)."""
        self.reference()
        return self._noise, self._ties

    def timing_sets(self, settings: Mapping[str, Any], l2_bytes: int) -> list[dict[str, Any]]:
        """Set 0 is the checked set; more sets until their total exceeds 4 x L2 (bounded by
        ``max_sets`` and by 30% of the free device memory)."""
        import torch

        if self._sets is None:
            want = 1
            if self.device == "cuda":
                want = max(2, math.ceil(4 * l2_bytes / max(1, self.input_bytes)))
                want = min(want, int(settings.get("max_sets", 32)))
                free, _total = torch.cuda.mem_get_info()
                want = max(1, min(want, int(0.3 * free // max(1, self.input_bytes))))
            self._sets = [self.inputs] + [self.random_inputs(i) for i in range(1, want)]
        return self._sets


class _Child:
    """The worker's state: device facts, the current problem, the L2 flush buffer."""

    def __init__(self, device: str, conn: Any):
        import torch

        self.conn = conn
        self.device = device
        self.problem: DeviceProblem | None = None
        self._flush = None
        info: dict[str, Any] = {"device": device, "pid": os.getpid(), "torch": torch.__version__}
        import triton

        info["triton"] = triton.__version__
        if device == "cuda":
            if os.environ.get("TRITON_INTERPRET") == "1":
                raise RuntimeError("TRITON_INTERPRET=1 is set: GPU kernels would run in the interpreter")
            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA GPU is visible (torch.cuda.is_available() is false)")
            torch.cuda.init()
            props = torch.cuda.get_device_properties(0)
            from tuner.profiles import profile_for_device_name

            info.update(device_name=props.name, profile=profile_for_device_name(props.name),
                        l2_bytes=int(props.L2_cache_size), sm_count=int(props.multi_processor_count),
                        total_memory=int(props.total_memory), capability=f"{props.major}.{props.minor}",
                        cuda=torch.version.cuda, timing_label=GPU_LABEL)
        else:
            import platform

            info.update(device_name=f"CPU ({platform.processor() or platform.machine()}), Triton interpreter",
                        profile=None, l2_bytes=0, timing_label=CPU_LABEL)
        self.info = info

    def phase(self, name: str) -> None:
        self.conn.send(("phase", name))

    def get_problem(self, payload: Mapping[str, Any], timing: Mapping[str, Any]) -> DeviceProblem:
        budget = int(timing.get("reference_budget", REFERENCE_BUDGET))
        p = self.problem
        if p is None or p.key != payload["key"] or p.seed != int(timing.get("seed", 0)) or p.budget != budget:
            self.problem = None  # free the previous problem's device memory first
            if self.device == "cuda":
                import torch

                torch.cuda.empty_cache()
            self.problem = DeviceProblem(payload, self.device, timing)
        return self.problem

    def flush_buffer(self) -> Any:
        import torch

        if self._flush is None:
            size = max(256 << 20, 2 * int(self.info.get("l2_bytes", 0)))
            self._flush = torch.empty(size // 4, dtype=torch.int32, device=self.device)
        return self._flush

    # -- jobs
    def run(self, job: str, payload: Mapping[str, Any], fault: str | None) -> dict[str, Any]:
        if job == "info":
            return dict(self.info)
        if job == "variant":
            return self.variant(payload, fault)
        if job == "copy_bandwidth":
            return self.copy_bandwidth(payload)
        if job == "binary":
            return self.binary(payload)
        raise ValueError(f"unknown job {job!r}")

    def binary(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """The compiled kernels of a fused candidate as this process launched them (the module
        and Triton's JIT cache are the ones its measurement used; a launch here first, so a
        restarted child compiles it the same way): tuner.measured_binary."""
        from tuner.measured_binary import compiled_kernels, measured_artifacts

        problem = self.get_problem(payload["problem"], payload.get("timing", {}))
        module = fused_module(problem, payload["variant"])
        module.launch(problem.inputs, problem.shape, scalars=tuning_scalars(problem.spec, problem.shape))
        self.sync()
        return measured_artifacts(compiled_kernels(module))

    def variant(self, payload: Mapping[str, Any], fault: str | None) -> dict[str, Any]:
        timing = payload.get("timing", {})
        self.phase("preparing")
        problem = self.get_problem(payload["problem"], timing)
        variant = payload["variant"]
        self.phase("compiling")
        if fault == "hang":
            time.sleep(10**6)
        fn = make_variant(problem, variant)
        outputs = fn(problem.inputs)
        self.sync()
        self.phase("checking")
        if fault == "corrupt":
            outputs = {p: t + 1 for p, t in outputs.items()}
        check = check_outputs(problem, outputs, variant)
        result: dict[str, Any] = {"check": check, "sample": {d: len(v) for d, v in problem.rows_np.items()}}
        if variant["kind"] != "fused":
            import torch

            result["float32_matmul_precision"] = torch.get_float32_matmul_precision()
        if not check["passed"]:
            result["error"] = check["error"]
            return result
        if variant["kind"] == "fused" and (variant.get("strategy") not in ("streaming_fused", "split_fused")
                                           or problem.derivation.exact):
            bar = accuracy_bar(problem, fn)
            result["accuracy"] = bar
            if not bar["passed"]:
                from fuser_core.accuracy import refusal

                result["error"] = refusal(str(variant.get("strategy") or "the kernel"), bar)
                return result
        if not payload.get("time", True):  # a correctness check only
            return result
        self.phase("running")
        if fault == "hang_running":
            time.sleep(10**6)
        if fault == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "exit":
            os._exit(3)
        if fault == "raise":
            raise RuntimeError("injected fault (raise)")
        if fault == "cuda_error":
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected fault)")
        sets = problem.timing_sets(timing, int(self.info.get("l2_bytes", 0)))
        stats = self.time(fn, sets, timing)
        result["timing"] = stats
        result["time_ms"] = stats["median_ms"]
        return result

    def sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def time(self, fn: Callable[[Any], Any], sets: list[dict[str, Any]], settings: Mapping[str, Any]) -> dict[str, Any]:
        if self.device == "cpu":
            return time_cpu(fn, sets, settings)
        return time_cuda(fn, sets, settings, self.flush_buffer())

    def copy_bandwidth(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """Device-to-device copy bandwidth (bytes read + written per second) of a buffer far
        larger than L2; on the CPU, a host memory copy (labelled)."""
        import torch

        self.phase("running")
        settings = payload.get("timing", {})
        if self.device == "cuda":
            nbytes = int(payload.get("bytes") or max(1 << 30, 8 * int(self.info["l2_bytes"])))
        else:
            nbytes = int(payload.get("bytes") or 64 << 20)
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        src.fill_(1)
        dst = torch.empty_like(src)

        def fn(_inputs: Any) -> None:
            dst.copy_(src)

        stats = self.time(fn, [{}], settings)
        seconds = stats["median_ms"] / 1e3
        return {"bytes": nbytes, "timing": stats, "bytes_per_s": 2 * nbytes / seconds,
                "what": "torch copy_ of a buffer (read + write)" + (" on the host CPU" if self.device == "cpu" else
                                                                     " device to device")}


def time_cuda(fn: Callable[[Any], Any], sets: list[dict[str, Any]], settings: Mapping[str, Any], flush: Any) -> dict[str, Any]:
    """do_bench-style timing with CUDA events (module docstring)."""
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


def fused_module(problem: DeviceProblem, variant: Mapping[str, Any]) -> Any:
    """The loaded generated module of a fused candidate (``{"strategy", "config"}``); loaded
    modules are cached by key, so a second call returns the module (and JIT caches) of the first."""
    from fuser_core.codegen.module import generate
    from fuser_core.codegen.plan import KernelConfig

    config = KernelConfig.from_dict(dict(variant["config"]))
    return generate(problem.spec, problem.derivation, variant["strategy"], problem.shape, config,
                    problem.dtypes).load()


def make_variant(problem: DeviceProblem, variant: Mapping[str, Any]) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """A function of the input tensors returning the outputs by part, for one variant:
    ``fused`` (a candidate), ``chain`` (the unfused kernel chain), ``eager`` (the spec in
    PyTorch), ``compile`` (that under ``torch.compile``), ``handwritten`` (torch's own kernel),
    ``expert`` (``variant["name"]``: an expert baseline of :mod:`tuner.experts`)."""
    spec, shape, dtypes = problem.spec, problem.shape, problem.dtypes
    kind = variant["kind"]
    if kind == "fused":
        launch = fused_module(problem, variant).launch
        scalars = tuning_scalars(spec, shape)
        return lambda tensors: launch(tensors, shape, scalars=scalars)
    if kind == "chain":
        return chain_function(problem.problem)
    if kind in ("eager", "compile", "handwritten", "expert"):
        import torch

        from tuner.torch_ref import matmul_precision

        # float32 matmuls in TF32 exactly where the fused kernels use it (bf16 inputs)
        torch.set_float32_matmul_precision(matmul_precision(dtypes))
    if kind in ("eager", "compile"):
        from tuner.torch_ref import build

        fn = build(problem.problem)
        if kind == "compile":
            import torch

            torch._dynamo.reset()  # one compiled function per job: never hit the recompile limit
            fn = torch.compile(fn, dynamic=False)
        return fn
    if kind == "handwritten":
        from tuner.torch_ref import handwritten, handwritten_reason

        hw = handwritten(spec)
        if hw is None:
            raise ValueError(handwritten_reason(spec))
        return lambda tensors: hw.fn(tensors, shape)
    if kind == "expert":
        from tuner.experts import expert

        chosen = expert(problem.problem, variant["name"])
        why_not = chosen.applies(problem.problem)
        if why_not is not None:
            raise ValueError(why_not)
        fn = chosen.build(problem.problem)
        return lambda tensors: fn(tensors, shape)
    raise ValueError(f"unknown variant kind {kind!r}")


def chain_function(problem: Problem) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """The unfused kernel chain (fuser_core.codegen.chain) with its modules generated and
    loaded once: one launch per kernel, intermediates through memory, as run_chain_detailed."""
    import torch

    from fuser_core.codegen.chain import chain_modules

    spec, shape = problem.spec, problem.shape
    kernels = chain_modules(spec, dict(shape), dict(problem.dtypes))
    for k in kernels:
        k.load()
    final = {p: getattr(torch, d) for p, d in problem.output_dtypes.items()}
    parts = spec.output_parts

    scalars = tuning_scalars(spec, shape)

    def run(tensors: Mapping[str, Any]) -> dict[str, Any]:
        memory: dict[str, Any] = {}
        for k in kernels:
            memory.update(k.launch(tensors, memory, shape, scalars))
        out = {}
        for part in parts:
            t = memory[part]
            out[part] = (t if t.dtype == final[part] else t.to(final[part])).contiguous()
        return out

    return run


def accuracy_bar(problem: DeviceProblem, fn: Callable[[Any], Any]) -> dict[str, Any]:
    """The accuracy bar (fuser_core.accuracy) on the device, for the tuner's gate families
    (``GATE_FAMILIES``: x + 100, x + 1000, peaked rows): the variant runs on each family's inputs at the
    job's shape, and its sampled rows are held to 2x the formula's error in the run's dtype on the same
    rows. torch's own op is the model measurer's comparison (at a reduced shape), not repeated here.
    ``{"passed", "families": [{"family", "passed", "error", "formula_error", "ratio", ...}]}``."""
    from fuser_core.accuracy import GATE_FAMILIES, bar_verdict, formula_dtype

    rows = []
    fdtype = formula_dtype(problem.dtypes)
    for name in GATE_FAMILIES:
        fam = problem.family(name)
        outputs = fn(fam["inputs"])
        sliced = {p: _select(outputs[p], problem.spec.step(p.split(".")[0]).dims, problem.rows) for p in fam["reference"]}
        verdict = bar_verdict(problem.spec, sliced, fam["reference"], fam["formula"], problem.stores, cancel=fam["cancel"])
        verdict.pop("parts")
        rows.append({"family": name, **verdict, "shape": dict(problem.shape), "formula_dtype": fdtype, "note": ""})
    return {"passed": all(r["passed"] for r in rows), "families": rows}


def check_outputs(problem: DeviceProblem, outputs: Mapping[str, Any], variant: Mapping[str, Any]) -> dict[str, Any]:
    """Compare with the sampled float64 reference, as fuser_core.runner.self_check judges."""
    import torch

    from fuser_core.runner import judge

    spec = problem.spec
    reference = problem.reference()
    missing = [p for p in reference if p not in outputs]
    if missing:
        return {"passed": False, "error": f"output {missing[0]!r} is missing"}
    sliced = {}
    for part in reference:
        t = outputs[part]
        want = tuple(problem.shape[d] for d in spec.step(part.split(".")[0]).dims)
        if tuple(t.shape) != want:
            return {"passed": False, "error": f"output {part!r} has shape {tuple(t.shape)}, expected {want}"}
        sliced[part] = _select(t, spec.step(part.split(".")[0]).dims, problem.rows)
    strategy = variant.get("strategy")
    exact = variant["kind"] != "fused" or strategy not in ("streaming_fused", "split_fused") or problem.derivation.exact
    noise, ties = problem.allowances()
    report: dict[str, Any] = judge(spec, sliced, reference, problem.stores, exact=exact, noise=noise, alternatives=ties,
                                   knife=problem.knife_edges)
    bad, errors, tolerances = report.pop("bad"), report["errors"], report["tolerances"]
    report["rows_checked"] = {d: len(v) for d, v in problem.rows_np.items()} or "all"
    if bad:
        p = bad[0]
        report["error"] = (f"wrong result: {p} has max relative error {errors[p]:.3g} > tolerance {tolerances[p]:.3g} "
                           f"against the float64 reference")
        return report
    for part, ref in reference.items():  # rows outside the sample: at least finite where the sample is
        t = outputs[part]
        if t.dtype.is_floating_point and np.isfinite(ref).all() and not bool(torch.isfinite(t.float()).all()):
            report.update(passed=False, error=f"wrong result: {part} has non-finite values outside the checked rows")
            return report
    return report


def _is_fatal(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}".lower()
    return "acceleratorerror" in text or any(m in text for m in _FATAL_MARKERS)


def _take_fault() -> str | None:
    """The injected fault for this job, if a test armed one (module docstring)."""
    path = os.environ.get(FAULT_ENV)
    if not path:
        return None
    taken = f"{path}.taken.{os.getpid()}"
    try:
        os.rename(path, taken)
    except OSError:
        return None
    try:
        with open(taken) as f:
            fault = f.read().strip()
    finally:
        os.unlink(taken)
    if fault not in FAULTS:
        raise ValueError(f"{FAULT_ENV}: unknown fault {fault!r}; one of {', '.join(FAULTS)}")
    return fault


def _worker_main(conn: Any, settings: Mapping[str, Any]) -> None:
    """The child: set up the device, answer ``ready``, then run jobs until told to stop or
    until the parent's end of the pipe closes."""
    device = settings["device"]
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    try:
        child = _Child(device, conn)
    except BaseException as err:  # noqa: BLE001 (no GPU, broken install: every job would fail the same way)
        conn.send(("startup_error", f"the measurement worker could not start on {device}: {type(err).__name__}: {err}"))
        return
    conn.send(("ready", child.info))
    from fuser_core.runner import interpreter_quiet

    with interpreter_quiet():  # every kernel's outputs are checked against the reference before timing
        _serve_jobs(conn, child)


def _serve_jobs(conn: Any, child: _Child) -> None:
    """The child's loop: run jobs until told to stop or until the parent's end of the pipe closes."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if message[0] != "job":
            return
        _, job, payload = message
        try:
            fault = _take_fault()
            result = child.run(job, payload, fault)
            conn.send(("result", result))
        except BaseException as err:  # noqa: BLE001 (any failure of a job is that job's answer)
            fatal = _is_fatal(err)
            body = {"error": f"{type(err).__name__}: {err}".strip()[:4000],
                    "traceback": traceback.format_exc(limit=8)[-4000:], "fatal": fatal}
            try:
                conn.send(("error", body))
            except (OSError, BrokenPipeError):
                return
            if fatal:  # the CUDA context is unusable after such an error
                conn.close()
                os._exit(70)


def worker_entry(argv: list[str]) -> None:
    """``python -m tuner.measure_cuda --worker FD DEVICE``: the child's entry point."""
    from multiprocessing.connection import Connection

    if len(argv) != 3 or argv[0] != "--worker":
        raise SystemExit("usage: python -m tuner.measure_cuda --worker FD cuda|cpu (started by WorkerProcess)")
    _worker_main(Connection(int(argv[1])), {"device": argv[2]})


__all__ = [
    "CPU_LABEL",
    "DEFAULT_TIMEOUT_S",
    "FAULTS",
    "FAULT_ENV",
    "GPU_LABEL",
    "REFERENCE_BUDGET",
    "CudaMeasurer",
    "JobResult",
    "DeviceProblem",
    "SampledEvaluator",
    "TimingSettings",
    "WorkerProcess",
    "chain_function",
    "check_outputs",
    "make_variant",
    "problem_payload",
    "reference_cost",
    "sample_rows",
    "sliceable_dims",
    "summarize",
    "time_cpu",
    "time_cuda",
]


if __name__ == "__main__":
    from tuner.measure_cuda import worker_entry as _entry  # the importable module, not __main__

    _entry(sys.argv[1:])
