"""Optuna drives the configuration search.

One study per (spec, shape, dtype, target, measurer); Optuna runs its trials, stores them
(in memory, or an SQLite/PostgreSQL database shared by several worker processes) and
samples with TPE. Trials are proposed three ways, all through the study:

1. **start-up**, enqueued in a new study (``study.enqueue_trial``): the best configurations
   of other shapes of the same spec, target and dtype (:func:`warm_start`), then each
   strategy's default, the configuration an expert starts from (:func:`default_candidates`), then the
   frontier configurations of each strategy (:func:`frontier_candidates`: the largest tiles
   that fit), then random feasible candidates (:func:`random_candidates`);
2. **local search** (:class:`LocalSearch`, a callback): the next untried neighbour of the
   best trial, enqueued after each trial;
3. **TPE** (:func:`default_sampler`), whenever nothing is enqueued.

Each trial picks a strategy (a
categorical parameter) and that strategy's own parameters (conditional: named
``"<strategy>/<param>"``, so ``streaming_fused/block_n`` and ``split_fused/block_n`` are
different parameters), builds a :class:`~tuner.space.Candidate`, and answers in one of four
ways, recorded in the trial's user attr ``result`` (a dict) under ``outcome``:

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

Parameters are positions in the space's ordered list of choices (``suggest_int(0, n-1)``),
so TPE sees their order (64 lies between 32 and 128); the values themselves are in the
trial's ``result`` (``values``, ``config``).

Distributed search: several processes call :meth:`Tuner.run` with the same ``study_name``
on one RDB storage (SQLite file or PostgreSQL, see :func:`make_storage`). The trial budget
is shared (:class:`SharedBudget`): each process stops once the study's finished trials
reach it, so the total overshoots by at most the number of workers minus one. With
heartbeats, a trial whose worker died is failed once its heartbeat is older than the grace
period, and retried (re-enqueued with the same parameters) by whichever worker looks next.

Example::

    problem = make_problem(spec, shape, dtype)  # fuser_core.problem: bound once
    space = SearchSpace(problem, derivation, get_profile("h100"))
    measurer = ModelMeasurer(problem, derivation, get_profile("h100"))
    result = Tuner(space, measurer, seed=0).run(40)
    print(result.strategy, result.config, result.time_ms)
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import socket
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, Trial, TrialState

__all__ = [
    "BUDGET_STATES", "LocalSearch", "MeasurementFailed", "NoResult", "Objective", "SharedBudget", "TuneResult", "Tuner",
    "budget_used", "candidate_params", "compile_pruned_trials", "default_candidates", "default_sampler",
    "frontier_candidates", "make_storage", "random_candidates",
    "study_name_for", "suggest_candidate", "trial_result", "warm_start", "worker_id",
]

#: Trial states that consume the shared budget (FAIL only when the measurer failed it; see
#: :func:`budget_used`).
BUDGET_STATES = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
_FINISHED_WITH_RESULT = ("measured", "cached", "infeasible", "failed")


def worker_id() -> str:
    """Recorded on every trial (user attr ``worker``): the host and process that ran it."""
    return f"{socket.gethostname()}:{os.getpid()}"


class MeasurementFailed(Exception):
    """The measurer could not give a time for this candidate (the trial FAILs, the study goes on)."""


class NoResult(Exception):
    """The study has no successful trial: every candidate tried was infeasible or failed."""


@dataclass
class TuneResult:
    """The best configuration found, and how the search went.

    ``trials`` counts the study's trials that used the budget (all workers together);
    ``overhead_ms`` is this process's mean time per trial spent outside the measurer
    (sampler, suggestions, storage, bookkeeping), ``overhead_max_ms`` the worst trial.
    """

    strategy: str
    config: dict[str, Any]
    time_ms: float
    measurer: str
    target: str | None
    trials: int
    predicted: bool
    study_name: str | None = None
    best_trial: int | None = None
    counts: dict[str, int] = field(default_factory=dict)  # outcome -> trials, this process; compile_pruned ⊆ infeasible
    overhead_ms: float = 0.0
    overhead_max_ms: float = 0.0
    setup_ms: float = 0.0  # opening the study and enqueuing its start-up trials, once per run
    compile: list[dict[str, Any]] | None = None  # the best trial's compile facts (with a gate)
    # trials of the study the compile gate pruned: number, strategy, config, reason (the compiler's)
    compile_pruned_trials: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------- storage, names


def make_storage(
    url: str,
    *,
    heartbeat_interval: int | None = 10,
    grace_period: int | None = None,
    max_retry: int | None = 2,
    schema: str | None = "optuna",
) -> optuna.storages.RDBStorage:
    """An RDB storage for a shared study, with heartbeats and retry of trials whose worker died.

    ``url`` is an SQLAlchemy URL: ``sqlite:///tune.db`` or
    ``postgresql+psycopg://user@host:5432/db``. Every ``heartbeat_interval`` seconds a running
    trial records a heartbeat; one silent for ``grace_period`` seconds (default twice the
    interval) is failed by the next worker that starts a trial, and re-enqueued with the same
    parameters up to ``max_retry`` times. ``heartbeat_interval=None`` turns heartbeats off.

    On PostgreSQL Optuna's tables live in their own ``schema`` (created when missing), so its
    table names (``studies``, ``trials``) and its ``alembic_version`` never meet the service's
    own tables and migrations. SQLite has no schemas: use a file of its own.

    Example::

        storage = make_storage("sqlite:///tune.db", heartbeat_interval=5)
        study = optuna.create_study(storage=storage, study_name="s", load_if_exists=True)
    """
    engine_kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        # several processes write one file: wait for the lock rather than fail at once
        engine_kwargs["connect_args"] = {"timeout": 60}
    elif url.startswith("postgresql") and schema:
        _ensure_schema(url, schema)
        engine_kwargs["connect_args"] = {"options": f"-csearch_path={schema}"}
        engine_kwargs["pool_pre_ping"] = True
    kwargs: dict[str, Any] = {"engine_kwargs": engine_kwargs}
    if heartbeat_interval is not None:
        kwargs["heartbeat_interval"] = heartbeat_interval
        kwargs["grace_period"] = grace_period or 2 * heartbeat_interval
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            retry_cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
            if retry_cls is not None:  # optuna >= 4.9
                kwargs["heartbeat_stale_trial_callback"] = retry_cls(max_retry=max_retry)
            else:
                kwargs["failed_trial_callback"] = optuna.storages.RetryFailedTrialCallback(max_retry=max_retry)
    storage = _open_rdb_storage(url, kwargs)
    if url.startswith("sqlite"):
        _sqlite_wal(storage)
    return storage


def _open_rdb_storage(url: str, kwargs: dict[str, Any], attempts: int = 5) -> optuna.storages.RDBStorage:
    """Open (and on a fresh database create) Optuna's tables. Several workers starting at once
    race on creating them (PostgreSQL: a unique violation on Optuna's enum type): retry."""
    import sqlalchemy as sa

    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(url, **kwargs)
        except sa.exc.IntegrityError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def _sqlite_wal(storage: optuna.storages.RDBStorage) -> None:
    """Make an SQLite storage safe and quicker for several processes.

    Python's sqlite3 driver starts a transaction only at the first write, so Optuna's
    read-then-update of a trial's state (``SELECT ... FOR UPDATE`` on PostgreSQL) is not atomic
    there: two workers could both take the same enqueued trial and one then fails with "Cannot
    tell a COMPLETE trial". Every transaction therefore begins with ``BEGIN IMMEDIATE`` (one
    writer at a time, from its first read). The write-ahead log and normal sync make each
    commit (Optuna commits every attribute) cheap.
    """
    import sqlalchemy as sa

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # the driver no longer opens transactions itself
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    def on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    sa.event.listen(storage.engine, "connect", on_connect)
    sa.event.listen(storage.engine, "begin", on_begin)
    storage.engine.dispose()


def _ensure_schema(url: str, schema: str) -> None:
    import sqlalchemy as sa

    if not schema.isidentifier():
        raise ValueError(f"schema name {schema!r} is not a plain identifier")
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
    except sa.exc.IntegrityError:
        pass  # another process created it at the same moment
    finally:
        engine.dispose()


def study_name_for(spec_hash: str, shape: Mapping[str, int], dtypes: str | Mapping[str, str], target: str,
                   measurer: str) -> str:
    """The study name of one tuning job: ``foldwise:<hash16>:m=4,n=300:float16:h100:model``.

    A map of dtypes that gives every input the same dtype is written as that one dtype.
    """
    shape_text = ",".join(f"{k}={v}" for k, v in sorted(shape.items()))
    if isinstance(dtypes, str):
        dtype_text = dtypes
    else:
        distinct = set(dtypes.values())
        dtype_text = (next(iter(distinct)) if len(distinct) == 1
                      else ",".join(f"{k}={v}" for k, v in sorted(dtypes.items())))
    return f"foldwise:{spec_hash[:16]}:{shape_text}:{dtype_text}:{target}:{measurer}"


def fail_orphaned_trials(storage: optuna.storages.BaseStorage, study_name: str, reason: str) -> int:
    """Mark the study's RUNNING trials FAIL (with ``reason`` as user attr ``orphaned``); returns how many.

    For the holder of a job's lease, whose own trials have finished: every trial still RUNNING
    belongs to a worker that lost the job (killed before Optuna's heartbeat grace period ran
    out, or cut off by a takeover). They carry no result, so they use none of the trial budget.

    Example::

        fail_orphaned_trials(storage, job.study_name, "its worker lost the job")
    """
    try:
        study_id = storage.get_study_id_from_name(study_name)
    except KeyError:
        return 0
    failed = 0
    for t in storage.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,)):
        try:
            storage.set_trial_user_attr(t._trial_id, "orphaned", reason)
            # a result its worker set before dying (even a failed measurement) must not count
            storage.set_trial_user_attr(t._trial_id, "result", {"outcome": "orphaned", "error": reason})
            failed += bool(storage.set_trial_state_values(t._trial_id, TrialState.FAIL))
        except (optuna.exceptions.UpdateFinishedTrialError, RuntimeError):
            continue  # its worker finished it meanwhile
    return failed


