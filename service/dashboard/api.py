"""The dashboard's own JSON endpoints (thin routes over :mod:`service.dashboard.views`).

- ``GET /v1/specs/{spec_hash}/math``: the spec, its derivation as LaTeX per reduction, the certificate;
- ``GET /v1/specs/{spec_hash}/source?strategy=&shape=&dtype=``: generated Triton source (default:
  the tuned kernel's);
- ``GET /v1/dashboard/specs?hash=&hash=``: spec names and dim names (canonical -> own) for list pages;
- ``GET /v1/dashboard/kernels?spec_hash=&target=&dtype=&limit=&offset=`` (``kernels:read``): the
  kernel cache with speedups and prediction vs measurement;
- ``GET /v1/catalog``: the catalog specs with their suite shapes (for the submit form);
- ``GET /v1/dashboard/options``: targets, measurers, dtypes and budget limits for the submit form;
- ``GET /v1/auth/me``: ``{auth_enabled, name, scopes}`` of the presented token.

"Status read" follows :class:`service.auth.AuthPolicy`: open on a loopback bind, any valid
token otherwise. Errors are problem+json naming the field (:mod:`service.api.problems`).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request

from service.api.deps import Db, context, database
from service.api.problems import HttpProblem, error_entry, invalid
from service.auth import SCOPES
from service.dashboard import compute, views
from service.store.spec_store import HASH_PATTERN

router = APIRouter(tags=["dashboard"])
SpecHash = Annotated[str, Path(pattern=HASH_PATTERN, description="the spec's sha256 (64 hex), or a prefix of 12+")]
StatusRead = Annotated[Db, Depends(database(None))]
KernelRead = Annotated[Db, Depends(database("kernels:read"))]


async def _run(db: Db, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(session, ...)`` through the API's read session and auth check; DashboardError as problem+json."""
    try:
        return await db.run(fn, *args, **kwargs)
    except views.DashboardError as err:
        raise _problem(err) from None


def _problem(err: views.DashboardError) -> HttpProblem:
    if err.status == 404:
        return HttpProblem(404, "Not found", err.message, kind="not-found")
    if err.status == 409:  # an ambiguous spec hash prefix
        return HttpProblem(409, "Ambiguous spec hash", f"spec_hash: {err.message}", kind="ambiguous-hash",
                           errors=[error_entry(["spec_hash"], err.message, where=str(err.loc[0]))])
    where = str(err.loc[0]) if err.loc and err.loc[0] in ("query", "path", "body") else "query"
    loc = list(err.loc[1:]) if err.loc and err.loc[0] in ("query", "path", "body") else list(err.loc)
    return invalid([error_entry(loc, err.message, where=where)])


@router.get("/v1/specs/{spec_hash}/math")
async def spec_math(spec_hash: SpecHash, db: StatusRead, request: Request) -> dict[str, Any]:
    """The spec, its derivation as LaTeX (per reduction: F, the terms G/H, the update with its
    correction, the final value, the merge rule) and its certificate. The LaTeX is derived in a
    child process (service/dashboard/compute.py), bounded as derivations are."""
    stored = await _run(db, views.spec_math, spec_hash)
    math = await _compute(request, compute.spec_math, stored.pop("source"))
    return {**math, **stored}


@router.get("/v1/specs/{spec_hash}/source")
async def spec_source(
    spec_hash: SpecHash, db: KernelRead, request: Request,  # tuned kernels' source: kernels:read, as the kernel routes
    strategy: Annotated[str | None, Query(max_length=32, pattern=r"^[a-z_]+$")] = None,
    shape: Annotated[str | None, Query(max_length=1024, description="m=4,n=300 (the spec's dim names)")] = None,
    dtype: Annotated[str | None, Query(max_length=1024)] = None,
) -> dict[str, Any]:
    """Generated Triton source: by default the spec's newest tuned kernel, else the preferred valid
    strategy's default configuration at the newest job's shape. Generated in a child process
    (service/dashboard/compute.py), bounded as derivations are."""
    q = await _run(db, views.spec_source_query, spec_hash)
    return await _compute(request, compute.spec_source, q["source"], q["spec_hash"], q["origin"], q["kernel"],
                          strategy, shape, dtype)


async def _compute(request: Request, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in the derivations' child processes (service.api.derive.DerivationPool.compute);
    its DashboardError as problem+json."""
    try:
        return await context(request).deriver.compute(fn, *args, request=request, passes=(compute.DashboardError,))
    except compute.DashboardError as err:
        raise _problem(err) from None


@router.get("/v1/dashboard/specs")
async def dashboard_specs(
    db: StatusRead,
    hash: Annotated[list[str], Query(max_length=views.MAX_NAMES, description="spec hashes, repeated")] = [],  # noqa: B006
) -> dict[str, Any]:
    """Names of specs and of their dims (canonical ``d0`` -> the spec's own), for list pages."""
    return {"specs": await _run(db, views.spec_names, hash)}


@router.get("/v1/dashboard/kernels")
async def dashboard_kernels(
    db: KernelRead,
    spec_hash: Annotated[str | None, Query(pattern=HASH_PATTERN)] = None,
    target: Annotated[str | None, Query(max_length=32)] = None,
    dtype: Annotated[str | None, Query(max_length=2048)] = None,
    limit: Annotated[int, Query(ge=1, le=views.MAX_LIMIT)] = 50,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> dict[str, Any]:
    """The kernel cache, newest first, with speedups over the stored baselines."""
    rows = await _run(db, views.kernel_rows, spec_hash=spec_hash, target=target, dtype=dtype, limit=limit,
                      offset=offset)
    return {"kernels": rows, "limit": limit, "offset": offset}


@router.get("/v1/catalog")
async def catalog(db: StatusRead) -> dict[str, Any]:
    """The catalog's specs (fuser_core.catalog: $FOLDWISE_CATALOG_DIR's folders, then the packaged catalog)."""
    return {"specs": await _run(db, lambda _session: views.catalog_entries())}


@router.get("/v1/dashboard/options")
async def options(request: Request, db: StatusRead) -> dict[str, Any]:
    """Choices and limits for the submit form."""
    settings = context(request).settings
    return await _run(db, views.form_options, max_trials=settings.max_trials, max_seconds=settings.max_seconds,
                      default_target=settings.target)


@router.get("/v1/auth/me")
async def auth_me(request: Request, db: StatusRead) -> dict[str, Any]:
    """Who the presented token is and what it may do; ``auth_enabled`` False in open mode (loopback
    bind, no token in the database: everything is allowed). A wrong or revoked token is 401, and
    so is no token on a server bound beyond loopback."""
    principal = await db.authorize()
    if principal is not None:
        scopes = sorted(SCOPES) if "admin" in principal.scopes else sorted(principal.scopes)
        return {"auth_enabled": True, "name": principal.name, "scopes": scopes}
    policy = context(request).auth
    if not await db.run(policy.tokens_exist):
        return {"auth_enabled": False, "name": None, "scopes": sorted(SCOPES)}
    return {"auth_enabled": True, "name": None, "scopes": []}  # loopback: status reads are open, nothing else
