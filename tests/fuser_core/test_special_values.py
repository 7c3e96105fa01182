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
import sympy as sp
import torch

from fuser_core.catalog import load_catalog_spec
from fuser_core.certificate import certify
from fuser_core.codegen.module import generate
from fuser_core.codegen.plan import BASELINE, STRATEGIES, KernelConfig, default_config, loop_axis
from fuser_core.derive import derive_cascade
from fuser_core.edge_rows import edge_inputs, special_mismatches
from fuser_core.problem import bind_dtypes
from fuser_core.reference import evaluate, random_inputs
from fuser_core.runner import interpreter_quiet, run
from fuser_core.spec import load_spec
from tests.support.cascades import red, spec_of

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
            # nothing to select (a top-k over an empty axis), or a shape the spec excludes (m <= n)
            assert zero in str(err) and (any(s.reduce == "topk" for s in spec.steps) or spec.constraints), (name, zero, err)
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


# --- regressions the cascade fuzzer (tests/support/fuzz_strategies.py) found, each with the smallest
# spec that showed it (small specs built with tests/support/cascades.py)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_not_of_a_comparison_keeps_ieee_nan():
    """sympy turns not (g < 0.5) into g >= 0.5, which a NaN g makes False where the spec's `not` gives True
    (CI fuzz, nan family: the max of where(not g < 0.5, x, -inf) was -inf, the reference NaN); `not` of an
    ordered comparison is now the opposite comparison or an unordered pair, in every strategy."""
    spec = spec_of([red("y", "max", "where(not x < 0.5 and not (x > 3 or x < -3), x * 2, -inf)", over="n")], ["y"],
                   inputs={"x": {"dims": ["m", "n"]}})
    x = np.random.default_rng(0).standard_normal((3, 13)).astype(np.float32)
    x[0, 4] = np.nan
    ref = evaluate(spec, {"m": 3, "n": 13}, {"x": x.astype(np.float64)})["y"]
    assert np.isnan(ref[0]) and np.isfinite(ref[1:]).all()
    for strategy in ("row_resident", "streaming_fused", "multi_pass", "unfused_chain"):
        got = run(spec, {"m": 3, "n": 13}, "float32", {"x": x}, strategy=strategy).outputs["y"].double().numpy()
        assert np.isnan(got[0]) and np.allclose(got[1:], ref[1:]), (strategy, got, ref)
    assert certify(derive_cascade(spec), trials=4).holds


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
@pytest.mark.parametrize("expr", ["(x - x) - mx", "(x + 1) - (x - x) + mx * 0", "x * 0 + (mx + x) - x"])
def test_cancelled_symbols_keep_their_nan(expr):
    """sympy simplifies x - x to 0, x * 0 to 0 and (a + b) - b to a, so an infinite x gave a finite kernel value
    where the formula as written (IEEE) gives NaN, in every strategy (the masked and NaN families refused
    row_resident too). The conversion keeps nan_of(x) (0 for finite x, NaN otherwise) for a symbol it dropped."""
    from fuser_core.accuracy import accuracy_check
    from fuser_core.symbolic import NanOf

    spec = spec_of([red("mx", "max", "x"), red("s", "sum", f"({expr}) ** 2")], ["s"])
    d = derive_cascade(spec)
    assert d.forms["s"].integrand.atoms(NanOf), d.forms["s"].integrand
    # (nan_of(x) - mx)^2 centres 0 on the running max, which 0 may exceed: not fused (a Taylor form could cancel)
    fused = ("streaming_fused",) if d.forms["s"].fused else ()
    assert fused or "both sides" in d.forms["s"].reason
    for strategy in ("row_resident", *fused, "multi_pass"):
        verdict = accuracy_check(spec, {"m": 3, "n": 9}, families=("masked", "nan"), strategy=strategy)
        assert verdict["passed"], (strategy, verdict["families"])
    assert certify(d, trials=4).holds


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_cancelled_elementwise_output_is_nan_where_its_input_is_infinite():
    """p = -(kk - kk) printed as 0.0: the reference's p is NaN where kk is -inf."""
    spec = spec_of([{"name": "p", "expr": "(-(kk - kk))"}, red("z", "max", "where(kk > 0, kk, -inf)", over="j2")],
                   ["p", "z"], inputs={"kk": {"dims": ["j2"]}})
    x = np.array([1.0, -np.inf, np.nan, 2.0])
    out = run(spec, {"j2": 4}, "float32", {"kk": x}, strategy="row_resident").outputs
    got = out["p"].numpy()
    assert got[0] == 0 and got[3] == 0 and np.isnan(got[1]) and np.isnan(got[2])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_welford_move_between_one_infinity_is_no_move():
    """CI fuzz after the list ``over`` draws: ``sum(x + T)`` with ``T = sum x`` adds count[old] (T[new] - T[old])
    per tile (then a shifted form, now Taylor's, its first-order coefficient being the count). On a row holding
    -inf the running estimate of T is -inf before and after a tile, and the move was inf - inf = NaN where the
    reference has -inf. ``shift_term`` (``nan_to_zero`` in the shifted form) takes that move as none (a NaN of
    the data is in the accumulator already: its contributions read the running estimate)."""
    from fuser_core.accuracy import accuracy_check
    from fuser_core.realisation import ShiftTerm

    spec = spec_of([red("T", "sum", "x"), red("tl", "sum", "x + T")], ["tl"])
    d = derive_cascade(spec)
    assert d.forms["tl"].kind == "taylor" and d.forms["tl"].realisation.accumulators[0].moved.atoms(ShiftTerm)
    for strategy in ("streaming_fused", "split_fused"):
        config = KernelConfig({"n": 4}, split=2 if strategy == "split_fused" else 1)
        verdict = accuracy_check(spec, {"m": 3, "n": 13}, families=("masked", "nan", "normal"), strategy=strategy,
                                 config=config)
        assert verdict["passed"], (strategy, verdict["families"])
    assert certify(d, trials=4).holds


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_masked_lane_whose_term_overflows_float32_is_masked():
    """CI fuzz: T = sum exp(mx - bias) * bias with mx = min(bias), its tail lanes loaded as 0: the term there is
    0 * exp(mx - 0), which float64 gives as 0 for any anchor the old check tried, but float32 as 0 * inf = NaN once
    the running min passes 88.7 (inputs near 100). The check now evaluates in float32 at anchors up to 1e30. (The
    argmin keeps bias from being loaded with the min's fill, which would mask the lanes anyway.)"""
    from fuser_core.accuracy import accuracy_check

    spec = spec_of([red("nblk", "argmin", "bias ** 3"), red("mx", "min", "bias"), red("T", "sum", "exp(mx - bias) * bias"),
                    red("top", "topk", "where(bias < 0, bias + T, -inf)", k=3, **{"as": "kdim"})], ["nblk", "top"],
                   inputs={"bias": {"dims": ["n"]}})
    verdict = accuracy_check(spec, {"n": 13}, families=("offset100", "normal"), strategy="streaming_fused",
                             config=KernelConfig({"n": 16}))
    assert verdict["passed"], verdict["families"]


