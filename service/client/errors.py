"""The kernel client's errors (:mod:`service.client` re-exports them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.bundle import BundleError

if TYPE_CHECKING:
    from service.client.jobs import TuningJob


class KernelCacheError(Exception):
    """Base of the client's errors."""


class KernelNotFound(KernelCacheError, LookupError):
    """No kernel for this request: the server has none (or only another shape), or it is
    unreachable and the disk cache has none (``offline``). ``job`` is the queued or running
    job that will make it, when the server has one (:class:`TuningJob`), else None."""

    def __init__(self, message: str, job: TuningJob | None = None, *, offline: bool = False):
        super().__init__(message)
        self.job, self.offline = job, offline


class KernelAuthError(KernelCacheError, PermissionError):
    """The server refused the token (401 missing/invalid, 403 lacking the kernels:read scope)."""


class KernelServiceError(KernelCacheError):
    """The server answered something this client cannot use (unexpected status or body)."""


class KernelIntegrityError(KernelCacheError, BundleError):
    """A downloaded bundle failed verification; it was not cached."""


class KernelTuningError(KernelCacheError):
    """A tuning job was refused (422: e.g. a spec whose certificate fails), failed or was cancelled."""


class KernelTuningTimeout(KernelTuningError, TimeoutError):
    """``tune(..., timeout=...)`` ran out before the job finished; the job goes on on the server."""


class ServerUnavailable(Exception):
    """The server could not be asked (network, timeout, 5xx): fall back to the disk cache."""
