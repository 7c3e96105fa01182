"""What the dashboard's own endpoints return, as plain functions over a Session.

The general API (service.api) serves jobs, trials, workers, kernels and bundles; these are the
few views only the dashboard needs: a spec's derivation as LaTeX, its generated Triton source,
the kernel cache as a table with speedups, the catalog for the submit form, and the choices
the form offers. Routes (:mod:`service.dashboard.api`) stay thin; errors are
:class:`DashboardError` with the request field they concern, so the route answers 404/422 with
a message naming it.

Costs are bounded: a spec was validated when first stored (size and expression limits of
:mod:`fuser_core.spec`), derivations and LaTeX are cached per spec (LRU), code generation is
cached on disk by :mod:`fuser_core.codegen.module`, and listings are paged with a hard limit.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from fuser_core import BASELINE, SpecError
from service import spec_store
from service.dim_names import DimNames
from service.models import Job, KernelRecord, SpecRecord, WorkerRecord

MAX_LIMIT = 500
MAX_NAMES = 200
DEFAULT_DIM = 128  # a dim's size for generated source when no job or kernel gives one
HASH_RE = re.compile(r"^[0-9a-f]{64}$")


class DashboardError(Exception):
    """A request the dashboard views cannot answer: ``status`` 404 or 422, ``loc`` the field."""

    def __init__(self, status: int, message: str, loc: tuple[str | int, ...] = ()):
        self.status, self.message, self.loc = status, message, tuple(loc)
        super().__init__(message)


# ----------------------------------------------------------------------------- specs


def _full_hash(session: Session, spec_hash: str, where: str) -> str | None:
    """A spec hash or a 12+ hex prefix as the full hash (:func:`service.spec_store.resolve_hash`);
    DashboardError 422 (malformed) or 409 (ambiguous prefix) naming ``spec_hash``."""
    try:
        return spec_store.resolve_hash(session, spec_hash)
    except spec_store.AmbiguousHash as err:
        raise DashboardError(409, err.message, (where, "spec_hash")) from None
    except SpecError as err:
        raise DashboardError(422, err.message, (where, "spec_hash")) from None


def _spec_record(session: Session, spec_hash: str) -> SpecRecord:
    full = _full_hash(session, spec_hash, "path")
    rec = session.get(SpecRecord, full) if full is not None else None
    if rec is None:
        raise DashboardError(404, f"no spec with hash {spec_hash}", ("path", "spec_hash"))
    return rec


@lru_cache(maxsize=128)
def _loaded(source: str) -> tuple[Any, Any]:
    """(Spec, Derivation) for a stored spec's source; cached, since both are pure functions of it."""
    from fuser_core import derive_cascade, load_spec

    spec = load_spec(source)
    return spec, derive_cascade(spec)


@lru_cache(maxsize=128)
def _math(source: str) -> str:
    """The LaTeX view as JSON text (cached as text so callers can never mutate the cached value)."""
    from service.dashboard.mathtex import derivation_math

    _, derivation = _loaded(source)
    return json.dumps(derivation_math(derivation))


def spec_names(session: Session, hashes: list[str]) -> dict[str, dict[str, Any]]:
    """For each known spec hash: its name and its dims' names (canonical -> as first stored).

    Job and kernel shapes are stored under canonical dim names (``d0``); pages show them in the
    spec's own names (:class:`service.dim_names.DimNames`), one request per page of rows.
    """
    wanted = sorted({h for h in hashes if HASH_RE.match(h)})
    if len(wanted) > MAX_NAMES:
        raise DashboardError(422, f"at most {MAX_NAMES} hashes per request", ("query", "hash"))
    if not wanted:
        return {}
    rows = session.execute(sa.select(SpecRecord.spec_hash, SpecRecord.name, SpecRecord.source)
                           .where(SpecRecord.spec_hash.in_(wanted))).all()
    out = {}
    for row in rows:
        out[row.spec_hash] = {"name": row.name, "dims": DimNames.of_source(row.source).user_dims()}
    return out


def spec_math(session: Session, spec_hash: str) -> dict[str, Any]:
    """The spec as submitted, its derivation as LaTeX per reduction, and its certificate."""
    rec = _spec_record(session, spec_hash)
    out = json.loads(_math(rec.source))
    report = rec.derivation or {}
    out.update(
        spec_hash=rec.spec_hash,
        name=rec.name,
        spec=json.loads(rec.source),
        certificate=report.get("certificate"),
        report_reductions=report.get("reductions", []),
        created_at=rec.created_at.isoformat() if rec.created_at else None,
    )
    return out


