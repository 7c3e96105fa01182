"""Loop bounds derived from masks (fuser_core.codegen.bounds): a program skips the tiles of the
loop axis that every reduction masks away for all of its lanes (causal attention, a KV-cache
mask aligned bottom-right, a sliding window), and gives the float64 reference's results."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

from fuser_core.certificate import certify
from fuser_core.codegen.emit import bound_source
from fuser_core.codegen.bounds import axis_window, first, last, window_of
from fuser_core.codegen.module import generate
from fuser_core.codegen.plan import KernelConfig, make_plan, valid_strategies
from fuser_core.codegen.structure import build_structure
from fuser_core.derive import derive_cascade
from fuser_core.reference import evaluate
from fuser_core.runner import bind_dtypes, run, self_check
from fuser_core.spec import load_spec
from tests.support.cascades import every_strategy_passes, red, spec_of

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

M = sp.Symbol("index(m)", integer=True, nonnegative=True)
N = sp.Symbol("index(n)", integer=True, nonnegative=True)
SIZE_M = sp.Symbol("size(m)", integer=True, positive=True)
SIZE_N = sp.Symbol("size(n)", integer=True, positive=True)


def test_windows_of_linear_masks() -> None:
    assert window_of(N, [M >= N]).hi == last("m") + 1 and window_of(N, [M >= N]).lo is None
    bottom_right = window_of(N, [N <= M + SIZE_N - SIZE_M])
    assert bottom_right.hi == last("m") + SIZE_N - SIZE_M + 1
    band = window_of(N, [sp.And(N <= M, N > M - 16)])
    assert band.lo == first("m") - 15 and band.hi == last("m") + 1
    assert window_of(N, [N < M]).hi == last("m")  # strict: the diagonal itself is masked too
    # not linear in index(n), or index(n) scaled: no window (the loop visits the whole axis)
    assert window_of(N, [N * N <= M]) is None
    assert window_of(N, [2 * N <= M]) is None


def test_a_fold_needs_the_identity_outside_the_mask() -> None:
    c = M >= N
    s = sp.Symbol("s", real=True)
    masked_max = ("max", sp.Piecewise((s, c), (-sp.oo, True)))
    masked_sum = ("sum", sp.Piecewise((sp.exp(s), c), (0, True)))
    assert axis_window("n", [masked_max, masked_sum], counts=False, selections=False).hi == last("m") + 1
    # a sum whose masked entries add 1: every tile still counts
    assert axis_window("n", [("sum", sp.Piecewise((s, c), (1, True)))], counts=False, selections=False) is None
    # a max masked to 0, not -inf: the masked entries can win
    assert axis_window("n", [("max", sp.Piecewise((s, c), (0, True)))], counts=False, selections=False) is None
    # a kernel that counts the values seen, or keeps indices: never skips
    assert axis_window("n", [masked_sum], counts=True, selections=False) is None
    assert axis_window("n", [masked_max], counts=False, selections=True) is None


def attention(name: str, scores: str) -> object:
    inputs = {"q": {"dims": ["b", "h", "m", "d"]}, "k": {"dims": ["b", "h", "n", "d"]}, "v": {"dims": ["b", "h", "n", "e"]}}
    return load_spec({"foldwise": 1, "name": name, "inputs": inputs, "params": {"scale": "1 / sqrt(size(d))"},
                      "steps": [{"name": "s0", "reduce": "sum", "over": "d", "expr": "q * k * scale"},
                                {"name": "s", "expr": scores},
                                {"name": "mx", "reduce": "max", "over": "n", "expr": "s"},
                                {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(s - mx)"},
                                {"name": "o", "reduce": "sum", "over": "n", "expr": "exp(s - mx) * v / den"}],
                      "outputs": ["o"]})


MASKS = {
    "causal": ("where(index(n) <= index(m), s0, -inf)", {"m": 40, "n": 40}),
    # 5 new queries after 65 cached keys: the diagonal aligned bottom-right (FlashAttention >= 2.1, SDPA)
    "kv_cache": ("where(index(n) <= index(m) + size(n) - size(m), s0, -inf)", {"m": 5, "n": 70}),
    # each query sees itself and the 19 keys before it
    "window": ("where(index(n) > index(m) - 20, where(index(n) <= index(m), s0, -inf), -inf)", {"m": 70, "n": 70}),
}


# the sliding window's nested where does not fuse yet (derive: "exp(-mx + s0) is not bounded by the
# running value of mx"), so it runs multi_pass only
CASES = [(m, s) for m in sorted(MASKS) for s in ("streaming_fused", "split_fused", "multi_pass")
         if m != "window" or s == "multi_pass"]


@pytest.mark.parametrize("mask,strategy", CASES)
@pytest.mark.parametrize("rows", [1, 16])
def test_masked_attention_skips_tiles_and_matches_float64(mask: str, strategy: str, rows: int) -> None:
    cond, sizes = MASKS[mask]
    spec = attention(f"attention_{mask}", cond)
    shape = {"b": 1, "h": 2, "d": 16, "e": 16, **sizes}
    blocks = {"n": 16, "e": 16, **({"m": rows} if rows > 1 else {})}
    cfg = KernelConfig(blocks, split=3 if strategy == "split_fused" else 1)
    derivation = derive_cascade(spec)
    source = generate(spec, derivation, strategy, shape, cfg, bind_dtypes(spec, "float32")).source
    assert "this program's lanes see no n from" in source  # the loop stops at the mask's edge
    if mask == "window":
        assert "this program's lanes see no n before" in source  # and starts at the window's
    if strategy == "streaming_fused" and rows > 1:  # tiles below the diagonal fold without the mask
        unmasked = source[source.index("# unmasked: every lane"):]
        unmasked = unmasked[:unmasked.index("    for start", unmasked.index("for start") + 1)]
        assert "offs_m" not in unmasked.split("\n", 2)[2] and "mask_n = tl.full(" in unmasked
    report = self_check(spec, shape, "float32", strategy=strategy, config=cfg, derivation=derivation)
    assert report["passed"], report


def test_a_counting_reduction_visits_every_tile() -> None:
    """A masked mean reads the count of values seen: skipping tiles would change it."""
    spec = load_spec({"foldwise": 1, "name": "masked_var", "inputs": {"x": {"dims": ["m", "n"]}},
                      "steps": [{"name": "mean", "reduce": "sum", "over": "n", "expr": "where(index(n) <= index(m), x, 0) / size(n)"},
                                {"name": "var", "reduce": "sum", "over": "n",
                                 "expr": "where(index(n) <= index(m), (x - mean) ** 2, 0) / size(n)"}],
                      "outputs": ["var"]})
    derivation = derive_cascade(spec)
    plan = make_plan(spec, derivation, "streaming_fused", {"m": 9, "n": 40}, KernelConfig({"n": 8}))
    loops = build_structure(plan, bind_dtypes(spec, "float32")).kernels[0].loops()
    # every loop visits every tile (the fallback pass too, where it runs: its trip count is the axis's times its flag)
    assert loops and all(loop.lo.is_zero() and bound_source(loop.hi) in ("size_n", "(size_n) * fallback")
                         for loop in loops)
    assert self_check(spec, {"m": 9, "n": 40}, "float32", strategy="streaming_fused", config=KernelConfig({"n": 8}),
                      derivation=derivation)["passed"]


# --- regressions the cascade fuzzer (tests/support/fuzz_strategies.py) found, each with the smallest
# spec that showed it (small specs built with tests/support/cascades.py)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_mask_window_over_an_inner_dim_starts_at_zero():
    """fuzz seed 48: ``where(index(t) > index(e), ...)`` summed over t, where e is an inner axis
    (another step sums over it), so every program holds e whole. The loop's window read
    ``pid_e * BLOCK_e`` (NameError: no program id of e); a whole dim's first index is 0."""
    spec = spec_of(
        [red("sel", "min", "sqrt(x ** 4 + 1)", over="t"), red("p", "sum", "a / (2 + sin(q))", over="e"),
         red("den", "sum", "where(index(t) > index(e), exp(sel - sqrt(x ** 4 + 1)) * x, 0)", over="t")],
        ["sel", "p", "den"], inputs={"a": {"dims": ["e", "t"]}, "x": {"dims": ["t"]}, "q": {"dims": ["e"]}})
    every_strategy_passes(spec, {"e": 5, "t": 37})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_an_element_masked_on_indices_is_not_read_in_any_strategy():
    """Fuzz seed 70: ``sum exp(mn - where(index(t) <= index(j2), -a q, inf)) (q - mn)`` is 0 * (q - mn) past the
    mask. multi_pass skipped those tiles (as FlashAttention skips masked keys) and gave a number; the formula read
    literally, row_resident and the unfused chain gave 0 * NaN = NaN for a NaN q there. An element a where() on
    indices masks to the identity is now not part of the reduction (fuser_core.masks): the reference drops it and
    every kernel's fold takes the identity there, whether or not its loop skips the tile."""
    from fuser_core.masks import step_exclusions

    steps = [red("mx", "max", "where(index(n) <= index(m), s, -inf)"),
             red("den", "sum", "exp(where(index(n) <= index(m), s, -inf) - mx)"),
             red("o", "sum", "exp(where(index(n) <= index(m), s, -inf) - mx) * v / den")]
    spec = spec_of(steps, ["o", "den"], inputs={"s": {"dims": ["m", "n"]}, "v": {"dims": ["n"]}})
    assert set(step_exclusions(spec)) == {"mx", "den", "o"}
    rng = np.random.default_rng(3)
    shape = {"m": 13, "n": 13}
    s, v = rng.standard_normal((13, 13)), rng.standard_normal(13)
    v[9] = np.nan  # key 9: seen by queries 9..12 only
    s[2, 11] = np.inf  # masked for query 2: exp(inf - mx) * v would be inf or NaN
    ref = evaluate(spec, shape, {"s": s, "v": v})
    assert np.isfinite(ref["o"][:9]).all() and np.isnan(ref["o"][9:]).all()
    d = derive_cascade(spec)
    valid = [st for st, why in valid_strategies(spec, d, shape).items() if why is None]
    assert {"row_resident", "multi_pass", "streaming_fused", "split_fused"} <= set(valid)
    for strategy in [*valid, "unfused_chain"]:
        config = None if strategy in ("row_resident", "unfused_chain") else KernelConfig(
            {"n": 4, "m": 1}, split=2 if strategy == "split_fused" else 1)
        got = run(spec, shape, "float32", {"s": s, "v": v}, strategy=strategy, config=config, derivation=d).outputs
        o = got["o"].double().numpy()
        assert np.array_equal(np.isnan(o), np.isnan(ref["o"])), (strategy, o)
        assert np.allclose(o[:9], ref["o"][:9], rtol=1e-5), (strategy, o, ref["o"])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_row_an_index_mask_empties_sums_to_zero_in_every_strategy():
    """Fuzz seed 49, once masked elements were dropped: ``sum exp(where(index(d) > index(t), kk x, -inf) - lse)``
    drops every d of the rows t >= size(d) - 1, so their sum is 0 and their max -inf; the fused strategies' settle
    gave 0 * exp(0 - -inf) = NaN. Such rows now take the fallback pass (fuser_core.masks.may_exclude_every), and
    the certificate compares them with the reference there. A row whose kept elements hold -inf is still NaN."""
    from fuser_core.masks import may_exclude_every

    spec = spec_of([red("lse", "max", "where(index(d) > index(t), kk * x, -inf)", over="d"),
                    red("nblk", "sum", "exp(where(index(d) > index(t), kk * x, -inf) - lse)", over="d")],
                   ["nblk"], inputs={"x": {"dims": ["d"]}, "kk": {"dims": ["t"]}})
    d = derive_cascade(spec)
    assert may_exclude_every(d.forms["nblk"].realisation.accumulators[0].contribution, "sum", "d")
    assert certify(d, trials=12).holds
    shape = {"d": 5, "t": 7}
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal(5), "kk": rng.standard_normal(7)}
    inputs["x"][4] = -np.inf  # rows t < 4 keep d = 4: kk * x = +-inf there
    ref = evaluate(spec, shape, inputs)["nblk"]
    assert np.isnan(ref[3]) and (ref[4:] == 0).all()
    for strategy in ("row_resident", "multi_pass", "streaming_fused", "split_fused", "unfused_chain"):
        config = None if strategy in ("row_resident", "unfused_chain") else KernelConfig(
            {"d": 2}, split=2 if strategy == "split_fused" else 1)
        got = run(spec, shape, "float32", inputs, strategy=strategy, config=config, derivation=d).outputs["nblk"]
        got = got.double().numpy()
        assert np.array_equal(np.isnan(got), np.isnan(ref)) and np.allclose(got[4:], 0.0), (strategy, got)
        assert np.allclose(got[:3], ref[:3], rtol=1e-5), (strategy, got)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_causal_attention_keeps_a_key_for_every_query():
    """Causal attention's mask, aligned bottom-right (key j visible to query i when j <= i + n - m),
    keeps key 0 for every query where the spec's constraint m <= n holds: no row is empty, so its fused
    kernels take no fallback pass for it. Without the constraint a row may be empty (m > n)."""
    from fuser_core.masks import may_exclude_every

    from fuser_core.catalog import load_catalog_spec

    for name in ("attention_causal", "attention_gqa"):
        spec = load_catalog_spec(name)
        assert spec.constraints == (("m", "<=", "n"),)
        d = derive_cascade(spec)
        for step in ("den", "o"):
            for acc in d.forms[step].realisation.accumulators:
                assert not may_exclude_every(acc.contribution, acc.op, "n", spec.constraints)
                assert may_exclude_every(acc.contribution, acc.op, "n")
