"""The errors of the service's stores (specs, job queue, kernel cache) and of its request
normaliser; the API turns them into problem answers (service/api/app.py)."""

from __future__ import annotations

from collections.abc import Sequence

from fuser_core import SpecError


class JobError(Exception):
    """A job-queue operation that cannot be done; the message says why."""


class NotFound(JobError):
    """No job, kernel or worker with that id."""


class LeaseLost(JobError):
    """The worker no longer holds the job (taken over after its lease expired, or finished)."""


class InvalidRequest(SpecError, JobError):
    """A bad submission field; ``loc`` names it (``("target",)``, ``("budget", "trials")``).

    ``errors`` lists every bad field of the submission (this one first), so that an answer can
    name them all at once."""

    def __init__(self, message: str, *, loc: tuple[str | int, ...] = (), step: str | None = None,
                 errors: Sequence[SpecError] = ()):
        super().__init__(message, loc=loc, step=step)
        self.errors: list[SpecError] = list(errors) or [self]

    @classmethod
    def of(cls, errors: Sequence[SpecError]) -> InvalidRequest:
        first = errors[0]
        return cls(first.message, loc=first.loc, step=first.step, errors=errors)


class BundleCorrupted(JobError):
    """A stored bundle's bytes no longer match its sha256: it is never served."""


class InvalidBundle(JobError):
    """A bundle that fails verification or is not for its job."""
