"""Reductions over several dims at once (issue 23, 6b): GroupNorm written with "over": ["c", "p"]
fuses into one loop over the merged dim c_p in every strategy, matches float64 and torch's
F.group_norm on the user's own tensors (x[n, g, c, p], a per-channel weight w[g, c]) through
Triton's interpreter, at sizes that are no multiple of the tiles, and on the inputs real models
give (offsets near 100, a scale of 30, peaked groups, NaN). Bad uses of a list ``over`` are
refused naming the field."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from fuser_core.canonical import canonical_form, spec_hash
from fuser_core.catalog import load_catalog_spec
from fuser_core.codegen.plan import BASELINE, STRATEGIES, KernelConfig
from fuser_core.derive import derive_cascade
from fuser_core.errors import SpecError
from fuser_core.merged import to_logical, to_storage
from fuser_core.problem import ShapeError, bind_shape
from fuser_core.reference import evaluate
from fuser_core.report import derivation_report
from fuser_core.runner import interpreter_quiet, run, self_check
from fuser_core.spec import load_spec

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
ALL = (*STRATEGIES, BASELINE)
SHAPE = {"n": 2, "g": 3, "c": 5, "p": 7}  # c * p = 35: four tiles of 8 and a partial one


def config(strategy: str) -> KernelConfig | None:
    if strategy in ("row_resident", BASELINE):
        return None
    return KernelConfig({"c_p": 8, "n": 2, "g": 2}, split=3 if strategy == "split_fused" else 1)


@pytest.fixture(scope="module")
def group_norm():
    spec = load_catalog_spec("group_norm")
    return spec, derive_cascade(spec)


def test_the_two_dims_merge_into_one_loop_axis(group_norm):
    spec, d = group_norm
    assert spec.merges == {"c_p": ("c", "p")} and spec.dims == ("n", "g", "c_p")
    assert spec.input("x").dims == ("n", "g", "c_p") and spec.input("x").storage_dims == ("n", "g", "c", "p")
    assert spec.input("w").dims == ("g", "c_p") and spec.input("w").storage_dims == ("g", "c")
    assert d.fusible and [g.axis for g in d.groups] == ["c_p"]
    assert bind_shape(spec, SHAPE) == {**SHAPE, "c_p": 35}


def test_derive_reports_it_fused_with_a_holding_certificate(group_norm):
    spec, _ = group_norm
    report = derivation_report(spec)
    assert report["fusible"] and report["certificate"]["holds"], report
    assert report["axes"][0]["axis"] == "c_p" and report["axes"][0]["dims"] == ["c", "p"]
    var = next(r for r in report["reductions"] if r["name"] == "var")
    # the count is the product of the parts' sizes, as the spec divides by it: the Taylor shift's top
    # coefficient, sum 1 / (size(c) size(p)), is count[old] / (size(c) size(p))
    assert var["realisation"] == "taylor" and "shift_term(count[old]/(size(c)*size(p))" in var["correction"], var


def user_tensors(kind: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    n, g, c, p = (SHAPE[d] for d in ("n", "g", "c", "p"))
    x = rng.standard_normal((n, g, c, p))
    if kind == "offset100":
        x = x + 100.0
    elif kind == "scale30":
        x = x * 30.0
    elif kind == "peaked":  # one large value per group
        x[:, :, 1, 3] = 50.0
    elif kind == "nan":
        x[0, 1, 2, 4] = np.nan
    return {"x": x.astype(np.float32), "w": rng.standard_normal((g, c)).astype(np.float32),
            "b": rng.standard_normal((g, c)).astype(np.float32)}


def torch_group_norm(t: dict[str, np.ndarray], dtype=torch.float64) -> np.ndarray:
    n, g, c, p = t["x"].shape
    x = torch.from_numpy(t["x"]).to(dtype).reshape(n, g * c, p)
    y = F.group_norm(x, g, torch.from_numpy(t["w"]).to(dtype).reshape(-1), torch.from_numpy(t["b"]).to(dtype).reshape(-1),
                     1e-5)
    return y.reshape(n, g, c, p).double().numpy()


def test_the_reference_is_torchs_group_norm(group_norm):
    spec, _ = group_norm
    bound = bind_shape(spec, SHAPE)
    t = user_tensors("normal", np.random.default_rng(1))
    y = evaluate(spec, bound, {k: to_logical(spec, k, v.astype(np.float64), bound) for k, v in t.items()})["y"]
    np.testing.assert_allclose(to_storage(spec, spec.step("y").dims, y, bound), torch_group_norm(t), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("strategy", ALL)
def test_kernels_match_float64_and_torch_on_the_users_tensors(group_norm, strategy):
    spec, d = group_norm
    bound = bind_shape(spec, SHAPE)
    rng = np.random.default_rng(3)
    for kind in ("normal", "offset100", "scale30", "peaked", "nan"):
        t = user_tensors(kind, rng)
        want = torch_group_norm(t)
        with interpreter_quiet():
            result = run(spec, SHAPE, "float32", {k: to_logical(spec, k, v, bound) for k, v in t.items()},
                         strategy=strategy, config=config(strategy), derivation=d)
        got = to_storage(spec, spec.step("y").dims, result.outputs["y"].numpy().astype(np.float64), bound)
        assert got.shape == want.shape == (2, 3, 5, 7)
        nan = np.isnan(want)
        assert (np.isnan(got) == nan).all(), kind  # a NaN spreads over its group only, as in torch
        assert nan.any() == (kind == "nan") and nan[0, 1].all() and not nan[0, 0].any() if kind == "nan" else True
        # torch's own float32 op: the bar's "at most 2x torch's error" (with a floor of a few ulps)
        floor = 8 * np.finfo(np.float32).eps * np.abs(want[~nan]).max()
        torch32 = np.abs(torch_group_norm(t, torch.float32) - want)[~nan].max()
        err = np.abs(got - want)[~nan].max()
        assert err <= 2 * max(torch32, floor), (kind, err, torch32)


@pytest.mark.parametrize("strategy", ALL)
def test_self_check_in_half_precision(group_norm, strategy):
    spec, d = group_norm
    for dtype in ("float16", "bfloat16"):
        report = self_check(spec, SHAPE, dtype, strategy=strategy, config=config(strategy), derivation=d, seed=4)
        assert report["passed"], report


def test_a_per_channel_weight_is_repeated_along_the_positions():
    spec = load_catalog_spec("group_norm")
    bound = bind_shape(spec, {"n": 1, "g": 2, "c": 3, "p": 4})
    w = torch.arange(6.0).reshape(2, 3)
    logical = to_logical(spec, "w", w, bound)
    assert logical.shape == (2, 12) and logical[1].tolist() == [3.0] * 4 + [4.0] * 4 + [5.0] * 4
    x = torch.arange(24.0).reshape(1, 2, 3, 4)
    assert to_logical(spec, "x", x, bound).data_ptr() == x.data_ptr()  # a contiguous tensor: a view


def test_the_canonical_copy_keeps_the_list_and_its_hash():
    spec = load_catalog_spec("group_norm")
    form = canonical_form(spec)
    # inputs sorted by name: b[g, c] names g d0 and c d1, x[n, g, c, p] names n d2 and p d3
    assert form["steps"][0]["over"] == ["d1", "d3"] and form["inputs"]["x"]["dims"] == ["d2", "d0", "d1", "d3"]
    copy = load_spec(form, printed=True)
    assert copy.merges == {"d1_d3": ("d1", "d3")} and spec_hash(copy) == spec_hash(spec)
    report = derivation_report(load_spec({**json.loads(json.dumps(form)), "name": "renamed"}))
    assert report["axes"][0]["dims"] == ["d1", "d3"] and report["axes"][0]["axis"] == "d1_d3"


BASE = {"foldwise": 1, "name": "gn", "inputs": {"x": {"dims": ["n", "c", "p"]}, "w": {"dims": ["c"]}},
        "steps": [{"name": "m", "reduce": "sum", "over": ["c", "p"], "expr": "x * w"}], "outputs": ["m"]}


def variant(**step) -> dict:
    return {**BASE, "steps": [{**BASE["steps"][0], **step}]}


@pytest.mark.parametrize("raw, loc, words", [
    (variant(over=["c"]), ("steps", 0, "over"), "2 to 4 dims"),
    (variant(over=["c", "q"]), ("steps", 0, "over"), "unknown dim 'q'"),
    (variant(over=["c", "c"]), ("steps", 0, "over"), "twice"),
    (variant(reduce="argmax"), ("steps", 0, "over"), "argmax over several dims"),
    (variant(over={}), ("steps", 0, "over"), "must be an identifier"),  # unhashable: found by the fuzz test in CI
    (variant(over=3), ("steps", 0, "over"), "must be an identifier"),
    (variant(expr="x * index(c)"), ("steps", 0, "expr"), "index(c)"),
    ({**BASE, "inputs": {"x": {"dims": ["c", "n", "p"]}, "w": {"dims": ["c"]}}}, ("inputs", "x", "dims"),
     "next to each other"),
    ({**BASE, "inputs": {"x": {"dims": ["n", "p", "c"]}, "w": {"dims": ["c"]}}}, ("inputs", "x", "dims"),
     "in that order"),
    ({**BASE, "steps": [BASE["steps"][0], {"name": "k", "reduce": "max", "over": "p", "expr": "x"}],
      "outputs": ["m", "k"]}, ("steps", 1, "over"), "reduce over that list"),
])
def test_bad_lists_are_refused_naming_the_field(raw, loc, words):
    with pytest.raises(SpecError) as err:
        load_spec(raw)
    assert err.value.loc == loc and words in str(err.value), str(err.value)


def test_size_of_a_part_and_the_shapes_it_needs():
    spec = load_spec(variant(expr="x * w / size(p)"))
    assert spec.dims == ("n", "c_p") and spec.input("w").dims == ("c_p",)
    with pytest.raises(ShapeError) as err:
        bind_shape(spec, {"n": 2, "c": 3})
    assert err.value.loc == ("shape", "p")
    assert bind_shape(spec, {"n": 2, "c": 3, "p": 0}, allow_empty=True)["c_p"] == 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_weight_is_read_where_it_is_stored(group_norm, strategy):
    """The fused kernels read a per-channel weight at c = m // size(p) of the merged index m: the
    launcher passes the user's w[g, c] itself (no copy repeated along p), and takes the logical
    w[g, c * p] the runner uses as a view of its first positions. Both give the same outputs."""
    from fuser_core.codegen.module import generate
    from fuser_core.codegen.plan import default_config
    from fuser_core.merged import kernel_dims

    spec, d = group_norm
    bound = bind_shape(spec, SHAPE)
    assert kernel_dims(spec, "w") == ("g", "c") and kernel_dims(spec, "x") == ("n", "g", "c_p")
    module = generate(spec, d, strategy, bound, config(strategy) or default_config(spec, d, strategy, bound),
                      {"x": "float32", "w": "float32", "b": "float32"})
    assert re.search(r"\(offs_c_p(\[None, :\])? // size_p\) \* stride_w_c", module.source)
    t = {k: torch.from_numpy(v) for k, v in user_tensors("normal", np.random.default_rng(7)).items()}
    logical = {k: to_logical(spec, k, v, bound) for k, v in t.items()}
    with interpreter_quiet():
        got_user = module.load().launch(t, bound, scalars={"eps": 1e-5})["y"]
        got_logical = module.load().launch(logical, bound, scalars={"eps": 1e-5})["y"]
    assert torch.equal(got_user, got_logical)
    want = torch_group_norm({k: v.numpy() for k, v in t.items()})
    assert np.abs(to_storage(spec, spec.step("y").dims, got_user.double().numpy(), bound) - want).max() < 1e-5


def test_a_logical_weight_that_does_not_repeat_is_refused_naming_it(group_norm):
    """The kernels read a per-channel weight at its first position along p, the reference at every one: a
    logical w[g, c * p] that is no repeat of a user's w[g, c] has no meaning, and is refused, not run."""
    spec, d = group_norm
    bound = bind_shape(spec, SHAPE)
    t = {k: to_logical(spec, k, v, bound) for k, v in user_tensors("normal", np.random.default_rng(2)).items()}
    t["w"] = np.array(t["w"])
    t["w"][1, 3] += 1.0
    with pytest.raises(ShapeError) as err:
        run(spec, SHAPE, "float32", t, strategy="streaming_fused", derivation=d)
    assert err.value.loc == ("inputs", "w") and "repeat" in str(err.value)


