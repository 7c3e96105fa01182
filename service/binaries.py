"""Compiled variants of stored bundles (issue 15), server side: compile, store, read.

A bundle's kernels are compiled for its target's arch with Triton's GPU compiler, which needs
no GPU (:mod:`fuser_core.codegen.gpu_compile`), in compile-pool workers (the interpreter must
be off there). The result is a *variant* (:func:`service.bundle.make_variant`) stored in
``kernel_binaries`` beside the bundle and served in format-2 bundles. Not imported by the client.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from typing import Any

from sqlalchemy.orm import Session

from service.bundle import BundleError, canonical_bytes, make_variant, verify_variant
from service.models import Bundle, KernelBinary, utcnow

log = logging.getLogger("foldwise.binaries")


def compile_request_for(bundle: Mapping[str, Any], capability: int) -> Any:
    """The CompileRequest that generates exactly ``bundle``'s module (its canonical spec, shape,
    dtypes, strategy and config)."""
    from fuser_core.codegen.gpu_compile import CompileRequest
    from fuser_core.runner import bind_dtypes
    from fuser_core.spec import load_spec

    canon = load_spec(bundle["spec"], printed=True)
    return CompileRequest(canon, dict(bundle["shape"]), bind_dtypes(canon, bundle["dtype"]), bundle["strategy"],
                          dict(bundle["config"]), capability)


def compile_variant(bundle: Mapping[str, Any], arch: str | None = None, *, pool: Any = None) -> dict:
    """Compile ``bundle`` for ``arch`` (default: its target's, e.g. sm_90 for h100) -> a variant.

    ``pool``: a CompilePool (default the process's shared one, tuner.compile_gate)."""
    from fuser_core.codegen.gpu_compile import capability_of
    from tuner.compile_gate import shared_compile_pool
    from tuner.profiles import get_profile

    capability = capability_of(arch or get_profile(bundle["target"]).arch)
    [artifacts] = (pool or shared_compile_pool()).artifacts([compile_request_for(bundle, capability)])
    return make_variant(artifacts)


def store_variant(session: Session, bundle_sha256: str, variant: dict) -> KernelBinary:
    """Store (or replace) the variant of a stored bundle for its arch; flushes, does not commit."""
    verify_variant(variant)
    if session.get(Bundle, bundle_sha256) is None:
        raise LookupError(f"bundle_sha256: no stored bundle {bundle_sha256:.64}")
    content = canonical_bytes(variant)
    values = {"content": content, "sha256": hashlib.sha256(content).hexdigest(), "size": len(content),
              "triton_version": variant["triton_version"][:64], "ptxas_version": variant["ptxas_version"][:128],
              "created_at": utcnow()}
    row = session.get(KernelBinary, (bundle_sha256, variant["arch"]))
    if row is None:
        row = KernelBinary(bundle_sha256=bundle_sha256, arch=variant["arch"], **values)
        session.add(row)
    else:
        for k, v in values.items():
            setattr(row, k, v)
    session.flush()
    return row


def stored_variants(session: Session, bundle_sha256: str, arch: str | None = None) -> dict[str, dict]:
    """arch -> variant of a bundle (one arch, or all); a row whose bytes no longer hash to its
    sha256, or whose cubins do not verify, is left out (logged): it is never served."""
    query = session.query(KernelBinary).filter(KernelBinary.bundle_sha256 == bundle_sha256)
    if arch is not None:
        query = query.filter(KernelBinary.arch == arch)
    out = {}
    for row in query.order_by(KernelBinary.arch):
        try:
            if hashlib.sha256(row.content).hexdigest() != row.sha256:
                raise BundleError("stored bytes do not hash to the row's sha256")
            variant = json.loads(row.content)
            verify_variant(variant, f"binaries.{row.arch}")
        except (ValueError, BundleError) as err:
            log.error("corrupted kernel binary not served",
                      extra={"bundle_sha256": bundle_sha256, "arch": row.arch, "error": str(err)})
            continue
        out[row.arch] = variant
    return out


def variant_summaries(session: Session, bundle_sha256: str) -> list[dict[str, Any]]:
    """What the dashboard shows per stored variant: arch, versions, and per kernel its name,
    cubin size and sha256, registers, spills and shared memory (no binary bytes)."""
    out = []
    for arch, v in stored_variants(session, bundle_sha256).items():
        out.append({"arch": arch, "triton_version": v["triton_version"], "ptxas_version": v["ptxas_version"],
                    "kernels": [{"index": n, "name": k["name"], "cubin_size": k["cubin_size"],
                                 "cubin_sha256": k["cubin_sha256"], "ptx_chars": len(k["ptx"]),
                                 "registers": k.get("registers"), "spill_bytes": k.get("spill_bytes"),
                                 "shared_bytes": k.get("shared_bytes"), "num_warps": k["metadata"].get("num_warps")}
                                for n, k in enumerate(v["kernels"])]})
    return out
