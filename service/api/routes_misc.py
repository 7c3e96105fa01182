"""Derivations, stored specs, workers, liveness and metrics."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from service.api import ops
from service.api.deps import AppContext, Context, Db, database
from fuser_core import SpecError
from service.api.backward import backward_answer
from service.api.problems import HttpProblem, spec_problem
from service.api.routes_jobs import ERRORS
from service.api.schemas import DerivationRequest, SpecView, WorkerList
from service.api.validation import checked_spec_text
from service.bundle.signing import ALGORITHM, SIGNATURE_HEADER
from service.store.spec_store import HASH_PATTERN

router = APIRouter()
SpecHash = Annotated[str, Path(pattern=HASH_PATTERN, description="the spec's sha256 (64 lowercase hex), or a prefix of 12+")]


@router.post("/v1/derivations", tags=["specs"], responses=ERRORS)
async def derive(req: DerivationRequest, request: Request, ctx: Context,
                 db: Annotated[Db, Depends(database(None))]) -> JSONResponse:
    """Validate and derive a spec: the same object as ``foldwise derive --json``. Nothing is stored.
    Bounded (service/api/derive.py): 429 when too many derivations wait, 503 past the deadline."""
    await db.authorize()
    source = await ctx.deriver.run(checked_spec_text, req.spec)  # a catalog name: its file is read
    return JSONResponse(await ctx.deriver.derive(source, request))  # parsed in a child process


@router.post("/v1/backward", tags=["specs"], responses=ERRORS)
async def backward(req: DerivationRequest, request: Request, ctx: Context,
                   db: Annotated[Db, Depends(database(None))]) -> JSONResponse:
    """A spec's derived backward (docs/THEORY.md section 9): the same object as ``foldwise backward
    --json --no-derive``: the saving forward, the backward specs (each a spec to submit as a job),
    the gradients, the statistics saved and the certificate against torch's autograd. Nothing is
    stored. Computed in a derivation child (bounded: 429, 503 past the deadline); 422 naming the field
    for a spec it refuses (a topk step, a paged input)."""
    await db.authorize()
    source = await ctx.deriver.run(checked_spec_text, req.spec)
    answer = await ctx.deriver.compute(backward_answer, source, request=request)
    if "error" in answer:
        error = answer["error"]
        raise spec_problem(SpecError(error["message"], loc=tuple(error["loc"]), step=error["step"]))
    return JSONResponse(answer)


@router.get("/v1/specs/{spec_hash}", tags=["specs"], response_model=SpecView, responses=ERRORS)
async def get_spec(spec_hash: SpecHash, db: Annotated[Db, Depends(database(None))]) -> JSONResponse:
    """A stored spec (as first submitted, and canonical) with its derivation."""
    return JSONResponse(await db.run(ops.get_spec, spec_hash))


@router.get("/v1/workers", tags=["workers"], response_model=WorkerList, responses=ERRORS)
async def list_workers(ctx: Context, db: Annotated[Db, Depends(database(None))]) -> JSONResponse:
    """Registered workers, most recently seen first; ``alive``: a heartbeat within the lease time."""
    return JSONResponse({"workers": await db.run(ops.list_workers, alive_within_s=ops.alive_within_s(ctx.settings))})


@router.get("/v1/signing-key", tags=["kernels"], responses=ERRORS)
async def signing_key(ctx: Context, db: Annotated[Db, Depends(database(None))]) -> JSONResponse:
    """The public key this server signs served bundles with (``Foldwise-Signature``; docs/API.md,
    "Signed bundles"): give it to clients as a trusted key, over a channel you trust. 404 when the
    server signs nothing (no ``FOLDWISE_SIGNING_KEY_FILE``). A status read (auth policy): a public key."""
    await db.authorize()
    if ctx.signer is None:
        raise HttpProblem(404, "Not found", "this server signs no bundles (FOLDWISE_SIGNING_KEY_FILE is not set)",
                      kind="not-found")
    return JSONResponse({"algorithm": ALGORITHM, "key_id": ctx.signer.key_id, "public_key": ctx.signer.public_key,
                         "header": SIGNATURE_HEADER})


@router.get("/healthz", tags=["ops"])
async def healthz(ctx: Context) -> JSONResponse:
    """Liveness: 200 while the process serves requests; ``database`` says whether it answers."""
    try:
        await run_in_threadpool(_ping, ctx)
        database_state = "ok"
    except Exception as err:  # noqa: BLE001  (reported, not raised: the process itself is alive)
        database_state = f"unavailable: {type(err).__name__}"
    return JSONResponse({"status": "ok", "database": database_state})


def _ping(ctx: AppContext) -> None:
    with ctx.read_sessions() as session:
        ops.ping(session)


@router.get("/metrics", tags=["ops"], response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
async def metrics(ctx: Context) -> Response:
    """Prometheus metrics (text format); job, trial, kernel and worker gauges read from the database."""
    body, content_type = await run_in_threadpool(ctx.metrics.render)
    return Response(body, media_type=content_type)
