"""Derivations, bounded: one deadline, a bounded pool and queue, stopped when nobody waits.

A derivation is CPU work (sympy, then the float64 certificate): seconds for a large spec, and
the certificate can take longer than the derivation. A thread cannot be stopped, and in the
API's process it would also hold the GIL against every other request, so each derivation runs
in a **child process** of its own (forked from a ``forkserver`` with fuser_core and sympy
already imported: a start costs milliseconds, not an import), at a lower CPU priority
(``nice``), so the event loop keeps its share of the CPU.

The bounds, per request (:meth:`DerivationPool.report`):

- **one deadline** (``derive_timeout_seconds``) from the request's arrival here: the wait for a
  slot, the derivation *and* the certificate. Past it the child is killed and the answer is
  503 ``derivation-timeout`` with ``Retry-After``;
- **a bounded pool** (``derive_workers`` children at a time) **with a bounded queue**
  (``derive_queue`` requests waiting for one): a request past both is refused at once with 429
  ``derivation-busy`` and ``Retry-After``;
- **nobody waits, no work**: while a request waits, its client's connection is watched
  (``Request.is_disconnected``, every ``POLL_S``); when the last request waiting for a
  derivation has gone (or was cancelled: a server stopping), its child is killed at once
  (SIGKILL: sympy has no cancellation points);
- **identical specs share**: requests for one canonical spec in flight at once wait for one
  derivation (60 identical submissions are one derivation, not a full queue).

``POST /v1/derivations`` parses its spec in a child process too (:mod:`service.api.spec_child`:
milliseconds of pure Python per large spec, which held the GIL against the event loop), within
the same deadline; an invalid spec is answered 422 from that parse, without a derivation's slot.

A finished derivation's report (in canonical names) comes back to this process's cache
(``fuser_core.remember_report``), so storing the spec of a job after it is a lookup and a
retry of the same spec is answered at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fuser_core import DerivationLimitError, SpecError, SpecKey
from service.api.child_bounds import bound_child, lower_priority, memory_message
from service.api.child_pipe import receive as receive_answer
from service.api.problems import HttpProblem, invalid_field, spec_problem
from service.api.cache import SpecCache
from service.api.spec_child import SpecParser

log = logging.getLogger("foldwise.api")
POLL_S = 0.1  # how often a waiting request looks at its client's connection
CHILD_NICE = 10  # the children's CPU priority below the API's
# imported once, in the forkserver, before it forks the children: sympy and the derivation, and
# this module (the children's target: unpickling it in each child would import the API, ~1 s)
PRELOAD = ["service.api.derive", "service.api.spec_child", "fuser_core.report", "fuser_core.derive", "fuser_core.certificate",
           "fuser_core.present", "service.dashboard.compute", "service.dashboard.mathtex", "fuser_core.codegen.module",
           "service.api.validation"]
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)  # only a list until the forkserver starts (DerivationPool.warm_up)


def _child(conn: Any, source: str) -> None:
    """In the child: the report's cache entry of the spec whose JSON text is ``source`` (text
    crosses to the child cheaply; a parsed Spec costs the API's process a pickling)."""
    from fuser_core import load_spec, report_entry

    _answer_in_child(conn, lambda: ("ok", *report_entry(load_spec(source))))


def _compute_child(conn: Any, fn: Any, args: tuple, passes: tuple[type[Exception], ...]) -> None:
    """In the child: ``fn(*args)`` as JSON text (:meth:`DerivationPool.compute`), or an exception of
    one of ``passes`` as itself (it pickles)."""
    _answer_in_child(conn, lambda: ("ok", json.dumps(fn(*args))), passes)


