"""The code generator beyond the catalog: new cascades whose split combine is derived, not
written per workload; non-fusible cascades; the kernel cache; masked tails; arg/min/bottom-k
reductions; and the generated source itself. Kernels run through Triton's interpreter."""

from __future__ import annotations

import re

import numpy as np
import pytest
from tests.support.catalog import load_catalog

from fuser_core.certificate import certify
from fuser_core.codegen import module as codegen_module
from fuser_core.codegen.module import cache_dir, generate, output_dtypes
from fuser_core.codegen.plan import STRATEGIES, KernelConfig, NotValid, valid_strategies
from fuser_core.derive import derive_cascade
from fuser_core.reference import bind_shape, evaluate, random_inputs
from fuser_core.runner import TOLERANCE, bind_dtypes, compare, run, self_check
from fuser_core.spec import load_spec
from tests.support.cascades import every_strategy_passes, red, spec_of

# masked-off lanes of a tile compute on fill values (0 / 0, inf - inf); they are never stored
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

N = 45  # the loop axis: 6 tiles of 8, the last one ragged
BLOCK = 8


def make_spec(name: str, steps: list[dict], outputs: list[str], inputs: dict | None = None, params: dict | None = None):
    raw = {"foldwise": 1, "name": name, "inputs": inputs or {"x": {"dims": ["m", "n"]}}, "steps": steps,
           "outputs": outputs}
    if params:
        raw["params"] = params
    return load_spec(raw)


MX = {"name": "mx", "reduce": "max", "over": "n", "expr": "x"}
MN = {"name": "mn", "reduce": "min", "over": "n", "expr": "x"}
MEAN = {"name": "mean", "reduce": "sum", "over": "n", "expr": "x / size(n)"}
DEN = {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - mx)"}


def config(strategy: str, split: int = 3, lanes: dict[str, int] | None = None) -> KernelConfig:
    blocks = dict(lanes or {})
    if strategy != "row_resident":
        blocks["n"] = BLOCK
    return KernelConfig(blocks, split=split if strategy == "split_fused" else 1)