def test_the_accuracy_bar_compares_with_torchs_group_norm(group_norm):
    """foldwise run's bar and the tuner's gate hold every strategy to torch's F.group_norm too, at a shape
    that keeps the parts (c = 5, p = 7; a capped shape keeps them as far as it can)."""
    from fuser_core.accuracy import accuracy_check
    from fuser_core.codegen.plan import capped_shape

    spec, d = group_norm
    for strategy in ALL:
        verdict = accuracy_check(spec, SHAPE, families=("normal", "offset100"), strategy=strategy, derivation=d)
        assert verdict["torch_op"] == "group_norm" and verdict["passed"], verdict
        assert all(r["torch_error"] is not None for r in verdict["families"]), verdict["families"]
    small = capped_shape(spec, d, bind_shape(spec, {"n": 2, "g": 3, "c": 5, "p": 7}), axis=20, inner=5, free=4,
                         batch=2, lane=3)
    assert (small["c"], small["p"], small["c_p"]) == (2, 7, 14)


def test_group_norm_written_with_one_dim_steps_is_pointed_to_the_list_form():
    """Issue 37, 16: a sum over g of a sum over c (GroupNorm's statistics as two one-dim steps each)
    is not fused, and the refusal names the list form of over that is."""
    from fuser_core.derive import derive_cascade
    from fuser_core.spec import load_spec

    nested = {"foldwise": 1, "name": "gn_nested", "inputs": {"x": {"dims": ["t", "g", "c"]}}, "steps": [
        {"name": "s1", "reduce": "sum", "over": "c", "expr": "x"},
        {"name": "s", "reduce": "sum", "over": "g", "expr": "s1"},
        {"name": "mean", "expr": "s / (size(g) * size(c))"},
        {"name": "q1", "reduce": "sum", "over": "c", "expr": "(x - mean) * (x - mean)"},
        {"name": "q", "reduce": "sum", "over": "g", "expr": "q1"},
        {"name": "y", "expr": "(x - mean) * rsqrt(q / (size(g) * size(c)) + 1e-5)"}], "outputs": ["y"]}
    derivation = derive_cascade(load_spec(nested))
    reasons = {f.step.name: f.reason for f in derivation.forms.values() if not f.fused}
    assert set(reasons) == {"q1", "q"}, reasons
    assert 's is a sum over g of the sum s1: one step with "over": ["g", "c"]' in reasons["q1"]
    assert 'q is a sum over g of the sum q1: one step with "over": ["g", "c"]' in reasons["q"]
    listed = {**nested, "name": "gn_listed", "steps": [
        {"name": "s", "reduce": "sum", "over": ["g", "c"], "expr": "x"},
        {"name": "mean", "expr": "s / (size(g) * size(c))"},
        {"name": "q", "reduce": "sum", "over": ["g", "c"], "expr": "(x - mean) * (x - mean)"},
        {"name": "y", "expr": "(x - mean) * rsqrt(q / (size(g) * size(c)) + 1e-5)"}]}
    assert all(f.fused for f in derive_cascade(load_spec(listed)).forms.values())
    # a step over one of the dims alone (a per-block amax over c) could not join a list: no hint there
    blocks = derive_cascade(load_catalog_spec("rmsnorm_fp8_per_block"))
    amax = next(f for f in blocks.forms.values() if f.step.name == "amax")
    assert not amax.fused and '"over": [' not in amax.reason
