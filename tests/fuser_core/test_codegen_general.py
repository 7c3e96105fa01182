"""The code generator beyond the catalog: new cascades whose split combine is derived, not
written per workload; non-fusible cascades; the kernel cache; masked tails; arg/min/bottom-k
reductions; and the generated source itself. Kernels run through Triton's interpreter."""

from __future__ import annotations

import re

import numpy as np
import pytest
from tests.support.catalog import load_catalog

from fuser_core.codegen import module as codegen_module
from fuser_core.codegen.module import cache_dir, generate, output_dtypes
from fuser_core.codegen.plan import STRATEGIES, KernelConfig, NotValid, valid_strategies
from fuser_core.derive import derive_cascade
from fuser_core.reference import bind_shape, evaluate, random_inputs
from fuser_core.runner import TOLERANCE, bind_dtypes, compare, run, self_check
from fuser_core.spec import load_spec

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


CAUSAL = load_spec(load_catalog()["attention_causal"])


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
