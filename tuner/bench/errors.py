"""Why a bench cannot run as asked: :class:`BenchError`, whose message says why, and its
case :class:`NoGpu` (no CUDA GPU and no CPU smoke mode asked for)."""

from __future__ import annotations


class BenchError(Exception):
    """A bench that cannot run as asked (unknown suite, bad case, bad option): the message says why."""


class NoGpu(BenchError):
    """No CUDA GPU, and the CPU smoke mode was not asked for."""


__all__ = ["BenchError", "NoGpu"]
