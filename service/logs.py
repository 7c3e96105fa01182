"""Structured logs: one JSON object per line on stderr.

Why JSON: the service runs as several processes (API, workers) whose logs end up in one
collector; a line that is a JSON object with fixed keys (``ts``, ``level``, ``logger``,
``msg`` and the call's ``extra`` fields such as ``job_id``, ``worker_id``, ``status``,
``duration_ms``) can be filtered without parsing free text.

Example::

    configure_logging("info")
    log = logging.getLogger("foldwise.worker")
    log.info("job claimed", extra={"job_id": job.id, "worker_id": wid})
    # {"ts": "2025-...Z", "level": "info", "logger": "foldwise.worker", "msg": "job claimed", "job_id": "...", ...}
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import sys
from typing import Any, TextIO

# attributes every LogRecord has: anything else on a record came from ``extra=`` and is logged
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName", "color_message"}
LEVELS = ("debug", "info", "warning", "error", "critical")


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line: ts, level, logger, msg, extra fields, exception."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _dt.datetime.fromtimestamp(record.created, _dt.UTC).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each record (not the one at set-up)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def configure_logging(level: str = "info", stream: TextIO | None = None) -> None:
    """Send the ``foldwise`` and ``uvicorn`` loggers to ``stream`` (stderr) as JSON lines.

    Idempotent: calling it again replaces the handler rather than adding a second one.
    ``level`` is one of :data:`LEVELS`.
    """
    if level.lower() not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; one of {', '.join(LEVELS)}")
    handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    handler.setFormatter(JsonFormatter())
    handler.set_name("foldwise-json")
    for name in ("foldwise", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if h.get_name() == "foldwise-json" or name.startswith("uvicorn")]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(level.upper())
        logger.propagate = False
    # the API logs each request itself (service.api.app); uvicorn's own access log would repeat it
    logging.getLogger("uvicorn.access").disabled = True
