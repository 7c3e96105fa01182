"""Warm start: a new study's first trials are the best configurations of other shapes.

Contract: :func:`warm_start` reads the other studies in the storage whose user attrs name the
same spec hash, target and dtype (any shape, any measurer), and enqueues their best distinct
candidates, nearest shape first, that exist in this search space and pass its check. It
enqueues only; it never measures.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from tuner.search.proposals import candidate_params
from tuner.search.storage import open_storage
from tuner.search.trials import trial_result

if TYPE_CHECKING:
    from tuner.space import SearchSpace


def warm_start(study: optuna.Study, space: SearchSpace, storage: str | optuna.storages.BaseStorage | None, *,
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
    store = open_storage(storage)
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



def _identity(attrs: Mapping[str, Any]) -> tuple[str, str, str] | None:
    if not attrs.get("spec_hash") or not attrs.get("target"):
        return None
    return attrs["spec_hash"], attrs["target"], json.dumps(attrs.get("dtype"), sort_keys=True)


def _shape_distance(a: Any, b: Any) -> float:
    if not isinstance(a, dict) or not isinstance(b, dict):
        return math.inf
    keys = set(a) | set(b)
    return sum(abs(math.log2(max(1, a.get(k, 1))) - math.log2(max(1, b.get(k, 1)))) for k in keys)

