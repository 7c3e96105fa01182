"""The function Optuna minimises: one candidate's time in ms, with the study's results as its cache.

Contract: each trial picks a strategy (a categorical parameter) and that strategy's own
parameters (conditional: named ``"<strategy>/<param>"``, so ``streaming_fused/block_n`` and
``split_fused/block_n`` are different parameters; see :mod:`tuner.search.proposals`), builds a
:class:`~tuner.space.Candidate`, and answers in one of four ways, recorded in the trial's user
attr ``result`` (a dict) under ``outcome``:

``measured``
    the measurer timed it: the trial's value is ``time_ms``.
``cached``
    the same candidate (same :meth:`Candidate.key`) already has a result in this study,
    from this process or any other worker sharing the storage: the trial gets the stored
    time (or the stored failure), and nothing is measured again. A candidate that another
    worker is measuring right now is waited for (see :meth:`Objective._stored_result`).
``infeasible``
    :meth:`SearchSpace.check` rejected it (shared memory, registers, a tile larger than the
    dim): the trial is **pruned** (``optuna.TrialPruned``) with the reason in ``reason``,
    before the measurer sees it. Why pruned: TPE reads COMPLETE and PRUNED trials and ranks
    every pruned trial after every complete one, so infeasible regions land in its "bad"
    group and it moves away from them, exactly as a value of ``inf`` would; but no made-up
    time ever enters the study (``best_trial``, plots and statistics see real times only,
    and a study whose candidates are all infeasible has no best trial rather than a best of
    ``inf``). FAIL would be wrong: TPE ignores failed trials and would keep proposing them.
    With a compile gate (:mod:`tuner.compile_gate`), a candidate the check accepts is then
    compiled for the target: one that fails to compile, or whose compiled kernels exceed the
    target's shared memory or registers, is infeasible too, with the compiler's reason, and
    every gated trial keeps the compiler's facts in ``compile``.
``failed``
    the measurer returned an error (a wrong result, a crash, a timeout): the trial FAILs,
    the error kept in ``error``; it never gets a time.

A compile or measurement that failed for the host (a full disk) is none of these: it raises
:class:`HostFault` and stops the search (the trial FAILs without a ``result``).

The values themselves are in the trial's ``result`` (``values``, ``config``). The measurer is
anything that keeps the :class:`tuner.measure.Measurer` contract; only its ``measure`` is
called here.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
import warnings
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import FrozenTrial, Trial, TrialState

from fuser_core import is_host_fault
from tuner.search.proposals import suggest_candidate
from tuner.search.trials import trial_result

if TYPE_CHECKING:
    from tuner.compile_gate import CompileGate
    from tuner.measure import Measurer
    from tuner.space import SearchSpace

_FINISHED_WITH_RESULT = ("measured", "cached", "infeasible", "failed")


def worker_id() -> str:
    """Recorded on every trial (user attr ``worker``): the host and process that ran it."""
    return f"{socket.gethostname()}:{os.getpid()}"


class MeasurementFailed(Exception):
    """The measurer could not give a time for this candidate (the trial FAILs, the study goes on)."""


class HostFault(Exception):
    """The candidate's compile or measurement failed for the host, not the kernel: a full disk
    (:func:`fuser_core.is_host_fault`). It stops the search: the trial FAILs for Optuna with no
    ``result`` (so it uses no budget and says nothing of the candidate), and the caller resumes
    the study once the host has room (the worker gives the job back)."""



class Objective:
    """The function Optuna minimises: one candidate's time in ms.

    Answers from the study's stored results when the candidate was already measured, prunes
    infeasible candidates without measuring (those :meth:`SearchSpace.check` rejects, then, with
    a ``gate`` (:class:`tuner.compile_gate.CompileGate`), those the GPU compiler rejects or that
    exceed the target's shared memory or registers once compiled), and raises :class:`MeasurementFailed` (a FAIL
    trial, its error kept) when the measurer fails. Keeps the time spent in the measurer and
    waiting on other workers per trial, so the tuner's own overhead can be told apart.

    Each trial's user attrs (few, since every write is a database round trip on an RDB
    storage): ``worker`` (host:pid), ``candidate`` (:meth:`Candidate.key`, for feasible
    candidates), ``measuring`` (this trial claimed the measurement), and at the end
    ``result``: ``{"outcome", "strategy", "values", "config"}`` plus ``time_ms`` and
    ``predicted`` (measured, cached), ``cached_from`` (cached), ``reason`` (infeasible),
    ``error`` (failed), ``details`` (the measurer's), ``compile`` (with a gate: per kernel
    ``kernel, ok, registers, spill_bytes, shared_bytes, num_warps, num_stages`` and ``error``
    where it failed; a compile-pruned trial's ``reason`` is the gate's).

    Example::

        objective = Objective(space, measurer)
        study.optimize(objective, n_trials=10, catch=(MeasurementFailed,))
        study.best_trial.user_attrs["result"]["config"]
    """

    def __init__(self, space: SearchSpace, measurer: Measurer, *, gate: CompileGate | None = None,
                 wait_s: float = 300.0, poll_s: float = 0.05):
        self.space = space
        self.measurer = measurer
        self.gate = gate
        self.wait_s = wait_s
        self.poll_s = poll_s
        self.outside_s: dict[int, float] = {}  # trial number -> seconds in the measurer / waiting
        self.counts: dict[str, int] = {k: 0 for k in _FINISHED_WITH_RESULT}
        if gate is not None:
            self.counts["compile_pruned"] = 0  # of the infeasible ones: pruned by the compile gate

    def __call__(self, trial: Trial) -> float:
        inherited = trial.user_attrs  # a retried trial starts with its predecessor's attrs
        trial.set_user_attr("worker", worker_id())
        strategy, values = suggest_candidate(trial, self.space)
        candidate = self.space.candidate(strategy, values)
        result: dict[str, Any] = {"strategy": strategy, "values": dict(values), "config": candidate.config.to_dict()}

        reason = self.space.check(candidate)
        if reason is not None:
            return self._finish(trial, result, "infeasible", reason=reason)

        key = candidate.key()
        if inherited.get("measuring"):
            trial.set_user_attr("measuring", False)
        # set before the gate too: LocalSearch reads it as "tried", so a candidate the compiler
        # rejects is not enqueued again
        trial.set_user_attr("candidate", key)
        if self.gate is not None:
            start = time.perf_counter()
            try:
                verdict = self.gate.check(candidate)
            finally:  # compiling is the measurement's own cost, not the tuner's overhead
                self.outside_s[trial.number] = self.outside_s.get(trial.number, 0.0) + time.perf_counter() - start
            if verdict.pruned and is_host_fault(verdict.reason):
                raise HostFault(verdict.reason)
            result["compile"] = verdict.facts()
            if verdict.pruned:
                self.counts["compile_pruned"] += 1
                return self._finish(trial, result, "infeasible", reason=verdict.reason)
        stored = self._stored_result(trial, key)
        if stored is not None:
            source, value = stored
            result["cached_from"] = source.number
            result["predicted"] = bool(trial_result(source).get("predicted", False))
            if isinstance(value, str):
                return self._finish(trial, result, "failed", error=value, cached=True)
            return self._finish(trial, result, "cached", time_ms=value)

        start = time.perf_counter()
        try:
            m = self.measurer.measure(candidate)
        finally:
            self.outside_s[trial.number] = self.outside_s.get(trial.number, 0.0) + time.perf_counter() - start
        if m.error is not None and is_host_fault(m.error):
            raise HostFault(m.error)
        result["predicted"] = bool(m.predicted)
        if m.details:
            result["details"] = _jsonable(m.details)
        if m.error is not None or m.time_ms is None or not math.isfinite(m.time_ms):
            return self._finish(trial, result, "failed", error=m.error or f"the measurer gave no time ({m.time_ms!r})")
        return self._finish(trial, result, "measured", time_ms=float(m.time_ms))

    def _finish(self, trial: Trial, result: dict[str, Any], outcome: str, *, time_ms: float | None = None,
                reason: str | None = None, error: str | None = None, cached: bool = False) -> float:
        result["outcome"] = outcome
        if time_ms is not None:
            result["time_ms"] = time_ms
        if reason is not None:
            result["reason"] = reason
        if error is not None:
            result["error"] = error
        trial.set_user_attr("result", result)
        self.counts["cached" if cached else outcome] += 1
        if reason is not None:
            raise optuna.TrialPruned(reason)
        if error is not None:
            raise MeasurementFailed(error)
        assert time_ms is not None
        return time_ms

    def _stored_result(self, trial: Trial, key: str) -> tuple[FrozenTrial, float | str] | None:
        """A finished trial of this study with the same candidate, and its time or error; None
        when this trial should measure it (having claimed it: user attr ``measuring``).

        Workers sharing the study may suggest the same candidate at once. Each trial writes its
        ``candidate`` before reading the others', and its ``measuring`` claim before reading
        again, so of the running trials with one candidate only one measures: a trial waits
        while a lower-numbered one runs the same candidate, or a higher-numbered one has
        claimed it, and withdraws its own claim when it finds a lower-numbered one after
        claiming. (The second read is skipped when no lower-numbered trial could still show
        up with the same candidate: none is running or waiting without a known candidate.)
        A trial whose worker died stops blocking once the heartbeat fails it; without
        heartbeats the wait ends after ``wait_s``. Time spent waiting is not the tuner's
        overhead.
        """
        deadline = time.monotonic() + self.wait_s
        study = trial.study
        while True:
            found, lower, claimed, unknown = self._scan(trial, key)
            if found is not None:
                return found
            if not lower and not claimed:
                trial.set_user_attr("measuring", True)
                if not unknown:
                    return None
                found, lower, _, _ = self._scan(trial, key)
                if found is None and not lower:
                    return None
                trial.set_user_attr("measuring", False)
                if found is not None:
                    return found
            if time.monotonic() > deadline:
                trial.set_user_attr("measuring", True)
                return None
            t0 = time.perf_counter()
            time.sleep(self.poll_s)
            with warnings.catch_warnings():  # a dead worker's trial stops blocking (no-op without heartbeats)
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                optuna.storages.fail_stale_trials(study)
            self.outside_s[trial.number] = self.outside_s.get(trial.number, 0.0) + time.perf_counter() - t0

    @staticmethod
    def _scan(trial: Trial, key: str) -> tuple[tuple[FrozenTrial, float | str] | None, bool, bool, bool]:
        """(a stored result, a lower-numbered trial runs this candidate, a higher-numbered one
        claimed it, a lower-numbered trial runs or waits with no candidate known yet)."""
        lower = claimed = unknown = False
        states = (TrialState.COMPLETE, TrialState.FAIL, TrialState.RUNNING, TrialState.WAITING)
        for t in trial.study.get_trials(deepcopy=False, states=states):
            if t.number == trial.number:
                continue
            other = t.user_attrs.get("candidate")
            if other is None and t.number < trial.number and t.state in (TrialState.RUNNING, TrialState.WAITING):
                unknown = True
            if other != key:
                continue
            r = trial_result(t)
            if t.state == TrialState.COMPLETE and r.get("outcome") in ("measured", "cached") and t.value is not None:
                return (t, float(t.value)), False, False, False
            if t.state == TrialState.FAIL and r.get("outcome") == "failed" and "error" in r:
                return (t, str(r["error"])), False, False, False
            if t.state == TrialState.RUNNING:
                if t.number < trial.number:
                    lower = True
                elif t.user_attrs.get("measuring") is True:
                    claimed = True
        return None, lower, claimed, unknown


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return json.loads(json.dumps(value, default=str))
