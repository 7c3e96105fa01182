"""A crash-isolated worker process: jobs run in a child that a hang or a crash cannot take down with it.

**Isolation.** :class:`WorkerProcess` is a child process started with a pipe, once, and reused,
so device initialisation and imports are paid once; the child leads its own process group. The
parent waits with a deadline: a job that hangs is a failed job ("timed out after 30s
compiling"), the child's process group is killed and the next job starts a fresh child; a
child that dies (an illegal address that takes the process down, a segfault in a driver,
``os._exit``) fails its job only ("worker process died with signal SIGSEGV while running"). A
device error that leaves the context unusable (illegal memory access, device-side assert,
launch failure: :func:`is_fatal`, whose markers match CUDA's messages and HIP's alike) fails
the job and the child exits after answering, so the next job gets a clean context.

Nothing here is CUDA-specific or measurement-specific. The child runs a *job runner*, named
``"module:Class"`` (default :data:`DEVICE_JOBS`, :class:`tuner.device.jobs.DeviceJobs`):
``Class(device, conn)`` sets the device up (an exception is a startup error, remembered and
answered at once to every later call) and keeps its facts in ``info``; ``run(job, payload,
fault)`` answers one job with a dict, and may send ``("phase", name)`` on ``conn`` first
(:data:`PHASE_WORDS` names them in failures). ``device`` is ``"cuda"`` (torch's name for the
GPU, ROCm's included) or ``"cpu"`` (the child sets ``TRITON_INTERPRET=1``).

**Fault injection (tests only).** When ``FOLDWISE_MEASURE_FAULT_FILE`` (:data:`FAULT_ENV`)
names a file, the child takes (renames, reads and deletes) that file before each job and, if
it held a fault name, hands it to the job runner once: ``hang`` (while compiling),
``hang_running``, ``segv``, ``exit``, ``raise``, ``cuda_error`` (a fatal-looking device error)
or ``corrupt`` (the outputs are perturbed before the check). Nothing happens when the variable
is unset.

Example::

    with WorkerProcess("cpu") as worker:
        r = worker.call("info")
        r.ok, r.value["device_name"]
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Self

DEFAULT_TIMEOUT_S = 120.0  # one trial: inputs, compile, check and timing
STARTUP_TIMEOUT_S = 300.0  # the child's imports and device initialisation
DEVICE_JOBS = "tuner.device.jobs:DeviceJobs"  # the measurement jobs (module:Class), the default job runner
FAULT_ENV = "FOLDWISE_MEASURE_FAULT_FILE"
FAULTS = ("hang", "hang_running", "segv", "exit", "raise", "cuda_error", "corrupt")
PHASE_WORDS = {"starting": "starting the worker", "preparing": "preparing inputs and the reference",
               "compiling": "compiling", "checking": "checking", "running": "running", "idle": "between jobs"}
# device errors after which the context is unusable: CUDA's texts, which HIP's (ROCm) reuse
_FATAL_MARKERS = ("illegal memory access", "illegal address", "device-side assert", "unspecified launch failure",
                  "misaligned address", "cuda error: an illegal instruction", "cudaerrorlaunchfailure",
                  "cuda_error_illegal_address", "cuda_error_launch_failed",
                  "operation not permitted when stream is capturing")



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
    """One persistent child process that runs jobs (module docstring); ``jobs`` names its job runner.

    :meth:`call` sends a job and waits for its answer until ``timeout_s``; on a timeout or a
    crash the child is killed and the failure returned, and the next call starts a new child.
    A failure to start (no GPU, broken install) is remembered and answered immediately.
    """

    def __init__(self, device: str = "cuda", *, startup_timeout_s: float = STARTUP_TIMEOUT_S,
                 env: Mapping[str, str] | None = None, jobs: str = DEVICE_JOBS):
        if device not in ("cuda", "cpu"):
            raise ValueError(f"device: expected 'cuda' or 'cpu', got {device!r}")
        self.device = device
        self.jobs = jobs
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
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo holding tuner/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tuner.device.worker", "--worker", str(theirs.fileno()), self.device, self.jobs],
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
                    self._discard()  # the child exits after a fatal device error; the next call starts another
                return JobResult(False, error=body["error"], kind="exception", phase=phase,
                                 traceback=body.get("traceback"))
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
    def call(self, job: str, payload: Mapping[str, Any] | None = None, *,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> JobResult:
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


def is_fatal(err: BaseException) -> bool:
    """Whether ``err`` left the device context unusable (the child must exit after answering)."""
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
    """The child: set up the device and the job runner (``settings["jobs"]``, ``module:Class``),
    answer ``ready``, then run jobs until told to stop or until the parent's end of the pipe closes."""
    device = settings["device"]
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    try:
        module, name = settings["jobs"].split(":")
        child = getattr(importlib.import_module(module), name)(device, conn)
    except BaseException as err:  # noqa: BLE001 (no GPU, broken install: every job would fail the same way)
        conn.send(("startup_error", f"the measurement worker could not start on {device}: {type(err).__name__}: {err}"))
        return
    conn.send(("ready", child.info))
    _serve_jobs(conn, child)


def _serve_jobs(conn: Any, child: Any) -> None:
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
            fatal = is_fatal(err)
            body = {"error": f"{type(err).__name__}: {err}".strip()[:4000],
                    "traceback": traceback.format_exc(limit=8)[-4000:], "fatal": fatal}
            try:
                conn.send(("error", body))
            except (OSError, BrokenPipeError):
                return
            if fatal:  # the device context is unusable after such an error
                conn.close()
                os._exit(70)


def worker_entry(argv: list[str]) -> None:
    """``python -m tuner.device.worker --worker FD DEVICE JOBS``: the child's entry point."""
    from multiprocessing.connection import Connection

    if len(argv) != 4 or argv[0] != "--worker":
        raise SystemExit("usage: python -m tuner.device.worker --worker FD cuda|cpu module:Class "
                         "(started by WorkerProcess)")
    _worker_main(Connection(int(argv[1])), {"device": argv[2], "jobs": argv[3]})


if __name__ == "__main__":
    from tuner.device.worker import worker_entry as _entry  # the importable module, not __main__

    _entry(sys.argv[1:])
