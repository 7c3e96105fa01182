"""The float64 reference evaluator against independent NumPy / torch computations."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import scipy.special
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from fuser_core.derive import derive_cascade
from fuser_core.expr import parse_expr_text
from fuser_core.reference import (
    MAX_ELEMENTS,
    Evaluator,
    ShapeError,
    bind_shape,
    cast_to,
    evaluate,
    param_values,
    random_inputs,
)
from fuser_core.certificate import certify
from fuser_core.catalog import PACKAGED_DIR
from fuser_core.spec import load_spec
from tests.support import cascades

CATALOG = PACKAGED_DIR
F8 = ml_dtypes.float8_e4m3fn


@pytest.fixture(scope="session")
def catalog_dir() -> Path:
    return CATALOG


def catalog(name: str):
    return load_spec((CATALOG / f"{name}.json").read_text())


def spec_of(inputs, steps, outputs, params=None):
    return load_spec({"foldwise": 1, "name": "t", "inputs": inputs, "params": params or {},
                      "steps": steps, "outputs": outputs})


def rng(seed=0):
    return np.random.default_rng(seed)


def close(a, b, rtol=1e-12, atol=1e-12):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


SMALL = {
    "safe_softmax": {"m": 3, "n": 7},
    "logsumexp": {"m": 4, "n": 9},
    "attention": {"b": 2, "h": 3, "m": 5, "n": 7, "d": 4, "e": 6},
    "attention_causal": {"b": 2, "h": 2, "m": 6, "n": 6, "d": 4, "e": 3},
    "attention_sink": {"b": 2, "h": 3, "m": 5, "n": 7, "d": 4, "e": 6},
    "moe_routing": {"t": 5, "x": 12},
    "layernorm": {"t": 4, "c": 10},
    "rmsnorm": {"t": 4, "c": 10},
    "cross_entropy": {"t": 6, "v": 11},
    "fp8_quant_per_token": {"t": 5, "c": 16},
    "fp8_quant_gemm": {"m": 4, "k": 16, "n": 3},
    "group_norm": {"n": 2, "g": 3, "c": 4, "p": 5},
    # the serving catalog: its references against torch are tests/fuser_core/test_serving_catalog.py
    **{name: {"b": 2, "g": 2, "r": 2, "m": 3, "n": 7, "d": 4, "e": 5} for name in (
        "attention_gqa", "attention_padded", "attention_varlen", "attention_sliding_window", "attention_softcap")},
    "cross_entropy_ignore": {"t": 6, "v": 11},
    "rmsnorm_residual": {"t": 4, "c": 10},
    "swiglu_fp8_per_token": {"t": 5, "f": 16},
    # issue 36: their reference tests against vLLM's formulas are in test_serving_catalog.py
    "rmsnorm_fp8_per_token": {"t": 4, "c": 10},
    "rmsnorm_residual_fp8_per_token": {"t": 4, "c": 10},
    "rmsnorm_fp8_per_block": {"t": 4, "g": 3, "c": 8},
    # a paged KV cache (issue 36): its reference test against torch, pages gathered, is test_paged_attention.py
    "attention_paged": {"b": 2, "g": 2, "r": 2, "m": 3, "n": 7, "d": 4, "e": 5},
    "linear_cross_entropy": {"t": 6, "v": 11, "d": 5},  # an LM head and its loss (issue 39)
}


def test_every_catalog_spec_evaluates(catalog_dir):
    names = sorted(p.stem for p in catalog_dir.glob("*.json") if p.stem != "suites")
    assert set(names) == set(SMALL), "add a small shape (and a reference test) for each catalog spec"
    for name in names:
        spec = catalog(name)
        out = evaluate(spec, SMALL[name], random_inputs(spec, SMALL[name], rng()))
        assert list(out) == list(spec.output_parts)
        for part, arr in out.items():
            step = spec.step(part.split(".")[0])
            bound = bind_shape(spec, SMALL[name])
            assert arr.shape == tuple(bound[d] for d in step.dims), (name, part)
            assert arr.dtype == (np.int64 if part.endswith(".indices") or step.is_integer else np.float64)
            assert np.isfinite(arr).all(), (name, part)


# ---------------------------------------------------------------- catalog vs independent code


def test_safe_softmax():
    x = rng().standard_normal((3, 7)) * 5
    y = evaluate(catalog("safe_softmax"), {"m": 3, "n": 7}, {"x": x})["y"]
    e = np.exp(x - x.max(axis=1, keepdims=True))
    close(y, e / e.sum(axis=1, keepdims=True))
    close(y, torch.softmax(torch.tensor(x), dim=1).numpy())


def test_logsumexp():
    x = rng(1).standard_normal((4, 9)) * 30
    lse = evaluate(catalog("logsumexp"), {"m": 4, "n": 9}, {"x": x})["lse"]
    close(lse, scipy.special.logsumexp(x, axis=1))


@pytest.mark.parametrize("name", ["attention", "attention_causal"])
@pytest.mark.parametrize("mn", [(5, 7), (6, 6), (7, 5)])
def test_attention_vs_sdpa(name, mn):
    m, n = mn
    shape = {"b": 2, "h": 3, "m": m, "n": n, "d": 4, "e": 6}
    spec = catalog(name)
    ins = random_inputs(spec, shape if m <= n else {**shape, "n": m}, rng(2))
    ins = {**ins, "k": ins["k"][:, :, :n], "v": ins["v"][:, :, :n]}
    q, k, v = (torch.tensor(ins[x]) for x in "qkv")
    if name == "attention_causal" and m > n:  # the m queries are the last m of the n keys: m <= n
        with pytest.raises(ShapeError, match=r"^shape\.m: m = 7 and n = 5: the spec takes only m <= n"):
            evaluate(spec, shape, ins)
        return
    o = evaluate(spec, shape, ins)["o"]
    mask = causal_lower_right(m, n) if name == "attention_causal" else None  # aligned bottom-right
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert o.shape == (2, 3, m, 6)
    close(o, want.numpy())


def test_attention_sink_is_softmax_over_scores_and_the_sink_with_its_column_dropped():
    """gpt-oss's sinks (FlashAttention-3's s_aux): softmax over [q k^T * scale, sink], the sink's column
    dropped, times v."""
    shape = SMALL["attention_sink"]
    spec = catalog("attention_sink")
    ins = random_inputs(spec, shape, rng(3))
    o = evaluate(spec, shape, ins)["o"]
    q, k, v = (torch.tensor(ins[x]) for x in "qkv")
    sink = torch.tensor(ins["sink"]).reshape(1, -1, 1, 1).expand(2, 3, 5, 1)
    scores = q @ k.transpose(-1, -2) / shape["d"] ** 0.5
    p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    close(o, (p @ v).numpy())


def test_attention_param():
    assert param_values(catalog("attention"), {"b": 1, "h": 1, "m": 1, "n": 1, "d": 64, "e": 3}) == {"scale": 0.125}


def test_moe_routing_vs_torch_topk():
    spec = catalog("moe_routing")
    shape = {"t": 5, "x": 12}  # the 'as' dim j may be omitted: it is k
    ins = random_inputs(spec, shape, rng(3))
    out = evaluate(spec, shape, ins)
    values, indices = torch.topk(torch.softmax(torch.tensor(ins["logits"]), dim=1), k=8, dim=1)
    close(out["gate.values"], values.numpy())
    np.testing.assert_array_equal(out["gate.indices"], indices.numpy())
    assert out["gate.indices"].dtype == np.int64


def test_layernorm():
    spec = catalog("layernorm")
    ins = random_inputs(spec, {"t": 4, "c": 10}, rng(4))
    y = evaluate(spec, {"t": 4, "c": 10}, ins)["y"]
    x, g, b = (torch.tensor(ins[n]) for n in ("x", "gamma", "beta"))
    close(y, F.layer_norm(x, (10,), g, b, eps=1e-5).numpy(), rtol=1e-10, atol=1e-10)


def test_rmsnorm():
    spec = catalog("rmsnorm")
    ins = random_inputs(spec, {"t": 4, "c": 10}, rng(5))
    y = evaluate(spec, {"t": 4, "c": 10}, ins)["y"]
    x, w = ins["x"], ins["w"]
    close(y, x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-6) * w)
    close(y, F.rms_norm(torch.tensor(x), (10,), torch.tensor(w), eps=1e-6).numpy(), rtol=1e-10, atol=1e-10)


def test_cross_entropy():
    spec = catalog("cross_entropy")
    shape = {"t": 40, "v": 11}
    ins = random_inputs(spec, shape, rng(6))
    t = ins["target"]
    assert t.dtype == np.int64 and t.min() >= 0 and t.max() < 11 and len(set(t)) > 4  # [0, size(v))
    loss = evaluate(spec, shape, ins)["loss"]
    want = F.cross_entropy(torch.tensor(ins["logits"]), torch.tensor(t), reduction="none")
    close(loss, want.numpy())


def test_linear_cross_entropy():
    spec = catalog("linear_cross_entropy")
    shape = {"t": 40, "v": 11, "d": 5}
    ins = random_inputs(spec, shape, rng(6))
    loss = evaluate(spec, shape, ins)["loss"]
    logits = torch.tensor(ins["h"]) @ torch.tensor(ins["w"]).T
    close(loss, F.cross_entropy(logits, torch.tensor(ins["target"]), reduction="none").numpy())


def test_fp8_quant_per_token():
    spec = catalog("fp8_quant_per_token")
    x = rng(7).standard_normal((5, 16)) * 3
    x[2] = 0.0  # an all-zero row: scale from the 1e-12 floor, q all zero
    out = evaluate(spec, {"t": 5, "c": 16}, {"x": x})
    scale = np.maximum(np.abs(x).max(axis=1), 1e-12) / 448
    q = np.clip(x / scale[:, None], -448, 448).astype(F8).astype(np.float64)
    close(out["scale"], scale)
    np.testing.assert_array_equal(out["q"], q)
    assert np.abs(out["q"]).max() == 448  # each row's absmax lands on the top of the range
    # independent rounding: torch's own float8 conversion
    np.testing.assert_array_equal(out["q"], torch.tensor(x / scale[:, None]).to(torch.float8_e4m3fn).double().numpy())


def test_fp8_quant_gemm():
    spec = catalog("fp8_quant_gemm")
    shape = {"m": 4, "k": 16, "n": 3}
    ins = random_inputs(spec, shape, rng(8), {"a": "float16", "w": "float8_e4m3fn", "w_scale": "float32"})
    assert np.array_equal(ins["w"], ins["w"].astype(F8).astype(np.float64))
    assert np.array_equal(ins["a"], ins["a"].astype(np.float16).astype(np.float64))
    a, w, ws = ins["a"], ins["w"], ins["w_scale"]
    amax = np.maximum(np.abs(a).max(axis=1, keepdims=True), 1e-12)
    qa = (a * 448 / amax).astype(F8).astype(np.float64)
    want = (qa @ w.T) * amax / 448 * ws
    out = evaluate(spec, shape, ins)["out"]
    assert out.shape == (4, 3)  # (m, n): step dims in spec order
    close(out, want)


# ---------------------------------------------------------------- layout and order


def test_output_dim_order_follows_step_dims_not_inputs():
    # spec.dims = (m, n) from b; x arrives as (n, m); y's dims are (m, n)
    spec = spec_of({"b": {"dims": ["m"]}, "x": {"dims": ["n", "m"]}},
                   [{"name": "y", "expr": "x * b"}, {"name": "s", "reduce": "sum", "over": "m", "expr": "y"}],
                   ["y", "s"])
    assert spec.dims == ("m", "n") and spec.step("y").dims == ("m", "n")
    x, b = rng().standard_normal((3, 5)), rng(1).standard_normal(5)
    out = evaluate(spec, {"m": 5, "n": 3}, {"x": x, "b": b})
    close(out["y"], x.T * b[:, None])
    close(out["s"], (x * b).sum(axis=1))


def test_aligned_layout_of_run():
    spec = catalog("moe_routing")
    ev = Evaluator(spec, {"t": 2, "x": 9, "j": 8})
    env = ev.run(random_inputs(spec, {"t": 2, "x": 9}, rng()))
    assert env["logits"].shape == (2, 9, 1)
    assert env["mx"].shape == env["den"].shape == (2, 1, 1)
    assert env["gate.values"].shape == env["gate.indices"].shape == (2, 1, 8)
    a = rng().standard_normal((8, 2))
    np.testing.assert_array_equal(ev.aligned(a, ("j", "t")), a.T.reshape(2, 1, 8))
    np.testing.assert_array_equal(ev.unaligned(ev.aligned(a, ("j", "t")), ("j", "t")), a)
    with pytest.raises(ShapeError):
        ev.aligned(np.zeros((3, 2)), ("j", "t"))


def test_size_one_dims_keep_their_axes():
    spec = catalog("attention")
    shape = {"b": 1, "h": 2, "m": 1, "n": 3, "d": 1, "e": 1}
    assert evaluate(spec, shape, random_inputs(spec, shape, rng()))["o"].shape == (1, 2, 1, 1)


# ---------------------------------------------------------------- reductions


def topk_spec(k):
    return spec_of({"x": {"dims": ["t", "n"]}},
                   [{"name": "g", "reduce": "topk", "over": "n", "k": k, "as": "j", "expr": "x"},
                    {"name": "a", "reduce": "argmax", "over": "n", "expr": "x"},
                    {"name": "b", "reduce": "argmin", "over": "n", "expr": "x"}],
                   ["g", "a", "b"])


def test_topk_ties_lower_index_first():
    x = np.array([[1.0, 3.0, 3.0, 2.0, 3.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    out = evaluate(topk_spec(4), {"t": 2, "n": 6}, {"x": x})
    np.testing.assert_array_equal(out["g.values"], [[3, 3, 3, 2], [0, 0, 0, 0]])
    np.testing.assert_array_equal(out["g.indices"], [[1, 2, 4, 3], [0, 1, 2, 3]])
    np.testing.assert_array_equal(out["a"], [1, 0])  # first occurrence
    np.testing.assert_array_equal(out["b"], [0, 0])
    assert out["a"].dtype == out["g.indices"].dtype == np.int64


def test_topk_k_equals_size_is_a_full_descending_sort():
    x = rng().standard_normal((3, 5))
    out = evaluate(topk_spec(5), {"t": 3, "n": 5, "j": 5}, {"x": x})
    np.testing.assert_array_equal(out["g.indices"], np.argsort(-x, axis=1, kind="stable"))
    np.testing.assert_array_equal(out["g.values"], -np.sort(-x, axis=1))


def test_reductions_min_max_and_index_use():
    spec = spec_of({"x": {"dims": ["m", "n"]}},
                   [{"name": "lo", "reduce": "min", "over": "n", "expr": "x"},
                    {"name": "am", "reduce": "argmax", "over": "n", "expr": "x"},
                    {"name": "y", "expr": "where(index(n) == am, x - lo, 0) + size(n)"}],
                   ["lo", "am", "y"])
    x = rng().standard_normal((3, 4))
    out = evaluate(spec, {"m": 3, "n": 4}, {"x": x})
    close(out["lo"], x.min(axis=1))
    want = np.where(np.arange(4) == x.argmax(axis=1)[:, None], x - x.min(axis=1, keepdims=True), 0) + 4
    close(out["y"], want)
    assert out["y"].dtype == np.float64


# ---------------------------------------------------------------- functions and IEEE behaviour


X = np.array([-3.5, -2.5, -1.0, -0.5, 0.0, 0.5, 1.5, 2.5, 4.0])


@pytest.mark.parametrize("text, fn", [
    ("exp(x)", np.exp), ("exp2(x)", lambda x: 2.0**x), ("log(abs(x) + 1)", lambda x: np.log(np.abs(x) + 1)),
    ("log2(abs(x) + 1)", lambda x: np.log2(np.abs(x) + 1)), ("log1p(abs(x))", lambda x: np.log1p(np.abs(x))),
    ("sqrt(abs(x))", lambda x: np.abs(x) ** 0.5), ("rsqrt(abs(x) + 1)", lambda x: 1 / np.sqrt(np.abs(x) + 1)),
    ("tanh(x)", np.tanh), ("sigmoid(x)", lambda x: torch.sigmoid(torch.tensor(x)).numpy()),
    ("erf(x)", lambda x: np.array([math.erf(v) for v in x])), ("sin(x)", np.sin), ("cos(x)", np.cos),
    ("round(x)", lambda x: np.array([round(v) for v in x], float)),  # Python rounds half to even too
    ("maximum(x, 0.5)", lambda x: np.maximum(x, 0.5)), ("minimum(x, 0.5)", lambda x: np.minimum(x, 0.5)),
    ("clamp(x, -1, 2)", lambda x: np.clip(x, -1, 2)), ("where(x < 0, -x, x * 2)", lambda x: np.where(x < 0, -x, 2 * x)),
    ("where(x >= 0.5, 1, 0)", lambda x: (x >= 0.5) * 1.0), ("where(x != 0, 1, 0)", lambda x: (x != 0) * 1.0),
    ("-x ** 2", lambda x: -(x**2)), ("2 ** -x", lambda x: 2.0 ** (-x)),
    ("(x - 1) / 2 * 3 + x", lambda x: (x - 1) / 2 * 3 + x),
])
def test_functions(text, fn):
    spec = spec_of({"x": {"dims": ["n"]}}, [{"name": "y", "expr": "x"}], ["y"])
    ev = Evaluator(spec, {"n": len(X)})
    got = ev.eval_expr(parse_expr_text(text), {"x": ev.aligned(X, ("n",))})
    close(got, fn(X), rtol=1e-14, atol=1e-15)


def test_ieee_results_without_warnings():
    spec = spec_of({"x": {"dims": ["n"]}},
                   [{"name": "y", "expr": "1 / x"}, {"name": "l", "expr": "log(x)"},
                    {"name": "z", "expr": "x ** 0.5 + exp(x * 1000)"}],
                   ["y", "l", "z"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = evaluate(spec, {"n": 3}, {"x": np.array([0.0, -1.0, 4.0])})
    np.testing.assert_array_equal(out["y"], [np.inf, -1, 0.25])
    np.testing.assert_array_equal(out["l"], [-np.inf, np.nan, np.log(4)])
    assert math.isnan(out["z"][1]) and out["z"][2] == math.inf


def test_params_use_sizes_and_functions():
    spec = spec_of({"x": {"dims": ["n", "d"]}}, [{"name": "y", "expr": "x * a + b * c"}], ["y"],
                   params={"a": 2, "b": "1 / sqrt(size(d))", "c": "exp2(size(n)) - 1"})
    assert param_values(spec, {"n": 3, "d": 16}) == {"a": 2.0, "b": 0.25, "c": 7.0}
    env = Evaluator(spec, {"n": 3, "d": 16}).run({"x": np.ones((3, 16))})
    assert env["b"].shape in ((), (1, 1))
    close(env["y"], np.full((3, 16), 2 + 0.25 * 7))


# ---------------------------------------------------------------- casts


def test_cast_fp8_saturates_like_torch_and_triton():
    x = np.array([448, 449, 463.9, 464, 465, 480, 1e6, np.inf, -1e6, -np.inf, 0.3, -2.7, 1e-9, 2.0**-9])
    got = cast_to(x, "float8_e4m3fn")
    np.testing.assert_array_equal(got[:10], [448] * 8 + [-448, -448])
    np.testing.assert_array_equal(got, torch.tensor(x).to(torch.float8_e4m3fn).double().numpy())
    assert math.isnan(cast_to(np.array([np.nan]), "float8_e4m3fn")[0])
    # ml_dtypes by itself does not saturate: beyond the rounding range it gives NaN
    with np.errstate(all="ignore"):
        assert np.isnan(np.array([464.0 + 1, np.inf]).astype(F8).astype(float)).all()


@pytest.mark.parametrize("dtype, torch_dtype", [
    ("float8_e4m3fn", torch.float8_e4m3fn), ("bfloat16", torch.bfloat16),
    ("float16", torch.float16), ("float32", torch.float32),
])
def test_cast_matches_torch_rounding(dtype, torch_dtype):
    x = np.concatenate([rng().standard_normal(2000) * s for s in (1e-3, 1, 100)])
    x = x.astype(np.float32).astype(np.float64)  # kernels round from float32
    want = torch.tensor(x).to(torch_dtype).double().numpy()
    np.testing.assert_array_equal(cast_to(x, dtype), want)


def test_cast_in_a_step_and_overflow():
    spec = spec_of({"x": {"dims": ["n"]}},
                   [{"name": "h", "expr": 'cast(x, "float16")'}, {"name": "b", "expr": 'cast(x, "bfloat16")'},
                    {"name": "f", "expr": 'cast(x, "float32")'}],
                   ["h", "b", "f"])
    x = np.array([1 / 3, 70000.0, 1e39, -1e300])
    out = evaluate(spec, {"n": 4}, {"x": x})
    np.testing.assert_array_equal(out["h"], [np.float16(1 / 3), np.inf, np.inf, -np.inf])
    assert out["b"][0] == float(ml_dtypes.bfloat16(1 / 3)) and out["b"][2] == np.inf
    np.testing.assert_array_equal(out["f"], [np.float32(1 / 3), 70000, np.inf, -np.inf])


# ---------------------------------------------------------------- random inputs


def test_random_inputs_dtypes_and_layout():
    spec = spec_of({"x": {"dims": ["n", "m"]}, "w": {"dims": ["m"]}, "i": {"dims": ["n"], "kind": "index"}},
                   [{"name": "y", "expr": "where(i == index(m), x * w, 0)"}], ["y"])
    r = random_inputs(spec, {"m": 7, "n": 50}, rng(), {"x": "bfloat16", "w": "float8_e4m3fn"})
    assert r["x"].shape == (50, 7) and r["w"].shape == (7,) and r["i"].shape == (50,)
    assert r["x"].dtype == np.float64 and r["i"].dtype == np.int64
    assert np.array_equal(r["x"], r["x"].astype(ml_dtypes.bfloat16).astype(np.float64))
    assert np.array_equal(r["w"], r["w"].astype(F8).astype(np.float64))
    assert r["i"].min() >= 0 and r["i"].max() < 7
    for dt, npdt in (("float16", np.float16), ("float32", np.float32)):
        x = random_inputs(spec, {"m": 7, "n": 50}, rng(), dt)["x"]
        assert np.array_equal(x, x.astype(npdt).astype(np.float64)) and x.std() > 0.5
    # an index input never compared with index(): values in [0, 4)
    spec2 = spec_of({"x": {"dims": ["n"]}, "i": {"dims": ["n"], "kind": "index"}},
                    [{"name": "y", "expr": "x * i"}], ["y"])
    i = random_inputs(spec2, {"n": 200}, rng())["i"]
    assert set(i) == {0, 1, 2, 3}
    with pytest.raises(ValueError):
        random_inputs(spec2, {"n": 2}, rng(), "float128")


# ---------------------------------------------------------------- shape errors


def shape_error(fn, *args) -> ShapeError:
    with pytest.raises(ShapeError) as info:
        fn(*args)
    return info.value


def test_bind_shape_fills_the_as_dim_and_copies():
    spec = catalog("moe_routing")
    shape = {"t": 3, "x": 10}
    bound = bind_shape(spec, shape)
    assert bound == {"t": 3, "x": 10, "j": 8} and shape == {"t": 3, "x": 10}
    assert bind_shape(spec, {"t": np.int64(3), "x": 10, "j": 8}) == bound


@pytest.mark.parametrize("shape, dim", [
    ({"t": 3}, "x"),                          # missing dim
    ({"t": 0, "x": 10}, "t"),                 # non-positive
    ({"t": -2, "x": 10}, "t"),
    ({"t": True, "x": 10}, "t"),              # bool is not an int
    ({"t": 2.0, "x": 10}, "t"),
    ({"t": "2", "x": 10}, "t"),
    ({"t": 3, "x": 10, "j": 4}, "j"),         # wrong 'as' size
    ({"t": 3, "x": 7}, "x"),                  # k = 8 > size(x)
    ({"t": 3, "x": 10, "zz": 2}, "zz"),       # unknown dim
    ({"t": 2**20, "x": 2**12}, None),         # too many elements
])
def test_bind_shape_errors(shape, dim):
    err = shape_error(bind_shape, catalog("moe_routing"), shape)
    assert err.loc[0] == "shape"
    if dim is not None:
        assert err.loc == ("shape", dim)
        assert dim in str(err)


def test_element_limit_counts_what_a_strategy_stores():
    """Issue 36: inputs and outputs count (every strategy addresses them); a step only where a strategy
    stores it: attention's s (b, h, m, n) at 2**32 elements binds, the fused strategies run it, and the
    unfused chain, which stores s, refuses the shape naming s."""
    from fuser_core.codegen.chain import chain_plan
    from fuser_core.codegen.plan import NotValid, valid_strategies
    from fuser_core.derive import derive_cascade

    spec = catalog("attention")
    shape = {"b": 1, "h": 1, "m": 2**16, "n": 2**16, "d": 1, "e": 1}
    assert 2**32 > MAX_ELEMENTS
    bound = bind_shape(spec, shape)
    valid = valid_strategies(spec, derive_cascade(spec), bound)
    assert valid["streaming_fused"] is None and valid["split_fused"] is None
    with pytest.raises(NotValid, match=r"the unfused chain stores step 's' \(b=1, h=1, m=65536, n=65536\): "
                                       r"4294967296 elements"):
        chain_plan(spec, bound, "float32")
    wide = {**shape, "n": 1, "e": 2**15}  # o (b, h, m, e): an output, 2**31 elements
    assert bind_shape(spec, wide)["e"] == 2**15
    message = str(shape_error(bind_shape, spec, {**wide, "e": 2**15 + 1}))
    assert "output 'o' (b=1, h=1, m=65536, e=32769) would have 2147549184 elements" in message


def test_input_errors_name_the_input():
    spec = catalog("cross_entropy")
    good = {"logits": np.zeros((3, 5)), "target": np.zeros(3, np.int64)}
    shape = {"t": 3, "v": 5}
    assert evaluate(spec, shape, good)["loss"].shape == (3,)
    cases = [
        ({"logits": np.zeros((5, 3)), "target": good["target"]}, "logits"),  # transposed
        ({"logits": np.zeros((3, 5, 1)), "target": good["target"]}, "logits"),
        ({"logits": good["logits"], "target": np.zeros(4, np.int64)}, "target"),
        ({"logits": good["logits"]}, "target"),                                 # missing
        ({"logits": good["logits"], "target": np.zeros(3)}, "target"),          # floats for an index input
        ({**good, "extra": np.zeros(3)}, "extra"),                              # not an input
    ]
    for inputs, name in cases:
        err = shape_error(evaluate, spec, shape, inputs)
        assert err.loc == ("inputs", name), (name, err)


# --- regressions the cascade fuzzer (tests/support/fuzz_strategies.py) found, each with the smallest
# spec that showed it (small specs built with tests/support/cascades.py)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_negated_index_mask_is_evaluated_by_the_reference():
    """CI fuzz: ``where(not index(m) <= index(n), x, -inf)`` is ``index(m) > index(n) or unordered(...)`` (NaN makes
    a comparison false, and `not` true); the reference's masked-element rule could not evaluate the unordered
    part and the certificate raised. It is never true for indices."""
    spec = cascades.spec_of([cascades.red("sel", "max", "where(not index(m) <= index(n), x, -inf)", over="m"),
                             cascades.red("vals", "sum", "(x - sel) ** 2", over="m")],
                            ["vals", "sel"], inputs={"x": {"dims": ["n", "m"]}})
    assert certify(derive_cascade(spec), trials=6).holds
    x = np.arange(12, dtype=np.float64).reshape(3, 4)
    sel = evaluate(spec, {"n": 3, "m": 4}, {"x": x})["sel"].ravel()
    assert sel.tolist() == [3.0, 7.0, 11.0]