def chunks(n: int, split: int, block: int = BLOCK) -> int:
    """Non-empty chunks the split launcher makes (its chunk: ceil(ceil(n / split) / block) * block)."""
    chunk = -(-(-(-n // split)) // block) * block
    return sum(1 for s in range(split) if s * chunk < n)


def check(spec, shape, dtype="float32", *, strategy, cfg, derivation=None, seed=0) -> dict:
    report = self_check(spec, shape, dtype, strategy=strategy, config=cfg, derivation=derivation, seed=seed)
    assert report["strategy"] == strategy
    assert report["exact"] is True
    assert report["passed"], report
    return report


# ---------------------------------------------------------------------------------------------
# (a) cascades that are not in the catalog, split over several chunks: the combine is derived


NEW_CASCADES = {
    # softmax entropy -sum p log p, p = exp(x - mx) / den: two terms (exp(x) x and exp(x)) over a max anchor
    "softmax_entropy": make_spec("softmax_entropy", [
        MX, DEN,
        {"name": "p", "expr": "exp(x - mx) / den"},
        {"name": "ent", "reduce": "sum", "over": "n", "expr": "-p * log(p)"},
    ], ["ent"]),
    # a monotone cascade: max of (x - mean), with a sum dependency as the shift
    "max_minus_mean": make_spec("max_minus_mean", [
        MEAN, {"name": "r", "reduce": "max", "over": "n", "expr": "x - mean"},
    ], ["r", "mean"]),
    # layernorm-like variance, anchored at the running max instead of the mean, then normalised
    "variance_max_anchor": make_spec("variance_max_anchor", [
        MX,
        {"name": "var", "reduce": "sum", "over": "n", "expr": "(x - mx) ** 2 / size(n)"},
        {"name": "y", "expr": "(x - mx) * rsqrt(var + eps)"},
    ], ["y", "var"], params={"eps": 1e-5}),
    # a softmax-weighted variance around the mean: a max anchor and a sum dependency in one term
    "softmax_weighted_variance": make_spec("softmax_weighted_variance", [
        MX, MEAN, {"name": "wv", "reduce": "sum", "over": "n", "expr": "exp(x - mx) * (x - mean) ** 2 / size(n)"},
    ], ["wv"]),
    # three levels: the largest probability, then probabilities relative to it
    "softmax_relative_to_peak": make_spec("softmax_relative_to_peak", [
        MX, DEN,
        {"name": "peak", "reduce": "max", "over": "n", "expr": "exp(x - mx) / den"},
        {"name": "r", "reduce": "sum", "over": "n", "expr": "exp(x - mx) / den / peak"},
    ], ["r", "peak"]),
}


@pytest.mark.parametrize("split", [3, 6])
@pytest.mark.parametrize("name", sorted(NEW_CASCADES))
def test_new_cascade_split_fused(name: str, split: int) -> None:
    spec = NEW_CASCADES[name]
    derivation = derive_cascade(spec)
    assert all(f.fused for f in derivation.forms.values()), {k: f.reason for k, f in derivation.forms.items()}
    assert chunks(N, split) >= 3
    report = check(spec, {"m": 3, "n": N}, strategy="split_fused", cfg=config("split_fused", split, {"m": 2}),
                   derivation=derivation)
    assert report["config"]["split"] == split and report["config"]["blocks"]["n"] == BLOCK
    assert set(report["errors"]) == set(spec.output_parts)
    assert max(report["errors"].values()) <= TOLERANCE["float32"]


@pytest.mark.parametrize("name", ["softmax_entropy", "variance_max_anchor"])
def test_new_cascade_split_fused_16bit_and_other_strategies(name: str) -> None:
    spec = NEW_CASCADES[name]
    derivation = derive_cascade(spec)
    for strategy in STRATEGIES:
        check(spec, {"m": 3, "n": N}, "bfloat16", strategy=strategy, cfg=config(strategy), derivation=derivation)


SHIFT_CASES = {
    # layernorm's variance, shifted at the running mean (Welford/Chan): the stable realisation
    "mean_variance": make_spec("mean_variance", [
        MEAN, {"name": "var", "reduce": "sum", "over": "n", "expr": "(x - mean) ** 2 / size(n)"},
    ], ["var", "mean"]),
    **{k: NEW_CASCADES[k] for k in ("softmax_entropy", "variance_max_anchor", "softmax_weighted_variance")},
}


@pytest.mark.parametrize("strategy", ["streaming_fused", "split_fused"])
@pytest.mark.parametrize("name", sorted(SHIFT_CASES))
def test_fused_sums_are_stable_away_from_zero(name: str, strategy: str) -> None:
    """Rows of 100 + N(0, 1): the unfused strategies evaluate these in float32 to ~1e-7, so the
    fused realisation must stay within float32's tolerance too (docs/THEORY.md 5: prefer shifted /
    Welford-style updates over raw power sums, whose terms cancel catastrophically here)."""
    spec = SHIFT_CASES[name]
    shape = bind_shape(spec, {"m": 3, "n": N})
    dtypes = bind_dtypes(spec, "float32")
    inputs = random_inputs(spec, shape, np.random.default_rng(7), dtypes)
    inputs["x"] = (inputs["x"].astype(np.float64) + 100.0).astype(np.float32)
    ref = evaluate(spec, shape, inputs)
    stores = output_dtypes(spec, dtypes)
    errors = {}
    for s in ("multi_pass", strategy):
        cfg = KernelConfig({"n": BLOCK}, split=3 if s == "split_fused" else 1)
        result = run(spec, shape, dtypes, inputs, strategy=s, config=cfg)
        errors[s] = max(compare(spec, result.outputs, ref, stores).values())
    assert errors["multi_pass"] <= TOLERANCE["float32"], errors  # the inputs are benign for float32
    forms = {k: (f.kind, [str(t.g) for t in f.terms]) for k, f in derive_cascade(spec).forms.items()}
    assert errors[strategy] <= TOLERANCE["float32"], (forms, errors)


# ---------------------------------------------------------------------------------------------
# (b) non-fusible cascades: multi-pass and row-resident run them; the fused strategies refuse


NON_FUSIBLE = {
    "sum_sin_x_mx": (make_spec("sum_sin_x_mx", [
        MX, {"name": "s", "reduce": "sum", "over": "n", "expr": "sin(x * mx)"},
    ], ["s"]), "sin(mx*x)"),
    "sum_maximum_x_mean": (make_spec("sum_maximum_x_mean", [
        MEAN, {"name": "s", "reduce": "sum", "over": "n", "expr": "maximum(x, mean)"},
    ], ["s", "mean"]), "Max(mean, x)"),
}


@pytest.mark.parametrize("name", sorted(NON_FUSIBLE))
def test_non_fusible_runs_multi_pass_and_row_resident(name: str) -> None:
    spec, term = NON_FUSIBLE[name]
    derivation = derive_cascade(spec)
    shape = {"m": 3, "n": N}
    valid = valid_strategies(spec, derivation, bind_shape(spec, shape))
    assert valid["multi_pass"] is None and valid["row_resident"] is None
    for strategy in ("multi_pass", "row_resident"):
        for dtype in ("float32", "float16"):
            check(spec, shape, dtype, strategy=strategy, cfg=config(strategy), derivation=derivation)


@pytest.mark.parametrize("strategy", ["streaming_fused", "split_fused"])
@pytest.mark.parametrize("name", sorted(NON_FUSIBLE))
def test_non_fusible_refused_by_fused_strategies(name: str, strategy: str) -> None:
    spec, term = NON_FUSIBLE[name]
    derivation = derive_cascade(spec)
    shape = {"m": 3, "n": N}
    why = valid_strategies(spec, derivation, bind_shape(spec, shape))[strategy]
    assert why is not None and term in why and "s is not" in why, why
    with pytest.raises(NotValid, match=re.escape(term)):
        self_check(spec, shape, "float32", strategy=strategy, config=config(strategy), derivation=derivation)


def test_non_fusible_default_strategy_is_not_fused() -> None:
    spec, _ = NON_FUSIBLE["sum_sin_x_mx"]
    report = self_check(spec, {"m": 2, "n": 37})
    assert report["strategy"] in ("row_resident", "multi_pass") and report["passed"]


# ---------------------------------------------------------------------------------------------
# (c) generated code is cached on disk, keyed by (spec, strategy, config, dtype)


def _kernel_files() -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in cache_dir().glob("*.py")}


def test_generated_code_is_cached(kernel_cache_dir, monkeypatch) -> None:
    assert cache_dir().resolve().is_relative_to(kernel_cache_dir.resolve())  # tests never touch ~/.cache
    spec = make_spec("cache_probe", [MX, DEN, {"name": "y", "expr": "exp(x - mx) / den * 3"}], ["y"])
    derivation = derive_cascade(spec)
    shape = bind_shape(spec, {"m": 3, "n": 37})
    dtypes = bind_dtypes(spec, "float32")
    cfg = KernelConfig({"n": 8})

    before = _kernel_files()
    first = generate(spec, derivation, "streaming_fused", shape, cfg, dtypes)
    after_first = _kernel_files()
    assert set(after_first) - set(before) == {first.path.name}
    assert first.path.read_text() == first.source

    def regenerated(*args, **kwargs):
        raise AssertionError("the same (spec, strategy, config, dtype) was generated again")

    with monkeypatch.context() as mp:
        mp.setattr(codegen_module, "module_source", regenerated)
        again = generate(spec, derivation, "streaming_fused", shape, cfg, dtypes)
        # running it (twice) reuses the cached file as well
        for _ in range(2):
            report = self_check(spec, shape, "float32", strategy="streaming_fused", config=cfg, derivation=derivation)
            assert report["passed"]
    assert again.path == first.path and again.key == first.key and again.source == first.source
    assert _kernel_files() == after_first  # nothing new, nothing rewritten (same mtimes)

    # the kernel is shape-generic: another size with the same blocks is the same file
    longer = generate(spec, derivation, "streaming_fused", bind_shape(spec, {"m": 5, "n": 61}), cfg, dtypes)
    assert longer.path == first.path

    variants = [
        generate(spec, derivation, "streaming_fused", shape, KernelConfig({"n": 16}), dtypes),
        generate(spec, derivation, "streaming_fused", shape, KernelConfig({"n": 8}, num_warps=2), dtypes),
        generate(spec, derivation, "streaming_fused", shape, cfg, bind_dtypes(spec, "float16")),
        generate(spec, derivation, "multi_pass", shape, cfg, dtypes),
    ]
    paths = {v.path for v in variants}
    assert len(paths) == len(variants) and first.path not in paths
    assert set(_kernel_files()) - set(after_first) == {p.name for p in paths}
    assert "BLOCK_n=16" in variants[0].source and "BLOCK_n=8" in first.source


def test_renamed_spec_does_not_reuse_kernel_with_other_names() -> None:
    """Same canonical computation, different input name: the kernel's interface differs."""
    a = make_spec("rename_probe", [MX, DEN], ["den"])
    b = make_spec("rename_probe", [
        {"name": "mx", "reduce": "max", "over": "n", "expr": "z"},
        {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(z - mx)"},
    ], ["den"], inputs={"z": {"dims": ["m", "n"]}})
    shape = {"m": 2, "n": 19}
    ga = generate(a, derive_cascade(a), "streaming_fused", bind_shape(a, shape), KernelConfig({"n": 8}),
                  bind_dtypes(a, "float32"))
    gb = generate(b, derive_cascade(b), "streaming_fused", bind_shape(b, shape), KernelConfig({"n": 8}),
                  bind_dtypes(b, "float32"))
    assert ga.path != gb.path
    assert self_check(b, shape, strategy="streaming_fused", config=KernelConfig({"n": 8}))["passed"]


# ---------------------------------------------------------------------------------------------
# (d) masked tails: tiles and whole split chunks with nothing unmasked stay finite


def _top_left_causal() -> dict:
    """attention_causal with a top-left diagonal (query i sees keys 0..i) and no m <= n constraint: the
    catalog's is bottom-right since issue 36, and refuses m > n; this one keeps that shape to test."""
    raw = {**load_catalog()["attention_causal"], "name": "causal_top_left"}
    raw.pop("constraints")
    raw["steps"] = [{**s, "expr": "where(index(n) <= index(m), s0, -inf)"} if s["name"] == "s" else s
                    for s in raw["steps"]]
    return raw


CAUSAL = load_spec(_top_left_causal())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_causal_attention_more_queries_than_keys(strategy: str) -> None:
    # m > n; tiles of 2 keys, so queries 0 and 1 see only the first tile, and split = 3 gives
    # them two chunks with every key masked
    shape = {"b": 1, "h": 1, "m": 7, "n": 5, "d": 3, "e": 2}
    cfg = KernelConfig({"n": 2} if strategy != "row_resident" else {}, split=3 if strategy == "split_fused" else 1)
    bound = bind_shape(CAUSAL, shape)
    inputs = random_inputs(CAUSAL, bound, np.random.default_rng(3), bind_dtypes(CAUSAL, "float32"))
    result = run(CAUSAL, bound, "float32", inputs, strategy=strategy, config=cfg)
    o = result.outputs["o"].numpy()
    assert o.shape == (1, 1, 7, 2) and np.isfinite(o).all()
    ref = evaluate(CAUSAL, bound, inputs)
    assert compare(CAUSAL, result.outputs, ref, {"o": "float32"})["o"] <= TOLERANCE["float32"]
    # query 0 sees key 0 alone: its output is v[0]
    np.testing.assert_allclose(o[0, 0, 0], inputs["v"][0, 0, 0], rtol=1e-6)


MASKED = {
    "early": "where(index(n) <= 2, x, -inf)",  # keys 0..2: every later tile and chunk fully masked
    "late": "where(index(n) >= 40, x, -inf)",  # keys 40..44: the running max is -inf for 5 tiles
    "ragged_tail": "where(index(n) == size(n) - 1, x, -inf)",  # one key, in the ragged last tile
}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mask", sorted(MASKED))
def test_mostly_masked_softmax_stays_finite(mask: str, strategy: str) -> None:
    spec = make_spec(f"masked_{mask}", [
        {"name": "s", "expr": MASKED[mask]},
        {"name": "mx", "reduce": "max", "over": "n", "expr": "s"},
        {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(s - mx)"},
        {"name": "y", "expr": "exp(s - mx) / den"},
        {"name": "lse", "expr": "mx + log(den)"},
    ], ["y", "lse"])
    shape = bind_shape(spec, {"m": 3, "n": N})
    inputs = random_inputs(spec, shape, np.random.default_rng(5), bind_dtypes(spec, "float32"))
    result = run(spec, shape, "float32", inputs, strategy=strategy, config=config(strategy))
    y, lse = result.outputs["y"].numpy(), result.outputs["lse"].numpy()
    assert np.isfinite(y).all() and np.isfinite(lse).all()
    keep = {"early": np.arange(N) <= 2, "late": np.arange(N) >= 40, "ragged_tail": np.arange(N) == N - 1}[mask]
    assert (y[:, ~keep] == 0).all()
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-5)
    ref = evaluate(spec, shape, inputs)
    errors = compare(spec, result.outputs, ref, {"y": "float32", "lse": "float32"})
    assert max(errors.values()) <= TOLERANCE["float32"], errors


# ---------------------------------------------------------------------------------------------
# (e) argmax / argmin / min, and bottom-k (topk of a negated monotone form)

ORDER_SPEC = make_spec("order_family", [
    MN, MX,
    {"name": "am", "reduce": "argmax", "over": "n", "expr": "exp(x - mx)"},
    {"name": "ai", "reduce": "argmin", "over": "n", "expr": "x - mn"},
    {"name": "lo", "reduce": "topk", "k": 3, "as": "j", "over": "n", "expr": "-(x - mn) * 2"},
    {"name": "mn2", "reduce": "min", "over": "n", "expr": "(x - mx) / 3"},
], ["mn", "am", "ai", "lo", "mn2"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_arg_min_and_bottom_k(strategy: str) -> None:
    derivation = derive_cascade(ORDER_SPEC)
    shape = bind_shape(ORDER_SPEC, {"m": 3, "n": N})
    assert valid_strategies(ORDER_SPEC, derivation, shape)[strategy] is None
    cfg = config(strategy, lanes={"m": 2})
    inputs = random_inputs(ORDER_SPEC, shape, np.random.default_rng(11), bind_dtypes(ORDER_SPEC, "float32"))
    result = run(ORDER_SPEC, shape, "float32", inputs, strategy=strategy, config=cfg, derivation=derivation)
    out = {k: v.numpy() for k, v in result.outputs.items()}
    x = inputs["x"].astype(np.float64)
    assert len(np.unique(x)) == x.size  # no ties: indices are unambiguous
    np.testing.assert_array_equal(out["am"], np.argmax(x, axis=1))
    np.testing.assert_array_equal(out["ai"], np.argmin(x, axis=1))
    np.testing.assert_array_equal(out["lo.indices"], np.argsort(x, axis=1)[:, :3])
    assert str(result.outputs["am"].dtype) == "torch.int32" and str(result.outputs["lo.indices"].dtype) == "torch.int32"
    np.testing.assert_allclose(out["lo.values"], -2 * (np.sort(x, axis=1)[:, :3] - x.min(axis=1, keepdims=True)),
                               rtol=1e-6, atol=1e-6)
    assert (np.diff(out["lo.values"], axis=1) <= 0).all()  # values sorted descending
    np.testing.assert_array_equal(out["mn"], x.min(axis=1).astype(np.float32))
    ref = evaluate(ORDER_SPEC, shape, inputs)
    errors = compare(ORDER_SPEC, result.outputs, ref, output_dtypes(ORDER_SPEC, bind_dtypes(ORDER_SPEC, "float32")))
    assert errors["am"] == errors["ai"] == errors["lo.indices"] == 0
    assert max(errors.values()) <= TOLERANCE["float32"], errors


@pytest.mark.parametrize("strategy", ["streaming_fused", "split_fused"])
def test_argmax_ties_take_the_first_index(strategy: str) -> None:
    """Equal maxima in different tiles and split chunks: the lowest index wins, like numpy."""
    spec = make_spec("argmax_ties", [{"name": "am", "reduce": "argmax", "over": "n", "expr": "x"}], ["am"])
    x = np.zeros((2, N), np.float32)
    x[0, [5, 20, 44]] = 3.0  # tiles 0, 2 and 5; split chunks 0, 1 and 2
    x[1, [44, 43]] = 1.0
    result = run(spec, {"m": 2, "n": N}, "float32", {"x": x}, strategy=strategy, config=config(strategy))
    np.testing.assert_array_equal(result.outputs["am"].numpy(), [5, 43])


# ---------------------------------------------------------------------------------------------
# (e2) a reduction over a top-k's output dim: a router renormalising its selected gate weights

ROUTER_RENORM = make_spec("router_renorm", [
    {"name": "mx", "reduce": "max", "over": "x", "expr": "logits"},
    {"name": "den", "reduce": "sum", "over": "x", "expr": "exp(logits - mx)"},
    {"name": "gate", "reduce": "topk", "k": 3, "as": "j", "over": "x", "expr": "exp(logits - mx) / den"},
    {"name": "norm", "reduce": "sum", "over": "j", "expr": "gate.values"},
    {"name": "w", "expr": "gate.values / norm"},
], ["w", "gate"], inputs={"logits": {"dims": ["t", "x"]}})


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_sum_over_the_top_k_slots_runs_in_the_kernels_epilogue(strategy: str) -> None:
    """Mixtral/DeepSeek-style routers: softmax, top-k over the experts, then the k weights
    renormalised over j. The loop runs over x; the sum over j reads the final top-k and is
    computed after the loop from the k slots the kernel holds, in the same kernel."""
    derivation = derive_cascade(ROUTER_RENORM)
    assert [(e.name, e.second_pass) for e in derivation.epilogue] == [("w", False)]  # j is held whole: no pass
    shape = bind_shape(ROUTER_RENORM, {"t": 5, "x": N})
    assert valid_strategies(ROUTER_RENORM, derivation, shape)[strategy] is None
    cfg = KernelConfig({"x": BLOCK, "t": 2} if strategy != "row_resident" else {"t": 2},
                       split=3 if strategy == "split_fused" else 1)
    check(ROUTER_RENORM, shape, strategy=strategy, cfg=cfg, derivation=derivation)
    module = generate(ROUTER_RENORM, derivation, strategy, shape, cfg, bind_dtypes(ROUTER_RENORM, "float32"))
    lines = module.source.splitlines()
    # once, at a kernel's top level (after its loops), in the strategy's own kernels: no extra launch (and once
    # more for the outputs of the fallback passes, which rank again rows whose max ended +-inf or NaN)
    fallback = next((i for i, line in enumerate(lines) if line.strip().startswith("# fallback:")), len(lines))
    norms = [line for line in lines[:fallback] if line.strip().startswith("norm = tl.sum(")]
    assert len(norms) == 1 and norms[0].startswith("    norm = ")
    kernels = re.findall(r"^def (\w+_kernel)\(", module.source, re.M)
    assert len(kernels) == (2 if strategy == "split_fused" else 1), kernels
    inputs = random_inputs(ROUTER_RENORM, shape, np.random.default_rng(5), bind_dtypes(ROUTER_RENORM, "float32"))
    out = run(ROUTER_RENORM, shape, "float32", inputs, strategy=strategy, config=cfg, derivation=derivation).outputs
    np.testing.assert_allclose(out["w"].numpy().sum(axis=1), 1.0, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# (f) the generated source is readable Python, not an eval of a string


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", sorted(load_catalog()))
def test_generated_source_is_readable(name: str, strategy: str) -> None:
    spec = load_spec(load_catalog()[name])
    derivation = derive_cascade(spec)
    shape = {d: 5 for d in spec.dims}
    for s in spec.steps:
        if s.as_dim:
            shape[s.as_dim] = s.k
            shape[s.over] = 16
    shape = bind_shape(spec, shape)
    cfg = KernelConfig({}, split=3 if strategy == "split_fused" else 1)
    dtype = {"a": "float16", "w": "float8_e4m3fn", "w_scale": "float32"} if name == "fp8_quant_gemm" else "float16"
    source = generate(spec, derivation, strategy, shape, cfg, bind_dtypes(spec, dtype)).source
    compile(source, f"{name}_{strategy}.py", "exec")  # valid Python
    assert "eval(" not in source and "exec(" not in source and "__import__" not in source
    assert f"{name}, strategy {strategy}" in source.splitlines()[0]
    body = source[source.index(f"def {name}_{strategy}_kernel"):]
    comments = [line.split("#", 1)[1] for line in body.splitlines() if "#" in line]
    for step in spec.steps:
        if step.is_reduction:
            assert any(re.search(rf"\b{step.name}\b", c) for c in comments), (step.name, comments)
    assert "def launch(inputs, shape, out=None, scalars=None):" in source


# --- regressions the cascade fuzzer (tests/support/fuzz_strategies.py) found, each with the smallest
# spec that showed it (small specs built with tests/support/cascades.py)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_split_fused_with_scalar_results():
    """A split kernel stored a size-1 block through a scalar workspace pointer (InterpreterError)."""
    spec = spec_of(
        [red("mx", "max", "x", over="m"), red("den", "sum", "exp(x - mx)", over="m"),
         red("v", "sum", "(x - mx) ** 2", over="m"), red("am", "argmax", "x - mx", over="m"),
         red("g", "topk", "exp(x - mx) / den", over="m", k=3, **{"as": "j"})],
        ["mx", "den", "v", "am", "g"], inputs={"x": {"dims": ["m"]}},
    )
    report = self_check(spec, {"m": 11}, strategy="split_fused", config=KernelConfig({"m": 4}, split=2))
    assert report["passed"], report


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_powers_above_eight_of_negative_values():
    """x ** 9 and x ** 10 printed as exp2(e * log2(x)): NaN for every negative x."""
    spec = spec_of([red("a", "sum", "x ** 9"), red("b", "max", "x ** 10"), {"name": "y", "expr": "(x - a) ** 11"}],
                   ["a", "b", "y"])
    every_strategy_passes(spec, {"m": 2, "n": 13})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_lone_product_in_a_denominator():
    """(x / size(n)) ** 2 printed as `x * x / s * s` (= x * x)."""
    spec = spec_of([red("r", "min", "(x / size(n)) ** 2")], ["r"])
    every_strategy_passes(spec, {"m": 2, "n": 13})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_integer_values_in_float_functions():
    """exp(cos(argmin)) and sqrt(index(n)) gave tl.cos(int32): Triton takes floats only."""
    spec = spec_of([red("am", "argmin", "x"), {"name": "y", "expr": "exp(cos(am)) * x + sqrt(index(n)) * log(index(m) + 1)"}],
                   ["y"])
    every_strategy_passes(spec, {"m": 3, "n": 13})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_cast_of_a_constant_and_a_constant_output():
    """cast(alpha, ...) printed as (2.0).to(...), and a constant step as tl.broadcast_to(1e-10, ...)."""
    spec = spec_of([red("mx", "max", "x"), {"name": "y", "expr": 'cast(alpha, "float32") * x + cast(1.7, "bfloat16")'},
                    {"name": "c", "expr": "alpha * alpha"}], ["mx", "y", "c"], params={"alpha": 1e-5})
    every_strategy_passes(spec, {"m": 2, "n": 13})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_nested_casts_of_constants():
    """cast(cast(alpha, "float16"), "float16") printed as fp16 rounding of a Python float
    (AttributeError: 'float' object has no attribute 'to'): constants are evaluated and rounded
    when generated, as the reference does."""
    spec = spec_of([red("mx", "max", 'x + cast(cast(alpha, "float16"), "float16")'),
                    {"name": "y", "expr": 'x * cast(cast(1 / 3, "bfloat16") + 1, "bfloat16")'},
                    # round() of a constant inside a cast was printed without the cast (29.791, not 29.75)
                    {"name": "z", "expr": 'sin(cast((round(3 * 4) * 0.25 + 0.1) ** 3, "bfloat16") * x)'}], ["mx", "y", "z"],
                   params={"alpha": 0.1})
    every_strategy_passes(spec, {"m": 2, "n": 13})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_folded_conditions_on_a_size_and_a_block():
    """sympy folds where() conditions into And/Or/Not of a comparison on size(e) (a scalar in the
    kernel) and one on the values (a block); Triton's interpreter cannot `|`, `&` or `~` those
    (TypeError: ufunc 'bitwise_or' not supported)."""
    spec = spec_of([red("r", "max", "where(where(bias >= 0, 1, 0) != where(size(e) > 20, 0, 1), bias, -bias)", over="e"),
                    red("s", "sum", "where(where(bias >= 0, 1, 0) == where(size(e) > 3, 1, 0), bias, 0)", over="e")],
                   ["r", "s"], inputs={"bias": {"dims": ["e"]}})
    every_strategy_passes(spec, {"e": 13})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_constant_functions_are_evaluated_in_float64():
    """log1p(abs(1e-5)) printed as tl.log(1.00001): in float32 that is 1.0014e-5, so a constant
    comparison with 1e-5 went the other way (error 72) and tanh(log1p(eps)) * x was off by 1.4e-3."""
    spec = spec_of([red("mean", "max", "where(minimum(eps, scale) < log1p(abs(scale)), x, -1)"),
                    {"name": "y", "expr": "x * tanh(log1p(abs(scale))) + mean"},
                    # a whole step of constants folded to one number still stores as a block
                    {"name": "c", "expr": "log2(sigmoid(clamp(2, -1, 0.5)) + 1) + round(0.3 * 4)"}], ["y", "c"],
                   params={"eps": "1 / sqrt(size(m))", "scale": 1e-05})
    every_strategy_passes(spec, {"m": 1, "n": 13})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_bfloat16_casts_round_to_nearest_even_under_the_interpreter():
    """The interpreter's float32 -> bfloat16 conversion truncates (1.01171875 -> 1.0078125)."""
    spec = spec_of([red("mx", "max", "x"), {"name": "y", "expr": 'cast(x, "bfloat16") * 1'}], ["mx", "y"],
                   inputs={"x": {"dims": ["n"]}})
    values = np.array([1.00390625, 1.01171875, 1 + 2**-8 + 2**-20, -1.00390625, 3.3, 0.1, 1e38, -0.0], np.float32)
    shape = {"n": values.size}
    out = run(spec, shape, "float32", {"x": values.astype(np.float64)})
    ref = evaluate(spec, shape, {"x": values.astype(np.float64)})
    np.testing.assert_array_equal(out.outputs["y"].float().numpy(), ref["y"])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_where_inside_a_where_condition():
    """sympy folds it into ITE(...), which the printer refused (UnsupportedExpression)."""
    spec = spec_of(
        [red("h", "argmax", "x", over="m"), red("r", "min", "maximum(x, where(alpha >= where(index(m) == h, size(m), -1), w, -1))", over="m")],
        ["r"], inputs={"x": {"dims": ["n", "m"]}, "w": {"dims": ["n"]}}, params={"alpha": "log(size(m) + 1)"},
    )
    every_strategy_passes(spec, {"n": 2, "m": 13})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_step_named_count_as_an_anchor():
    """A dependency named `count` printed its own count[old] as the tile counter."""
    spec = spec_of([red("count", "max", "v", over="t"), red("idx", "sum", "(v - count) ** 2", over="t")],
                   ["count", "idx"], inputs={"v": {"dims": ["t", "d"]}})
    every_strategy_passes(spec, {"t": 13, "d": 2})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_log1p_of_small_values_keeps_float32_accuracy():
    """log1p(a) was printed tl.log(a + 1.0): for |a| ~ 1e-5 that loses ~1e-3 of the result."""
    spec = spec_of([red("out", "sum", "x * 1e-5"), {"name": "y", "expr": "log1p(abs(out)) + 0 * x"}], ["y"])
    every_strategy_passes(spec, {"m": 2, "n": 13})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_inner_argmax_or_topk_is_not_valid_rather_than_a_crash():
    """An argmax over an inner axis raised NotImplementedError while writing the kernel. Where the
    sum over j keeps s2, the kernel loops over s2 (the argmax runs in the loop, the sum inside each
    tile) and every strategy runs it; where s2 cannot be the loop axis, the inner argmax is refused."""
    shape = {"d": 2, "j": 5, "s2": 3}
    looped = spec_of(
        [red("s", "sum", "v * q", over="j"), red("am", "argmax", "z", over="s2")],
        ["s", "am"], inputs={"v": {"dims": ["d", "j", "s2"]}, "q": {"dims": ["d", "j", "s2"]}, "z": {"dims": ["s2", "j"]}},
    )
    d = derive_cascade(looped)
    assert all(r is None for r in valid_strategies(looped, d, shape).values())
    for strategy in ("row_resident", "streaming_fused", "split_fused", "multi_pass"):
        assert self_check(looped, shape, derivation=d, strategy=strategy)["passed"], strategy
    inner = spec_of(
        [red("s", "sum", "v * q", over="j"), red("am", "argmax", "z", over="s2")],
        ["s", "am"], inputs={"v": {"dims": ["d", "j"]}, "q": {"dims": ["d", "j"]}, "z": {"dims": ["s2", "j"]}},
    )
    d = derive_cascade(inner)
    reasons = valid_strategies(inner, d, shape)
    assert all(r is not None and "argmax over s2 inside the loop over j" in r for r in reasons.values()), reasons
    with pytest.raises(NotValid):
        self_check(inner, shape, derivation=d)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_inf_literals_and_overflowing_constants_stay_ieee():
    """`inf` in a where() branch (causal masks) and constants that overflow float64 are fine."""
    spec = spec_of([red("mx", "max", "where(index(n) <= index(m), x, -inf)"),
                    red("den", "sum", "exp(where(index(n) <= index(m), x, -inf) - mx) + sin(inf) * 0 + x * 1e300 * 1e300 * 0")],
                   ["den"])
    d = derive_cascade(spec)
    assert certify(d, trials=4).holds


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_split_topk_of_negative_values():
    """The combine kernel loaded the padding slots of each part's top-k list (BLOCK_as > k) as 0,
    which beat every negative value: the top 3 of -|x| - 1 came out as [0, 0, -1.04]."""
    spec = spec_of([red("g", "topk", "-abs(x) - 1", k=3, **{"as": "j"})], ["g"])
    report = self_check(spec, {"m": 2, "n": 13}, strategy="split_fused", config=KernelConfig({"n": 4}, split=2))
    assert report["passed"], report


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_split_bottomk_of_positive_values():
    """The same padding for the smallest-k list: +inf, never 0 (nor -inf, which would win every merge)."""
    spec = spec_of([red("mx", "max", "x"), red("g", "topk", "-(abs(x) + 1) * exp(mx)", k=3, **{"as": "j"})], ["g"])
    assert derive_cascade(spec).forms["g"].effective_op == "bottomk"  # the negative factor -exp(mx) swaps the order
    report = self_check(spec, {"m": 2, "n": 13}, strategy="split_fused", config=KernelConfig({"n": 4}, split=2))
    assert report["passed"], report


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_tanh_of_tiny_values_keeps_float32_accuracy():
    """tanh printed as 2 sigmoid(2x) - 1 cancelled to 0 for tiny x (max of tanh(erf(a v)^10):
    relative error 1.0); the kernel helper uses a series near 0."""
    spec = spec_of([red("s", "min", "erf(x) ** 10", over="n"), red("t", "max", "tanh(s)", over="m")], ["t"],
                   inputs={"x": {"dims": ["m", "n"]}})
    rng = np.random.default_rng(0)
    x = (rng.random((13, 13)) * 0.2 + 0.01).astype(np.float32)  # erf(x)^10 ~ 1e-20 .. 1e-8
    result = run(spec, {"m": 13, "n": 13}, "float32", {"x": x})
    got = result.outputs["t"].double().numpy()
    ref = evaluate(spec, {"m": 13, "n": 13}, {"x": x.astype(np.float64)})["t"]
    assert 0 < ref.max() < 1e-6
    np.testing.assert_allclose(got, ref, rtol=1e-5)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_tanh_is_within_a_few_float32_ulps_everywhere():
    """tanh printed as 2 sigmoid(2x) - 1 above |x| = 1/16 erred by up to 20 ulps (x ~ 0.064: the
    subtraction cancels); the accuracy bar's fuzz failed every strategy on it (9 ulps at a peaked
    row). The helper is Cephes' tanhf now: a polynomial below 0.625, 1 - 2 / (exp(2|x|) + 1) above."""
    spec = spec_of([red("y", "max", "tanh(x)", over="n")], ["y"], inputs={"x": {"dims": ["m", "n"]}})
    x = np.concatenate([np.linspace(-3, 3, 2001), [0.0, -0.0, 0.0625, 0.064, 0.62, 0.63, 40.0, -40.0, np.nan]])
    x = x.astype(np.float32)[:, None]  # one value per row: y = tanh(x)
    got = run(spec, {"m": x.shape[0], "n": 1}, "float32", {"x": x}).outputs["y"].double().numpy()
    ref = np.tanh(x[:, 0].astype(np.float64))
    assert np.isnan(got[-1]) and np.isnan(ref[-1])
    ulps = np.abs(got[:-1] - ref[:-1]) / np.spacing(np.abs(ref[:-1]).astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 3, (ulps.max(), x[np.argmax(ulps), 0])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_argmax_and_argmin_take_the_first_nan_as_numpy_does():
    """log(x) is NaN for x < 0. NumPy's argmax/argmin (the reference) return the first NaN; the
    certificate's tiled run sorted NaN last (algebra error 1.0), and the kernels' tl.max skipped it."""
    spec = spec_of([red("mx", "max", "x"), red("am", "argmin", "exp(x - mx) * log(x)"), red("ax", "argmax", "log(x)")],
                   ["am", "ax"])
    d = derive_cascade(spec)
    assert d.forms["am"].fused
    cert = certify(d, trials=12)
    assert cert.holds and cert.per_reduction["am"] == 0.0 and cert.per_reduction["ax"] == 0.0, cert
    every_strategy_passes(spec, {"m": 3, "n": 13})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_combine_kernel_recomputes_a_dependency_a_per_lane_part_kernel_merged(compile_pool):
    """Fuzz seed 45: split_fused's part kernel merged its lanes (per-lane states) and recorded r's
    final value as printed; the combine kernel inherited that record and skipped recomputing r
    after its split loop, then read the loop-scoped r (NameError on sm_90). Each kernel now starts
    with nothing in scope (KernelWriter.begin_kernel)."""
    from fuser_core.codegen.gpu_compile import CompileRequest
    from fuser_core.targets import Target

    spec = load_spec({
        "foldwise": 1, "name": "riyc", "inputs": {"kk": {"dims": ["seq"]}, "x": {"dims": ["seq"]}},
        "steps": [{"name": "h", "expr": "(eps) ** 2 * x"},
                  {"name": "sel", "reduce": "sum", "over": "seq", "expr": "maximum(clamp(0.5, -1, 0.5), (x) ** 2)"},
                  {"name": "r", "reduce": "sum", "over": "seq", "expr": "kk * sel"},
                  {"name": "tmp", "reduce": "sum", "over": "seq", "expr": "kk + r"},
                  {"name": "acc0", "reduce": "sum", "over": "seq", "expr": "where(x > 0, x * rsqrt(r * r + 1), 0)"}],
        "outputs": ["h", "tmp", "acc0"], "params": {"eps": "log(size(seq) + 1)"}})
    config = KernelConfig({"seq": 4}, split=2)
    report = self_check(spec, {"seq": 13}, "float32", strategy="split_fused", config=config)
    assert report["passed"], report
    builds = compile_pool.compile([CompileRequest(spec, {"seq": 13}, {"kk": "float32", "x": "float32"}, "split_fused",
                                                  config.to_dict(), Target.parse(arch)) for arch in ("sm_90", "sm_80")])
    assert all(b.ok and len(b.kernels) == 2 for b in builds), [b.first_error() for b in builds]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
@pytest.mark.parametrize("strategy", ["row_resident", "streaming_fused", "split_fused", "multi_pass"])
def test_a_top_k_of_a_row_masked_to_minus_inf_gives_k_distinct_indices(strategy):
    """Fuzz seed 46: where(index(seq) < target, ..., -inf) with target = 0 masks the whole row; the
    top-4 of thirteen -inf values is indices 0..3 (lower index first on ties, as the reference),
    but the kernels' lists marked taken and empty slots with -inf and returned [0, 0, 0, 0]. Empty
    and taken slots now carry index 2147483647; argmax of a -inf row is index 0 the same way."""
    spec = load_spec({
        "foldwise": 1, "name": "f", "inputs": {"a": {"dims": ["seq", "m"]}, "target": {"dims": [], "kind": "index"}},
        "steps": [{"name": "tl", "reduce": "topk", "over": "seq", "k": 4, "as": "kdim",
                   "expr": "where(index(seq) < target, a, -inf)"},
                  {"name": "am", "reduce": "argmax", "over": "seq", "expr": "where(index(seq) < target, a, -inf)"}],
        "outputs": ["tl", "am"]})
    shape = {"seq": 13, "m": 2, "kdim": 4}
    config = KernelConfig({"seq": 16} if strategy == "row_resident" else {"seq": 4},
                          split=2 if strategy == "split_fused" else 1)
    rng = np.random.default_rng(0)
    for target in (0, 2, 13):
        inputs = {"a": rng.standard_normal((13, 2)).astype(np.float32), "target": np.array(target, np.int32)}
        out = run(spec, shape, "float32", inputs, strategy=strategy, config=config).outputs
        ref = evaluate(spec, shape, inputs)
        got = out["tl.indices"].numpy()
        np.testing.assert_array_equal(got, ref["tl.indices"])
        np.testing.assert_array_equal(out["am"].numpy(), ref["am"])
        assert all(len(set(row)) == 4 for row in got.tolist())


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_step_named_like_an_anchor_is_no_anchor():
    """Fuzz seed 70: ``sum(bias * den_anchor)`` with ``den_anchor = max(bias)``: the tail lanes' fold was left
    unmasked because the value's name ended in ``_anchor`` (a safe anchor is finite); on a row masked to -inf the
    tail's 0 * -inf was NaN where the formula has +inf, in the row-resident kernel."""
    from fuser_core.accuracy import accuracy_check

    spec = spec_of([red("den_anchor", "max", "bias", over="seq"), red("mx_old", "sum", "bias * den_anchor", over="seq")],
                   ["mx_old"], inputs={"bias": {"dims": ["seq"]}})
    for strategy in ("row_resident", "multi_pass", "streaming_fused"):
        verdict = accuracy_check(spec, {"seq": 13}, families=("masked", "nan", "normal"), strategy=strategy)
        assert verdict["passed"], (strategy, verdict["families"])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_sigmoid_of_a_large_negative_value_is_not_zero():
    """Fuzz seed 54: ``sigmoid(-v)`` at v near 100 printed as ``1 / (1 + exp(v))`` is 1 / inf = 0 in float32, where
    the formula has exp(-100) (a denormal); an argmax over such values then picked another index. The printer
    calls ``sigmoid_accurate`` (exp(x) / (1 + exp(x)) for x < 0)."""
    spec = spec_of([red("out", "argmax", "sigmoid(-v)"), {"name": "s", "expr": "sigmoid(-v)"}], ["out", "s"],
                   inputs={"v": {"dims": ["n"]}})
    v = np.array([100.0, 99.5, 101.0, 100.2, 99.0, 100.7, 98.9, 100.1, 102.0, 99.9, 100.3, 99.8, 100.4])
    ref = evaluate(spec, {"n": 13}, {"v": v})
    for strategy in ("row_resident", "multi_pass"):
        got = run(spec, {"n": 13}, "float32", {"v": v}, strategy=strategy).outputs
        assert int(got["out"]) == int(ref["out"]) == 6, strategy
        s = got["s"].double().numpy()
        assert (s > 0).all() and np.allclose(s, ref["s"], rtol=1e-2, atol=2e-45), (strategy, s)  # denormals: steps of 1.4e-45


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_integer_powers_are_squarings():
    """Fuzz seed 73: ``sin(c) ** 12`` printed as exp2(12 log2 |b|) erred 2.3x the formula's error; integer powers up
    to 32 are printed as squarings (at most 2 log2(n) roundings)."""
    from fuser_core.codegen.tritonize import _squarings

    assert _squarings("b", 12).count("*") == 11 and _squarings("b", 4) == "(b * b) * (b * b)"
    x = np.array([6.5, 0.3, -2.0, 1.1, -0.9, 3.0, 0.05])
    spec = spec_of([{"name": "p", "expr": "sin(x) ** 12"}, red("s", "sum", "sin(x) ** 12")], ["p", "s"],
                   inputs={"x": {"dims": ["n"]}})
    got = run(spec, {"n": 7}, "float32", {"x": x}, strategy="row_resident").outputs
    assert np.allclose(got["p"].double().numpy(), np.sin(x) ** 12, rtol=2e-6, atol=0)


def test_exp_prints_in_base2_only_where_every_output_is_16_bit() -> None:
    """Issue 35: exp(s - m) as tl.exp2(s * LOG2E - m * LOG2E) (one FMA before the MUFU, tutorial 06's
    form) where the outputs' rounding hides the folded argument's; float32 outputs keep tl.exp (at
    logits near 1000 the base-2 form's error is ~90x the formula's: benchmarks/exp_base2_accuracy.py)."""
    import sympy as sp

    from fuser_core.codegen.tritonize import VarRef, to_triton

    x, m = sp.Symbol("x"), sp.Symbol("mx")
    names = {"x": VarRef("x", ("m", "n")), "mx": VarRef("mx", ("m",))}
    from fuser_core.codegen.layout import Layout

    text = to_triton(sp.exp(x - m), names, Layout(("m", "n")), exp_base2=True)
    assert text == "tl.exp2(x * 1.4426950408889634 - mx[:, None] * 1.4426950408889634)"
    assert to_triton(sp.exp(2 * x + 1), {"x": VarRef("x")}, exp_base2=True) == (
        "tl.exp2(x * 2.8853900817779268 + 1.4426950408889634)")
    assert to_triton(sp.exp(x - m), names, Layout(("m", "n"))) == "tl.exp(x - mx[:, None])"

    spec = load_spec(load_catalog()["safe_softmax"])
    d = derive_cascade(spec)
    shape = {"m": 4, "n": 1000}
    config = KernelConfig({"m": 1, "n": 256})
    for dtype, base2 in (("float16", True), ("bfloat16", True), ("float32", False)):
        source = generate(spec, d, "streaming_fused", shape, config, {"x": dtype}).source
        assert ("tl.exp2(" in source) is base2 and ("tl.exp(" in source) is not base2, dtype


def test_a_constant_whose_denominator_overflows_float32_is_printed_as_one_literal():
    """Found by the cascade fuzzer: eps**8 with eps = 1e-5 is 1 / 10**40, and printed as
    ``x / 1e40`` its denominator is inf in float32, so x = -inf gave NaN where the formula (x times
    the float32 subnormal 1e-40) gives -inf. The rational is one literal now."""
    import numpy as np

    from fuser_core import runner
    from fuser_core.reference import evaluate
    from fuser_core.spec import load_spec

    spec = load_spec({"foldwise": 1, "name": "tiny", "inputs": {"a": {"dims": ["n", "d"]}},
                      "params": {"eps": 1e-05},
                      "steps": [{"name": "t", "expr": "((eps / size(n)) ** 4) ** 2 * a"},
                                {"name": "s", "reduce": "sum", "over": "d", "expr": "a"}],
                      "outputs": ["t", "s"]})
    a = np.array([[-np.inf, 1.0, -2.0], [3.0, np.inf, 0.0]], np.float32)
    want = evaluate(spec, {"n": 2, "d": 3}, {"a": a})["t"]
    got = runner.run(spec, {"n": 2, "d": 3}, "float32", {"a": a}, strategy="row_resident")
    assert "e+40" not in got.source and "0000000000000000000000000000000000000000.0" not in got.source
    np.testing.assert_array_equal(np.isinf(got.outputs["t"].numpy()), np.isinf(want))
    assert not np.isnan(got.outputs["t"].numpy()).any()