def default_sampler(seed: int | None = 0, n_startup_trials: int = 10) -> optuna.samplers.TPESampler:
    """TPE, seeded; multivariate over each strategy's own parameters.

    ``group=True`` lets multivariate TPE model a conditional space (each strategy's
    parameters form their own group) instead of falling back to independent sampling.
    ``n_startup_trials`` matches :class:`Tuner`'s enqueued start-up trials, so TPE models
    from the first trial after them.

    Example::

        study = optuna.create_study(sampler=default_sampler(seed=1))
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=n_startup_trials)


# ----------------------------------------------------------------------------- budget


def budget_used(study: optuna.Study) -> int:
    """Trials that used the shared budget: COMPLETE, PRUNED (infeasible), and FAIL when the
    measurer failed them. A trial failed because its worker died does not count: it is
    retried, and the retry counts once it finishes."""
    return _used(study.get_trials(deepcopy=False, states=BUDGET_STATES))


def _used(trials: Iterable[FrozenTrial]) -> int:
    return sum(1 for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
               or (t.state == TrialState.FAIL and trial_result(t).get("outcome") == "failed"))


class SharedBudget:
    """Stop the study once ``n_trials`` trials used the budget, counted over every worker.

    Like :class:`optuna.study.MaxTrialsCallback`, but a trial failed by a dead worker (which
    is retried) is not counted. Checked after each trial, so with ``w`` workers the study
    ends with at most ``n_trials + w - 1`` trials.

    Example::

        study.optimize(objective, callbacks=[SharedBudget(40)])
    """

    def __init__(self, n_trials: int):
        self.n_trials = n_trials

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if budget_used(study) >= self.n_trials:
            study.stop()


# ----------------------------------------------------------------------------- objective


def suggest_candidate(trial: Trial, space: Any) -> tuple[str, dict[str, int]]:
    """Suggest a strategy, then its own parameters (positions in each list of choices; a
    parameter with a single choice is not a trial parameter)."""
    strategy = trial.suggest_categorical("strategy", list(space.strategies()))
    values: dict[str, int] = {}
    for name, choices in space.params(strategy).items():
        i = trial.suggest_int(f"{strategy}/{name}", 0, len(choices) - 1) if len(choices) > 1 else 0
        values[name] = choices[i]
    return strategy, values


def candidate_params(space: Any, strategy: str, values: Mapping[str, int]) -> dict[str, Any] | None:
    """The trial parameters that suggest ``(strategy, values)`` in ``space``; None when a value
    is not among this space's choices (or the strategy is not in it)."""
    if strategy not in space.strategies():
        return None
    params: dict[str, Any] = {"strategy": strategy}
    for name, choices in space.params(strategy).items():
        if name not in values or values[name] not in choices:
            return None
        if len(choices) > 1:
            params[f"{strategy}/{name}"] = list(choices).index(values[name])
    return params


