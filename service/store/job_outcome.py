"""What became of a claimed job: one name for each end, instead of loose strings.

The worker (:mod:`service.worker`) answers one :class:`JobOutcome` per job it claims and logs
it (``job cancelled``). The three that finish a job are also its stored ``status``
(:mod:`service.store.job_queue`), with the same strings, so stored rows read as before.
"""

from __future__ import annotations

from enum import StrEnum


class JobOutcome(StrEnum):
    SUCCEEDED = "succeeded"  # its kernel (or a range's kernels) stored
    FAILED = "failed"  # failed, saying why
    CANCELLED = "cancelled"  # asked to cancel: stopped after the current trial, its trials kept
    RELEASED = "released"  # the worker is stopping: the job went back to the queue for another
    LOST = "lost"  # another worker holds it now (this one's lease ran out): nothing more written

    @property
    def stops_search(self) -> bool:
        """The search ends early and nothing is stored (cancelled, released, lost)."""
        return self in (JobOutcome.CANCELLED, JobOutcome.RELEASED, JobOutcome.LOST)

    @property
    def finished(self) -> bool:
        """The job's final status (succeeded, failed, cancelled): nobody runs it again."""
        return self in (JobOutcome.SUCCEEDED, JobOutcome.FAILED, JobOutcome.CANCELLED)
