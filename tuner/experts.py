"""Expert kernels to time the fused kernels against: what a performance engineer would use.

:mod:`tuner.torch_ref.handwritten` gives torch's own hand-written kernel per catalog cascade (one each);
this module adds the others an inference stack reaches for, by catalog cascade:

- Liger-Kernel's softmax, RMSNorm, LayerNorm and cross-entropy (the PyPI package
  ``liger-kernel``, imported, never copied; absent: the expert is reported unavailable);
- ``F.scaled_dot_product_attention`` under each of its backends (flash, efficient, cudnn,
  math), one expert per backend, for attention;
- a split-KV ("flash-decoding") Triton decoder for attention with one query row (``m == 1``):
  the key axis cut into chunks over programs, each writing its running max, sum and output
  row, merged by a second kernel (:func:`split_kv_decode`);
- for the fp8 GEMM, per-token quantisation in torch followed by ``torch._scaled_mm`` with
  row-wise scales, and ``torch._scaled_mm`` alone on activations quantised before timing
  (a lower bound for the GEMM part, labelled so).

An expert applies only where the spec has the exact structure of the catalog spec of its name
(:func:`tuner.torch_ref.handwritten.handwritten_reason`: same ``spec_hash``), so a user spec that happens
to be called ``rmsnorm`` never gets Liger's RMSNorm. Every expert is a function
``fn(tensors, shape) -> outputs`` like :class:`tuner.torch_ref.handwritten.Handwritten`; the measurement
worker checks its outputs against the float64 reference before timing it, as it does for
every variant (:mod:`tuner.device.checks`), so an expert that computes something else is
reported wrong, never timed.

Example (on a GPU)::

    for expert in experts_for(problem):
        out = expert.build(problem)(tensors, problem.shape)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fuser_core.problem import Problem

Fn = Callable[[Mapping[str, Any], Mapping[str, int]], dict[str, Any]]


class ExpertUnavailable(RuntimeError):
    """The expert cannot run here (a package is missing, no such backend): the message says why."""


@dataclass(frozen=True)
class Expert:
    """One expert baseline: ``name`` as tables show it, ``build(problem) -> fn``; ``applies``
    says whether it runs at the problem's shape (None: it does; else why not)."""

    name: str
    build: Callable[[Problem], Fn]
    applies: Callable[[Problem], str | None] = lambda _problem: None


# ---------------------------------------------------------------------------- Liger-Kernel


def _liger(what: str) -> Any:
    try:
        from liger_kernel.transformers import functional
    except ImportError as err:
        raise ExpertUnavailable(f"liger-kernel is not installed ({err})") from None
    return getattr(functional, what)


def _liger_softmax(problem: Problem) -> Fn:
    softmax = _liger("liger_softmax")
    return lambda t, shape: {"y": softmax(t["x"])}


def _liger_rms_norm(problem: Problem) -> Fn:
    rms_norm = _liger("liger_rms_norm")
    eps = _param(problem, "eps")
    # in_place=False: the input is timed again, it must stay as it was
    return lambda t, shape: {"y": rms_norm(t["x"], t["w"], eps, in_place=False)}


def _liger_layer_norm(problem: Problem) -> Fn:
    layer_norm = _liger("liger_layer_norm")
    eps = _param(problem, "eps")
    return lambda t, shape: {"y": layer_norm(t["x"], t["gamma"], t["beta"], eps)}


def _liger_cross_entropy(problem: Problem) -> Fn:
    cross_entropy = _liger("liger_cross_entropy")

    def fn(t: Mapping[str, Any], shape: Mapping[str, int]) -> dict[str, Any]:
        # the logits do not require grad, so Liger computes no gradient in place of them
        return {"loss": cross_entropy(t["logits"], t["target"].long(), reduction="none")}

    return fn


def _param(problem: Problem, name: str) -> float:
    from fuser_core.reference import param_values

    from fuser_core.problem import tuning_scalars

    return float(param_values(problem.spec, problem.shape, scalars=tuning_scalars(problem.spec, problem.shape))[name])


# ---------------------------------------------------------------------------- attention


def _sdpa(backend: str, causal: bool) -> Callable[[Problem], Fn]:
    def build(problem: Problem) -> Fn:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        chosen = getattr(SDPBackend, backend)

        def fn(t: Mapping[str, Any], shape: Mapping[str, int]) -> dict[str, Any]:
            with sdpa_kernel([chosen]):
                return {"o": F.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=causal)}

        return fn

    return build


def _one_query(problem: Problem) -> str | None:
    return None if problem.shape.get("m") == 1 else "the split-KV decoder takes one query row (m == 1)"


def _decoder(problem: Problem) -> Fn:
    return lambda t, shape: {"o": split_kv_decode(t["q"], t["k"], t["v"])}


DECODER_BLOCK = 64  # the split-KV decoder's keys per step