def fused_pass_specials(spec, shape, block, families=("masked", "nan", "normal")):
    """The fused strategies (split in two) pass the accuracy bar, special values included."""
    from fuser_core.accuracy import accuracy_check

    axis, _ = loop_axis(spec)
    for strategy in ("streaming_fused", "split_fused"):
        config = KernelConfig({axis: block}, split=2 if strategy == "split_fused" else 1)
        verdict = accuracy_check(spec, shape, families=families, strategy=strategy, config=config)
        assert verdict["passed"], (strategy, verdict["families"])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_factored_dependency_that_ends_infinite_takes_the_fallback_pass():
    """Fuzz seed 60: ``sum(a * mask)`` with ``mask = sum(a)`` is kept as ``mask * sum(a)``. On a row half masked
    to -inf, mask = -inf and the formula's terms are +inf (a = -inf) and -inf (a finite, positive) or +inf: NaN,
    where the factored form gives +inf. The fused kernels now recompute such a row with a pass of the formula
    (its trip count is 0 where the dependency is finite)."""
    from fuser_core.codegen.module import generate
    from fuser_core.problem import bind_dtypes

    spec = spec_of([red("mask", "sum", "x"), red("acc", "sum", "x * mask")], ["acc"])
    d = derive_cascade(spec)
    assert d.forms["acc"].kind == "scaled"
    source = generate(spec, d, "streaming_fused", {"m": 3, "n": 13}, KernelConfig({"n": 4}), bind_dtypes(spec, "float32")).source
    assert "fallback = tl.where(tl.abs(mask_acc) == float('inf'), 1, 0)" in source
    assert "range(0, (size_n) * fallback, BLOCK_n)" in source
    fused_pass_specials(spec, {"m": 3, "n": 13}, 4)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_max_offset_that_ends_infinite_takes_the_fallback_pass():
    """Fuzz seed 61: ``max(k + v)`` with ``v = max(w - k)`` is kept as ``max(k) + v`` (v anchored at its running
    value). Where k is half -inf, v = +inf and the formula's max over k + inf holds -inf + inf = NaN, which max
    propagates; the offset form gives +inf."""
    spec = spec_of([red("v", "max", "w - x"), red("acc", "max", "x + v")], ["acc"],
                   inputs={"x": {"dims": ["n", "m"]}, "w": {"dims": ["n"]}})
    fused_pass_specials(spec, {"m": 2, "n": 13}, 4)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_taylor_sum_of_infinite_data_with_a_centre_crossing_zero_takes_the_fallback_pass():
    """Fuzz seed 61: ``sum(k - (c + mn * v))`` with ``mn = min(x)`` streams ``-mn~ * v`` at the running min,
    whose sign may change between tiles: at v = -inf the tiles add +inf and -inf (NaN), where the formula
    has one sign. A non-finite Taylor or shifted result is computed again."""
    spec = spec_of([red("mn", "min", "x"), red("s", "sum", "k - (0.4 + mn * v)"), red("out", "min", "v")], ["s", "out"],
                   inputs={"v": {"dims": ["m", "n"]}, "k": {"dims": ["n"]}, "x": {"dims": ["n"]}})
    fused_pass_specials(spec, {"m": 2, "n": 13}, 4, families=("masked", "normal"))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_topk_offset_by_a_nan_sum_ranks_as_the_formula():
    """Fuzz seed 61: ``topk(erf(a) * c + offs)`` with ``offs = sum(a)`` ranks erf(a) and adds offs at the end.
    Where offs is NaN every value is NaN and the formula's top-k is the first k indices."""
    spec = spec_of([red("offs", "sum", "x"), red("best", "topk", "erf(x) * 0.7 + offs", k=2, **{"as": "slot"})],
                   ["best"], inputs={"x": {"dims": ["m", "n"]}})
    for strategy in ("streaming_fused", "split_fused"):
        config = KernelConfig({"n": 4}, split=2 if strategy == "split_fused" else 1)
        x = np.random.default_rng(0).normal(size=(2, 13))
        x[1, 5] = np.nan
        got = run(spec, {"m": 2, "n": 13}, "float32", {"x": x}, strategy=strategy, config=config).outputs
        assert got["best.indices"][1].tolist() == [0, 1], strategy
        assert torch.isnan(got["best.values"][1]).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_an_elementwise_output_of_a_recomputed_top_k_is_written_again():
    """Fuzz seed 60: ``acc = sel.indices * tanh(a)`` with ``sel = topk(v - h)``, ``h = max(v)``: on a NaN row the
    fallback pass ranked again, but acc (an elementwise output reading ``sel.indices``) kept the fused value."""
    spec = spec_of([red("h", "max", "v", over="d"), red("sel", "topk", "v - h", over="d", k=1, **{"as": "jj"}),
                    {"name": "acc", "expr": "sel.indices * tanh(a)"}], ["acc"],
                   inputs={"v": {"dims": ["n", "d"]}, "a": {"dims": ["d"]}})
    fused_pass_specials(spec, {"n": 2, "d": 13, "jj": 1}, 4, families=("nan", "masked"))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_comparison_sympy_decides_for_finite_values_is_kept_as_written():
    """CI fuzz: ``where(c, acc, 0) != log2(sigmoid(w) + 1)`` was folded to ``where(c, acc != L, 0 != L)``, and sympy
    took ``0 != L`` for True (sigmoid(w) > 0 for a finite w). At w = -inf, L is 0: the formula's condition is false,
    the kernels took the other branch (0.1 expected, -1.4 given, every strategy). Comparisons of values that may be
    infinite or NaN are kept as written, and a where() inside one is folded branch by branch."""
    from fuser_core.accuracy import accuracy_check
    from fuser_core.symbolic import InfCompare, compare

    w = sp.Symbol("w", real=True)
    assert isinstance(compare("!=", sp.Integer(0), sp.log(1 / (1 + sp.exp(-w)) + 1)), InfCompare)
    assert compare("<", sp.Symbol("index(n)", integer=True), sp.Symbol("index(n)", integer=True) + 1) == sp.true
    spec = spec_of([red("stride", "sum", "w", over="j2"), red("acc", "sum", "where(w > 0, maximum(w, stride), 0)", over="j2"),
                    {"name": "count", "expr": "round(where(where(-1.5 / (1 - 1.5 * acc) <= w, acc, 0) != log2(sigmoid(w) + 1), "
                                              "-1.5, 0) * 4) * 0.25 + 0.1"}],
                   ["stride", "count"], inputs={"w": {"dims": ["j2"]}})
    for strategy in ("row_resident", "multi_pass"):
        verdict = accuracy_check(spec, {"j2": 13}, families=("masked", "normal"), strategy=strategy)
        assert verdict["passed"], (strategy, verdict["families"])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_an_or_of_complementary_comparisons_is_false_for_nan():
    """Fuzz seed 72: ``where(l * q <= l or l < q * l, q * a, 0)``: sympy folds the ``or`` of two complementary
    comparisons to True, but for a NaN ``l`` both are false and the formula takes 0; every kernel added ``q * a``
    there (28.5 against 19.1). Where sympy decides an ``or`` so, its comparisons of values are kept as written."""
    from fuser_core.accuracy import accuracy_check
    from fuser_core.symbolic import InfCompare, SymbolicSpec

    spec = spec_of([red("amax", "sum", "where((logits * q) <= logits or logits < (q * logits), q * a, 0)"),
                    red("tl", "sum", "(q - amax) ** 2")], ["tl"],
                   inputs={"logits": {"dims": ["n"]}, "q": {"dims": ["n"]}, "a": {"dims": ["n"]}})
    assert SymbolicSpec(spec).integrand(spec.step("amax")).atoms(InfCompare)
    for strategy in ("row_resident", "multi_pass"):
        verdict = accuracy_check(spec, {"n": 13}, families=("nan", "normal"), strategy=strategy)
        assert verdict["passed"], (strategy, verdict["families"])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_cancelled_symbol_adds_nan_only_for_its_own_infinity():
    """Fuzz seed 73: ``(-v) + (v - q)`` is ``-q`` to sympy, and IEEE's NaN for an infinite v was kept as
    ``nan_of(v - q)``, NaN at q = -inf too, where the formula gives inf (a min over such values then NaN instead
    of a number). The kept NaN now reads the lost symbol's part of the operand: ``nan_of(v)``."""
    spec = spec_of([red("amax", "min", "(-v) + (v - q)", over="e")], ["amax"],
                   inputs={"q": {"dims": ["e", "j2"]}, "v": {"dims": ["c"]}})
    q = np.array([[-np.inf, -0.1], [-np.inf, 0.3], [-np.inf, -np.inf], [-np.inf, 0.9]])
    v = np.array([-0.7])
    shape = {"e": 4, "j2": 2, "c": 1}
    ref = evaluate(spec, shape, {"q": q, "v": v})["amax"].ravel()
    assert np.isposinf(ref[0]) and np.isfinite(ref[1])
    for strategy in ("row_resident", "multi_pass"):
        got = run(spec, shape, "float32", {"q": q, "v": v}, strategy=strategy).outputs["amax"].double().numpy().ravel()
        assert np.isposinf(got[0]) and np.isclose(got[1], ref[1]), (strategy, got)
    v_inf = np.array([np.inf])  # an infinite v still gives the formula's NaN
    assert np.isnan(run(spec, shape, "float32", {"q": q, "v": v_inf}, strategy="row_resident").outputs["amax"]).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_an_output_reduced_over_another_axis_is_written_again_after_a_fallback():
    """Fuzz seed 73: ``h = max over t of where(index(e) == g, q, 0)`` with ``g`` an argmax over e whose offset
    ``best`` is NaN: the fallback pass redid g, but h, an output reduced over another axis from it, kept the fused
    g's value (NaN at a position the reference has 0). Outputs reduced over other axes that read a redone step
    are computed and written again."""
    from fuser_core.accuracy import accuracy_check

    spec = spec_of([red("best", "sum", "q", over="e"), red("g", "argmax", "(-q) * 2 + best", over="e"),
                    red("h", "max", "where(index(e) == g, q, 0)", over="t")], ["h"],
                   inputs={"q": {"dims": ["m", "e", "t"]}})
    verdict = accuracy_check(spec, {"m": 2, "e": 13, "t": 5}, families=("nan", "normal"), strategy="streaming_fused",
                             config=KernelConfig({"e": 16}, per_lane=False))
    assert verdict["passed"], verdict["families"]