def _query_value(parse: Any, text: str) -> Any:
    """A query parameter or stored text read by one of :mod:`service.bundle`'s text readers
    (``parse_shape_text``, ``parse_dtype_text``); DashboardError naming the parameter otherwise."""
    from fuser_core import SpecError

    try:
        return parse(text)
    except SpecError as err:
        raise DashboardError(422, err.message, ("query", *err.loc)) from None


def spec_source(
    session: Session, spec_hash: str, *, strategy: str | None = None, shape: str | None = None,
    dtype: str | None = None,
) -> dict[str, Any]:
    """Generated Triton source for the spec.

    Defaults: the shape, dtype, strategy and configuration of the spec's newest kernel (the
    tuned source), else the newest job's shape and dtype with the preferred valid strategy and
    its default configuration, else ``DEFAULT_DIM`` per dim in float32.
    """
    from fuser_core import (
        FALLBACK, GENERATOR_VERSION, PREFERENCE, NotValid, SpecError, bind_dtypes, bind_shape, default_config, generate,
        valid_strategies,
    )
    from service.bundle import parse_dtype_text, parse_shape_text

    rec = _spec_record(session, spec_hash)
    spec_hash = rec.spec_hash  # the full hash, when a prefix was given
    spec, derivation = _loaded(rec.source)
    kernel = session.scalars(
        sa.select(KernelRecord).where(KernelRecord.spec_hash == spec_hash, KernelRecord.partial == sa.false())
        .order_by(KernelRecord.created_at.desc()).limit(1)
    ).first()
    job = None
    if kernel is None:
        job = session.scalars(
            sa.select(Job).where(Job.spec_hash == spec_hash).order_by(Job.created_at.desc()).limit(1)
        ).first()
    origin = kernel or job
    # stored shapes and tuned configs use the canonical dim names (service.spec_store); show the spec's own
    names = DimNames.of_source(rec.source)
    raw_shape: Mapping[str, int] = (
        _query_value(parse_shape_text, shape) if shape else names.user_shape(origin.shape) if origin is not None
        else {d: DEFAULT_DIM for d in spec.dims if not any(s.as_dim == d for s in spec.steps)}
    )
    raw_dtype: str | dict[str, str] = (
        _query_value(parse_dtype_text, dtype) if dtype else _query_value(parse_dtype_text, origin.dtype)
        if origin is not None else "float32"
    )
    fallback_note = ""
    try:
        bound = bind_shape(spec, raw_shape)
    except SpecError as err:
        if shape:
            raise DashboardError(422, err.message, ("query", *err.loc)) from None
        # a stored shape the generator cannot take (larger than the reference's limits): show the code anyway
        fallback_note = f"The stored shape cannot be generated here ({err}); showing {DEFAULT_DIM} per dim. "
        bound = bind_shape(spec, {d: DEFAULT_DIM for d in spec.dims if not any(s.as_dim == d for s in spec.steps)})
        kernel = None
    try:
        dtypes = bind_dtypes(spec, raw_dtype)
    except SpecError as err:
        raise DashboardError(422, err.message, ("query", *err.loc)) from None
    valid = valid_strategies(spec, derivation, bound)
    module = None
    if kernel is not None and not shape and not dtype and strategy in (None, kernel.strategy):
        module, config = _tuned_module(spec, derivation, kernel, bound, dtypes, names)
    if module is not None:
        assert kernel is not None
        chosen, kernel_id = kernel.strategy, kernel.id
        note = f"The tuned kernel {kernel.id[:12]} ({kernel.time_ms:.4g} ms, {kernel.measurer})."
    else:
        kernel_id = None
        chosen = strategy or next((s for s in PREFERENCE if valid.get(s) is None), FALLBACK)
        if chosen not in valid:
            raise DashboardError(422, f"unknown strategy {chosen!r}; one of {', '.join(valid)}", ("query", "strategy"))
        if valid[chosen] is not None:
            raise DashboardError(422, f"{chosen} is not valid here: {valid[chosen]}", ("query", "strategy"))
        config = default_config(spec, derivation, chosen, bound)
        note = fallback_note + "The strategy's default configuration (before tuning)."
        try:
            module = generate(spec, derivation, chosen, bound, config, dtypes)
        except (NotValid, ValueError) as err:
            raise DashboardError(422, str(err), ("query", "strategy")) from None
    return {
        "spec_hash": spec_hash,
        "strategy": chosen,
        "strategies": valid,
        "shape": bound,
        "dtype_key": raw_dtype if isinstance(raw_dtype, str) else json.dumps(raw_dtype, sort_keys=True),
        "config": config.to_dict(),
        "generator_version": GENERATOR_VERSION,
        "kernel_id": kernel_id,
        "note": note,
        "source": module.source,
    }


