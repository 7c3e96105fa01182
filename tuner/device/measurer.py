"""The device measurer (``--measurer cuda``): each candidate checked against the float64 reference, then timed.

**Correctness first.** A trial generates the candidate's module and runs it once, at the full
shape, on random inputs drawn on the device, and compares with the float64 reference on a
sample of independent rows (:mod:`fuser_core.sampled_reference`; every output element outside
the sample must still be finite whenever the sampled reference is), then holds fused kernels
to the accuracy bar (:mod:`tuner.device.checks`). A wrong kernel is a failed trial carrying
its errors, never a time. Then it is timed (:mod:`tuner.device.timing`).

Every trial runs in a crash-isolated worker process (:class:`tuner.device.worker.WorkerProcess`,
running :class:`tuner.device.jobs.DeviceJobs`): a hang is a failed trial after ``timeout_s``, a
crash fails its trial only.

**CPU mode** (``device="cpu"``): kernels run through Triton's interpreter
(``TRITON_INTERPRET=1`` in the child), timed with ``time.perf_counter``; such times are
labelled ``"CPU interpreter (TRITON_INTERPRET=1), not GPU"`` everywhere and the measurer calls
itself ``cuda-interpreter``. It exists so that the process machinery, the correctness gate,
timeouts and crash handling are tested for real on machines without a GPU.

Contract: :class:`DeviceMeasurer` keeps :class:`tuner.measure.Measurer` (``measure``,
``measured_binary``, ``close``). Its ``name`` (``cuda``, ``cuda-interpreter``) is what results
and the service record; the device is torch's ``"cuda"``, which PyTorch's ROCm build also
answers to.

Example (on a GPU)::

    m = DeviceMeasurer(make_problem(spec, {"m": 4096, "n": 32768}, "float16"), derivation, get_profile("h100"))
    r = m.measure(space.candidate(STREAMING_FUSED.name, {"block_n": 2048, "block_m": 1,
                                                         "num_warps": 8, "num_stages": 3}))
    r.time_ms, r.details["timing"]["p20_ms"], r.details["check"]["max_rel_err"]
    m.close()
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

from fuser_core.derive import Derivation
from fuser_core.problem import Problem
from tuner.device.inputs import problem_payload
from tuner.device.timing import CPU_LABEL, GPU_LABEL, TimingSettings
from tuner.device.worker import DEFAULT_TIMEOUT_S, STARTUP_TIMEOUT_S, WorkerProcess
from tuner.measure import Measurement
from tuner.profiles import GpuProfile
from tuner.space import Candidate


class DeviceMeasurer:
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
