"""The checks ``foldwise run``, ``tune`` and ``compile`` make before any heavy import.

Bad input must be refused in well under a second (issue 26), and what makes a refusal slow is
what it imports: torch alone takes about 2 s on a 2-core host, Triton, SciPy and Optuna more.
So every argument a command can check from the spec's JSON, the shape and dtype text and the
light tables (strategy names, targets, measurers, input families) is checked here first, with
only the light modules loaded (fuser_core.problem, the strategy registry, tuner.profiles,
service.tuning_request; NumPy for the families). Only the check that a named strategy can hold
the problem needs the derivation, and so sympy: :func:`strategy_fits` runs it next, still
before torch or Triton. Each failure is a :class:`UsageError` naming the flag (or the
SpecError naming the field, which main() prints), as the later checks would have raised it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from service.cli.errors import UsageError


def read_spec_source(name_or_path: str) -> bytes:
    """The bytes of the spec a command-line argument means: a file, else a catalog name."""
    from fuser_core import CatalogError, spec_source

    try:
        return spec_source(name_or_path)
    except CatalogError as err:
        raise UsageError(str(err)) from None


def read_spec(name_or_path: str):
    from fuser_core import load_spec

    return load_spec(read_spec_source(name_or_path))


def shape_and_dtype(args: argparse.Namespace, spec) -> tuple[dict[str, int], str | dict[str, str]]:
    """``--shape m=4,n=300`` (without it, the spec's ``example``) and ``--dtype float16`` (or a JSON
    object of input -> dtype), read by :func:`service.bundle.parse_shape_text` and
    ``parse_dtype_text``; UsageError naming the flag."""
    from fuser_core import SpecError
    from service.bundle import parse_dtype_text, parse_shape_text

    if args.shape is None and not spec.example:
        raise UsageError(f"--shape: {spec.name} has no example shape; give one, e.g. --shape "
                         + ",".join(f"{d}=64" for d in spec.dims[:2]))
    try:
        shape = dict(spec.example) if args.shape is None else parse_shape_text(args.shape)
        return shape, parse_dtype_text(args.dtype)
    except SpecError as err:
        raise UsageError(f"--{err.loc[0]}: {err.message}") from None


def checked_problem(args: argparse.Namespace, *, allow_empty: bool = False) -> tuple[Any, dict[str, int], Any]:
    """(spec, the shape bound to it, the ``--dtype`` text read) of a command's spec, ``--shape``
    and ``--dtype``: a misspelt catalog name, an unknown or missing dim and an unknown dtype
    are refused here (SpecError naming the field, or UsageError naming the flag)."""
    from fuser_core import SpecError, bind_dtypes, bind_shape

    spec = read_spec(args.spec)
    raw_shape, dtype = shape_and_dtype(args, spec)
    try:
        shape = bind_shape(spec, raw_shape, allow_empty=allow_empty)
    except SpecError as err:
        if args.shape is not None:
            raise
        raise SpecError(err.message, loc=("example", *err.loc[1:])) from None  # the spec's own example
    bind_dtypes(spec, dtype)
    return spec, shape, dtype


def checked_strategy(name: str | None, *, extra: tuple[str, ...] = ()) -> str | None:
    """A strategy name of the registry, the baseline, or one of ``extra`` (``all``)."""
    from fuser_core import BASELINE, STRATEGIES

    if name is None or name in STRATEGIES or name == BASELINE or name in extra:
        return name
    raise UsageError(f"--strategy: unknown strategy {name!r}; one of {', '.join((*STRATEGIES, BASELINE, *extra))}")


def checked_config(text: str | None):
    """``--config`` as a KernelConfig (None when not given)."""
    from fuser_core import KernelConfig

    if not text:
        return None
    try:
        return KernelConfig.from_dict(json.loads(text))
    except (json.JSONDecodeError, ValueError, TypeError, AttributeError) as err:
        raise UsageError(f"--config: {err}") from None


def checked_families(text: str | None) -> tuple[str, ...]:
    from fuser_core import parse_families

    try:
        return parse_families(text)
    except ValueError as err:
        raise UsageError(f"--families: {err}") from None


def strategy_fits(spec: Any, shape: dict[str, int], strategy: str | None) -> Any:
    """The spec's derivation, after checking that ``strategy`` (None: the best valid one) can run
    this shape with its default configuration: a row too long to keep resident, a tile too
    large, or no strategy at all is refused naming ``--strategy``. Loads sympy, not torch; the
    caller passes the derivation on, so it is made once."""
    from fuser_core import BASELINE, derive_cascade, has_empty_dim, valid_strategies

    derivation = derive_cascade(spec)
    if strategy == BASELINE or has_empty_dim(shape):  # the chain runs any shape; an empty one runs nothing
        return derivation
    valid = valid_strategies(spec, derivation, shape)
    if strategy is not None and valid.get(strategy):
        raise UsageError(f"--strategy: {valid[strategy]}")
    if strategy is None and all(valid.values()):
        raise UsageError("--strategy: no strategy can run this spec: " + "; ".join(f"{k}: {v}" for k, v in valid.items()))
    return derivation


def checked_tune_choices(args: argparse.Namespace) -> None:
    """``tune``'s ``--trials``, ``--heartbeat``, ``--measurer`` and ``--target`` (the same checks
    :func:`service.worker.tuning.tuning_setup` makes later, made before Optuna and the tuner load)."""
    from service.worker.tuning import SetupError, checked_choice
    from service.tuning_request import check_measurer, check_target

    if args.trials < 1:
        raise UsageError(f"--trials: must be at least 1, got {args.trials}")
    if args.db and args.heartbeat < 1:
        raise UsageError(f"--heartbeat: must be at least 1 second, got {args.heartbeat}")
    try:
        checked_choice(check_measurer, args.measurer)
        checked_choice(check_target, args.target)
    except SetupError as err:
        raise UsageError(err.cli_message) from None
