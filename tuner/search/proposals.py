"""Which candidates a search tries: start-up designs, local search, and TPE's sampler.

Contract: a candidate is proposed as Optuna trial parameters, ``{"strategy": s,
"<s>/<param>": position}``; a parameter is a position in the space's ordered list of choices
(``suggest_int(0, n-1)``), so TPE sees their order (64 lies between 32 and 128), and a
parameter with a single choice is not a trial parameter. :func:`suggest_candidate` reads a
trial's candidate back, :func:`candidate_params` writes one, :func:`values_from_params` reads
enqueued parameters. The start-up designs (:func:`default_candidates`,
:func:`frontier_candidates`, :func:`random_candidates`) return only candidates the space's
check accepts; :class:`LocalSearch` enqueues one untried neighbour of the best trial after
each trial; :func:`default_sampler` is TPE for whatever is not enqueued. Nothing here
measures or stores a result.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import FrozenTrial, Trial, TrialState

from tuner.search.trials import budget_used_by, trial_result

if TYPE_CHECKING:
    from tuner.space import SearchSpace


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



def suggest_candidate(trial: Trial, space: SearchSpace) -> tuple[str, dict[str, int]]:
    """Suggest a strategy, then its own parameters (positions in each list of choices; a
    parameter with a single choice is not a trial parameter)."""
    strategy = trial.suggest_categorical("strategy", list(space.strategies()))
    values: dict[str, int] = {}
    for name, choices in space.params(strategy).items():
        i = trial.suggest_int(f"{strategy}/{name}", 0, len(choices) - 1) if len(choices) > 1 else 0
        values[name] = choices[i]
    return strategy, values


def candidate_params(space: SearchSpace, strategy: str, values: Mapping[str, int]) -> dict[str, Any] | None:
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


def default_candidates(space: SearchSpace) -> list[tuple[str, dict[str, int]]]:
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
                or (got.num_warps, got.num_stages, got.split, got.per_lane, got.combine)
                != (config.num_warps, config.num_stages, config.split, config.per_lane, config.combine)):
            continue  # a default outside the space's choices: not this space's to try
        if space.check(candidate) is None:
            out.append((strategy, space.values_of(candidate)))
    return out


#: the output tiles of Triton's matmul tutorial (03-matrix-multiplication's CUDA configs), in its order
GEMM_TILES = ((128, 256), (64, 256), (128, 128))


def _snapped(space: SearchSpace, strategy: str, want: Mapping[str, int]) -> dict[str, int]:
    """``want`` on the space's choices for ``strategy``: each value the nearest choice, a parameter
    it lacks the first choice."""
    params = space.params(strategy)
    return {name: _nearest(want[name], choices) if name in want else choices[0] for name, choices in params.items()}


def expert_candidates(space: SearchSpace) -> list[tuple[str, dict[str, int]]]:
    """The configurations the hand-written kernels use at this shape, where the space has them:
    first trials beside the defaults, so that the search always measures the expert's shape.

    - a contraction with a query tile (attention): Triton tutorial 06's forward tile, BLOCK_M
      128, BLOCK_N 128 (64 for a head dim under 128), 8 warps, 3 stages, the whole head dim;
    - a matrix product, both operands carrying the loop axis (the fp8 GEMM's ``a[m, k]`` and
      ``w[n, k]``): Triton's matmul tutorial's first Hopper tile (03-matrix-multiplication),
      128 x 256 outputs, a K step of 64 (128 where an operand is fp8), 8 warps, 3 stages, for
      each strategy that can run it, or the first of its other tiles (GEMM_TILES) that fits:
      Foldwise's fp8 GEMM quantises its activations in registers, so 128 x 256 does not fit its
      registers at 8 warps and 64 x 256 does;
    - a contraction with one query row (decode): the split-KV decoder's
      (:func:`tuner.experts.split_kv_decode`): 64 keys a step, 4 warps, as many parts as fill
      the SMs twice (split_fused), or one part per row (streaming_fused);
    - a row reduction: Liger-Kernel's ``calculate_settings`` (ops/utils.py): the whole row in one
      block (row_resident) when it fits, else its loop's block of at most 32768 (its
      cross-entropy's), with its warps: 32 from a block of 32768, 16 from 8192, 8 from 2048, else 4.

    Values snap to the nearest choice of the space; where the space's check refuses the expert's
    loop block, the largest smaller one it accepts at the same warps stands in (Foldwise's
    streaming cross-entropy at 32 warps holds 16384, not Liger's 32768); a candidate still
    refused is left out."""
    from fuser_core.codegen.plan import contraction_dims, next_pow2
    from fuser_core.codegen.names import FP8
    from fuser_core.codegen.strategies import MULTI_PASS, ROW_RESIDENT, SPLIT_FUSED, STREAMING_FUSED
    from tuner.experts import DECODER_BLOCK, decoder_parts

    axis, shape = getattr(space, "axis", None), getattr(space, "shape", None)
    if axis is None or shape is None:  # a space without a loop axis has no expert shape here
        return []
    free, batch = contraction_dims(space.spec, space.derivation)
    # a value dim shares an input with the loop axis (attention's e, of v[n, e]): its block is
    # whole; the other free dims are the query tile's (m, of q[m, d])
    with_axis = {d for i in space.spec.inputs if axis in i.dims for d in i.dims}
    inner = {d: shape[d] for d in sorted(free) if d != axis and d in with_axis}
    lanes = sorted(d for d in free if d != axis and d not in inner)
    wanted: list[tuple[str, dict[str, int]]] = []
    if free and not lanes and len(inner) >= 2:  # every output dim on an operand with the axis: a GEMM tile
        rows, cols = sorted(inner)[:2]
        step = 128 if FP8 in space.problem.dtypes.values() else 64
        for strategy in (MULTI_PASS.name, STREAMING_FUSED.name):
            if strategy not in space.strategies():
                continue
            tiles = [{f"block_{rows}": r, f"block_{cols}": c, f"block_{axis}": step, "num_warps": 8, "num_stages": 3}
                     for r, c in GEMM_TILES]
            fits = [t for t in tiles if space.check(space.candidate(strategy, _snapped(space, strategy, t))) is None]
            wanted.append((strategy, fits[0] if fits else tiles[0]))
    elif free:
        query = [d for d in lanes if shape[d] > 1]
        if query:
            head = max(inner.values(), default=128)
            blocks = {f"block_{query[0]}": 128, f"block_{axis}": 128 if head >= 128 else 64}
            wanted.append((STREAMING_FUSED.name, {**blocks, "num_warps": 8, "num_stages": 3}))
        else:
            rows = math.prod(shape[d] for d in (*batch, *lanes))  # one query row each
            parts = decoder_parts(shape[axis], max(1, rows), space.profile.sm_count, DECODER_BLOCK)
            base = {f"block_{axis}": DECODER_BLOCK, "num_warps": 4, "num_stages": 3}
            wanted.append((SPLIT_FUSED.name, {**base, "split": parts}) if parts > 1 else (STREAMING_FUSED.name, base))
        for _, values in wanted:
            values.update({f"block_{d}": next_pow2(n) for d, n in inner.items()})
    else:
        block = next_pow2(shape[axis])
        resident = ROW_RESIDENT.name in space.strategies() and block in space.params(ROW_RESIDENT.name).get(
            f"block_{axis}", [])
        block = block if resident else min(block, 32768)
        warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
        wanted.append((ROW_RESIDENT.name if resident else STREAMING_FUSED.name,
                       {f"block_{axis}": block, "num_warps": warps, "num_stages": 1 if resident else 3}))
    out = []
    for strategy, want in wanted:
        if strategy not in space.strategies():
            continue
        params = space.params(strategy)
        values = _snapped(space, strategy, want)
        loop = params.get(f"block_{axis}", [])
        # the expert's block may hold more than Foldwise's kernel can at those warps (Liger's
        # cross-entropy keeps fewer values live): the largest smaller one that fits, same warps
        while space.check(space.candidate(strategy, values)) is not None and loop.index(values[f"block_{axis}"]) > 0:
            values[f"block_{axis}"] = loop[loop.index(values[f"block_{axis}"]) - 1]
        if space.check(space.candidate(strategy, values)) is None and (strategy, values) not in out:
            out.append((strategy, values))
    return out


#: start-up layouts: (num_warps, which blocks grow first); see :func:`frontier_candidates`
FRONTIER_LAYOUTS = ((4, "axis"), (16, "axis"), (4, "lanes"))


def frontier_candidates(space: SearchSpace, layouts: Sequence[tuple[int, str]] = FRONTIER_LAYOUTS,
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


def _grow(space: SearchSpace, strategy: str, values: dict[str, int], names: Sequence[str]) -> dict[str, int] | None:
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

    def __init__(self, space: SearchSpace, *, seed: int | None = 0, tpe_every: int = 0, budget: int | None = None):
        self.space = space
        self.seed = seed
        self.tpe_every = tpe_every
        self.budget = budget

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        trials = study.get_trials(deepcopy=False)
        if any(t.state == TrialState.WAITING for t in trials):
            return
        if self.budget is not None and budget_used_by(trials) >= self.budget:
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


def random_candidates(space: SearchSpace, n: int, seed: int | None, *, exclude: Iterable[str] = (),
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


def values_from_params(space: SearchSpace, params: Mapping[str, Any]) -> dict[str, int]:
    """The values of the candidate that trial parameters ``params`` suggest (:func:`candidate_params` inverted)."""
    strategy = params["strategy"]
    return {name: choices[params.get(f"{strategy}/{name}", 0)] for name, choices in space.params(strategy).items()}


def _nearest(value: int, choices: Sequence[int]) -> int:
    return min(choices, key=lambda c: (abs(math.log2(max(c, 1)) - math.log2(max(value, 1))), c))

