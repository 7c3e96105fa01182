"""Failures of the host, not of a kernel: a full disk (``ENOSPC``) or a used-up quota (``EDQUOT``).

A candidate whose compile or check fails because the disk is full is no worse a kernel: counting
it as "does not compile" would fail every trial and then the job (issue 37, 5: a full cache
directory failed the job and left ``.tmp`` files). Such a failure often reaches its reader as
text (a compile runs in a pool process; Triton wraps the OSError), so both an exception's chain
and a message are read. The tuner stops the search on one (:class:`tuner.search.objective.HostFault`)
and the worker gives the job back instead of failing it; caches skip a write that cannot be made.
"""

from __future__ import annotations

import errno
import os

HOST_FAULT_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
HOST_FAULT_MESSAGES = tuple(os.strerror(e) for e in HOST_FAULT_ERRNOS)  # "No space left on device", ...


def is_host_fault(error: BaseException | str | None) -> bool:
    """Whether ``error`` (an exception, searched through its causes, or a failure's text) says the
    host's disk is full or over quota."""
    if error is None:
        return False
    if isinstance(error, BaseException):
        seen, err = 0, error
        while err is not None and seen < 8:
            if isinstance(err, OSError) and err.errno in HOST_FAULT_ERRNOS:
                return True
            if any(m in str(err) for m in HOST_FAULT_MESSAGES):
                return True
            err, seen = err.__cause__ or err.__context__, seen + 1
        return False
    return any(m in error for m in HOST_FAULT_MESSAGES)


def write_cache_file(path: os.PathLike | str, text: str) -> OSError | None:
    """Write a cache entry atomically (a temporary file, then a rename); the OSError, with nothing
    left behind, when the host cannot (a full disk), else None. For a cache that is a saving the
    caller goes on without it."""
    from pathlib import Path

    path = Path(path)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
        return None
    except OSError as err:
        tmp.unlink(missing_ok=True)
        return err


__all__ = ["HOST_FAULT_ERRNOS", "HOST_FAULT_MESSAGES", "is_host_fault", "write_cache_file"]