def _answer_in_child(conn: Any, work: Any, passes: tuple[type[Exception], ...] = ()) -> None:
    """A child's one job: bounded (it dies with the API, its heap capped: service/api/child_bounds.py)
    at a lower CPU priority, ``work()``'s answer sent, or its failure as plain data (a SpecError's
    ``loc`` and ``step`` do not survive pickling): "spec", "limit" (the derivation's limits, or the
    heap), "raised" (one of ``passes``), "error" (a bug: the parent logs it and answers 500)."""
    bound_child()
    lower_priority(CHILD_NICE)
    try:
        result: tuple = work()
    except passes as err:
        result = ("raised", err)
    except SpecError as err:
        result = ("spec", err.message, err.loc, err.step)
    except DerivationLimitError as err:
        result = ("limit", str(err))
    except MemoryError:
        result = ("limit", memory_message())
    except Exception as err:  # noqa: BLE001 - a bug: the parent logs it and answers 500
        result = ("error", f"{type(err).__name__}: {err}")
    conn.send(result)
    conn.close()


class DerivationPool:
    """The app's derivations; see the module docstring."""

    def __init__(self, timeout_s: float, *, workers: int = 2, queue: int = 8, memo_items: int = 64):
        self.timeout_s, self.workers, self.queue = timeout_s, workers, queue
        self._slots: asyncio.Semaphore | None = None  # made on the event loop that uses it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._admitted = 0  # requests waiting for a slot or deriving
        self._starter = ThreadPoolExecutor(workers, thread_name_prefix="foldwise-derive")  # process starts block
        # the API process's own CPU work for derivations (renaming a cached report: a millisecond
        # or two) in one thread: ten requests at once then hold the GIL against the event loop as
        # one thread does, not as ten. Parsing a spec, the larger part, is not here: see .parser
        self._cpu = ThreadPoolExecutor(1, thread_name_prefix="foldwise-derive-cpu")
        self.parser = SpecParser(_CONTEXT, self._starter, nice=CHILD_NICE)  # specs and job requests, parsed
        self._inflight: dict[str, asyncio.Future] = {}  # canonical JSON (or a computation's key) -> its task
        self._computed = SpecCache(memo_items)  # a computation's key -> its answer as JSON text
        self._waiters: dict[asyncio.Future, int] = {}  # requests waiting for each
        self.running: set[int] = set()  # the pids of the children now deriving (tests and metrics read it)
        self.killed = 0  # children stopped before they finished (deadline, client gone, shutdown)
        self.started = 0  # children started for derivations and computations (tests read it)

    def warm_up(self, *, wait: bool = False) -> None:
        """Start the forkserver (it imports PRELOAD: seconds) in the background, so the first
        derivation does not wait for it; ``wait``: until it forks (tests with short deadlines)."""
        from multiprocessing import forkserver

        self._starter.submit(forkserver.ensure_running)
        if wait:
            proc = _CONTEXT.Process(target=os.getpid, daemon=True)
            proc.start()
            proc.join()

    def close(self) -> None:
        self.parser.close()
        self._starter.shutdown(wait=False, cancel_futures=True)
        self._cpu.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` in the derivations' one CPU thread (see ``__init__``)."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    async def derive(self, source: str, request: Any = None) -> dict[str, Any]:
        """``fuser_core.derivation_report`` of the spec whose JSON text is ``source``, parsed in
        a child process (:mod:`service.api.spec_child`) within the deadline; see :meth:`report`."""
        deadline = time.monotonic() + self.timeout_s
        key = await self.parser.key(source, deadline, self._too_slow)
        return await self.report(key, source, request, deadline=deadline)

    async def job_request(self, req: Any, settings: Any) -> Any:
        """The :class:`~service.api.validation.CheckedJob` of a ``POST /v1/jobs`` body, checked in the
        spec parser's child within the deadline (:meth:`service.api.spec_child.SpecParser.job_request`);
        the measurer is resolved here first (the server's default, probed once per process)."""
        if req.measurer is None:
            from service.api.validation import default_measurer

            measurer = settings.measurer or await self.run(default_measurer)
            req = req.model_copy(update={"measurer": measurer})
        return await self.parser.job_request(req, settings, time.monotonic() + self.timeout_s, self._too_slow)

    async def report(self, key: SpecKey, source: str, request: Any = None, *,
                     deadline: float | None = None) -> dict[str, Any]:
        """``fuser_core.derivation_report`` of the spec with ``key``, or a HttpProblem: 422 (invalid),
        429 (pool and queue full), 503 (past the deadline: ``deadline``, ``time.monotonic()``,
        default the timeout from now). ``source``: the spec's JSON text (what the child parses);
        ``request``: the Starlette request whose client is watched (None: not watched).

        Identical specs (by canonical form) in flight at once share one derivation (concurrent
        identical submissions are one request's work, not a full queue); it is stopped when the
        last request waiting for it has gone."""
        from fuser_core import cached_report

        cached = await self.run(cached_report, key)  # renaming a large report: a millisecond or two
        if cached is not None:
            return cached
        result = await self._shared(key.canonical, key.name, (_child, (source,)), request, deadline)
        return await self.run(self._answer, key, result)  # the rename: off the event loop

    async def compute(self, fn: Any, *args: Any, request: Any = None,
                      passes: tuple[type[Exception], ...] = ()) -> Any:
        """``fn(*args)`` computed in a child process, bounded as a derivation is (one deadline from
        now, the pool's slots and queue, killed when nobody waits): for a request's CPU work that
        would hold the API's GIL (the dashboard's LaTeX and generated source). ``fn``: a module-level
        function (it crosses by name) of plain, picklable arguments whose answer is JSON-able;
        identical calls share one child, and answers are kept (``memo_items``, as JSON text: each
        caller gets its own copy). An exception of one of ``passes`` is raised here as itself;
        otherwise the HttpProblems of :meth:`report`."""
        key = repr((fn.__module__, fn.__qualname__, args))
        text = self._computed.get(key)
        if text is None:
            name = fn.__qualname__
            deadline = time.monotonic() + self.timeout_s
            result = await self._shared(key, name, (_compute_child, (fn, args, passes)), request, deadline)
            if result[0] == "raised":
                raise result[1]
            if result[0] != "ok":
                raise _failure(name, result)
            text = result[1]
            self._computed.put(key, text)
        return await self.run(json.loads, text)

    async def _shared(self, key: str, name: str, job: tuple, request: Any, deadline: float | None) -> tuple:
        """The answer of ``job`` (a child's target and its arguments), run once for every caller
        with the same ``key`` in flight; 429 past the pool and queue; stopped when the last caller
        has gone."""
        task = self._inflight.get(key)
        if task is None:
            if self._admitted >= self.workers + self.queue:
                raise HttpProblem(429, "Too many derivations", f"{self.workers} derivations are running and "
                                  f"{self.queue} waiting, the most this server takes; retry later",
                                  kind="derivation-busy",
                                  headers={"Retry-After": str(max(1, round(self.timeout_s / 2)))})
            if deadline is None:
                deadline = time.monotonic() + self.timeout_s
            task = asyncio.ensure_future(self._work(name, job, deadline))
            self._inflight[key] = task
            task.add_done_callback(lambda _: self._inflight.pop(key, None))
            self._waiters[task] = 0
        self._waiters[task] += 1
        try:
            return await self._wait(task, name, request)
        finally:
            self._waiters[task] -= 1
            if not self._waiters[task]:
                del self._waiters[task]
                if not task.done():
                    task.cancel()  # nobody waits for it: the child is killed

    async def _wait(self, task: asyncio.Future, name: str, request: Any) -> tuple:
        """The shared derivation's result (or its HttpProblem), watching this request's client."""
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                return task.result()
            if request is not None and await request.is_disconnected():
                log.info("a derivation's client has gone", extra={"spec": name})
                # nobody reads this answer; 499 (nginx's "client closed request") in the access log
                raise HttpProblem(499, "Client closed request", "the client left before the derivation "
                                  "ended", kind="client-gone")

    async def _work(self, name: str, job: tuple, deadline: float) -> tuple:
        """One derivation (or computation): a slot in the pool (waiting counts against the deadline),
        then the child."""
        slots = self._slots_here()
        self._admitted += 1
        try:
            try:
                await asyncio.wait_for(slots.acquire(), timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise self._too_slow() from None
            try:
                return await self._derive(name, job, deadline)
            finally:
                slots.release()
        finally:
            self._admitted -= 1

    def _slots_here(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._loop is not loop:  # a test client may run the app on a new loop
            self._slots, self._loop = asyncio.Semaphore(self.workers), loop
        return self._slots

    def _too_slow(self) -> HttpProblem:
        return HttpProblem(503, "Derivation too slow", f"the derivation and its certificate took longer than "
                           f"{self.timeout_s:g} s (this server's limit: FOLDWISE_DERIVE_TIMEOUT_SECONDS) and were "
                           "stopped; retry when the server is less busy", kind="derivation-timeout",
                           headers={"Retry-After": str(max(1, round(self.timeout_s)))})

    async def _derive(self, name: str, job: tuple, deadline: float) -> tuple:
        """Run ``job`` (``_child`` or ``_compute_child`` and its arguments after the pipe's end) in
        a new process until it answers; kill it at the deadline, or when this task is cancelled
        (the last request waiting for it has gone, or the app stops)."""
        loop = asyncio.get_running_loop()
        receive, send = _CONTEXT.Pipe(duplex=False)
        target, args = job
        proc = _CONTEXT.Process(target=target, args=(send, *args), daemon=True, name="foldwise-derive")
        started = loop.run_in_executor(self._starter, proc.start)
        try:  # a cold forkserver may take seconds to start: within the deadline too
            await asyncio.wait_for(asyncio.shield(started), timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            started.add_done_callback(lambda _: self._stop(proc))
            receive.close()
            send.close()
            raise self._too_slow() from None
        except BaseException:
            started.add_done_callback(lambda _: self._stop(proc))  # started after all: stop it once it is
            receive.close()
            send.close()
            raise
        send.close()  # the child holds its end: EOF here if it dies without answering
        self.started += 1
        self.running.add(proc.pid)
        finished = False
        try:
            try:  # read whole off the loop (service/api/child_pipe.py: uvloop and answers over 64 KB)
                result = await receive_answer(receive, deadline)
            except TimeoutError:
                raise self._too_slow() from None
            except EOFError:
                result = ("error", f"the derivation's process died (exit code {proc.exitcode})")
            finished = True
            return result
        finally:
            if not finished:  # killed first: a read still waiting in its thread ends with EOF
                log.info("derivation stopped", extra={"spec": name})
                self._stop(proc)
            receive.close()
            self.running.discard(proc.pid)
            if finished:
                self._reap(proc)

    def _stop(self, proc: Any) -> None:
        if proc.pid is None:
            return
        self.killed += 1
        proc.kill()
        self._reap(proc)

    def _reap(self, proc: Any) -> None:
        try:
            self._starter.submit(proc.join, 5)  # off the event loop
        except RuntimeError:  # the app is stopping: multiprocessing reaps its children at exit
            pass

    def _answer(self, key: SpecKey, result: tuple) -> dict[str, Any]:
        from fuser_core import cached_report, remember_report

        if result[0] == "ok":
            remember_report(result[1], result[2])
            return cached_report(key)  # a lookup now, in the caller's names
        raise _failure(key.name, result)


def _failure(name: str, result: tuple) -> HttpProblem:
    """The HttpProblem for a child's answer that is not "ok": 422 naming the field (an invalid spec,
    a derivation past its limits), 500 for a bug (logged)."""
    kind = result[0]
    if kind == "spec":
        return spec_problem(SpecError(result[1], loc=tuple(result[2]), step=result[3]))
    if kind == "limit":
        return invalid_field(("spec",), f"the derivation exceeds its limits: {result[1]}")
    log.error("derivation failed", extra={"spec": name, "error": result[1][:500]})
    return HttpProblem(500, "Derivation failed", "the derivation failed; this is a bug, see the server's log",
                       kind="derivation-failed")
