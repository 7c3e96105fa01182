"""Attention judged as FlashAttention's own tests judge it (issue 22, 2): with 16-bit operands on
tensor cores (P rounded to V's dtype, fp32 accumulators), the error against a float64 reference
is at most 2x that of a standard attention computed in the same dtype: QK^T and P.V as 16-bit
GEMMs with fp32 accumulation, softmax in fp32, P rounded to 16 bits; plus FlashAttention's
``fwd_atol``, the dtype's rounding of the reference itself. Kernels run through Triton's
interpreter, each fused strategy, on the scores real models produce (unit and peaked)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fuser_core.catalog import load_catalog_spec
from fuser_core.codegen.plan import default_config, valid_strategies
from fuser_core.derive import derive_cascade
from fuser_core.reference import evaluate
from fuser_core.runner import run

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")  # rows past m: 0/0, not stored

SHAPE = {"b": 1, "h": 2, "m": 48, "n": 80, "d": 32, "e": 32}  # not multiples of the tiles
TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def standard_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """FlashAttention's ``attention_ref`` in the inputs' dtype: 16-bit GEMMs accumulated in fp32
    (products of 16-bit values are exact in fp32), softmax in fp32, P rounded to V's dtype."""
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:  # the catalog's causal mask: key n is seen by query m when n <= m
        m, n = s.shape[-2:]
        s = s.masked_fill(torch.arange(n)[None, :] > torch.arange(m)[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1).to(v.dtype)
    return (p.float() @ v.float()).to(v.dtype)


@pytest.mark.parametrize("name,dtype", [("attention", "float16"), ("attention", "bfloat16"),
                                        ("attention_causal", "bfloat16"), ("attention_causal", "float16")])
@pytest.mark.parametrize("peak", [1.0, 6.0])  # unit scores, and peaked rows (q 6x: scores of std ~6)
def test_attention_within_twice_the_standard_attentions_error(name: str, dtype: str, peak: float) -> None:
    spec = load_catalog_spec(name)
    derivation = derive_cascade(spec)
    rng = np.random.default_rng(7)
    t = TORCH[dtype]
    q = (torch.from_numpy(rng.standard_normal((1, 2, 48, 32))) * peak).to(t)
    k = torch.from_numpy(rng.standard_normal((1, 2, 80, 32))).to(t)
    v = torch.from_numpy(rng.standard_normal((1, 2, 80, 32))).to(t)
    inputs = {"q": q.double().numpy(), "k": k.double().numpy(), "v": v.double().numpy()}  # the 16-bit values, exactly
    ref = torch.from_numpy(evaluate(spec, SHAPE, inputs)["o"])
    standard = standard_attention(q, k, v, causal=name == "attention_causal").double()
    fwd_atol = 2 * ((ref + 0.3 - 0.3).to(t).double() - ref).abs().max().item()
    standard_err = (standard - ref).abs().max().item()
    strategies = [s for s, why in valid_strategies(spec, derivation, SHAPE).items() if why is None]
    assert {"streaming_fused", "split_fused"} <= set(strategies)
    for strategy in strategies:
        config = default_config(spec, derivation, strategy, SHAPE)
        result = run(spec, SHAPE, dtype, inputs, strategy=strategy, config=config, derivation=derivation)
        if strategy != "row_resident":  # the tiled strategies multiply on tensor cores
            assert "tl.dot(" in result.source, strategy
        got = result.outputs["o"].double()
        err = (got - ref).abs().max().item()
        print(f"{name} {dtype} peak {peak} {strategy}: {err:.3g} vs standard {standard_err:.3g} (fwd_atol {fwd_atol:.3g})")
        assert err <= 2 * standard_err + fwd_atol, (strategy, err, standard_err, fwd_atol)


def test_the_kernel_checks_bfloat16_tolerance_admits_two_roundings_and_refuses_five_ulps() -> None:
    """The tuner's gate refused bf16 causal multi_pass at 0.0121 (P and the output each rounded to
    bf16 once: 2 ulps of 2^-8) under a fixed 1e-2; bf16 is allowed 4 of its ulps (runner.TOLERANCE),
    and an error of 5 is still refused."""
    from fuser_core.runner import TOLERANCE, rel_err

    ref = np.linspace(1.0, 1.9, 64)
    ulp = 2.0**-8  # bf16's spacing in [1, 2)
    assert rel_err(ref * (1 + 2 * ulp), ref, 0.1) <= TOLERANCE["bfloat16"]
    assert rel_err(ref * (1 + 0.0121), ref, 0.1) <= TOLERANCE["bfloat16"]
    assert rel_err(ref * (1 + 5 * ulp), ref, 0.1) > TOLERANCE["bfloat16"]
