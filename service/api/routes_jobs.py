"""``/v1/jobs``: submit (idempotent), list, read, trials, cancel. Thin: see service.api.ops.

Status codes of ``POST /v1/jobs`` (the same request always gets the same job while it is
queued, running or succeeded):

- **202 Accepted** with ``Location: /v1/jobs/{id}`` when the answer is a job still to run or
  running: a new job, or the same request again while its job is queued or running;
- **200 OK** (same body, same ``Location``) when the answer is already finished: the job
  succeeded (or a kernel for exactly this request was already cached), ``kernel_id`` is set.

A queued job that no live worker can take (no worker registered for its target and measurer with
a recent heartbeat) says so in ``warnings`` (computed whenever the job is read, so the warning
goes once a worker registers); it is still queued, not refused.

A job that failed or was cancelled is not reused: the same request then queues a new job (202).
The ``Foldwise-Job-Created`` header says whether this request queued a new search.
``POST /v1/jobs/{id}/cancel`` answers 202 while a running job is stopping (the worker stops
after its current trial), 200 once the job is finished (cancelled, or it had already ended).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import JSONResponse

from service.api import ops
from service.api.deps import AppContext, Context, Db, database
from service.api.schemas import JobList, JobRequest, JobView, ProblemView, TrialList
from service.store.spec_store import HASH_PATTERN
from service.tuning_request import TARGET_PATTERN

router = APIRouter(tags=["jobs"])
JobId = Annotated[str, Path(pattern=r"^[0-9a-f]{32}$", description="a job id (32 lowercase hex)")]
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ProblemView, "content": {"application/problem+json": {}}} for code in (401, 403, 404, 422)
}


def _live(ctx: AppContext) -> ops.LiveWorkers:
    """The live workers, read once per request when a queued job's ``warnings`` need them."""
    return ops.LiveWorkers(ops.alive_within_s(ctx.settings))


@router.post("/v1/jobs", status_code=202, response_model=None,
             responses={202: {"model": JobView, "description": "queued or running"},
                        200: {"model": JobView, "description": "already finished"}, **ERRORS})
async def submit_job(req: JobRequest, request: Request, ctx: Context,
                     db: Annotated[Db, Depends(database("jobs:write", write=True))]) -> JSONResponse:
    """Queue a tuning job for (spec, shape, dtype, target, measurer).

    Idempotent: the same request (same spec_hash, shape, dtype, target, measurer; the budget
    is not part of the identity) answers the same job while it is queued, running or
    succeeded. **202** with ``Location`` while the job is queued or running (new or not),
    **200** with the same body once it has succeeded (or a kernel for exactly this request was
    already cached: ``kernel_id`` is set). A failed or cancelled job is not reused: the same
    request queues a new one. ``Foldwise-Job-Created: true`` when this request queued a new
    search. Needs the ``jobs:write`` scope once tokens exist (service/auth.py)."""
    result = await ops.submit_job(db, ctx, req, request)
    view = result.view
    assert view is not None
    finished = view["status"] in ("succeeded", "failed", "cancelled")
    return JSONResponse(view, status_code=200 if finished else 202,
                        headers={"Location": view["url"], "Foldwise-Job-Created": "true" if result.created else "false"})


@router.get("/v1/jobs", response_model=JobList, responses=ERRORS)
async def list_jobs(
    ctx: Context, db: Annotated[Db, Depends(database(None))],
    status: Annotated[Literal["queued", "running", "succeeded", "failed", "cancelled"] | None, Query()] = None,
    spec_hash: Annotated[str | None, Query(pattern=HASH_PATTERN)] = None,
    target: Annotated[str | None, Query(pattern=TARGET_PATTERN)] = None,
    shape: Annotated[str | None, Query(max_length=2048, description="d0=4,d1=300 (needs spec_hash)")] = None,
    dtype: Annotated[str | None, Query(max_length=2048, description="a dtype or a per-input map (needs spec_hash)")]
    = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> JSONResponse:
    """Jobs, newest first, filtered by status, spec_hash, target, and (with spec_hash) shape and
    dtype as ``GET /v1/kernels`` reads them: the jobs of one request key, e.g. the client's
    "a job for this kernel is queued"."""
    views = await db.run(ops.list_jobs, ctx.specs, _live(ctx), status=status, spec_hash=spec_hash,
                         target=target.strip().lower() if target else None, shape=shape, dtype=dtype,
                         limit=limit, offset=offset)
    return JSONResponse({"jobs": views, "limit": limit, "offset": offset, "count": len(views)})


@router.get("/v1/jobs/{job_id}", response_model=JobView, responses=ERRORS)
async def get_job(job_id: JobId, ctx: Context, db: Annotated[Db, Depends(database(None))]) -> JSONResponse:
    """A job: status, progress, best so far, kernel_id, error."""
    return JSONResponse(await db.run(ops.get_job, ctx.specs, _live(ctx), job_id))


@router.get("/v1/jobs/{job_id}/trials", response_model=TrialList, responses=ERRORS)
async def list_trials(job_id: JobId, ctx: Context, db: Annotated[Db, Depends(database(None))]) -> JSONResponse:
    """Every recorded trial of the job: config (tile blocks in the spec's own dim names), time or
    failure reason, worker."""
    return JSONResponse({"job_id": job_id, "trials": await db.run(ops.list_trials, ctx.specs, job_id)})


@router.post("/v1/jobs/{job_id}/cancel", response_model=None,
             responses={200: {"model": JobView}, 202: {"model": JobView, "description": "stopping"}, **ERRORS})
async def cancel_job(job_id: JobId, ctx: Context,
                     db: Annotated[Db, Depends(database("jobs:write", write=True))]) -> JSONResponse:
    """Stop the job's search; finished trials are kept."""
    view = await db.run(ops.cancel, ctx.specs, _live(ctx), job_id)
    return JSONResponse(view, status_code=202 if view["status"] == "running" else 200)