def default_candidates(space: Any) -> list[tuple[str, dict[str, int]]]:
    """Per strategy, the configuration a Triton engineer would start from
    (:func:`fuser_core.codegen.plan.default_config`), where it fits: the first trials, so that
    a search of a few trials on a GPU has measured the expert's choice."""
    from fuser_core.codegen.plan import default_config
    from tuner.space import Candidate

    out = []
    for strategy in space.strategies():
        try:
            config = default_config(space.spec, space.derivation, strategy, dict(space.shape))
        except Exception:  # noqa: BLE001 (no default for this strategy here: the frontier starts it)
            continue
        # the default leaves lane blocks of 1 implicit: the space's candidate fills every parameter
        candidate = space.candidate(strategy, space.values_of(Candidate(strategy, config)))
        got = candidate.config
        if ({d: got.blocks.get(d) for d in config.blocks} != config.blocks
                or (got.num_warps, got.num_stages, got.split, got.per_lane)
                != (config.num_warps, config.num_stages, config.split, config.per_lane)):
            continue  # a default outside the space's choices: not this space's to try
        if space.check(candidate) is None:
            out.append((strategy, space.values_of(candidate)))
    return out


#: start-up layouts: (num_warps, which blocks grow first); see :func:`frontier_candidates`
FRONTIER_LAYOUTS = ((4, "axis"), (16, "axis"), (4, "lanes"))


