"""Request models (with their limits) and the JSON views of stored rows.

Requests are Pydantic models: unknown fields are refused (a typo such as ``budgt`` is an
error naming it, not a silently ignored field), shape sizes must be JSON integers. Limits
that come from :class:`service.settings.Settings` (budget, dim and shape sizes) are checked
by :func:`service.api.validation.check_job_request`, since they are not known when the
models are defined.

Views are plain dicts built by the ``*_view`` functions, documented for OpenAPI by the
``*View`` models (responses are not re-validated through them: the views are built here and
the hot paths stay cheap).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from fuser_core import MAX_DIMS
from service.store.models import Job, KernelRecord, KernelRange, TrialRecord, WorkerRecord
from service.shape_ranges import bucket_count, one_kernel, range_view
from service.tuning_request import MEASURERS

DEFAULT_TRIALS = 40
DEFAULT_SECONDS = 3600.0
MAX_NAME = 64


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")
    trials: StrictInt = Field(DEFAULT_TRIALS, ge=1, description="trials to run (at most the server's max_trials)")
    seconds: float = Field(DEFAULT_SECONDS, gt=0, allow_inf_nan=False,
                           description="wall-clock budget, checked between trials (at most max_seconds)")


class DerivationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    spec: dict[str, Any] | str = Field(description="the spec: a JSON object (docs/SPEC.md), its JSON text, or a catalog "
                                                   "name (\"safe_softmax\", GET /v1/catalog lists them)")


class JobRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    spec: dict[str, Any] | str = Field(description="the spec: a JSON object (docs/SPEC.md), its JSON text, or a catalog "
                                                   "name (\"safe_softmax\", GET /v1/catalog lists them)")
    # a range is checked field by field by service.shape_ranges (errors name shape.t.min), not here
    shape: dict[str, StrictInt | dict[str, Any]] = Field(
        max_length=MAX_DIMS, description='dim sizes, e.g. {"m": 4, "n": 300}; a dim may be a range '
                                         '{"min": 1, "max": 16384, "buckets": [...]} (docs/API.md, "Shape ranges")')
    dtype: str | dict[str, str] = Field("float32", description="float32|float16|bfloat16|float64, or a map input -> dtype")
    target: str | None = Field(None, max_length=32, description="GPU profile (default: the server's, h100)")
    measurer: Literal[MEASURERS] | None = Field(  # type: ignore[valid-type]
        None, description="cuda (timed on a worker's GPU) or model (predicted); default: the server's")
    budget: Budget = Field(default_factory=Budget)
    allow_uncertified: bool = Field(
        False, description="tune even when the spec's certificate fails (its fused forms missed the float64 "
                           "reference); otherwise such a job answers 422 naming the reductions")
    batch_invariant: bool = Field(
        False, description="one kernel for every size of the shape's ranges (one bucket each, at max), so a row "
                           "gives the same bits at every batch size (docs/API.md, \"Shape ranges\")")


# ----------------------------------------------------------------------------- views


def iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    return value.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def job_view(job: Job | Any) -> dict[str, Any]:
    """The JSON view of a job (an ORM ``Job`` or a Core row of the jobs table).

    A failed job's ``kernel_id`` (stored) is the partial kernel it kept (service.store.job_queue.keep_partial):
    shown as ``partial_kernel_id``, never as ``kernel_id``, which only a finished kernel fills."""
    partial = job.status == "failed" and job.kernel_id is not None
    kernel_id = None if partial else job.kernel_id
    return {
        "id": job.id, "status": job.status, "spec_hash": job.spec_hash, "shape": job.shape,
        "dtype": _dtype(job.dtype), "target": job.target, "measurer": job.measurer,
        "budget": {"trials": job.budget_trials, "seconds": job.budget_seconds},
        # a range job runs budget.trials per bucket (service.shape_ranges)
        "progress": {"trials_done": job.trials_done, "trials_budget": job.budget_trials * bucket_count(job.shape)},
        "best": job.best, "kernel_id": kernel_id, "error": job.error,
        "cancel_requested": bool(job.cancel_requested), "attempts": job.attempts, "worker_id": job.worker_id,
        "created_at": iso(job.created_at), "started_at": iso(job.started_at), "finished_at": iso(job.finished_at),
        "url": f"/v1/jobs/{job.id}",
        "kernel_url": f"/v1/kernels/{kernel_id}" if kernel_id else None,
        "partial_kernel_id": job.kernel_id if partial else None,
        "partial_kernel_url": f"/v1/kernels/{job.kernel_id}" if partial else None,
        "range": range_view(job.shape),  # a range job's buckets (docs/API.md, "Shape ranges"); else null
    }


def kernel_view(kernel: KernelRecord, exact: bool | None = None, *,
                kernel_range: tuple[KernelRange, list[KernelRecord]] | None = None) -> dict[str, Any]:
    """A kernel's view; ``kernel_range`` (a lookup inside a tuned range): the range and its
    buckets' kernels, shown as ``range`` (docs/API.md, "Shape ranges")."""
    view = {
        "id": kernel.id, "spec_hash": kernel.spec_hash, "shape": kernel.shape, "dtype": _dtype(kernel.dtype),
        "target": kernel.target, "strategy": kernel.strategy, "config": kernel.config, "time_ms": kernel.time_ms,
        "measurer": kernel.measurer, "predicted": kernel.predicted, "bundle_sha256": kernel.bundle_sha256,
        "triton_version": kernel.triton_version, "generator_version": kernel.generator_version,
        "job_id": kernel.job_id, "baselines": kernel.baselines, "created_at": iso(kernel.created_at),
        "bundle_url": f"/v1/kernels/{kernel.id}/bundle", "partial": bool(kernel.partial),
    }
    if exact is not None:
        view["exact_match"] = exact
    if kernel_range is not None:
        row, kernels = kernel_range
        view["range"] = {
            "id": row.id, "shape": row.shape, "job_id": row.job_id, "batch_invariant": one_kernel(row.shape),
            "buckets": [{"shape": b["shape"], "kernel_id": k.id, "bundle_sha256": k.bundle_sha256,
                         "strategy": k.strategy, "config": k.config, "time_ms": k.time_ms, "predicted": k.predicted,
                         "bundle_url": f"/v1/kernels/{k.id}/bundle"} for b, k in zip(row.buckets, kernels)],
        }
    return view


