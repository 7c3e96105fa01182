"""Format-2 and -3 bundles precomputed at store time, so a ``?format=2|3[&arch=]`` download is
one indexed read (``served_bundles``; service.store.models.ServedBundle).

A format-2 or -3 bundle is a function of the stored format-1 bundle and its stored binaries
(:func:`service.bundle.bundle_v2`, :func:`service.bundle.bundle_v3`); it changes only when one of
them is stored. So the writers build every view then: :func:`service.store.kernel_cache.store_kernel`
when it stores a new bundle (no binaries yet), :func:`service.binaries.store_variant` when it
stores a binary, and the migrations for bundles stored before them (0004, 0005:
:func:`rebuild_views`). The views of one bundle, for each format F of 2 and 3:

- ``"F"``: with every stored arch (``?format=F``);
- ``"F:<arch>"``: with that arch's binaries only (``?arch=sm_90a``, format 2 unless ``format=3``);
- ``"F:none"``: with no binaries (``?arch=`` of an arch that has none).

Format 3 carries every Triton version's variant; format 2 one per arch, the newest Triton's
(:func:`service.bundle.newest_per_arch`), as clients written for it expect.

A served row is checked against its own hash before its bytes are first served
(:func:`served_bytes`), like a format-1 bundle.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from service.bundle import BundleError, bundle_sha256, bundle_v2, bundle_v3, canonical_bytes, newest_per_arch
from service.errors import BundleCorrupted
from service.store.models import ServedBundle, utcnow

FORMATS = (2, 3)


def view_of(arch: str | None, format: int = 2) -> str:
    """The view a request asks for: ``?format=2`` -> ``"2"``, ``?arch=X`` -> ``"2:X"``,
    ``?format=3&arch=X`` -> ``"3:X"``."""
    return str(format) if arch is None else f"{format}:{arch}"


def no_binaries(view: str) -> str:
    """The view without binaries of ``view``'s format: what an arch without a binary is served."""
    return f"{view.split(':')[0]}:none"


def served_views(bundle: Mapping[str, Any], variants: list[dict]) -> dict[str, tuple[str, bytes]]:
    """view -> (sha256, bytes) of every format-2 and -3 view of a verified ``bundle`` with its
    verified ``variants`` (any number per arch, one per Triton version)."""
    archs = sorted({v["arch"] for v in variants})
    newest = newest_per_arch(variants)
    bodies = [("2", bundle_v2(dict(bundle), newest)), ("2:none", bundle_v2(dict(bundle), {})),
              *((view_of(a), bundle_v2(dict(bundle), {a: newest[a]})) for a in archs),
              ("3", bundle_v3(dict(bundle), variants)), ("3:none", bundle_v3(dict(bundle), [])),
              *((view_of(a, 3), bundle_v3(dict(bundle), [v for v in variants if v["arch"] == a])) for a in archs)]
    return {view: (body["sha256"], canonical_bytes(body)) for view, body in bodies}


def rebuild_views(conn: sa.Connection) -> None:
    """Every stored bundle's served views, rebuilt from the stored bundle and binaries with
    Core statements only (the migrations' use): a bundle whose bytes do not verify gets none (it
    is not served in any format), a binary whose bytes do not hash to its row is left out."""
    import hashlib

    from service.bundle import verify_variant

    bundles = sa.table("bundles", sa.column("sha256", sa.String), sa.column("content", sa.LargeBinary))
    binaries = sa.table("kernel_binaries", sa.column("bundle_sha256", sa.String), sa.column("arch", sa.String),
                        sa.column("content", sa.LargeBinary), sa.column("sha256", sa.String))
    served = ServedBundle.__table__
    conn.execute(sa.delete(served))
    now = utcnow()
    for sha, content in conn.execute(sa.select(bundles.c.sha256, bundles.c.content)).all():
        if not bundle_intact(content, sha):
            continue
        variants = []
        for raw, raw_sha in conn.execute(sa.select(binaries.c.content, binaries.c.sha256)
                                         .where(binaries.c.bundle_sha256 == sha)).all():
            try:
                if hashlib.sha256(raw).hexdigest() != raw_sha:
                    continue
                variant = json.loads(raw)
                verify_variant(variant)
            except (ValueError, BundleError):
                continue
            variants.append(variant)
        rows = [{"bundle_sha256": sha, "view": view, "sha256": digest, "content": body, "size": len(body),
                 "created_at": now} for view, (digest, body) in served_views(json.loads(content), variants).items()]
        conn.execute(sa.insert(served), rows)


def store_served(session: Session, bundle: Mapping[str, Any], variants: list[dict]) -> None:
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