def frontier_candidates(space: Any, layouts: Sequence[tuple[int, str]] = FRONTIER_LAYOUTS,
                        ) -> list[tuple[str, dict[str, int]]]:
    """Per strategy, the largest tiles that fit: sensible first trials.

    These kernels are mostly memory-bound: a program should keep many bytes in flight, so the
    best configurations sit near the frontier of what fits (registers, shared memory, tile
    size), which a random start rarely reaches and a model of pruned trials even steers away
    from. For each ``(num_warps, first)`` layout, start from the smallest blocks (num_stages
    3, split 8, or the nearest choices) and grow, one power of two at a time while the
    candidate still fits: ``"axis"`` grows the loop axis' block first and then the other
    blocks in turn (a long row per program), ``"lanes"`` grows the other blocks in turn first
    (rows per program, a contraction's M/N tile) and the loop axis last.

    Example::

        for strategy, values in frontier_candidates(space):
            study.enqueue_trial(candidate_params(space, strategy, values))
    """
    axis = getattr(space, "axis", None)
    out: list[tuple[str, dict[str, int]]] = []
    for strategy in space.strategies():
        params = space.params(strategy)
        blocks = [n for n, c in params.items() if n.startswith("block_") and len(c) > 1]
        loop = [n for n in blocks if n == f"block_{axis}"]
        lanes = [n for n in blocks if n not in loop]
        base = {name: choices[0] for name, choices in params.items()}
        base["num_stages"] = _nearest(3, params.get("num_stages", [1]))
        if "split" in params:
            base["split"] = _nearest(8, params["split"])
        for warps, first in layouts:
            values: dict[str, int] | None = dict(base, num_warps=_nearest(warps, params.get("num_warps", [warps])))
            for group in ((loop, lanes) if first == "axis" else (lanes, loop)):
                values = values and _grow(space, strategy, values, group)
            if values is None or (strategy, values) in out:
                continue
            if space.check(space.candidate(strategy, values)) is None:
                out.append((strategy, values))
    return out


def _grow(space: Any, strategy: str, values: dict[str, int], names: Sequence[str]) -> dict[str, int] | None:
    """Double the named blocks in turn while the candidate fits (through an infeasible start)."""
    params = space.params(strategy)

    def fits(v: dict[str, int]) -> bool:
        return space.check(space.candidate(strategy, v)) is None

    active = list(names)
    while active:
        for name in list(active):
            choices = params[name]
            j = choices.index(values[name]) + 1
            if j >= len(choices):
                active.remove(name)
                continue
            bigger = dict(values, **{name: choices[j]})
            if fits(bigger) or not fits(values):
                values = bigger
            else:
                active.remove(name)
    return values


