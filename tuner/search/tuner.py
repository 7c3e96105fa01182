"""The tuner: runs one study (proposals, objective, shared budget) and returns the best configuration.

Contract: ``Tuner(space, measurer).run(n_trials, storage, study_name)`` opens or joins the
study, enqueues a new study's start-up trials (warm start, defaults, frontier, random), runs
trials until the study has used ``n_trials`` over every worker, and returns a
:class:`TuneResult`, or raises :class:`NoResult` when no trial succeeded. The measurer keeps
the :class:`tuner.measure.Measurer` contract; the tuner never closes it (its owner does).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import FrozenTrial

from tuner.search.objective import MeasurementFailed, Objective
from tuner.search.proposals import (
    LocalSearch,
    candidate_params,
    default_candidates,
    default_sampler,
    expert_candidates,
    frontier_candidates,
    random_candidates,
    values_from_params,
)
from tuner.search.storage import open_storage
from tuner.search.trials import SharedBudget, budget_used, compile_pruned_trials, trial_result
from tuner.search.warm_start import warm_start

if TYPE_CHECKING:
    from tuner.compile_gate import CompileGate
    from tuner.measure import Measurer
    from tuner.space import SearchSpace


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



class Tuner:
    """Search one (spec, shape, dtype, target) with Optuna; see :mod:`tuner.search`.

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

    def __init__(self, space: SearchSpace, measurer: Measurer, *, seed: int | None = 0,
                 sampler: optuna.samplers.BaseSampler | None = None, target: str | None = None, startup: int = 10,
                 frontier: bool = True, local_search: bool = True, tpe_every: int = 0,
                 gate: CompileGate | None = None):
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
        storage = open_storage(storage) if storage is not None else None
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

    def _start(self, study: optuna.Study, storage: optuna.storages.BaseStorage | None, warm: bool) -> None:
        """Enqueue a new study's first trials: the best of other shapes (warm start), each
        strategy's default, the experts' configurations (:func:`expert_candidates`), the
        frontier configurations of each strategy, then random feasible candidates up to
        ``startup`` in all (TPE's own start-up, by default, is as long)."""
        enqueued = warm_start(study, self.space, storage) if warm else []
        keys = {self.space.candidate(p["strategy"], values_from_params(self.space, p)).key() for p in enqueued}
        picks = []
        designs = (("default", default_candidates), ("expert", expert_candidates), ("frontier", frontier_candidates))
        for source, design in designs if self.frontier else ():
            for strategy, values in design(self.space):
                key = self.space.candidate(strategy, values).key()
                if key not in keys:
                    keys.add(key)
                    picks.append((strategy, values, source))
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
            measurer=self.measurer.name,
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
