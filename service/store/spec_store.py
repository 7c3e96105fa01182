"""The spec store: every submitted spec, stored once by its ``spec_hash`` with its derivation.

**Names.** Everything stored is keyed in the *canonical* spec's names (dims ``d0, d1, ...``;
inputs keep their names), as bundles are (:mod:`service.bundle`): two specs with the same
``spec_hash`` may name or order their dims differently, and a shape keyed by the submitter's
names could then select another shape's kernel. So ``Job.shape``, ``KernelRecord.shape`` and their
``shape_key`` (``"d0=4,d1=300"``) are canonical, and the spec a worker tunes is
:func:`job_spec` (the canonical spec). :func:`display_shape` translates a canonical shape back
to the names of the spec as first stored, for people (:class:`service.dim_names.DimNames`).

Every function here ends its transaction (commit, or rollback on error).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from fuser_core import Spec, canonical_json, load_spec, spec_hash as compute_spec_hash
from service.store.db import RETRIES, committed, get_row
from service.dim_names import DimNames
from service.errors import InvalidRequest, JobError
from service.store.models import SpecRecord


def job_spec(record: SpecRecord) -> Spec:
    """The spec whose dim names a job's ``shape`` uses: the canonical spec."""
    return load_spec(record.canonical, printed=True)


def display_shape(record: SpecRecord, shape: Mapping[str, int]) -> dict[str, int]:
    """A canonical shape in the dim names of the spec as first stored (``record.source``)."""
    return DimNames.of_source(record.source).user_shape(shape)


_PARSED: OrderedDict[str, tuple[Spec, str]] = OrderedDict()  # text -> (spec, spec_hash), the last PARSED_ITEMS
PARSED_ITEMS = 256
_PARSED_LOCK = threading.Lock()


def parsed_source(source: str) -> tuple[Spec, str]:
    """(spec, spec_hash) of a spec's JSON text, kept by the text (a spec is a value: the same text
    always parses to the same spec): storing a spec the API has checked compares its text with
    the spec without parsing it again (milliseconds of the API's GIL per new spec, issue 37, 2).
    Raises SpecError for an invalid spec (not kept)."""
    with _PARSED_LOCK:
        hit = _PARSED.get(source)
    if hit is not None:
        return hit
    spec = load_spec(source)
    shash = compute_spec_hash(spec)
    remember_parsed(source, spec, shash)
    return spec, shash


def remember_parsed(source: str, spec: Spec, spec_hash: str) -> None:
    """Keep a parse done elsewhere (the API's spec parser child parses a job's spec: the same text
    gives the same spec in any process) for :func:`parsed_source`."""
    with _PARSED_LOCK:
        _PARSED[source] = (spec, spec_hash)
        _PARSED.move_to_end(source)
        while len(_PARSED) > PARSED_ITEMS:
            _PARSED.popitem(last=False)


def ensure_spec(session: Session, spec: Spec, source: str, spec_hash: str | None = None) -> SpecRecord:
    """The stored record of ``spec`` (by spec_hash; given when the caller has it), storing it with
    its derivation report once.

    ``source`` is the spec JSON as submitted; it must parse to the same spec_hash. The
    derivation (seconds, for large specs) is computed outside any transaction; a concurrent
    insert of the same spec is resolved by reading the winner's record. Commits.
    """
    shash = spec_hash or compute_spec_hash(spec)
    record = session.get(SpecRecord, shash)
    session.commit()
    if record is not None:
        return record
    if parsed_source(source)[1] != shash:
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


# ----------------------------------------------------------------------------- hash prefixes

MIN_PREFIX = 12  # hex characters: 48 bits, so a prefix stays unique far beyond any store's size
HASH_PATTERN = rf"^[0-9a-f]{{{MIN_PREFIX},64}}$"  # a spec hash or a prefix of one, as routes take it
_HASH_RE = re.compile(HASH_PATTERN)


class AmbiguousHash(InvalidRequest):
    """A hash prefix that more than one stored spec starts with; ``matches`` lists some of them."""

    def __init__(self, prefix: str, matches: list[str], *, field: str):
        super().__init__(f"spec hash prefix {prefix} is ambiguous: it starts {', '.join(m[:16] + '...' for m in matches)}; "
                         "give more characters", loc=(field,))
        self.prefix, self.matches = prefix, matches


def resolve_hash(session: Session, text: str, *, field: str = "spec_hash") -> str | None:
    """The full spec hash that ``text`` names: 64 hex characters as they are (stored or not, so
    no read), or a prefix of at least :data:`MIN_PREFIX` hex characters (the CLI prints 16) that
    exactly one stored spec starts with; None when no stored spec does. ``InvalidRequest``
    naming ``field`` for anything else, :class:`AmbiguousHash` when several specs match.
    The one resolver: the API, the dashboard and the CLI all call it. Ends its transaction."""
    text = text.strip().lower()
    if not _HASH_RE.match(text):
        raise InvalidRequest(f"a spec hash is {MIN_PREFIX} to 64 hex characters (a prefix of its sha256); "
                             f"got {text[:80]!r}", loc=(field,))
    if len(text) == 64:
        return text
    # a range on the primary key (an index scan on every backend; LIKE may not use the index)
    found = session.execute(sa.select(SpecRecord.spec_hash)
                            .where(SpecRecord.spec_hash >= text, SpecRecord.spec_hash <= text + "f" * (64 - len(text)))
                            .order_by(SpecRecord.spec_hash).limit(3)).scalars().all()
    session.rollback()
    found = [h for h in found if h.startswith(text)]
    if len(found) > 1:
        raise AmbiguousHash(text, found, field=field)
    return found[0] if found else None