def trial_view(t: TrialRecord) -> dict[str, Any]:
    return {"number": t.number, "state": t.state, "strategy": t.strategy, "config": t.config, "time_ms": t.time_ms,
            "error": t.error, "worker_id": t.worker_id, "predicted": t.predicted, "source": t.source,
            "compile": t.compile, "created_at": iso(t.created_at)}


def worker_view(w: WorkerRecord, *, alive_within_s: float) -> dict[str, Any]:
    age = (datetime.now(UTC) - w.last_heartbeat).total_seconds() if w.last_heartbeat else None
    alive = age is not None and age <= alive_within_s
    # a dead worker works on nothing: its job's lease runs out and another worker takes it
    return {"id": w.id, "hostname": w.hostname, "gpu_name": w.gpu_name, "target": w.target, "measurer": w.measurer,
            "versions": w.versions, "current_job_id": w.current_job_id if alive else None,
            "started_at": iso(w.started_at), "last_heartbeat": iso(w.last_heartbeat), "alive": alive}


def _dtype(text: str) -> Any:
    import json

    return json.loads(text) if text.startswith("{") else text


# ----------------------------------------------------------------------------- OpenAPI documentation


class BudgetView(BaseModel):
    trials: int
    seconds: float


class ProgressView(BaseModel):
    trials_done: int
    trials_budget: int


