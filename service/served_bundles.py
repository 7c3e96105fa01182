"""Format-2 bundles precomputed at store time, so a ``?format=2[&arch=]`` download is one
indexed read (``served_bundles``; service.models.ServedBundle).

A format-2 bundle is a function of the stored format-1 bundle and its stored binaries
(:func:`service.bundle.bundle_v2`); it changes only when one of them is stored. So the writers
build every view then: :func:`service.kernel_cache.store_kernel` when it stores a new bundle
(no binaries yet), :func:`service.binaries.store_variant` when it stores a binary, and
migration 0004 for the bundles stored before it. The views of one bundle:

- ``"2"``: with every stored arch (``?format=2``);
- ``"2:<arch>"``: with that arch's binary only (``?arch=sm_90a``);
- ``"2:none"``: with no binaries (``?arch=`` of an arch that has none).

A served row is checked against its own hash before its bytes are first served
(:func:`served_bytes`), like a format-1 bundle.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from service.bundle import BundleError, bundle_sha256, bundle_v2, canonical_bytes
from service.errors import BundleCorrupted
from service.models import ServedBundle, utcnow

ALL_ARCHS = "2"
NO_BINARIES = "2:none"


def view_of(arch: str | None) -> str:
    """The view a request asks for: ``?format=2`` -> ``"2"``, ``?arch=X`` -> ``"2:X"``."""
    return ALL_ARCHS if arch is None else f"2:{arch}"


def served_views(bundle: Mapping[str, Any], variants: Mapping[str, dict]) -> dict[str, tuple[str, bytes]]:
    """view -> (sha256, bytes) of every format-2 view of a verified ``bundle`` with its verified
    ``variants`` (arch -> variant)."""
    out = {}
    for view, chosen in ((ALL_ARCHS, variants), (NO_BINARIES, {}),
                         *((view_of(arch), {arch: variants[arch]}) for arch in variants)):
        body = bundle_v2(dict(bundle), chosen)
        out[view] = (body["sha256"], canonical_bytes(body))
    return out


def store_served(session: Session, bundle: Mapping[str, Any], variants: Mapping[str, dict]) -> None:
    """Write (replace) the served views of ``bundle`` (stored, verified) and its ``variants``; flushes."""
    digest = bundle["sha256"]
    views = served_views(bundle, variants)
    rows = {row.view: row for row in session.scalars(
        sa.select(ServedBundle).where(ServedBundle.bundle_sha256 == digest))}
    for view, row in rows.items():
        if view not in views:
            session.delete(row)
    for view, (sha, content) in views.items():
        row = rows.get(view)
        if row is None:
            session.add(ServedBundle(bundle_sha256=digest, view=view, sha256=sha, content=content, size=len(content),
                                     created_at=utcnow()))
        elif row.sha256 != sha or row.content != content:
            row.sha256, row.content, row.size = sha, content, len(content)
    session.flush()


SERVED_QUERY = sa.select(ServedBundle.view, ServedBundle.sha256).where(
    ServedBundle.bundle_sha256 == sa.bindparam("bundle_sha256"),
    ServedBundle.view.in_([sa.bindparam("view"), sa.bindparam("fallback")]))


def choose(rows: list[Any], view: str) -> tuple[str, str] | None:
    """(view, sha256) to serve from the rows of :data:`SERVED_QUERY`: the view asked for, else
    (an arch without a binary) the one without binaries."""
    found = {r[0]: r[1] for r in rows}
    for v in (view, NO_BINARIES):
        if v in found:
            return v, found[v]
    return None


def served_bytes(session: Session, bundle_sha: str, view: str) -> tuple[str, bytes]:
    """(sha256, bytes) of one served view, after re-checking them against their hash."""
    row = session.get(ServedBundle, (bundle_sha, view), populate_existing=True)
    session.commit()
    if row is None:
        raise BundleCorrupted(f"bundle {bundle_sha}: no stored format-2 copy {view!r} (run `foldwise db upgrade`)")
    if not bundle_intact(row.content, row.sha256):
        raise BundleCorrupted(f"stored format-2 bundle {row.sha256} ({view}) of bundle {bundle_sha}: hash mismatch "
                              "(its bytes changed after it was stored); it is not served")
    return row.sha256, row.content


def bundle_intact(content: bytes, digest: str) -> bool:
    """The bytes of a stored bundle (any format) parse, are canonical, name ``digest`` and hash to it."""
    try:
        obj = json.loads(content)
        return (isinstance(obj, dict) and obj.get("sha256") == digest and canonical_bytes(obj) == content
                and bundle_sha256(obj) == digest)
    except (ValueError, BundleError, RecursionError):
        return False
