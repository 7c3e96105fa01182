"""The kernel client's work that outlasts a call: tuning jobs (a job as the server reports it,
its progress line, its budget: :meth:`service.client.KernelCache.tune`) and prefetches
(:meth:`service.client.KernelCache.prefetch`)."""

from __future__ import annotations

import logging
import math
import sys
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from service.client.errors import KernelServiceError

if TYPE_CHECKING:
    from service.bundle import BundleKernel

log = logging.getLogger("foldwise.client")
LIVE_JOBS = ("running", "queued")  # a job in these states will still produce the kernel
FINISHED_JOBS = ("succeeded", "failed", "cancelled")


@dataclass(frozen=True)
class TuningJob:
    """A tuning job as the server reports it (``GET /v1/jobs/{id}``)."""

    id: str
    status: str  # queued, running, succeeded, failed, cancelled
    trials_done: int
    trials_budget: int
    best_ms: float | None
    kernel_id: str | None
    error: str | None

    @staticmethod
    def of(view: Any, what: str) -> TuningJob:
        """From a job view; KernelServiceError naming ``what`` when it is not one."""
        try:
            progress, best = view["progress"], view.get("best") or {}
            job = TuningJob(str(view["id"]), str(view["status"]), int(progress["trials_done"]),
                            int(progress["trials_budget"]), best.get("time_ms"), view.get("kernel_id"),
                            view.get("error"))
        except (TypeError, KeyError, ValueError, AttributeError):
            raise KernelServiceError(f"{what}: expected a job view, got {str(view)[:200]}") from None
        return job

    @property
    def finished(self) -> bool:
        return self.status in FINISHED_JOBS

    @property
    def state(self) -> str:
        """``running, 5/40 trials, best 0.0123 ms``."""
        best = f", best {self.best_ms:.4g} ms" if isinstance(self.best_ms, int | float) else ""
        return f"{self.status}, {self.trials_done}/{self.trials_budget} trials{best}"


class ProgressLine:
    """A job's progress: one line rewritten in place on a terminal, else a log line per change."""

    def __init__(self, what: str, enabled: bool, stream: TextIO | None = None):
        self.what, self.enabled = what, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self.last: str | None = None

    def show(self, job: TuningJob) -> None:
        text = f"job {job.id} {job.state}"
        if not self.enabled or text == self.last:
            return
        self.last = text
        if self.tty:
            self.stream.write(f"\r\x1b[2Kfoldwise: tuning {self.what}: {text}")
            self.stream.flush()
        else:
            log.info("tuning %s: %s", self.what, text, extra={"job_id": job.id, "status": job.status,
                                                               "trials_done": job.trials_done})

    def close(self) -> None:
        if self.tty and self.last is not None:
            self.stream.write("\n")
            self.stream.flush()


def positive_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a positive number of seconds, got {value!r:.40}")
    return float(value)


def tuning_budget(trials: int | None, seconds: float | None) -> dict[str, Any]:
    """A job's ``budget`` (what is left out, the server's default)."""
    budget: dict[str, Any] = {}
    if trials is not None:
        if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
            raise ValueError(f"trials: expected a positive integer, got {trials!r:.40}")
        budget["trials"] = trials
    if seconds is not None:
        budget["seconds"] = positive_seconds("seconds", seconds)
    return budget


class Prefetch:
    """The handle :meth:`KernelCache.prefetch` returns: one future per request, in order."""

    def __init__(self, futures: list[Future]):
        self.futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self, timeout: float | None = None) -> list[BundleKernel]:
        """The kernels, in the order asked for, once all are loaded; raises the first request's
        error (each future has its own), or TimeoutError after ``timeout`` seconds."""
        _, pending = wait_futures(self.futures, timeout=timeout)
        if pending:
            raise TimeoutError(f"{len(pending)} of {len(self.futures)} prefetches still running after {timeout} s")
        return [f.result() for f in self.futures]