class JobView(BaseModel):
    id: str
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    spec_hash: str
    shape: dict[str, int | dict[str, Any]] = Field(description="a range job's ranged dims: {min, max, buckets}")
    dtype: str | dict[str, str]
    target: str
    measurer: str
    budget: BudgetView
    progress: ProgressView
    best: dict[str, Any] | None = Field(description="{strategy, config, time_ms, trial} of the best trial so far; "
                                                    "config.blocks in your dim names")
    kernel_id: str | None
    error: str | None
    cancel_requested: bool
    attempts: int
    worker_id: str | None
    created_at: str | None
    started_at: str | None
    finished_at: str | None
    url: str
    kernel_url: str | None
    partial_kernel_id: str | None = Field(
        None, description="a failed job only: the partial kernel it kept (the bundle of its best complete trial, "
                          "GET /v1/kernels/{id} says partial: true); lookups and submissions never answer with it")
    partial_kernel_url: str | None = None
    display_shape: dict[str, Any] = Field(description="shape in your dim names (those of the spec you submitted; "
                                                      "on reads, of the spec as first stored)")
    warnings: list[str] = Field(description="why a queued job may wait forever, e.g. no live worker takes its "
                                            "target; computed when read, so empty once a worker registers")
    range: dict[str, Any] | None = Field(
        None, description="a range job's buckets: {buckets: [every bucket's full shape, smallest first], "
                          "trial_number_stride} (trial n ran bucket n // trial_number_stride); null for a plain job")


class JobList(BaseModel):
    jobs: list[JobView]
    limit: int
    offset: int


class TrialView(BaseModel):
    number: int
    state: Literal["complete", "failed", "pruned"]
    strategy: str | None
    config: dict[str, Any] | None
    time_ms: float | None
    error: str | None
    worker_id: str | None
    predicted: bool
    source: str | None
    compile: list[dict[str, Any]] | None = Field(
        None, description="the compile gate's facts per kernel (kernel, ok, registers, spill_bytes, shared_bytes, "
                          "num_warps, num_stages; error where it failed to compile); null without a compile check")
    created_at: str | None


class TrialList(BaseModel):
    job_id: str
    trials: list[TrialView]


class KernelView(BaseModel):
    id: str
    spec_hash: str
    shape: dict[str, int]
    dtype: str | dict[str, str]
    target: str
    strategy: str
    config: dict[str, Any]
    time_ms: float
    measurer: str
    predicted: bool
    exact_match: bool | None = Field(None, description="lookups only: the kernel was tuned for exactly this shape")
    range: dict[str, Any] | None = Field(
        None, description="lookups inside a tuned range only: {id, shape, job_id, buckets: [{shape, kernel_id, "
                          "bundle_sha256, strategy, config, time_ms, predicted, bundle_url}]}; the kernel shown is "
                          "the bucket serving the shape asked for (the smallest bucket >= it)")
    bundle_sha256: str
    triton_version: str
    generator_version: str
    job_id: str | None
    baselines: dict[str, Any] | None
    created_at: str | None
    bundle_url: str
    partial: bool = Field(False, description="the best kernel of a job that failed before it finished (its job_id); "
                                             "never the answer of a lookup (docs/API.md, \"Partial kernels\")")


class WorkerView(BaseModel):
    id: str
    hostname: str
    gpu_name: str | None
    target: str
    measurer: str
    versions: dict[str, Any]
    current_job_id: str | None
    started_at: str | None
    last_heartbeat: str | None
    alive: bool


class WorkerList(BaseModel):
    workers: list[WorkerView]


class SpecView(BaseModel):
    spec_hash: str
    name: str
    spec: dict[str, Any] = Field(description="the spec as first submitted")
    canonical: dict[str, Any]
    derivation: dict[str, Any] = Field(description="the same object as `foldwise derive --json`")
    created_at: str | None


class ProblemView(BaseModel):
    type: str
    title: str
    status: int
    detail: str
    errors: list[dict[str, Any]] | None = None
