"""A spec's parse for ``POST /v1/derivations`` and a job request's check for ``POST /v1/jobs``,
in a child process: off the API's GIL.

Parsing, checking and canonicalising a large spec is milliseconds of pure Python (a 45-step,
6 KB spec: ~10 ms). Ten such requests at once, parsed in the API's process (even in a thread
of their own), held the GIL against the event loop, and a cheap GET answered 10-70 ms late
(benchmarks/derivation_flood.py, measured with a loop-lag probe). So the spec's text goes to
one long-lived child process (forked from the derivations' forkserver, at their lower CPU
priority), which answers what the API needs of it: its key in the reports' cache
(:class:`fuser_core.SpecKey`: canonical JSON and names), or its SpecError as plain data
(answered 422 naming the field, without waiting for a derivation's slot).

One question at a time on the child's pipe, in arrival order; the parse counts against its
request's deadline: past it (or when its request is cancelled mid-parse) the child is killed
and the next request starts a new one. A text parsed before is answered from a memo, without
the child (a spec is a value: the same text always parses to the same result).

A job request (:meth:`SpecParser.job_request`) is checked there whole: the spec parsed and every
field bound (``service.api.validation.job_request``, 4-9 ms of the GIL for a 12-step spec, the
largest share of a new job's work in the API; a flood of ``POST /v1/jobs`` held a cheap GET's p99
at 2.0-3.1x idle). The child answers the checked request with the spec's key, canonical form and
dim names (each another parse in the API: :class:`service.api.validation.CheckedJob`); an invalid
request's 422 crosses as plain data.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from fuser_core import SpecError, SpecKey
from service.api.cache import SpecCache
from service.api.child_bounds import bound_child, lower_priority
from service.api.child_pipe import receive
from service.api.problems import HttpProblem, spec_problem

log = logging.getLogger("foldwise.api")


def _serve(conn: Any, nice: int) -> None:
    """In the child: for each spec text received, ``("ok", SpecKey)`` or the error as plain
    data (a SpecError's ``loc`` and ``step`` do not survive pickling), until the API's end of
    the pipe closes."""
    bound_child()  # dies with the API, its heap capped (service/api/child_bounds.py)
    lower_priority(nice)
    from fuser_core import load_spec, spec_key

    while True:
        try:
            question = conn.recv()
        except (EOFError, OSError):
            return  # the API has gone
        try:
            if isinstance(question, str):  # a spec's text: its key
                result: tuple = ("ok", spec_key(load_spec(question)))
            else:  # a job request and the server's settings: service.api.validation.CheckedJob
                from service.api.validation import checked_job

                result = ("ok", checked_job(*question))
        except SpecError as err:
            result = ("spec", err.message, err.loc, err.step)
        except HttpProblem as problem:  # its fields do not survive pickling: sent as data
            result = ("problem", problem.status, problem.title, problem.detail, problem.kind, problem.errors,
                      problem.extra)
        except Exception as err:  # noqa: BLE001 - a bug in the parser: the API logs it and answers 500
            result = ("error", f"{type(err).__name__}: {err}")
        conn.send(result)


class SpecParser:
    """The child that parses specs for the API; see the module docstring."""

    def __init__(self, context: Any, starter: Executor, *, nice: int, memo_items: int = 128):
        self._context, self._starter, self._nice = context, starter, nice
        self._proc: Any = None
        self._conn: Any = None
        self._lock: asyncio.Lock | None = None  # made on the event loop that uses it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._memo = SpecCache(memo_items)  # text -> the child's answer ("ok" and "spec" only)
        self.started = 0  # children started (tests read it)

    async def key(self, source: str, deadline: float, too_slow: Callable[[], HttpProblem]) -> SpecKey:
        """``source``'s key; HttpProblem 422 naming the field for an invalid spec, ``too_slow()``
        past ``deadline`` (``time.monotonic()``), 500 for a bug in the parser."""
        return self._answered(self._memo.get(source) or await self._parse(source, source, deadline, too_slow))

    async def job_request(self, req: Any, settings: Any, deadline: float,
                          too_slow: Callable[[], HttpProblem]) -> Any:
        """The :class:`~service.api.validation.CheckedJob` of a ``POST /v1/jobs`` body ``req`` (its
        measurer already resolved: the child does not probe for a GPU) under ``settings``; the
        HttpProblems of :meth:`key`, and 422 naming every bad field."""
        # the same body under the same settings: the same answer (not a catalog name's: its file may change)
        named = isinstance(req.spec, str) and req.spec.lstrip()[:1] not in ("{", "[")
        memo = None if named else "job " + req.model_dump_json()
        answer = self._memo.get(memo) if memo else None
        return self._answered(answer or await self._parse(memo, (req, settings), deadline, too_slow))

    @staticmethod
    def _answered(answer: tuple) -> Any:
        if answer[0] == "ok":
            return answer[1]
        if answer[0] == "spec":
            raise spec_problem(SpecError(answer[1], loc=tuple(answer[2]), step=answer[3]))
        if answer[0] == "problem":
            status, title, detail, kind, errors, extra = answer[1:]
            raise HttpProblem(status, title, detail, kind=kind, errors=errors, **extra)
        log.error("spec parse failed", extra={"error": answer[1][:500]})
        raise HttpProblem(500, "Spec parse failed", "parsing the spec failed; this is a bug, see the server's log",
                          kind="derivation-failed")

    def close(self) -> None:
        self._kill()

    async def _parse(self, memo: str | None, question: Any, deadline: float,
                     too_slow: Callable[[], HttpProblem]) -> tuple:
        """The child's answer to ``question``, kept under ``memo`` (None: not kept; nor a bug's or a
        death's)."""
        lock = self._lock_here()
        try:  # the wait for the child counts against the deadline too
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await lock.acquire()
        except TimeoutError:
            raise too_slow() from None
        try:
            answer = self._memo.get(memo) if memo else None  # answered while this request waited for the child
            if answer is None:
                answer = await self._ask(question, deadline, too_slow)
                if memo and answer[0] in ("ok", "spec", "problem"):
                    self._memo.put(memo, answer)
            return answer
        finally:
            lock.release()

    def _lock_here(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._lock is None or self._loop is not loop:  # a test client may run the app on a new loop
            self._lock, self._loop = asyncio.Lock(), loop
        return self._lock

    async def _ask(self, question: Any, deadline: float, too_slow: Callable[[], HttpProblem]) -> tuple:
        if self._proc is None or self._proc.exitcode is not None:
            await self._start(deadline, too_slow)
        conn = self._conn
        answered = False
        try:
            conn.send(question)  # the child waits in recv: a pipe write (past 64 KB, until the child reads)
            try:  # read whole off the loop (service/api/child_pipe.py: uvloop and answers over 64 KB)
                answer = await receive(conn, deadline)
            except TimeoutError:
                raise too_slow() from None
            answered = True
            return answer
        except (EOFError, OSError) as err:  # the child died (killed from outside: a bug or the OOM killer)
            return ("error", f"the spec parser's process died ({type(err).__name__}, exit code {self._proc.exitcode})")
        finally:
            if not answered:  # its answer would be the next question's: a new child for that one
                self._kill()

    async def _start(self, deadline: float, too_slow: Callable[[], HttpProblem]) -> None:
        self._kill()
        mine, theirs = self._context.Pipe()
        proc = self._context.Process(target=_serve, args=(theirs, self._nice), daemon=True, name="foldwise-spec-parse")
        started = asyncio.get_running_loop().run_in_executor(self._starter, proc.start)  # process starts block
        try:  # a cold forkserver may take seconds to start: within the deadline too
            await asyncio.wait_for(asyncio.shield(started), timeout=max(0.0, deadline - time.monotonic()))
        except BaseException as err:
            started.add_done_callback(lambda _: _kill(proc))  # started after all: stop it once it is
            mine.close()
            theirs.close()
            if isinstance(err, TimeoutError):
                raise too_slow() from None
            raise
        theirs.close()  # the child holds its end: EOF there when this one closes
        self._proc, self._conn = proc, mine
        self.started += 1

    def _kill(self) -> None:
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if conn is not None:
            conn.close()
        if proc is not None:
            _kill(proc)
            try:
                self._starter.submit(proc.join, 5)  # reaped off the event loop
            except RuntimeError:  # the app is stopping: multiprocessing reaps its children at exit
                pass


def _kill(proc: Any) -> None:
    if proc.pid is not None and proc.exitcode is None:
        proc.kill()
