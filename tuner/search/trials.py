"""What a study's stored trials say: a trial's result, the trial budget used, the compile-pruned trials.

Contract: every trial that went through :class:`tuner.search.objective.Objective` keeps a
``result`` user attr (a dict with its ``outcome``); :func:`trial_result` reads it. The shared
budget counts COMPLETE and PRUNED trials, and FAIL trials only when the measurer failed them
(:func:`budget_used`, :func:`budget_used_by`); :class:`SharedBudget` stops a study there,
counted over every worker on the study.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

#: Trial states that consume the shared budget (FAIL only when the measurer failed it; see
#: :func:`budget_used`).
BUDGET_STATES = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def trial_result(t: FrozenTrial) -> dict[str, Any]:
    """The ``result`` user attr of a trial that finished through
    :class:`tuner.search.objective.Objective` ({} otherwise)."""
    r = t.user_attrs.get("result")
    return r if isinstance(r, dict) else {}


def budget_used(study: optuna.Study) -> int:
    """Trials that used the shared budget: COMPLETE, PRUNED (infeasible), and FAIL when the
    measurer failed them. A trial failed because its worker died does not count: it is
    retried, and the retry counts once it finishes."""
    return budget_used_by(study.get_trials(deepcopy=False, states=BUDGET_STATES))


def budget_used_by(trials: Iterable[FrozenTrial]) -> int:
    """:func:`budget_used` of these trials (a study's, already read)."""
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

