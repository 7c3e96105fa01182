"""Service settings, read from ``FOLDWISE_*`` environment variables (``FOLDWISE_DB_URL`` ...).

One place for every knob of ``foldwise serve`` / ``foldwise worker`` so the API, the workers
and the tests agree on defaults; command-line flags override them through
:func:`get_settings` keyword arguments.

Example:
    >>> s = get_settings(db_url="sqlite:///x.db", lease_seconds=30)
    >>> s.lease_seconds, s.heartbeat_seconds
    (30.0, 5.0)
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fuser_core import MAX_ELEMENTS, MAX_WORK
from service.http.limits import HEADER_TIMEOUT_S, MAX_CONNECTIONS, MAX_HEADER_BYTES
from service.tuning_request import MEASURERS


def default_derive_workers() -> int:
    """Derivations at once by default: 2, but never every core this process may use. Each is a
    CPU-bound child; on a 2-core machine two of them kept both cores busy and every wake-up of
    the API's threads waited behind one (issue 26: a cheap GET's p99 ~2.5x its idle value
    during a derivation flood, ~1.3x with one core left free; benchmarks/derivation_flood.py)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(2, cores - 1))


class Settings(BaseSettings):
    """Everything the service reads from its environment; see the module docstring."""

    model_config = SettingsConfigDict(env_prefix="FOLDWISE_", extra="ignore", validate_default=True)

    db_url: str = Field("sqlite:///foldwise.db", min_length=1)  # relative to the working directory
    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(8000, ge=0, le=65535)
    workers: int = Field(1, ge=0, le=256)  # in-process workers of `foldwise serve`
    target: str = Field("h100", min_length=1, max_length=32)
    measurer: str | None = None  # None: cuda when a GPU is visible, else model
    lease_seconds: float = Field(60.0, gt=0, le=24 * 3600)
    heartbeat_seconds: float = Field(5.0, gt=0)
    max_trials: int = Field(1000, ge=1)  # request budget limits
    max_seconds: float = Field(6 * 3600, gt=0)
    # size limits of a job's shape (fuser_core.problem.check_sizes): a server may lower the core's, not raise them
    max_tensor_elements: int = Field(MAX_ELEMENTS, ge=1, le=MAX_ELEMENTS)  # per input and step
    max_work: int = Field(MAX_WORK, ge=1, le=MAX_WORK)  # per step's iteration space
    max_dim: int = Field(2**31 - 1, ge=1)
    # a spec's derivation and certificate (POST /v1/derivations, a new spec's POST /v1/jobs) share one
    # deadline: 503 after it; derive_workers at a time, derive_queue waiting, more: 429 (service/api/derive.py)
    derive_timeout_seconds: float = Field(60.0, gt=0)
    derive_workers: int = Field(default_factory=default_derive_workers, ge=1, le=64)
    derive_queue: int = Field(8, ge=0, le=1024)
    # what a client can make the server hold before its request reaches the app (service/http/limits.py)
    max_header_bytes: int = Field(MAX_HEADER_BYTES, ge=1024, le=1 << 24)
    header_timeout_seconds: float = Field(HEADER_TIMEOUT_S, gt=0, le=3600)
    max_connections: int = Field(MAX_CONNECTIONS, ge=1, le=1 << 20)
    # workers compile each finished job's bundle for its target's arch and store the cubin (issue 15)
    compile_binaries: bool = True
    # an Ed25519 private key (PEM, `foldwise signing-key new`): every served bundle's sha256 is signed
    # with it, so clients that trust its public key run only what this server served (service/bundle/signing.py)
    signing_key_file: str | None = None

    @field_validator("measurer", mode="before")
    @classmethod
    def _measurer(cls, value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip() in ("", "auto")):
            return None  # FOLDWISE_MEASURER= (empty) or "auto" means: pick at start
        if value not in MEASURERS:
            raise ValueError(f"unknown measurer {value!r}; one of {', '.join(MEASURERS)} (or leave unset)")
        return value

    @model_validator(mode="after")
    def _heartbeat_within_lease(self) -> Settings:
        # a worker must renew its lease several times before it expires, or healthy jobs get taken over
        if self.heartbeat_seconds >= self.lease_seconds:
            raise ValueError(f"heartbeat_seconds ({self.heartbeat_seconds}) must be less than "
                             f"lease_seconds ({self.lease_seconds})")
        return self


def get_settings(**overrides: Any) -> Settings:
    """Settings from the environment, with ``overrides`` (None values are ignored, so CLI flags
    that were not given keep the environment's value)."""
    return Settings(**{k: v for k, v in overrides.items() if v is not None})