class LocalSearch:
    """Enqueue the next untried neighbour of the best trial: first-improvement hill climbing
    on the grid of choices, interleaved with TPE's own suggestions.

    After each finished trial (and while no enqueued trial is waiting), the best trial so far
    that still has untried feasible neighbours gets one enqueued: first the *pattern* move
    (repeat the step that led to it), then each parameter one choice up or down, then a step
    that does not fit taken with a step back of another parameter (along the edge of what
    fits), then any two parameters at once (a tile's shape at the same size, or tile and warps
    scaled together), then moves of parameters the trials show to be flat (changing them alone
    never changed the time), then the same values under the other strategies; each group in
    an order seeded by ``seed`` and the trial's candidate. TPE suggests the trial whenever
    nothing is enqueued: once every feasible neighbour of every finished trial was tried, and
    on every ``tpe_every``-th trial when that is set (0: never by turn).

    Why not TPE alone: on the paper suite with the model measurer, TPE (multivariate, group,
    any start-up) ends 40 trials up to ~50% from the optimum: the times have wide plateaus
    (bandwidth-bound regions where the tiling does not matter) and the optimum sits on the
    edge of what fits, a corner the plateau gives no gradient towards and pruned neighbours
    push TPE away from. Starting at that edge (:func:`frontier_candidates`) and climbing from
    the best point ends within 3% there (benchmarks/tuner_quality.py).

    Example::

        study.optimize(objective, n_trials=40, callbacks=[LocalSearch(space, seed=0)])
    """

    def __init__(self, space: Any, *, seed: int | None = 0, tpe_every: int = 0, budget: int | None = None):
        self.space = space
        self.seed = seed
        self.tpe_every = tpe_every
        self.budget = budget

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        trials = study.get_trials(deepcopy=False)
        if any(t.state == TrialState.WAITING for t in trials):
            return
        if self.budget is not None and _used(trials) >= self.budget:
            return
        if self.tpe_every and (len(trials) + 1) % self.tpe_every == 0:
            return
        tried = {t.user_attrs["candidate"] for t in trials if "candidate" in t.user_attrs}
        done = [t for t in trials
                if t.state == TrialState.COMPLETE and t.value is not None and "result" in t.user_attrs]
        for best in sorted(done, key=lambda t: (t.value, t.number)):
            for strategy, values in self.neighbours(best, trials):
                candidate = self.space.candidate(strategy, values)
                if candidate.key() in tried or self.space.check(candidate) is not None:
                    continue
                params = candidate_params(self.space, strategy, values)
                if params is None:
                    continue
                source = {"source": f"local: from trial {best.number}", "parent": best.number}
                # skip_if_exists: another worker may have enqueued the same neighbour a moment ago
                study.enqueue_trial(params, user_attrs=source, skip_if_exists=True)
                return

    @staticmethod
    def flat_params(strategy: str, names: Sequence[str], trials: Sequence[FrozenTrial]) -> set[str]:
        """Parameters that, as far as the trials show, do not change the time: every pair of
        measured trials of ``strategy`` that differ in that parameter alone took the same time
        (and at least one such pair exists). Their moves are tried last."""
        rows = []
        for t in trials:
            r = trial_result(t)
            if t.state == TrialState.COMPLETE and t.value is not None and r.get("strategy") == strategy:
                rows.append((r["values"], float(t.value)))
        flat = set()
        for name in names:
            by_rest: dict[str, dict[Any, float]] = {}  # the other values -> {this value: time}
            for values, value in rows:
                rest = json.dumps({k: v for k, v in values.items() if k != name}, sort_keys=True)
                by_rest.setdefault(rest, {})[values.get(name)] = round(value, 9)
            informative = [times for times in by_rest.values() if len(times) >= 2]
            if informative and all(len(set(times.values())) == 1 for times in informative):
                flat.add(name)
        return flat

    def neighbours(self, best: FrozenTrial, trials: Sequence[FrozenTrial]) -> Iterable[tuple[str, dict[str, int]]]:
        r = best.user_attrs["result"]
        strategy, values = r["strategy"], r["values"]
        params = self.space.params(strategy)
        names = [n for n, c in params.items() if len(c) > 1 and values.get(n) in c]
        rng = random.Random(f"{self.seed}:{best.user_attrs.get('candidate', best.number)}")

        def step(deltas: Mapping[str, int]) -> dict[str, int] | None:
            out = dict(values)
            for name, d in deltas.items():
                j = params[name].index(values[name]) + d
                if not 0 <= j < len(params[name]):
                    return None
                out[name] = params[name][j]
            return out

        parent = best.user_attrs.get("parent")
        if isinstance(parent, int) and 0 <= parent < len(trials):
            before = trial_result(trials[parent])
            if before.get("strategy") == strategy:
                deltas = {n: params[n].index(values[n]) - params[n].index(before["values"][n]) for n in names
                          if before["values"].get(n) in params[n]}
                pattern = step({n: d for n, d in deltas.items() if d})
                if pattern is not None and any(deltas.values()):
                    yield strategy, pattern
        flat = self.flat_params(strategy, names, trials)
        live = [n for n in names if n not in flat]
        fits = {(n, d): (v := step({n: d})) is not None and self.space.check(self.space.candidate(strategy, v)) is None
                for n in names for d in (-1, 1)}
        singles = [step({n: d}) for n in live for d in (-1, 1)]
        # a step that does not fit, taken together with a step back of another parameter:
        # along the edge of what fits (grow the rows, shrink the row length)
        repairs = [step({a: da, b: -da}) for a in live for da in (-1, 1) if not fits[(a, da)] for b in live if b != a]
        pairs = [step({a: da, b: db}) for a, b in itertools.combinations(live, 2) for da in (-1, 1) for db in (-1, 1)]
        rest = [step({n: d}) for n in flat for d in (-1, 1)]
        rest += [step({a: da, b: db}) for a, b in itertools.combinations(names, 2) if a in flat or b in flat
                 for da in (-1, 1) for db in (-1, 1)]
        for group in (singles, repairs, pairs, rest):
            moves = [v for v in group if v is not None]
            rng.shuffle(moves)
            yield from ((strategy, v) for v in moves)
        for other in self.space.strategies():
            if other != strategy:
                yield other, {n: _nearest(values.get(n, c[0]), c) for n, c in self.space.params(other).items()}