def _tuned_module(spec: Any, derivation: Any, kernel: KernelRecord, bound: dict[str, int], dtypes: dict[str, str],
                  names: DimNames) -> tuple[Any, Any]:
    """(module, config) of a stored kernel's strategy and configuration (its blocks renamed from the
    canonical dims), or (None, None) when this code cannot generate it (an older generator's config)."""
    from fuser_core import KernelConfig, NotValid, generate

    raw = dict(kernel.config or {})
    raw["blocks"] = names.user_shape(raw.get("blocks") or {})
    try:
        config = KernelConfig.from_dict(raw)
        return generate(spec, derivation, kernel.strategy, bound, config, dtypes), config
    except (NotValid, ValueError, KeyError):
        return None, None


# ----------------------------------------------------------------------------- kernels

_CHAIN_KEYS = (BASELINE, f"{BASELINE}_ms", "chain", "unfused")
_COMPILE_KEYS = ("torch_compile", "torch.compile", "torch_compile_ms", "compile", "inductor")
_PREDICTION_KEYS = ("predicted_ms", "model_ms", "model", "prediction", "predicted")


def _baseline(baselines: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[float, bool] | None:
    """(time_ms, predicted) of the first baseline present under one of ``keys``.

    A baseline is a number of milliseconds, or an object with ``time_ms`` (or ``ms``) and
    optionally ``predicted``; anything else (a failure note, NaN) counts as not measured.
    """
    for key in keys:
        value = baselines.get(key)
        predicted = False
        if isinstance(value, Mapping):
            predicted = bool(value.get("predicted", False))
            value = value.get("time_ms", value.get("ms"))
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
            return float(value), predicted
    return None


def speedups(kernel: KernelRecord) -> dict[str, Any]:
    """Speedup over the unfused chain and over torch.compile, where a baseline was stored."""
    base = kernel.baselines or {}
    out: dict[str, Any] = {}
    for name, keys in ((BASELINE, _CHAIN_KEYS), ("torch_compile", _COMPILE_KEYS)):
        found = _baseline(base, keys)
        if found is not None and kernel.time_ms and kernel.time_ms > 0:
            ms, predicted = found
            out[name] = {"baseline_ms": ms, "speedup": ms / kernel.time_ms, "predicted": predicted or kernel.predicted}
    return out


def prediction(kernel: KernelRecord) -> dict[str, Any]:
    """The model's prediction next to the measurement (a model-measured kernel is only a prediction)."""
    if kernel.predicted:
        return {"predicted_ms": kernel.time_ms, "measured_ms": None}
    found = _baseline(kernel.baselines or {}, _PREDICTION_KEYS)
    return {"predicted_ms": found[0] if found else None, "measured_ms": kernel.time_ms}


def kernel_rows(
    session: Session, *, spec_hash: str | None = None, target: str | None = None, dtype: str | None = None,
    limit: int = 50, offset: int = 0,
) -> list[dict[str, Any]]:
    """The kernel cache, newest first, with the spec's name, speedups and prediction vs measurement
    (finished kernels: a failed job's partial one is shown on its job's page)."""
    if spec_hash:
        spec_hash = _full_hash(session, spec_hash, "query")
        if spec_hash is None:  # no stored spec has that prefix
            return []
    limit = max(1, min(int(limit), MAX_LIMIT))
    query = (sa.select(KernelRecord, SpecRecord.name).join(SpecRecord, SpecRecord.spec_hash == KernelRecord.spec_hash)
             .where(KernelRecord.partial == sa.false()))
    if spec_hash:
        query = query.where(KernelRecord.spec_hash == spec_hash)
    if target:
        query = query.where(KernelRecord.target == target)
    if dtype:
        query = query.where(KernelRecord.dtype == dtype)
    query = query.order_by(KernelRecord.created_at.desc(), KernelRecord.id).limit(limit).offset(max(0, int(offset)))
    rows = []
    for kernel, name in session.execute(query):
        rows.append({
            "id": kernel.id, "spec_hash": kernel.spec_hash, "spec_name": name, "shape": kernel.shape,
            "shape_key": kernel.shape_key, "dtype": kernel.dtype, "target": kernel.target, "strategy": kernel.strategy,
            "config": kernel.config, "time_ms": kernel.time_ms, "measurer": kernel.measurer,
            "predicted": kernel.predicted, "baselines": kernel.baselines, "speedups": speedups(kernel),
            "prediction": prediction(kernel), "bundle_sha256": kernel.bundle_sha256, "job_id": kernel.job_id,
            "triton_version": kernel.triton_version, "generator_version": kernel.generator_version,
            "created_at": kernel.created_at.isoformat() if kernel.created_at else None,
            "bundle_url": f"/v1/kernels/{kernel.id}/bundle",
        })
    return rows


# ----------------------------------------------------------------------------- catalog and form choices


def catalog_entries() -> list[dict[str, Any]]:
    """The catalog's specs that load (:mod:`fuser_core.catalog`: $FOLDWISE_CATALOG_DIR's folders,
    then the packaged catalog), by name, each with its suite cases (shape, dtype), then its example shape."""
    from fuser_core import catalog_dirs, catalog_entries as entries

    dirs = catalog_dirs()
    found = entries(dirs)
    stamp = tuple((str(e.path), _mtime(e.path)) for e in found) + tuple(
        (str(d / "suites.json"), _mtime(d / "suites.json")) for d in dirs)
    return json.loads(_catalog_json(tuple(str(d) for d in dirs), stamp))


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


@lru_cache(maxsize=4)
def _catalog_json(dirs: tuple[str, ...], stamp: tuple[tuple[str, float], ...]) -> str:
    """The catalog as JSON, cached on the files' modification times (``stamp``)."""
    from fuser_core import (
        CatalogError, SpecError, catalog_entries as entries, load_spec, load_suites, spec_hash, spec_source,
    )

    paths = [Path(d) for d in dirs]
    try:
        suites = load_suites(paths)
    except CatalogError:
        suites = {}  # a broken suites file costs the form its shapes, not its specs
    cases: dict[str, list[dict[str, Any]]] = {}
    for suite in ("smoke", *sorted(k for k in suites if k != "smoke")):
        for case in suites.get(suite, []):
            if isinstance(case, dict) and isinstance(case.get("spec"), str):
                cases.setdefault(case["spec"], []).append({
                    "suite": suite, "shape": case.get("shape"), "dtype": case.get("dtype", "float32"),
                    "note": case.get("note")})
    out = []
    for entry in entries(paths):
        try:
            source = spec_source(entry.path)
            spec = load_spec(source)
        except (CatalogError, SpecError, ValueError):
            continue  # not a spec: a user's catalog folder may hold other JSON
        example = [{"suite": "example", "shape": spec.example, "dtype": "float32", "note": "the spec's own"}]
        out.append({"name": entry.name, "file": entry.path.name, "doc": entry.doc, "spec_hash": spec_hash(spec),
                    "spec": json.loads(source), "cases": cases.get(entry.name, []) + (example if spec.example else [])})
    return json.dumps(out)


def form_options(session: Session, *, max_trials: int, max_seconds: float, default_target: str) -> dict[str, Any]:
    """Targets, measurers and dtypes the submit form offers, defaulting to what live workers run."""
    from fuser_core import FLOAT_DTYPES
    from service.tuning_request import MEASURERS, known_targets, measurer_kind

    workers = session.execute(sa.select(WorkerRecord.target, WorkerRecord.measurer)
                              .order_by(WorkerRecord.last_heartbeat.desc()).limit(50)).all()
    measurers = sorted(MEASURERS, key=lambda m: measurer_kind(m).on_device)  # the model first: it needs no GPU
    default_measurer = workers[0].measurer if workers and workers[0].measurer in measurers else "model"
    targets = known_targets()
    target = workers[0].target if workers and workers[0].target in targets else default_target
    return {
        "targets": targets,
        "default_target": target if target in targets else min(targets),
        "measurers": measurers,
        "default_measurer": default_measurer,
        "dtypes": list(FLOAT_DTYPES[:3]),
        "max_trials": max_trials,
        "max_seconds": max_seconds,
    }
