"""The spec store: every submitted spec, stored once by its ``spec_hash`` with its derivation.

**Names.** Everything stored is keyed in the *canonical* spec's names (dims ``d0, d1, ...``;
inputs keep their names), as bundles are (:mod:`service.bundle`): two specs with the same
``spec_hash`` may name or order their dims differently, and a shape keyed by the submitter's
names could then select another shape's kernel. So ``Job.shape``, ``Kernel.shape`` and their
``shape_key`` (``"d0=4,d1=300"``) are canonical, and the spec a worker tunes is
:func:`job_spec` (the canonical spec). :func:`display_shape` translates a canonical shape back
to the names of the spec as first stored, for people (:class:`service.dim_names.DimNames`).

Every function here ends its transaction (commit, or rollback on error).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.orm import Session

from fuser_core import Spec, canonical_json, load_spec, spec_hash as compute_spec_hash
from service.db import RETRIES, committed, get_row
from service.dim_names import DimNames
from service.errors import InvalidRequest, JobError
from service.models import SpecRecord


def job_spec(record: SpecRecord) -> Spec:
    """The spec whose dim names a job's ``shape`` uses: the canonical spec."""
    return load_spec(record.canonical, printed=True)


def display_shape(record: SpecRecord, shape: Mapping[str, int]) -> dict[str, int]:
    """A canonical shape in the dim names of the spec as first stored (``record.source``)."""
    return DimNames.of_source(record.source).user_shape(shape)


def ensure_spec(session: Session, spec: Spec, source: str) -> SpecRecord:
    """The stored record of ``spec`` (by spec_hash), storing it with its derivation report once.

    ``source`` is the spec JSON as submitted; it must parse to the same spec_hash. The
    derivation (seconds, for large specs) is computed outside any transaction; a concurrent
    insert of the same spec is resolved by reading the winner's record. Commits.
    """
    shash = compute_spec_hash(spec)
    record = session.get(SpecRecord, shash)
    session.commit()
    if record is not None:
        return record
    if compute_spec_hash(load_spec(source)) != shash:
        raise InvalidRequest("the spec source does not parse to the spec given", loc=("spec",))
    from fuser_core import derivation_report

    report = derivation_report(spec)
    for _ in range(RETRIES):
        record = session.get(SpecRecord, shash)
        if record is not None:
            session.commit()
            return record
        record = SpecRecord(spec_hash=shash, name=spec.name, canonical=canonical_json(spec), source=source,
                            derivation=report)
        session.add(record)
        if committed(session):
            return record
    raise JobError(f"could not store spec {shash}: concurrent writers kept conflicting")


def uncertified(derivation: Mapping[str, Any]) -> list[str]:
    """The reductions whose fused form the stored derivation's certificate failed ([]: it holds)."""
    cert = derivation.get("certificate") or {}
    if cert.get("holds", True):
        return []
    tolerance = cert.get("tolerance", 1e-9)
    per = cert.get("per_reduction") or {}
    return cert.get("failed") or [k for k, v in per.items() if not v <= tolerance] or list(per)


def refuse_uncertified(spec: Spec, failed: list[str], allow: bool) -> None:
    """A job for a spec whose certificate fails is refused (422, naming the first failed reduction's
    step) unless the request allows it: its fused kernels may compute wrong values."""
    if not failed or allow:
        return
    names = [s.name for s in spec.steps]
    first = failed[0]
    raise InvalidRequest(
        f"the certificate fails for {', '.join(failed)}: the derived fused form disagrees with the step-by-step "
        "float64 reference, so fused kernels may compute wrong values (see `foldwise derive`); set "
        '"allow_uncertified": true to tune anyway', loc=("steps", names.index(first)) if first in names else (),
        step=first)


def get_spec(session: Session, spec_hash: str) -> SpecRecord:
    return get_row(session, SpecRecord, spec_hash, "spec with hash")
