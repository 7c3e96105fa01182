"""``/v1/kernels``: lookup (exact shape, else nearest), kernel views and bundle downloads.

Bundles are served as stored, byte for byte (``application/json``), with
``ETag: "<sha256>"``; ``If-None-Match`` with that tag (or ``*``) answers 304 without a body.
Formats 2 and 3 (``?format=2|3``, ``?arch=``) are stored too, precomputed per view when the
bundle or a binary is stored (service.store.served_bundles). The bytes are re-hashed when first read
from the database and then cached in memory by sha256 (content addressed, so never stale); the
per-request database work is one indexed lookup of the kernel's current bundle (formats 2 and
3: joined to its stored view), after the token check.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Path, Query, Request
from fastapi.responses import JSONResponse, Response

from service.api import ops
from service.api.deps import Context, Db, database
from service.api.fastpath import bundle_answer
from service.api.routes_jobs import ERRORS
from service.api.schemas import KernelView
from service.bundle import ARCH_PATTERN
from service.store.spec_store import HASH_PATTERN
from service.tuning_request import TARGET_PATTERN

router = APIRouter(tags=["kernels"])
KernelId = Annotated[str, Path(pattern=r"^[0-9a-f]{32}$", description="a kernel id (32 lowercase hex)")]


@router.get("/v1/kernels", response_model=KernelView, responses=ERRORS)
async def lookup_kernel(
    ctx: Context, db: Annotated[Db, Depends(database("kernels:read"))],
    spec_hash: Annotated[str, Query(pattern=HASH_PATTERN, description="the spec's sha256, or a prefix of 12+ hex characters")],
    target: Annotated[str | None, Query(pattern=TARGET_PATTERN, description="default: the server's target")] = None,
    shape: Annotated[str | None, Query(max_length=2048, description="d0=4,d1=300 (canonical dims) or the spec's own")] = None,
    dtype: Annotated[str, Query(max_length=2048, description="float32|float16|bfloat16|float64 or a JSON map")] = "float32",
    batch_invariant: Annotated[bool, Query(description="only a range one kernel serves whole")] = False,
) -> JSONResponse:
    """The tuned range holding the shape, else the best kernel for exactly this shape, else the
    nearest tuned shape of the same spec, target and dtype (``exact_match`` false)."""
    view = await db.run(ops.lookup_kernel, ctx.specs, spec_hash=spec_hash, target=target or ctx.settings.target,
                        shape=shape, dtype=dtype, batch_invariant=batch_invariant)
    return JSONResponse(view)


@router.get("/v1/kernels/{kernel_id}", response_model=KernelView, responses=ERRORS)
async def get_kernel(kernel_id: KernelId, db: Annotated[Db, Depends(database("kernels:read"))]) -> JSONResponse:
    """One kernel's view."""
    return JSONResponse(await db.run(ops.get_kernel, kernel_id))


@router.get("/v1/kernels/{kernel_id}/bundle", response_class=Response,
            responses={200: {"content": {"application/json": {}}, "description": "the bundle, as stored"},
                       304: {"description": "If-None-Match matched the ETag"}, **ERRORS})
async def get_bundle(
    kernel_id: KernelId, request: Request, ctx: Context,
    _auth: Annotated[Db, Depends(database("kernels:read"))],
    if_none_match: Annotated[str | None, Header(max_length=1024)] = None,
    format: Annotated[int, Query(ge=1, le=3, description="1 (default): source only; 2: with compiled binaries, one "
                                 "per arch (the newest Triton's); 3: with every Triton version's per arch")] = 1,
    arch: Annotated[str | None, Query(pattern=f"^({ARCH_PATTERN})$",
                                      description="one arch's binaries, e.g. sm_90a or gfx942; implies format=2 "
                                                  "unless format=3")] = None,
) -> Response:
    """The kernel's bundle, byte for byte as stored; ``ETag`` is its sha256.

    Served by service.api.fastpath.BundleFastPath before this route is reached (same answer);
    this route documents it and answers when the fast path is off.

    ``?format=2`` (or ``?arch=``) serves ``foldwise-bundle/2``: the same bundle with its compiled
    binaries (service.bundle, "binaries"), one per arch; ``?format=3`` serves
    ``foldwise-bundle/3``, with every Triton version's; ETag the served sha256, as precomputed
    when the bundle or a binary was stored (service.store.served_bundles). Format 1 stays the default
    so clients written for it are served what they understand."""
    status, headers, body = await bundle_answer(ctx, kernel_id, request.headers.get("authorization"),
                                                if_none_match, format=format, arch=arch)
    return Response(body, status_code=status, headers=headers)


# ----------------------------------------------------------------------------- single binaries

Arch = Annotated[str, Path(pattern=f"^({ARCH_PATTERN})$", description="a variant's arch, e.g. sm_90a or gfx942")]


@router.get("/v1/kernels/{kernel_id}/binaries", responses=ERRORS)
async def list_binaries(kernel_id: KernelId, db: Annotated[Db, Depends(database("kernels:read"))]) -> JSONResponse:
    """The kernel's stored compiled variants (arch, binary kind, versions; per kernel its name, binary
    (cubin or hsaco) and assembly (PTX or AMDGCN) sizes and sha256, registers, spills, shared memory)
    with the path of each download."""
    from service.binaries import kernel_binaries

    return JSONResponse(await db.run(kernel_binaries, kernel_id))


@router.get("/v1/kernels/{kernel_id}/binaries/{arch}/{filename}", response_class=Response,
            responses={200: {"content": {"application/octet-stream": {}, "text/plain": {}},
                             "description": "the cubin or hsaco (or PTX or AMDGCN text), byte for byte; "
                                            "ETag its sha256"},
                       304: {"description": "If-None-Match matched the ETag"}, **ERRORS})
async def get_binary(
    kernel_id: KernelId, arch: Arch,
    filename: Annotated[str, Path(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,199}\.(cubin|ptx|hsaco|amdgcn)$",
                                  description="<kernel name>.cubin or .ptx (NVIDIA), .hsaco or .amdgcn (AMD)")],
    db: Annotated[Db, Depends(database("kernels:read"))],
    if_none_match: Annotated[str | None, Header(max_length=1024)] = None,
    triton_version: Annotated[str | None, Query(pattern=r"^[0-9][0-9A-Za-z.+_-]{0,63}$",
                                                description="the Triton version that built it (default: the "
                                                            "newest stored for the arch)")] = None,
) -> Response:
    """One stored binary: ``ETag`` and ``X-Content-SHA256`` are the sha256 of the bytes served
    (for a cubin or hsaco, the ``cubin_sha256``/``hsaco_sha256`` the bundle records)."""
    from service.api.fastpath import etag_matches
    from service.binaries import BINARY_KINDS, binary_file

    name, kind = filename.rsplit(".", 1)
    sha, body = await db.run(binary_file, kernel_id, arch, name, kind, triton_version)
    headers = {"ETag": f'"{sha}"', "X-Content-SHA256": sha, "Cache-Control": "no-cache",
               "Content-Disposition": f'attachment; filename="{arch}-{filename}"'}
    if etag_matches(if_none_match, sha):
        return Response(b"", status_code=304, headers=headers)
    return Response(body, status_code=200, headers=headers, media_type=BINARY_KINDS[kind])
