"""Compiled variants of stored bundles (issues 15, 25), server side: compile, store, read.

A bundle's kernels are compiled for any fleet target (its own by default: sm_90 for h100,
gfx942 for mi300x) with Triton's GPU compiler, which needs no GPU
(:mod:`fuser_core.codegen.gpu_compile`), in compile-pool workers (the interpreter must be off
there). The result is a *variant* (:func:`service.bundle.make_variant`: cubins for an NVIDIA
arch, hsaco for an AMD one) stored in ``kernel_binaries`` beside the bundle, one per (arch,
Triton version): a binary belongs to the Triton that compiled it (its launcher, its cache key,
its ptxas or AMD backend), and workers on different Tritons (a GPU image's, the server's) each
store their own. Served in format-2 bundles (one per arch, the newest Triton's) and format-3
bundles (all): a bundle carries a binary per arch built. The ``ptxas_version`` column holds
the variant's compiler version (:func:`service.bundle.variant_compiler`: ptxas's for a cubin,
the AMD backend's for an hsaco). Not imported by the client.

Also here: which variant a finished job stores (:func:`job_variant`: the cuda measurer's
measured binary, else the host compile), one binary served on its own (:func:`kernel_binaries`,
:func:`binary_file`, the routes in service/api/routes_kernels.py) and the backfill of kernels
stored without a binary of this host's Triton (:func:`backfill`, ``foldwise binaries
backfill``). A request never compiles: the backfill is a command, so a download stays bounded
in time.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import sqlalchemy as sa
from sqlalchemy.orm import Session

from service.store import kernel_cache
from service.errors import BundleCorrupted, NotFound
from service.store.served_bundles import bundle_intact, store_served
from service.bundle import (KINDS, BundleError, canonical_bytes, make_variant, newest_per_arch, triton_version_key,
                            variant_compiler, variant_kind, verify_variant)
from service.store.models import Bundle, KernelRecord, KernelBinary, utcnow

if TYPE_CHECKING:
    from tuner import Measurer

log = logging.getLogger("foldwise.binaries")
MAX_TRITON_VERSION_CHARS = KernelBinary.__table__.c.triton_version.type.length  # part of the row's key


def compile_request_for(bundle: Mapping[str, Any], target: Any) -> Any:
    """The CompileRequest that generates exactly ``bundle``'s module (its canonical spec, shape,
    dtypes, strategy and config) for ``target`` (a :class:`fuser_core.Target`)."""
    from fuser_core import CompileRequest, bind_dtypes, load_spec

    canon = load_spec(bundle["spec"], printed=True)
    return CompileRequest(canon, dict(bundle["shape"]), bind_dtypes(canon, bundle["dtype"]), bundle["strategy"],
                          dict(bundle["config"]), target=target)


def compile_variant(bundle: Mapping[str, Any], arch: str | None = None, *, pool: Any = None) -> dict:
    """Compile ``bundle`` for ``arch`` (any arch Target.parse reads: "sm_89", "gfx950"; default
    its target's: sm_90 for h100, gfx942 for mi300x) -> a variant (cubin or hsaco).

    ``pool``: a CompilePool (default the process's shared one, tuner.compile_gate)."""
    from fuser_core import Target
    from tuner import get_profile, shared_compile_pool

    target = Target.parse(arch) if arch is not None else get_profile(bundle["target"]).target
    [artifacts] = (pool or shared_compile_pool()).artifacts([compile_request_for(bundle, target)])
    return make_variant(artifacts)


def measured_binary_of(measurer: Measurer, strategy: str, config: Mapping[str, Any]) -> dict | None:
    """With a GPU measurer, the compiled kernels of the winning candidate as it measured them
    (:meth:`tuner.Measurer.measured_binary`), read before the measurer closes; None for another
    measurer (a prediction, the interpreter), or when they cannot be had (logged: the host compile follows)."""
    if measurer.name != "cuda":  # the tuner's device measurer on a GPU (on the CPU it is "cuda-interpreter")
        return None
    try:
        return measurer.measured_binary(strategy, config)
    except Exception as err:  # noqa: BLE001 - job_variant's host compile is the fallback
        log.warning("measured binary not available, the kernel is compiled on this host instead",
                    extra={"error": str(err)[:500]})
        return None


def job_variant(bundle: Mapping[str, Any], measured: Mapping[str, Any] | None = None, *, pool: Any = None) -> dict:
    """The variant a finished job stores for its bundle: the ``measured`` artifacts of a cuda
    measurer (:func:`measured_binary_of`) when there are some, else the bundle compiled on this
    host for its target's arch (no GPU needed)."""
    if measured is not None:
        return make_variant(measured)
    return compile_variant(bundle, pool=pool)


def store_variant(session: Session, bundle_sha256: str, variant: dict) -> KernelBinary:
    """Store (or replace) the variant of a stored bundle for its arch and Triton version, and
    rebuild the bundle's served format-2 and -3 copies (service.store.served_bundles); flushes, does
    not commit."""
    verify_variant(variant)
    stored = session.get(Bundle, bundle_sha256)
    if stored is None:
        raise LookupError(f"bundle_sha256: no stored bundle {bundle_sha256:.64}")
    content = canonical_bytes(variant)
    values = {"content": content, "sha256": hashlib.sha256(content).hexdigest(), "size": len(content),
              "triton_version": variant["triton_version"], "ptxas_version": variant_compiler(variant)[:128],
              "created_at": utcnow()}
    if len(variant["triton_version"]) > MAX_TRITON_VERSION_CHARS:  # part of the key: never cut short
        raise BundleError(f"triton_version: longer than {MAX_TRITON_VERSION_CHARS} characters")
    row = session.get(KernelBinary, (bundle_sha256, variant["arch"], variant["triton_version"]))
    if row is None:
        row = KernelBinary(bundle_sha256=bundle_sha256, arch=variant["arch"], **values)
        session.add(row)
    else:
        for k, v in values.items():
            setattr(row, k, v)
    session.flush()
    if not bundle_intact(stored.content, bundle_sha256):
        raise BundleCorrupted(f"stored bundle {bundle_sha256}: hash mismatch; its format-2 copies are not rebuilt")
    store_served(session, json.loads(stored.content), stored_variants(session, bundle_sha256))
    return row


def stored_variants(session: Session, bundle_sha256: str, arch: str | None = None) -> list[dict]:
    """The variants of a bundle (one arch's, or all), by arch then Triton version (oldest first);
    a row whose bytes no longer hash to its sha256, or whose binaries do not verify, is left out
    (logged): it is never served."""
    query = session.query(KernelBinary).filter(KernelBinary.bundle_sha256 == bundle_sha256)
    if arch is not None:
        query = query.filter(KernelBinary.arch == arch)
    out = []
    for row in query.order_by(KernelBinary.arch, KernelBinary.triton_version):
        try:
            if hashlib.sha256(row.content).hexdigest() != row.sha256:
                raise BundleError("stored bytes do not hash to the row's sha256")
            variant = json.loads(row.content)
            verify_variant(variant, f"binaries.{row.arch}")
        except (ValueError, BundleError) as err:
            log.error("corrupted kernel binary not served",
                      extra={"bundle_sha256": bundle_sha256, "arch": row.arch, "triton_version": row.triton_version,
                             "error": str(err)})
            continue
        out.append(variant)
    return sorted(out, key=lambda v: (v["arch"], triton_version_key(v["triton_version"])))


def variant_summaries(session: Session, bundle_sha256: str) -> list[dict[str, Any]]:
    """What the dashboard shows per stored variant: arch, binary kind, versions, and per kernel
    its name, binary size and sha256, assembly size and sha256, registers, spills and shared
    memory (no binary bytes). Fields are named by the kind: ``cubin_size``/``ptx_chars`` for a
    cubin variant (as before AMD targets), ``hsaco_size``/``amdgcn_chars`` for an hsaco one;
    ``binary_kind`` and ``asm_kind`` say which."""
    out = []
    for v in stored_variants(session, bundle_sha256):
        kind = variant_kind(v)
        b, asm = kind.name, kind.asm
        out.append({"arch": v["arch"], "binary_kind": b, "asm_kind": asm, "triton_version": v["triton_version"],
                    kind.compiler: v[kind.compiler],
                    "kernels": [{"index": n, "name": k["name"], f"{b}_size": k[f"{b}_size"],
                                 f"{b}_sha256": k[f"{b}_sha256"], f"{asm}_chars": len(k[asm]),
                                 f"{asm}_sha256": hashlib.sha256(k[asm].encode()).hexdigest(),
                                 "registers": k.get("registers"), "spill_bytes": k.get("spill_bytes"),
                                 "shared_bytes": k.get("shared_bytes"), "num_warps": k["metadata"].get("num_warps")}
                                for n, k in enumerate(v["kernels"])]})
    return out


# ----------------------------------------------------------------------------- single binaries (API)

# file extension -> media type of what one binary route serves: a binary kind or its assembly text
BINARY_KINDS = {**{k.name: "application/octet-stream" for k in KINDS.values()},
                **{k.asm: "text/plain; charset=utf-8" for k in KINDS.values()}}


def binaries_path(kernel_id: str, arch: str, name: str, kind: str, triton_version: str | None = None) -> str:
    """The API path that serves one binary (:func:`binary_file`); one place for its shape."""
    query = f"?triton_version={quote(triton_version, safe='')}" if triton_version is not None else ""
    return f"/v1/kernels/{kernel_id}/binaries/{arch}/{name}.{kind}{query}"


def kernel_binaries(session: Session, kernel_id: str) -> dict[str, Any]:
    """``GET /v1/kernels/{id}/binaries``: the kernel's stored variants (:func:`variant_summaries`),
    each kernel with the paths of its binary and assembly downloads (``cubin_path`` and
    ``ptx_path``, or ``hsaco_path`` and ``amdgcn_path``). No variant stored: ``variants`` []."""
    kernel = kernel_cache.get_kernel(session, kernel_id)
    variants = variant_summaries(session, kernel.bundle_sha256)
    for v in variants:
        for k in v["kernels"]:
            for kind in (v["binary_kind"], v["asm_kind"]):
                k[f"{kind}_path"] = binaries_path(kernel_id, v["arch"], k["name"], kind, v["triton_version"])
    return {"kernel_id": kernel_id, "bundle_sha256": kernel.bundle_sha256, "target": kernel.target,
            "variants": variants}


def binary_file(session: Session, kernel_id: str, arch: str, name: str, kind: str,
                triton_version: str | None = None) -> tuple[str, bytes]:
    """(sha256, bytes) of one stored binary of a kernel: the cubin or hsaco (its verified
    ``cubin_sha256``/``hsaco_sha256``) or the PTX or AMDGCN text of kernel ``name`` in the
    ``arch`` variant built by ``triton_version`` (None: the newest Triton's, as format 2 serves).
    Raises NotFound naming what is missing (a kind the arch's variant does not hold included)."""
    if kind not in BINARY_KINDS:
        raise NotFound(f"kind: {kind!r:.20} is not one of {', '.join(BINARY_KINDS)}")
    kernel = kernel_cache.get_kernel(session, kernel_id)
    variants = stored_variants(session, kernel.bundle_sha256, arch)
    if not variants:
        raise NotFound(f"arch: kernel {kernel_id} has no stored {arch:.16} binary")
    if triton_version is None:
        variant = newest_per_arch(variants)[arch]
    else:
        variant = next((v for v in variants if v["triton_version"] == triton_version), None)
        if variant is None:
            raise NotFound(f"triton_version: kernel {kernel_id} has no {arch} binary built by Triton "
                           f"{triton_version!r:.64}; stored: {', '.join(v['triton_version'] for v in variants)}")
    held = variant_kind(variant)
    if kind not in (held.name, held.asm):
        raise NotFound(f"kind: the {arch} variant holds {held.name} and {held.asm}, not {kind}")
    found = [(k, b) for k, b in zip(variant["kernels"], verify_variant(variant)) if k["name"] == name]
    if not found:
        raise NotFound(f"name: the {arch} variant of kernel {kernel_id} has no kernel {name!r:.160}; "
                            f"it has {', '.join(k['name'] for k in variant['kernels'])}")
    entry, binary = found[0]
    if kind == held.name:
        return entry[f"{held.name}_sha256"], binary
    text = entry[held.asm].encode()
    return hashlib.sha256(text).hexdigest(), text


# ----------------------------------------------------------------------------- backfill


def bundles_without_binaries(session: Session, limit: int | None = None, *,
                             triton_version: str | None = None) -> list[str]:
    """sha256 of the bundles that kernels serve and that have no stored variant (kernels stored
    before migration 0003, or whose compile failed), or none built by ``triton_version`` when it
    is given, oldest kernel first."""
    joined = KernelBinary.bundle_sha256 == KernelRecord.bundle_sha256
    if triton_version is not None:
        joined = sa.and_(joined, KernelBinary.triton_version == triton_version)
    query = (sa.select(KernelRecord.bundle_sha256).outerjoin(KernelBinary, joined)
             .where(KernelBinary.bundle_sha256.is_(None)).group_by(KernelRecord.bundle_sha256)
             .order_by(sa.func.min(KernelRecord.created_at)))
    if limit is not None:
        query = query.limit(limit)
    return list(session.execute(query).scalars())


def backfill(sessions: Any, *, limit: int | None = None, pool: Any = None,
             progress: Any = None) -> dict[str, int]:
    """Compile and store the binaries of every served bundle that has none built by this host's
    Triton (for its target's arch): ``foldwise binaries backfill``, run where each Triton version
    a client runs is installed (a GPU worker stores its own Triton's with the job). One bundle at
    a time, each committed on its own; a bundle that does not compile is logged, counted and
    skipped (it stays served as source, or with the other Tritons' binaries).
    ``sessions``: a session factory. ``progress(sha256, outcome, detail)`` is told each one."""
    import triton  # the version compile_artifacts records in the variant (the pool runs this same Triton)

    with sessions() as session:
        todo = bundles_without_binaries(session, limit, triton_version=triton.__version__)
    counts = {"stored": 0, "failed": 0}
    for sha in todo:
        with sessions() as session:
            try:
                kernel = session.execute(sa.select(KernelRecord).where(KernelRecord.bundle_sha256 == sha).limit(1)).scalar_one()
                content = kernel_cache.get_bundle_bytes(session, kernel)  # re-hashed: a corrupted bundle is skipped
                variant = compile_variant(json.loads(content), pool=pool)
                store_variant(session, sha, variant)
                session.commit()
                outcome, detail = "stored", f"{variant['arch']} (Triton {variant['triton_version']})"
            except Exception as err:  # noqa: BLE001 - one bad bundle must not stop the others
                session.rollback()
                log.warning("backfill: kernel binary not stored", extra={"bundle_sha256": sha, "error": str(err)})
                outcome, detail = "failed", f"{type(err).__name__}: {err}"
        counts[outcome] += 1
        if progress is not None:
            progress(sha, outcome, detail)
    return counts
