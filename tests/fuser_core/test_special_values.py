"""One meaning for special values, whatever the strategy (issue 23): every catalog spec, in every
strategy and the unfused chain, on rows holding -inf, +inf and NaN, against the float64 reference
(which evaluates the spec as written; docs/SPEC.md, "Special values").

Before: the fused strategies moved an infinite running max to 0 (safe_anchor) and kept it there,
so softmax of a row holding +inf gave 0 at its finite positions (reference and torch: NaN),
logsumexp of an all -inf row gave -inf where the spec as written gives NaN; max/min dropped NaN
in every strategy (fp8 scale of a row holding NaN: 0.005); a where() guard on a reduction result
(``abs(mx) == inf``) was dropped by sympy; top-k picked masked lanes (index n, n+1, ...) over NaN.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from fuser_core.catalog import load_catalog_spec
from fuser_core.codegen.module import generate
from fuser_core.codegen.plan import BASELINE, STRATEGIES, default_config, loop_axis
from fuser_core.derive import derive_cascade
from fuser_core.edge_rows import edge_inputs, special_mismatches
from fuser_core.problem import bind_dtypes
from fuser_core.reference import evaluate, random_inputs
from fuser_core.runner import interpreter_quiet, run
from fuser_core.spec import load_spec

SHAPES = {
    "safe_softmax": {"m": 6, "n": 37}, "logsumexp": {"m": 6, "n": 37}, "layernorm": {"t": 6, "c": 37},
    "rmsnorm": {"t": 6, "c": 37}, "cross_entropy": {"t": 6, "v": 37}, "fp8_quant_per_token": {"t": 6, "c": 37},
    "moe_routing": {"t": 6, "x": 37}, "fp8_quant_gemm": {"m": 6, "k": 37, "n": 16},
    "attention": {"b": 1, "h": 1, "m": 6, "n": 37, "d": 16, "e": 16},
    "attention_causal": {"b": 1, "h": 1, "m": 6, "n": 37, "d": 16, "e": 16},
    "attention_sink": {"b": 1, "h": 1, "m": 6, "n": 37, "d": 16, "e": 16},
}
CONFIG_BLOCK = 16  # tiles of 16 along the reduced axis: three tiles and a partial one for 37


def as_numpy(t) -> np.ndarray:
    return (t.float() if t.dtype.is_floating_point else t).cpu().numpy().astype(np.float64)


def assert_same_specials(got: np.ndarray, want: np.ndarray, where: str) -> None:
    wrong = special_mismatches(got, want)
    assert not wrong, f"{where}: {'; '.join(wrong)} differ"


def check(spec, shape: dict[str, int], strategies=(*STRATEGIES, BASELINE)) -> None:
    derivation = derive_cascade(spec)
    inputs = edge_inputs(spec, shape)
    with np.errstate(all="ignore"):
        reference = evaluate(spec, shape, inputs)
    axis, _ = loop_axis(spec)
    selections = {f"{s.name}.indices" for s in spec.steps if s.reduce == "topk"}
    for strategy in strategies:
        config = None
        if strategy in ("streaming_fused", "split_fused"):
            config = default_config(spec, derivation, strategy, shape)
            config = type(config).from_dict({**config.to_dict(), "blocks": {**config.blocks, axis: CONFIG_BLOCK}})
        with interpreter_quiet():
            result = run(spec, shape, "float32", inputs, strategy=strategy, config=config, derivation=derivation)
        exact = strategy not in ("streaming_fused", "split_fused") or derivation.exact
        for part, want in reference.items():
            got = np.broadcast_to(as_numpy(result.outputs[part]), np.shape(want))
            want = np.asarray(want, np.float64)
            where = f"{spec.name} {strategy} {part}"
            if part in selections and strategy in ("streaming_fused", "split_fused"):
                # a fused top-k ranks by running values: where every final value is NaN (the anchor ended
                # infinite), the reference orders by index and the kernel by the values it saw (SPEC.md)
                values = np.asarray(reference[part.replace(".indices", ".values")])
                rows = ~np.isnan(values).all(axis=-1)
                got, want = got[rows], want[rows]
                assert got.shape[0] > 0, where
            assert_same_specials(got, want, where)
            if not exact:  # casts on running values (fp8 with a running amax): its numbers are judged elsewhere
                continue
            both = np.isfinite(got) & np.isfinite(want)
            err = np.abs(got[both] - want[both]) / (1.0 + np.abs(want[both]))
            assert err.max(initial=0.0) <= 1e-4, f"{where}: finite values off by {err.max():.2e}"


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_strategy_gives_the_references_special_values(name: str) -> None:
    check(load_catalog_spec(name), SHAPES[name])


def test_the_catalogs_softmax_and_logsumexp_match_torch_on_special_rows() -> None:
    """softmax of an all -inf row (and of one holding +inf) is NaN; logsumexp of an all -inf row is
    -inf, of one holding +inf is inf, of one holding NaN NaN: torch's answers, in every strategy."""
    for name, op, out in (("safe_softmax", lambda x: torch.softmax(x, -1), "y"),
                          ("logsumexp", lambda x: torch.logsumexp(x, -1), "lse")):
        spec, shape = load_catalog_spec(name), SHAPES[name]
        inputs = edge_inputs(spec, shape)
        want = op(torch.from_numpy(inputs["x"]).double()).numpy()
        for strategy in (*STRATEGIES, BASELINE):
            with interpreter_quiet():
                got = as_numpy(run(spec, shape, "float32", inputs, strategy=strategy).outputs[out])
            assert_same_specials(got, want, f"{name} {strategy} vs torch")
            both = np.isfinite(want)
            np.testing.assert_allclose(got[both], want[both], rtol=1e-5, atol=1e-6)


