"""Derivations run off the event loop, in a small pool of their own, with a time limit.

A derivation is CPU work (sympy, the float64 certificate): seconds for a large spec. It runs
in the :class:`Deriver`'s pool (few threads, so many concurrent derivations queue there instead
of filling the thread pool the database calls need) and the request waits at most its
``timeout_s``. A thread cannot be killed: a derivation that runs over finishes in the
background and is cached (fuser_core.report), so a retry is fast; the request gets 503 with
``Retry-After``.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fuser_core import DerivationLimitError, Spec, SpecError
from service.api.problems import Problem, invalid_field, spec_problem


@dataclass(frozen=True)
class Deriver:
    """The app's derivations: its thread pool and the time a request waits for one."""

    pool: ThreadPoolExecutor
    timeout_s: float

    async def report(self, spec: Spec) -> dict[str, Any]:
        """``fuser_core.report.derivation_report(spec)``, or a Problem (422 invalid, 503 too slow)."""
        from fuser_core import derivation_report

        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.pool, derivation_report, spec)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout=self.timeout_s)
        except TimeoutError:
            raise Problem(503, "Derivation too slow", f"the derivation took longer than {self.timeout_s:g} s; it "
                          "goes on in the background and is cached: retry later", kind="derivation-timeout",
                          headers={"Retry-After": "10"}) from None
        except SpecError as err:
            raise spec_problem(err) from None
        except DerivationLimitError as err:
            raise invalid_field(("spec",), f"the derivation exceeds its limits: {err}") from None
