"""The measurement jobs a worker child runs: a variant's check and time, its binary, copy bandwidth.

Contract (the job runner of :class:`tuner.device.worker.WorkerProcess`): ``DeviceJobs(device,
conn)`` sets up the device (raising when it cannot: no GPU, ``TRITON_INTERPRET=1`` set for a
GPU worker) and records its facts in ``info``; :meth:`DeviceJobs.run` answers one job
(``info``, ``variant``, ``binary``, ``copy_bandwidth``) with a dict, sending ``("phase",
name)`` messages as it goes so that a timeout names what it was doing. The current problem
(:class:`tuner.device.inputs.DeviceProblem`) is kept between jobs. An injected fault
(:data:`tuner.device.worker.FAULTS`) fires at its point in a ``variant`` job.

``device="cuda"`` is torch's device name for the GPU, which is also what PyTorch's ROCm build
calls an AMD GPU; ``device="cpu"`` runs the kernels in Triton's interpreter.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

from fuser_core.codegen.strategies import is_fused
from fuser_core.problem import tuning_scalars
from fuser_core.sampled_reference import REFERENCE_BUDGET
from tuner.device.checks import accuracy_bar, check_outputs, fused_module, make_variant
from tuner.device.inputs import DeviceProblem
from tuner.device.timing import CPU_LABEL, GPU_LABEL, flush_bytes, time_cpu, time_gpu


class DeviceJobs:
    """The worker child's state: device facts, the current problem, the L2 flush buffer (module docstring)."""

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
            size = flush_bytes(int(self.info.get("l2_bytes", 0)))
            self._flush = torch.empty(size // 4, dtype=torch.int32, device=self.device)
        return self._flush

    # -- jobs
    def run(self, job: str, payload: Mapping[str, Any], fault: str | None) -> dict[str, Any]:
        """Answer one job; ``fault`` is the injected fault for it (tests only), or None."""
        from fuser_core.runner import interpreter_quiet

        with interpreter_quiet():  # every kernel's outputs are checked against the reference before timing
            return self._dispatch(job, payload, fault)

    def _dispatch(self, job: str, payload: Mapping[str, Any], fault: str | None) -> dict[str, Any]:
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
        if variant["kind"] == "fused" and (not is_fused(variant.get("strategy")) or problem.derivation.exact):
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
        return time_gpu(fn, sets, settings, self.flush_buffer())

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