def test_a_where_guard_on_a_reduction_survives_simplification() -> None:
    """sympy takes symbols as finite reals and folded ``abs(mx) == inf`` to False, printing
    ``exp(x - mx)`` for ``exp(x - where(abs(mx) == inf, 0, mx))``; it is kept, and decided only on a
    running anchor, which safe_anchor keeps finite (no per-element guard in the streamed loop)."""
    raw = {"foldwise": 1, "name": "guarded_log_softmax", "inputs": {"x": {"dims": ["m", "n"]}},
           "steps": [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
                     {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - where(abs(mx) == inf, 0, mx))"},
                     {"name": "y", "expr": "x - where(abs(mx) == inf, 0, mx) - log(den)"}],
           "outputs": ["y"]}
    spec = load_spec(raw)
    derivation = derive_cascade(spec)
    shape = {"m": 6, "n": 37}
    for strategy in ("row_resident", "multi_pass"):
        text = generate(spec, derivation, strategy, shape, default_config(spec, derivation, strategy, shape),
                        bind_dtypes(spec, "float32")).source
        assert re.search(r'tl\.abs\(mx\w*\) == float\("inf"\)', text), strategy
    streamed = generate(spec, derivation, "streaming_fused", shape, default_config(spec, derivation, "streaming_fused", shape),
                        bind_dtypes(spec, "float32")).source
    lines = streamed.split("for start in range(")[1].splitlines()[1:]
    loop = "\n".join(line for line in lines[:next(i for i, line in enumerate(lines) if not line.startswith("        "))])
    assert "safe_anchor(" in loop and "tl.abs(" not in loop, loop
    check(spec, shape)



@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_zero_size_dim_gives_empty_outputs_or_identities_without_a_launch(name: str, monkeypatch) -> None:
    """An empty batch (the first dim) gives empty outputs; an empty reduced axis gives each
    reduction's identity, then the formula (logsumexp: -inf, as torch.logsumexp of nothing), or a
    clear error where nothing can be selected (argmax, a top-k with k > 0). No kernel is generated."""
    import fuser_core.codegen.module as module
    from fuser_core.problem import ShapeError, bind_shape

    def no_launch(*a, **k):
        raise AssertionError("a kernel was generated for a zero-size problem")

    monkeypatch.setattr(module, "generate", no_launch)
    spec, shape = load_catalog_spec(name), SHAPES[name]
    axis, _ = loop_axis(spec)
    for zero in dict.fromkeys((spec.dims[0], axis)):
        bound = {**shape, zero: 0}
        try:
            bind_shape(spec, bound, allow_empty=True)
        except ShapeError as err:
            assert zero in str(err) and any(s.reduce == "topk" for s in spec.steps), (name, zero, err)
            continue
        inputs = random_inputs(spec, bound, np.random.default_rng(1), "float32")
        with np.errstate(all="ignore"):
            reference = evaluate(spec, bound, inputs)
        got = run(spec, bound, "float32", inputs, strategy="streaming_fused").outputs
        for part, want in reference.items():
            g = as_numpy(got[part])
            assert g.shape == want.shape, (name, zero, part)
            assert_same_specials(g, want, f"{name} {zero}=0 {part}")
            np.testing.assert_allclose(g[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-6)
    if name == "logsumexp":  # torch's own answer for an empty axis
        lse = as_numpy(run(spec, {"m": 3, "n": 0}, "float32", {"x": np.zeros((3, 0), np.float32)}).outputs["lse"])
        np.testing.assert_array_equal(lse, torch.logsumexp(torch.zeros(3, 0), -1).numpy())
    with pytest.raises(ShapeError, match="positive"):  # tuning keeps sizes from 1: an empty problem has no kernel
        bind_shape(spec, {**shape, axis: 0})


def test_a_padding_and_a_causal_mask_compose_in_one_fused_kernel() -> None:
    """``where(index(n) <= index(m) and index(n) < kv_len, s, -inf)``: fused (the same nested as two
    where()s is not: its bound check cannot see through the outer branch), every strategy equal
    to the reference. A sequence of length 0 (every key masked) gives 0, as FlashAttention does: a
    mask on an index input drops the masked keys (issue 24), and a sum over no key is 0."""
    from tests.fuser_core.test_gpu_compile import PADDED_CAUSAL

    spec = load_spec(PADDED_CAUSAL)
    derivation = derive_cascade(spec)
    assert derivation.fusible, {k: f.reason for k, f in derivation.forms.items()}
    shape = {"b": 3, "h": 2, "m": 9, "n": 37, "d": 16, "e": 8}
    inputs = random_inputs(spec, shape, np.random.default_rng(3), "float32")
    inputs["kv_len"] = np.array([37, 20, 0])
    reference = evaluate(spec, shape, inputs)
    assert (reference["o"][2] == 0).all() and np.isfinite(reference["o"]).all()
    for strategy in (*STRATEGIES, BASELINE):
        with interpreter_quiet():
            got = as_numpy(run(spec, shape, "float32", inputs, strategy=strategy, derivation=derivation).outputs["o"])
        assert_same_specials(got, reference["o"], strategy)
        np.testing.assert_allclose(got, reference["o"], rtol=1e-4, atol=1e-5, err_msg=strategy)