def split_kv_decode(q: Any, k: Any, v: Any, *, block_n: int = DECODER_BLOCK, chunks: int | None = None) -> Any:
    """softmax(q k^T / sqrt(d)) v for q of shape [b, h, 1, d], k [b, h, n, d], v [b, h, n, e]:
    ``chunks`` programs per (b, h) each reduce a contiguous part of the key axis to its running
    max, sum and unnormalised output row; a second kernel merges the parts (flash-decoding)."""
    import torch

    from tuner._decode_kernels import decode_combine, decode_partial

    b, h, m, d = q.shape
    n, e = k.shape[2], v.shape[3]
    if m != 1:
        raise ValueError(f"split_kv_decode: q has {m} query rows, expected 1")
    rows = b * h
    if chunks is None:
        chunks = decoder_parts(n, rows, torch.cuda.get_device_properties(q.device).multi_processor_count, block_n)
    chunk = triton_cdiv(triton_cdiv(n, chunks), block_n) * block_n
    chunks = triton_cdiv(n, chunk)
    part_max = torch.empty((rows, chunks), dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    part_out = torch.empty((rows, chunks, e), dtype=torch.float32, device=q.device)
    qk_scale = 1.4426950408889634 / math.sqrt(d)  # log2(e) / sqrt(d): the kernels use exp2
    decode_partial[(rows, chunks)](
        q, k, v, part_max, part_sum, part_out, n, h, chunk, qk_scale,
        *q.stride(), *k.stride(), *v.stride(),
        BLOCK_N=block_n, BLOCK_D=_pow2(d), BLOCK_E=_pow2(e), D=d, E=e, num_warps=4)
    out = torch.empty((b, h, 1, e), dtype=q.dtype, device=q.device)
    decode_combine[(rows,)](part_max, part_sum, part_out, out, chunks, h, *out.stride(),
                            BLOCK_S=_pow2(chunks), BLOCK_E=_pow2(e), E=e, num_warps=4)
    return out


def decoder_parts(n: int, rows: int, sm_count: int, block_n: int = DECODER_BLOCK) -> int:
    """The split-KV decoder's parts per query row: enough programs to fill the GPU's SMs twice,
    each at least 4 key blocks."""
    return max(1, min(triton_cdiv(n, 4 * block_n), triton_cdiv(2 * sm_count, rows)))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# ---------------------------------------------------------------------------- the fp8 GEMM

FP8_MAX = 448.0


def _quantize_rows(a: Any) -> tuple[Any, Any]:
    """Per-token e4m3 quantisation as the spec writes it: (a * 448 / amax, cast), scale amax / 448."""
    import torch

    amax = a.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
    q = (a.float() * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, amax / FP8_MAX


def _scaled_mm(problem: Problem, *, prequantized: bool) -> Fn:
    import torch

    out_dtype = getattr(torch, problem.output_dtypes["out"])
    cache: dict[int, tuple[Any, Any]] = {}

    def fn(t: Mapping[str, Any], shape: Mapping[str, int]) -> dict[str, Any]:
        a, w = t["a"], t["w"]
        if prequantized:  # quantised once per input set, outside the timed region after the first run
            key = a.data_ptr()
            if key not in cache:
                cache[key] = _quantize_rows(a)
            qa, scale_a = cache[key]
        else:
            qa, scale_a = _quantize_rows(a)
        w8 = w if w.dtype == torch.float8_e4m3fn else w.view(torch.float8_e4m3fn)
        # row-wise scales: scale_a [m, 1], scale_b [1, n]; w is [n, k] row-major, so w.t() is
        # the column-major [k, n] operand _scaled_mm wants; row-wise scaling outputs bf16
        out = torch._scaled_mm(qa, w8.t(), scale_a=scale_a, scale_b=t["w_scale"].float().reshape(1, -1),
                               out_dtype=torch.bfloat16)
        return {"out": out.to(out_dtype)}

    return fn


# ---------------------------------------------------------------------------- the registry

EXPERTS: dict[str, tuple[Expert, ...]] = {
    "safe_softmax": (Expert("Liger softmax", _liger_softmax),),
    "rmsnorm": (Expert("Liger RMSNorm", _liger_rms_norm),),
    "layernorm": (Expert("Liger LayerNorm", _liger_layer_norm),),
    "cross_entropy": (Expert("Liger cross-entropy", _liger_cross_entropy),),
    "attention": (
        *(Expert(f"SDPA {b.lower()}", _sdpa(b, False)) for b in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION",
                                                                 "CUDNN_ATTENTION", "MATH")),
        Expert("split-KV decoder (Triton)", _decoder, _one_query),
    ),
    "attention_causal": tuple(Expert(f"SDPA {b.lower()} causal", _sdpa(b, True))
                              for b in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")),
    "fp8_quant_gemm": (
        Expert("torch quant + _scaled_mm", lambda p: _scaled_mm(p, prequantized=False)),
        Expert("_scaled_mm alone (a quantised before timing)", lambda p: _scaled_mm(p, prequantized=True)),
    ),
}


def experts_for(problem: Problem) -> list[Expert]:
    """The experts that compute ``problem``'s spec (its structure is the catalog spec's)."""
    from tuner.torch_ref.handwritten import HANDWRITTEN_TEMPLATES, template_hash
    from fuser_core.canonical import spec_hash

    spec = problem.spec
    if spec.name not in EXPERTS:
        return []
    if spec.name in HANDWRITTEN_TEMPLATES and spec_hash(spec) != template_hash(spec.name):
        return []
    if spec.name not in HANDWRITTEN_TEMPLATES and _catalog_hash(spec.name) != spec_hash(spec):
        return []
    return list(EXPERTS[spec.name])


def _catalog_hash(name: str) -> str | None:
    from fuser_core.canonical import spec_hash
    from fuser_core.catalog import load_catalog_spec

    try:
        return spec_hash(load_catalog_spec(name))
    except Exception:  # noqa: BLE001 (no such packaged spec: nothing to compare with)
        return None


def expert(problem: Problem, name: str) -> Expert:
    """The expert called ``name`` for ``problem``; ValueError naming what exists."""
    found = {e.name: e for e in experts_for(problem)}
    if name not in found:
        raise ValueError(f"no expert {name!r} for {problem.spec.name}; there are: {', '.join(found) or 'none'}")
    return found[name]


__all__ = ["EXPERTS", "Expert", "ExpertUnavailable", "expert", "experts_for", "split_kv_decode"]
