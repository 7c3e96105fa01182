"""What the dashboard's own endpoints return, as plain functions over a Session.

The general API (service.api) serves jobs, trials, workers, kernels and bundles; these are the
few views only the dashboard needs: a spec's derivation as LaTeX, its generated Triton source,
the kernel cache as a table with speedups, the catalog for the submit form, and the choices
the form offers. Routes (:mod:`service.dashboard.api`) stay thin; errors are
:class:`DashboardError` with the request field they concern, so the route answers 404/422 with
a message naming it.

Costs are bounded: a spec was validated when first stored (size and expression limits of
:mod:`fuser_core.spec`), the LaTeX and the generated source are computed off the API's process
(:mod:`service.dashboard.compute`: these functions read only what it needs from the database)
and kept, and listings are paged with a hard limit.
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
from service.store import spec_store
from service.dashboard.compute import DashboardError
from service.dim_names import DimNames
from service.store.models import Job, KernelRecord, SpecRecord, WorkerRecord

MAX_LIMIT = 500
MAX_NAMES = 200
DEFAULT_DIM = 128  # a dim's size for generated source when no job or kernel gives one
HASH_RE = re.compile(r"^[0-9a-f]{64}$")


# ----------------------------------------------------------------------------- specs


def _full_hash(session: Session, spec_hash: str, where: str) -> str | None:
    """A spec hash or a 12+ hex prefix as the full hash (:func:`service.store.spec_store.resolve_hash`);
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
    """What ``GET /v1/specs/{h}/math`` reads: the spec as submitted and its certificate, with its
    stored ``source`` (the LaTeX is :func:`service.dashboard.compute.spec_math` of it, in a child)."""
    rec = _spec_record(session, spec_hash)
    report = rec.derivation or {}
    return {
        "spec_hash": rec.spec_hash,
        "name": rec.name,
        "spec": json.loads(rec.source),
        "certificate": report.get("certificate"),
        "report_reductions": report.get("reductions", []),
        "created_at": rec.created_at.isoformat() if rec.created_at else None,
        "source": rec.source,
    }


def spec_source_query(session: Session, spec_hash: str) -> dict[str, Any]:
    """What ``GET /v1/specs/{h}/source`` reads, as the arguments of
    :func:`service.dashboard.compute.spec_source` (run in a child): the stored spec's text and
    full hash, the newest finished kernel, and the shape and dtype it (or else the newest job)
    ran at."""
    rec = _spec_record(session, spec_hash)
    kernel = session.scalars(
        sa.select(KernelRecord).where(KernelRecord.spec_hash == rec.spec_hash, KernelRecord.partial == sa.false())
        .order_by(KernelRecord.created_at.desc()).limit(1)
    ).first()
    origin: Any = kernel
    if kernel is None:
        origin = session.scalars(
            sa.select(Job).where(Job.spec_hash == rec.spec_hash).order_by(Job.created_at.desc()).limit(1)
        ).first()
    return {
        "source": rec.source,
        "spec_hash": rec.spec_hash,  # the full hash, when a prefix was given
        "origin": {"shape": dict(origin.shape), "dtype": origin.dtype} if origin is not None else None,
        "kernel": None if kernel is None else {"id": kernel.id, "strategy": kernel.strategy,
                                               "config": dict(kernel.config or {}), "time_ms": kernel.time_ms,
                                               "measurer": kernel.measurer},
    }


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