def random_candidates(space: Any, n: int, seed: int | None, *, exclude: Iterable[str] = (),
                      tries: int = 400) -> list[tuple[str, dict[str, int]]]:
    """Up to ``n`` distinct feasible candidates drawn at random (strategies in turn, each
    parameter uniform over its choices; infeasible draws rejected, at most ``tries`` per pick).

    A start-up design for TPE that never wastes a trial on a candidate :meth:`check` rejects,
    which matters where most of the space does not fit (attention with long rows: ~1% of it).
    """
    rng = random.Random(seed)
    strategies = list(space.strategies())
    seen = set(exclude)
    out: list[tuple[str, dict[str, int]]] = []
    dead: set[str] = set()
    turn = 0
    while len(out) < n and len(dead) < len(strategies):
        strategy = strategies[turn % len(strategies)]
        turn += 1
        if strategy in dead:
            continue
        params = space.params(strategy)
        for _ in range(tries):
            values = {name: rng.choice(choices) for name, choices in params.items()}
            candidate = space.candidate(strategy, values)
            if candidate.key() not in seen and space.check(candidate) is None:
                seen.add(candidate.key())
                out.append((strategy, values))
                break
        else:
            dead.add(strategy)
    return out


def _values_from_params(space: Any, params: Mapping[str, Any]) -> dict[str, int]:
    strategy = params["strategy"]
    return {name: choices[params.get(f"{strategy}/{name}", 0)] for name, choices in space.params(strategy).items()}


def _nearest(value: int, choices: Sequence[int]) -> int:
    return min(choices, key=lambda c: (abs(math.log2(max(c, 1)) - math.log2(max(value, 1))), c))


def compile_pruned_trials(study: optuna.Study) -> list[dict[str, Any]]:
    """The study's trials that the compile gate pruned (infeasible with compile facts that
    failed or exceeded the target): number, strategy, config and the reason."""
    out = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.PRUNED,)):
        r = trial_result(t)
        if r.get("outcome") == "infeasible" and "compile" in r:
            out.append({"number": t.number, "strategy": r.get("strategy"), "config": r.get("config"),
                        "reason": r.get("reason")})
    return out


def trial_result(t: FrozenTrial) -> dict[str, Any]:
    """The ``result`` user attr of a trial that finished through :class:`Objective` ({} otherwise)."""
    r = t.user_attrs.get("result")
    return r if isinstance(r, dict) else {}


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

    def __init__(self, space: Any, measurer: Any, *, gate: Any = None, wait_s: float = 300.0, poll_s: float = 0.05):
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


# ----------------------------------------------------------------------------- warm start


def warm_start(study: optuna.Study, space: Any, storage: str | optuna.storages.BaseStorage | None, *,
               per_study: int = 1, limit: int = 8) -> list[dict[str, Any]]:
    """Enqueue the best configurations of other shapes of the same spec, target and dtype.

    Other studies in ``storage`` whose user attrs name the same ``spec_hash``, ``target`` and
    ``dtype`` as ``study`` (any shape, any measurer) give their ``per_study`` best distinct
    candidates, nearest shape first; each is enqueued (``study.enqueue_trial``) when its
    strategy and values exist in ``space`` and :meth:`SearchSpace.check` accepts it, at most
    ``limit`` in all. Returns the enqueued trial parameters.

    Example::

        study = optuna.create_study(storage=url, study_name=name, load_if_exists=True)
        study.set_user_attr("spec_hash", h)  # and target, dtype, shape
        warm_start(study, space, url)
    """
    if storage is None:
        return []
    attrs = study.user_attrs
    ident = _identity(attrs)
    if ident is None:
        return []
    store = _as_storage(storage)
    peers = []
    for frozen in store.get_all_studies():
        if frozen.study_name == study.study_name or _identity(frozen.user_attrs) != ident:
            continue
        peers.append((_shape_distance(attrs.get("shape"), frozen.user_attrs.get("shape")), frozen.study_name))
    seen = {t.user_attrs.get("candidate") for t in study.get_trials(deepcopy=False)}
    waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    seen |= {json.dumps(t.params, sort_keys=True) for t in waiting}
    enqueued: list[dict[str, Any]] = []
    for _, name in sorted(peers):
        peer = optuna.load_study(study_name=name, storage=store)
        best: dict[str, FrozenTrial] = {}  # the peer's per_study best distinct candidates
        for t in sorted(peer.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), key=lambda t: t.value):
            if len(best) >= per_study:
                break
            best.setdefault(t.user_attrs.get("candidate", ""), t)
        for t in best.values():
            strategy, values = trial_result(t).get("strategy"), trial_result(t).get("values")
            if len(enqueued) >= limit or not isinstance(strategy, str) or not isinstance(values, dict):
                continue
            params = candidate_params(space, strategy, values)
            if params is None:
                continue
            candidate = space.candidate(strategy, values)
            if candidate.key() in seen or json.dumps(params, sort_keys=True) in seen:
                continue
            if space.check(candidate) is not None:
                continue
            seen.add(candidate.key())
            study.enqueue_trial(params, user_attrs={"source": f"warm start: best of {name}"})
            enqueued.append(params)
    return enqueued


