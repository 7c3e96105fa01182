"""Optuna drives the configuration search; this package is that search, one job per module.

One study per (spec, shape, dtype, target, measurer); Optuna runs its trials, stores them
(in memory, or an SQLite/PostgreSQL database shared by several worker processes) and
samples with TPE. Trials are proposed three ways, all through the study:

1. **start-up**, enqueued in a new study (``study.enqueue_trial``): the best configurations
   of other shapes of the same spec, target and dtype (:func:`~tuner.search.warm_start.warm_start`),
   then each strategy's default, the configuration an expert starts from
   (:func:`~tuner.search.proposals.default_candidates`), the hand-written kernels'
   configurations (:func:`~tuner.search.proposals.expert_candidates`: tutorial 06's tile,
   Liger's warps, the split-KV decoder's parts), then the frontier configurations of
   each strategy (:func:`~tuner.search.proposals.frontier_candidates`: the largest tiles that
   fit), then random feasible candidates (:func:`~tuner.search.proposals.random_candidates`);
2. **local search** (:class:`~tuner.search.proposals.LocalSearch`, a callback): the next
   untried neighbour of the best trial, enqueued after each trial;
3. **TPE** (:func:`~tuner.search.proposals.default_sampler`), whenever nothing is enqueued.

Each trial is answered by :class:`~tuner.search.objective.Objective` (its docstring lists the
four outcomes a trial records: measured, cached, infeasible, failed).

Distributed search: several processes call :meth:`Tuner.run` with the same ``study_name``
on one RDB storage (SQLite file or PostgreSQL, see :func:`~tuner.search.storage.make_storage`).
The trial budget is shared (:class:`~tuner.search.trials.SharedBudget`): each process stops
once the study's finished trials reach it, so the total overshoots by at most the number of
workers minus one. With heartbeats, a trial whose worker died is failed once its heartbeat is
older than the grace period, and retried (re-enqueued with the same parameters) by whichever
worker looks next.

The modules, each with one job (this package re-exports nothing: import from the module, or
the public names from ``tuner``):

- :mod:`~tuner.search.storage`: where studies live (the RDB storage, study names, orphaned trials);
- :mod:`~tuner.search.trials`: what a study's stored trials say (a trial's result, the budget used);
- :mod:`~tuner.search.proposals`: which candidates to try (start-up designs, local search, TPE);
- :mod:`~tuner.search.objective`: the function Optuna minimises, with the study's result cache;
- :mod:`~tuner.search.warm_start`: the best configurations of other shapes, as first trials;
- :mod:`~tuner.search.tuner`: :class:`~tuner.search.tuner.Tuner`, which runs a study with all of them.

Example::

    problem = make_problem(spec, shape, dtype)  # fuser_core.problem: bound once
    space = SearchSpace(problem, derivation, get_profile("h100"))
    measurer = ModelMeasurer(problem, derivation, get_profile("h100"))
    result = Tuner(space, measurer, seed=0).run(40)
    print(result.strategy, result.config, result.time_ms)
"""