def _as_storage(storage: str | optuna.storages.BaseStorage) -> optuna.storages.BaseStorage:
    """A URL opened with :func:`make_storage` (its schema, heartbeats, SQLite settings), or the storage as given."""
    return make_storage(storage) if isinstance(storage, str) else storage


def _identity(attrs: Mapping[str, Any]) -> tuple[str, str, str] | None:
    if not attrs.get("spec_hash") or not attrs.get("target"):
        return None
    return attrs["spec_hash"], attrs["target"], json.dumps(attrs.get("dtype"), sort_keys=True)


def _shape_distance(a: Any, b: Any) -> float:
    if not isinstance(a, dict) or not isinstance(b, dict):
        return math.inf
    keys = set(a) | set(b)
    return sum(abs(math.log2(max(1, a.get(k, 1))) - math.log2(max(1, b.get(k, 1)))) for k in keys)


# ----------------------------------------------------------------------------- the tuner


class Tuner:
    """Search one (spec, shape, dtype, target) with Optuna; see the module docstring.

    ``sampler`` defaults to :func:`default_sampler` (TPE seeded with ``seed``). A new study
    gets its start-up trials enqueued first (warm start, ``frontier`` configurations, then
    random feasible ones up to ``startup``); ``local_search`` adds :class:`LocalSearch` (``tpe_every``: leave every
    k-th trial to TPE; 0: TPE only when the local search has nothing left). With several
    workers on one study, give each its own seed (the same seed makes their TPE suggest the
    same points). ``gate``: a :class:`tuner.compile_gate.CompileGate` every candidate passes
    before it is measured (give the model measurer the same gate, so it predicts from the
    compiled facts); ``TuneResult.counts["compile_pruned"]`` counts the candidates it pruned.

    Example::

        tuner = Tuner(space, ModelMeasurer(space.problem, derivation, profile), seed=0)
        best = tuner.run(40)                                    # in memory
        best = tuner.run(40, storage=make_storage("sqlite:///t.db"), study_name="job-1")
    """

    def __init__(self, space: Any, measurer: Any, *, seed: int | None = 0,
                 sampler: optuna.samplers.BaseSampler | None = None, target: str | None = None, startup: int = 10,
                 frontier: bool = True, local_search: bool = True, tpe_every: int = 0, gate: Any = None):
        self.space = space
        self.gate = gate
        self.frontier = frontier
        self.measurer = measurer
        self.seed = seed
        self.startup = startup
        self.local_search = local_search
        self.tpe_every = tpe_every
        self.sampler = sampler
        profile = getattr(space, "profile", None) or getattr(measurer, "profile", None)
        self.target = target or getattr(profile, "name", None)
        self.study: optuna.Study | None = None

    def run(
        self,
        n_trials: int,
        storage: str | optuna.storages.BaseStorage | None = None,  # a URL is opened with make_storage
        study_name: str | None = None,
        callbacks: Iterable[Callable[[optuna.Study, FrozenTrial], None]] = (),
        *,
        attrs: Mapping[str, Any] | None = None,
        max_trials: int | None = None,
        show_progress_bar: bool = False,
        warm: bool = True,
    ) -> TuneResult:
        """Run trials until the study has used ``n_trials`` (shared with every other process
        on the same ``study_name``) or this process has run ``max_trials``; return the best.

        ``attrs`` are recorded as the study's user attrs when the study is new (a worker
        that joins reads them; ``budget``, when the study has one, follows ``n_trials`` of a
        call without ``max_trials``); a new study starts with enqueued trials (:meth:`_start`).
        Raises :class:`NoResult` when no trial succeeded.
        """
        if n_trials < 1:
            raise ValueError("n_trials must be at least 1")
        setup_start = time.perf_counter()
        storage = _as_storage(storage) if storage is not None else None
        sampler = self.sampler or default_sampler(self.seed, n_startup_trials=self.startup)
        study = optuna.create_study(storage=storage, sampler=sampler, study_name=study_name,
                                    direction="minimize", load_if_exists=True)
        self.study = study
        if not study.get_trials(deepcopy=False):
            for key, value in (attrs or {}).items():
                if study.user_attrs.get(key) != value:
                    study.set_user_attr(key, value)
            self._start(study, storage, warm)

        if max_trials is None and study.user_attrs.get("budget", n_trials) != n_trials:
            study.set_user_attr("budget", n_trials)  # workers joining later share the new budget
        objective = Objective(self.space, self.measurer, gate=self.gate)
        ends: list[tuple[int, float]] = []

        def clock(study: optuna.Study, trial: FrozenTrial) -> None:
            ends.append((trial.number, time.perf_counter()))

        remaining = n_trials - budget_used(study)
        if max_trials is not None:
            remaining = min(remaining, max_trials)
        local = []
        if self.local_search:
            local.append(LocalSearch(self.space, seed=self.seed, tpe_every=self.tpe_every, budget=n_trials))
        start = time.perf_counter()
        if remaining > 0:
            study.optimize(
                objective, n_trials=remaining, catch=(MeasurementFailed,),
                callbacks=[*callbacks, SharedBudget(n_trials), *local, clock], show_progress_bar=show_progress_bar,
            )
        with warnings.catch_warnings():  # leave no dead worker's trial RUNNING (no-op without heartbeats)
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        overheads, prev = [], start
        for number, end in ends:
            overheads.append(max(0.0, end - prev - objective.outside_s.get(number, 0.0)))
            prev = end
        result = self._result(study, objective, overheads)
        result.setup_ms = 1e3 * (start - setup_start)
        return result

    def _start(self, study: optuna.Study, storage: Any, warm: bool) -> None:
        """Enqueue a new study's first trials: the best of other shapes (warm start), the
        frontier configurations of each strategy, then random feasible candidates up to
        ``startup`` in all (TPE's own start-up, by default, is as long)."""
        enqueued = warm_start(study, self.space, storage) if warm else []
        keys = {self.space.candidate(p["strategy"], _values_from_params(self.space, p)).key() for p in enqueued}
        picks = []
        for strategy, values in default_candidates(self.space) if self.frontier else []:
            key = self.space.candidate(strategy, values).key()
            if key not in keys:
                keys.add(key)
                picks.append((strategy, values, "default"))
        for strategy, values in frontier_candidates(self.space) if self.frontier else []:
            key = self.space.candidate(strategy, values).key()
            if key not in keys:
                keys.add(key)
                picks.append((strategy, values, "frontier"))
        more = max(0, self.startup - len(enqueued) - len(picks))
        picks += [(s, v, "random start-up") for s, v in random_candidates(self.space, more, self.seed, exclude=keys)]
        for strategy, values, source in picks:
            params = candidate_params(self.space, strategy, values)
            if params is not None:
                study.enqueue_trial(params, user_attrs={"source": source}, skip_if_exists=True)

    def _result(self, study: optuna.Study, objective: Objective, overheads: list[float]) -> TuneResult:
        try:
            best = study.best_trial
        except ValueError:
            reasons = [trial_result(t).get("error") or trial_result(t).get("reason")
                       for t in study.get_trials(deepcopy=False)]
            first = next((r for r in reasons if r), "no trial ran")
            raise NoResult(f"no configuration succeeded in {len(reasons)} trials; first reason: {first}") from None
        return TuneResult(
            strategy=trial_result(best)["strategy"],
            config=trial_result(best)["config"],
            time_ms=float(best.value),
            measurer=getattr(self.measurer, "name", type(self.measurer).__name__),
            target=self.target,
            trials=budget_used(study),
            predicted=bool(trial_result(best).get("predicted", False)),
            study_name=study.study_name,
            best_trial=best.number,
            counts=dict(objective.counts),
            overhead_ms=1e3 * sum(overheads) / len(overheads) if overheads else 0.0,
            overhead_max_ms=1e3 * max(overheads, default=0.0),
            compile=trial_result(best).get("compile"),
            compile_pruned_trials=compile_pruned_trials(study),
        )
