"""The derived backward (issue 39 items 1, 3, 5): every catalog spec's backward certifies against
torch's float64 autograd of its formula or is refused by name; the backward specs load, derive
and run in every strategy; their kernels match torch's own backward on the accuracy families."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fuser_core import NotValid, SpecError, catalog_entries, derivation_report, load_spec, run, self_check
from fuser_core.accuracy.families import apply_family
from fuser_core.backward.certify import autograd_gradients, backward_gradients, certify_backward, gradient_error
from fuser_core.backward.derive import derive_backward, spec_json
from fuser_core.backward.in_forward import factor_value, gradient_factor, gradient_in_forward
from fuser_core.backward.kernels import kernel_gradients
from fuser_core.codegen.strategies.registry import STRATEGIES
from fuser_core.derive import derive_cascade

REFUSED = {  # catalog spec -> the field its refusal names
    "attention_paged": "inputs.k", "group_norm": "steps", "moe_routing": "steps[2] (gate).reduce",
}
CATALOG = [e.name for e in catalog_entries() if e.packaged]


def _spec(name: str):
    return load_spec(next(e for e in catalog_entries() if e.name == name).path.read_text())


@pytest.mark.parametrize("name", CATALOG)
def test_catalog_backward_certifies_or_is_refused_by_name(name):
    spec = _spec(name)
    if name in REFUSED:
        with pytest.raises(SpecError) as err:
            derive_backward(spec)
        assert str(err.value).startswith(REFUSED[name])
        return
    cascade = derive_backward(spec)
    report = certify_backward(spec, cascade)
    assert report["holds"], report
    assert set(report["worst"]) == {i.name for i in spec.inputs if not i.is_index}
    for s in cascade.specs:  # the same grammar: each one round-trips through the loader
        assert load_spec(spec_json(s), printed=True) == s


def test_a_wrong_backward_fails_the_certificate():
    """The certificate can fail: rmsnorm's d_w with its reduction dropped (d_y * x * r, summed
    over nothing) is caught."""
    spec = _spec("rmsnorm")
    cascade = derive_backward(spec)
    w_spec = cascade.spec(next(g.spec for g in cascade.gradients if g.input == "w"))
    raw = spec_json(w_spec)
    raw["steps"][-1]["expr"] = raw["steps"][-1]["expr"] + " * 1.0001"
    broken = load_spec(raw, printed=True)
    bad = type(cascade)(**{**cascade.__dict__, "specs": tuple(broken if s is w_spec else s for s in cascade.specs)})
    report = certify_backward(spec, bad)
    assert not report["holds"] and report["worst"]["w"] > 1e-5 and report["worst"]["x"] < 1e-12


def test_softmax_backward_is_torchs():
    """The shift carries no gradient, the backward reads the forward's output y (no exp, no
    statistic saved) and is torch's formula: s = sum(dy y), dx = y (dy - s)."""
    spec = _spec("safe_softmax")
    cascade = derive_backward(spec)
    assert cascade.shifts == ("mx",) and cascade.saved == ("y",) and cascade.forward is spec
    (back,) = cascade.specs
    assert [i.name for i in back.inputs] == ["y", "d_y"]
    from fuser_core import expr as ex

    assert [(s.reduce, ex.to_text(s.expr)) for s in back.steps] == [("sum", "d_y * y"), (None, "y * (d_y - s_2)")]


def test_per_row_statistics_are_saved():
    cascade = derive_backward(_spec("rmsnorm"))
    assert cascade.saved == ("ms",) and cascade.forward.outputs == ("y", "ms")
    (dx,) = [s for s in cascade.specs if "d_x" in s.outputs]
    assert [i.name for i in dx.inputs] == ["x", "w", "ms", "d_y"]


def test_a_max_that_is_an_output_is_differentiated_with_ties_split():
    """A max the outputs depend on is no shift: its gradient goes to the maximal elements, split
    evenly among ties as torch's amax splits it."""
    spec = load_spec({"foldwise": 1, "name": "row_max_and_sum", "inputs": {"x": {"dims": ["m", "n"]}},
                      "steps": [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
                                {"name": "sx", "reduce": "sum", "over": "n", "expr": "x * mx"}],
                      "outputs": ["mx", "sx"]})
    cascade = derive_backward(spec)
    assert cascade.shifts == ()
    x = np.array([[1.0, 3.0, 3.0, -2.0], [0.5, 0.25, 2.0, 2.0]])
    upstream = {"mx": np.array([1.5, -2.0]), "sx": np.array([0.75, 3.0])}
    shape = {"m": 2, "n": 4}
    derived = backward_gradients(cascade, shape, {"x": x}, upstream)
    reference = autograd_gradients(spec, shape, {"x": x}, upstream)
    assert gradient_error(derived["x"], reference["x"]) < 1e-15


def test_index_inputs_and_runtime_scalars_are_named_not_differentiated():
    ce = derive_backward(_spec("cross_entropy"))
    assert ce.not_differentiated == {"target": "an index input"}
    assert [g.input for g in ce.gradients] == ["logits"]
    rms = derive_backward(_spec("rmsnorm"))
    assert "eps" in rms.not_differentiated


def test_layernorm_drops_the_sum_that_stationarity_makes_zero():
    """d var / d mean = -2 sum(x - mean) / C is zero for every input: dropped, so d_x has torch's
    two row sums, not three (fuser_core.backward.vanishing); attention with a sink keeps the sum
    its random samples leave all-zero (a where() branch never taken)."""
    cascade = derive_backward(_spec("layernorm"))
    assert list(cascade.vanished.values()) == ["sum over c of x - mean"]
    dx = cascade.spec(next(g.spec for g in cascade.gradients if g.input == "x"))
    assert sum(s.is_reduction for s in dx.steps) == 2
    assert derive_backward(_spec("attention_sink")).vanished == {}


def test_weight_gradients_reduce_over_the_tokens_in_a_spec_of_their_own():
    cascade = derive_backward(_spec("layernorm"))
    by_input = {g.input: g for g in cascade.gradients}
    assert by_input["gamma"].spec == by_input["beta"].spec != by_input["x"].spec
    weights = cascade.spec(by_input["gamma"].spec)
    assert {s.over for s in weights.steps if s.is_reduction} == {"t"}
    assert {s.over for s in cascade.spec(by_input["x"].spec).steps if s.is_reduction} == {"c"}


def test_attention_backward_is_flashattention2s():
    """FlashAttention-2's structure, derived: the statistics and o saved, the m x n scores
    recomputed; D = rowsum(dO o) read from the forward's o (rule 3) in a stage of its own (rule 7),
    then dQ looping over the keys and dK, dV together looping over the queries (rule 6)."""
    cascade = derive_backward(_spec("attention"))
    assert cascade.saved == ("mx", "den", "o")
    stage, dq, dkv = cascade.specs
    (d_name,) = stage.outputs
    assert cascade.staged == (d_name,) and {i.name for i in stage.inputs} == {"o", "d_o"}
    assert [s.over for s in stage.steps] == ["e"]
    assert dq.outputs == ("d_q",) and dkv.outputs == ("d_k", "d_v")
    for s in (dq, dkv):
        assert d_name in {i.name for i in s.inputs} and "s" in {st.name for st in s.steps}
    assert all(derivation_report(s)["fusible"] for s in cascade.specs)


def test_attention_backward_kernels_against_sdpa():
    """The kernels (saving forward, the stage, dQ, dK/dV; each spec's best strategy) against
    torch's scaled_dot_product_attention backward in float64."""
    spec = _spec("attention")
    cascade = derive_backward(spec)
    shape = {"b": 1, "h": 2, "m": 37, "n": 45, "d": 16, "e": 16}
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal(s).astype(np.float32).astype(np.float64)
               for s in ((1, 2, 37, 16), (1, 2, 45, 16), (1, 2, 45, 16)))
    do = rng.standard_normal((1, 2, 37, 16)).astype(np.float32).astype(np.float64)
    got = kernel_gradients(spec, cascade, shape, "float32", {"q": q, "k": k, "v": v}, {"o": do})
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(tq, tk, tv).backward(torch.tensor(do))
    for name, ref in (("q", tq.grad), ("k", tk.grad), ("v", tv.grad)):
        assert gradient_error(got[name], ref.numpy()) < 2e-5, name


def test_an_input_with_a_structurally_zero_gradient_is_named():
    spec = load_spec({"foldwise": 1, "name": "t", "inputs": {"x": {"dims": ["m", "n"]}},
                      "steps": [{"name": "r", "expr": "round(x)"}, {"name": "s", "reduce": "sum", "over": "n", "expr": "r"}],
                      "outputs": ["s"]})
    cascade = derive_backward(spec)
    assert cascade.zero == ("x",) and cascade.specs == ()  # round's derivative is 0: no kernel to run
    grads = backward_gradients(cascade, {"m": 2, "n": 3}, {"x": np.ones((2, 3))}, {"s": np.ones(2)})
    assert np.array_equal(grads["x"], np.zeros((2, 3)))


# ---------------------------------------------------------------- kernels


@pytest.mark.parametrize("name", ["safe_softmax", "rmsnorm", "layernorm"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_backward_specs_run_in_every_strategy(name, strategy):
    cascade = derive_backward(_spec(name))
    for s in cascade.specs:
        shape = {d: n for d, n in {"m": 5, "n": 300, "t": 6, "c": 257}.items() if d in s.dims}
        report = self_check(s, shape, "float32", strategy=strategy)
        assert report["passed"], (s.name, report)


def _torch_softmax_grad(x, dy, dtype):
    t = torch.tensor(x, dtype=dtype, requires_grad=True)
    torch.softmax(t, -1).backward(torch.tensor(dy, dtype=dtype))
    return t.grad.double().numpy()


@pytest.mark.parametrize("family", ["normal", "offset100", "offset1000", "scale30", "peaked", "near_ties", "masked", "nan"])
def test_softmax_backward_kernels_against_torch_on_the_families(family):
    """Forward (saving mx, den) and backward kernels, float32, against torch's own softmax
    backward: float64 for the reference, float32 for the bar (error <= 2x torch float32's + 8 ulps);
    NaN and zeros where torch has them."""
    spec = _spec("safe_softmax")
    cascade = derive_backward(spec)
    rng = np.random.default_rng(3)
    shape = {"m": 4, "n": 300}
    x = apply_family(family, rng.standard_normal((4, 300)).astype(np.float32).astype(np.float64), rng)
    x = x.astype(np.float32).astype(np.float64)
    dy = rng.standard_normal((4, 300)).astype(np.float32).astype(np.float64)
    ref = _torch_softmax_grad(x, dy, torch.float64)
    t32 = _torch_softmax_grad(x, dy, torch.float32)
    for strategy in ("row_resident", "streaming_fused", "split_fused"):
        got = kernel_gradients(spec, cascade, shape, "float32", {"x": x}, {"y": dy}, strategy)["x"]
        assert np.array_equal(np.isnan(got), np.isnan(ref)), (strategy, family)
        ok = ~np.isnan(ref)
        if not ok.any():
            continue
        scale = np.max(np.abs(ref[ok])) or 1.0
        err = np.max(np.abs(got[ok] - ref[ok])) / scale
        bar = 2 * np.max(np.abs(t32[ok] - ref[ok])) / scale + 8 * 2.0**-24
        assert err <= bar, (strategy, family, err, bar)


def test_rmsnorm_backward_kernels_against_torch():
    spec = _spec("rmsnorm")
    cascade = derive_backward(spec)
    rng = np.random.default_rng(5)
    shape = {"t": 6, "c": 257}
    x, w, dy = (rng.standard_normal(s).astype(np.float32).astype(np.float64) for s in ((6, 257), (257,), (6, 257)))
    got = kernel_gradients(spec, cascade, shape, "float32", {"x": x, "w": w, "eps": 1e-6}, {"y": dy}, "streaming_fused")
    tx, tw = (torch.tensor(a, requires_grad=True) for a in (x, w))
    torch.nn.functional.rms_norm(tx, (257,), tw, 1e-6).backward(torch.tensor(dy))
    for name, ref in (("x", tx.grad.numpy()), ("w", tw.grad.numpy())):
        assert gradient_error(got[name], ref) < 5e-6, name


def test_cross_entropy_gradient_in_the_forward():
    """One kernel writes the loss and d loss / d logits; times the upstream gradient it is torch's
    cross-entropy backward."""
    spec = _spec("cross_entropy")
    cascade = derive_backward(spec)
    fused = gradient_in_forward(spec, cascade)
    assert fused is not None and fused.outputs == ("loss", "logits_grad")
    assert sum(s.is_reduction for s in fused.steps) == 3  # the forward's own: max, sum, picked
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((5, 300)) * 4 + 100).astype(np.float32).astype(np.float64)  # logits near 100
    target = rng.integers(0, 300, 5)
    dloss = rng.standard_normal(5).astype(np.float32).astype(np.float64)
    t = torch.tensor(logits, requires_grad=True)
    torch.nn.functional.cross_entropy(t, torch.tensor(target), reduction="none").backward(torch.tensor(dloss))
    for strategy in ("row_resident", "streaming_fused", "split_fused"):
        out = run(fused, {"t": 5, "v": 300}, "float32", {"logits": logits, "target": target}, strategy=strategy).outputs
        got = dloss[:, None] * out["logits_grad"].double().numpy()
        assert gradient_error(got, t.grad.numpy()) < 1e-6, strategy


def test_cross_entropy_with_ignore_index_writes_its_gradient_for_a_factor():
    """Two outputs (per-token losses, their mean over the counted tokens): the gradient reads the
    upstream gradients through one name, d_loss + d_mean / max(counted, 1) (the factor, a spec of
    its own over t), so the forward writes the rest and the count; factor times it is torch's
    backward with ignore_index, on every strategy that runs the forward."""
    spec = _spec("cross_entropy_ignore")
    cascade = derive_backward(spec)
    factor = gradient_factor(cascade)
    assert factor is not None and factor.dims == ("t",) and factor.saved == ("counted",)
    assert {i.name for i in factor.spec.inputs} == {"d_loss", "d_mean", "counted"}
    fused = gradient_in_forward(spec, cascade)
    assert fused is not None and fused.outputs == ("loss", "mean", "counted", "logits_grad")
    rng = np.random.default_rng(8)
    logits = (rng.standard_normal((7, 90)) * 3 + 100).astype(np.float32).astype(np.float64)
    target = rng.integers(0, 90, 7)
    target[[1, 4]] = -100
    d_loss, d_mean = rng.standard_normal(7), rng.standard_normal(())
    t = torch.tensor(logits, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(t, torch.tensor(target), reduction="none")
    ((loss * torch.tensor(d_loss)).sum() + loss.sum() / 5 * float(d_mean)).backward()
    ran = []
    for strategy in STRATEGIES:
        try:
            out = run(fused, {"t": 7, "v": 90}, "float32", {"logits": logits, "target": target}, strategy=strategy).outputs
        except NotValid:
            continue
        ran.append(strategy)
        values = {"d_loss": torch.tensor(d_loss), "d_mean": torch.tensor(d_mean), "counted": out["counted"]}
        r = factor_value(factor, values).numpy()
        got = r[:, None] * out["logits_grad"].double().numpy()
        assert gradient_error(got, t.grad.numpy()) < 1e-6, strategy
    assert len(ran) >= 2, ran


def test_no_gradient_in_the_forward_where_the_backward_reduces():
    spec = _spec("rmsnorm")
    assert gradient_in_forward(spec, derive_backward(spec)) is None


# ---------------------------------------------------------------- the GPU compiler


def _backward_kernels(name):
    spec = _spec(name)
    cascade = derive_backward(spec)
    fused = gradient_in_forward(spec, cascade)
    return [cascade.forward, *(s for s in cascade.specs if any(st.is_reduction for st in s.steps)),
            *([fused] if fused is not None else [])]


@pytest.mark.parametrize("name", ["safe_softmax", "rmsnorm", "layernorm", "cross_entropy", "cross_entropy_ignore",
                                  "attention"])
def test_backward_kernels_compile_for_sm90(name, compile_pool):
    """The interpreter accepts what the compiler rejects: the saving forward, every backward spec
    with a reduction and the forward writing its gradient compile for sm_90 (float16) in every
    strategy that takes them."""
    from fuser_core import bind_dtypes
    from fuser_core.codegen.gpu_compile import CompileRequest
    from fuser_core.targets import Target

    sizes = {"m": 100, "n": 1000, "t": 64, "c": 4096, "v": 32000, "b": 1, "h": 2, "d": 64, "e": 64}
    if name == "attention":
        sizes |= {"m": 256, "n": 256}
    if name == "cross_entropy_ignore":  # its mean over the tokens: no fused strategy streams a wider row yet
        sizes |= {"v": 1024}
    requests = [CompileRequest(s, {d: n for d, n in sizes.items() if d in s.dims}, bind_dtypes(s, "float16"), strategy,
                               None, Target.parse("sm_90"))
                for s in _backward_kernels(name) for strategy in STRATEGIES]
    built = 0
    for request, build in zip(requests, compile_pool.compile(requests)):
        assert not build.refused or request.strategy == "row_resident", (request.spec.name, build.refused)
        for kernel in build.kernels:
            assert kernel.ok, (request.spec.name, request.strategy, kernel.error)
            built += 1
    assert built >= len(requests)


def test_a_loss_variant_written_by_a_user_gets_its_gradient_in_the_forward():
    """Label smoothing and a z-loss (Liger needed forward and backward edits for each): derived,
    written by the forward kernel, against torch's autograd of the same loss (float64). No example
    shape in the spec: the numeric checks run at their own."""
    spec = load_spec({
        "foldwise": 1, "name": "ce_smooth_z", "doc": "cross-entropy, label smoothing 0.1, z-loss 1e-4",
        "inputs": {"logits": {"dims": ["t", "v"]}, "target": {"dims": ["t"], "kind": "index"}},
        "steps": [{"name": "mx", "reduce": "max", "over": "v", "expr": "logits"},
                  {"name": "den", "reduce": "sum", "over": "v", "expr": "exp(logits - mx)"},
                  {"name": "picked", "reduce": "sum", "over": "v", "expr": "where(index(v) == target, logits, 0)"},
                  {"name": "total", "reduce": "sum", "over": "v", "expr": "logits"},
                  {"name": "lse", "expr": "mx + log(den)"},
                  {"name": "loss", "expr": "lse - 0.9 * picked - 0.1 * total / size(v) + 0.0001 * lse * lse"}],
        "outputs": ["loss"]})
    cascade = derive_backward(spec)
    assert certify_backward(spec, cascade)["holds"]
    fused = gradient_in_forward(spec, cascade)
    assert fused is not None and fused.outputs == ("loss", "logits_grad")
    rng = np.random.default_rng(13)
    logits = (rng.standard_normal((6, 77)) * 3 + 50).astype(np.float32).astype(np.float64)
    target = rng.integers(0, 77, 6)
    dloss = rng.standard_normal(6)
    t = torch.tensor(logits, requires_grad=True)
    ce = torch.nn.functional.cross_entropy(t, torch.tensor(target), reduction="none", label_smoothing=0.1)
    lse = torch.logsumexp(t, -1)
    (ce + 1e-4 * lse * lse).backward(torch.tensor(dloss))
    out = run(fused, {"t": 6, "v": 77}, "float32", {"logits": logits, "target": target}, strategy="streaming_fused").outputs
    got = dloss[:, None] * out["logits_grad"].double().numpy()
    assert gradient_error(got, t.grad.numpy()) < 1e-6


@pytest.mark.parametrize("combine", ["kernel", "last_part"])
def test_a_weight_gradient_splits_over_the_tokens_with_a_deterministic_combine(combine):
    """Issue 39 item 2: d_w (a sum over the tokens) split into 4 chunks of rows, the partial sums
    merged by a combine kernel or, in the same launch, by the last chunk to finish (in chunk order:
    the same bits every run)."""
    from fuser_core import KernelConfig

    cascade = derive_backward(_spec("rmsnorm"))
    w_spec = cascade.spec(next(g.spec for g in cascade.gradients if g.input == "w"))
    config = KernelConfig(blocks={"t": 32, "c": 16}, num_warps=4, split=4, combine=combine)
    shape = {"t": 300, "c": 37}
    report = self_check(w_spec, shape, "float32", strategy="split_fused", config=config)
    assert report["passed"], report
    rng = np.random.default_rng(1)
    inputs = {"x": rng.standard_normal((300, 37)), "ms": rng.uniform(0.5, 2, 300), "d_y": rng.standard_normal((300, 37)),
              "eps": 1e-6}
    runs = [run(w_spec, shape, "float32", inputs, strategy="split_fused", config=config).outputs["d_w"] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("name", ["attention", "attention_causal"])
def test_attention_scores_are_a_dot_in_the_forward_and_every_backward_kernel(name):
    """The backward recomputes P = exp(s - mx) / den from the statistics the forward saved; torch's P is
    normalised by its own sums, and ours is only where the backward rounds s as the forward did. A
    mask of indices (the causal backward's where(c, 1, 0)) is no operand: b and h stay batch dims in
    every backward spec, as in the forward's, and each spec's default tiles (at 9 queries, under one
    dot tile) compute the scores as a tl.dot, as every candidate of the tuner's space does (rows and
    loop tiles of at least 16). Measured with the batch dims taken for free dims (a 3-d tile, the
    scores summed elementwise in one kernel and by tl.dot in another): d_v 2.8x torch float32's error
    against float64 autograd; alike, 0.72x (tests/e2e/test_trainable_serve.py checks it served)."""
    from fuser_core.codegen.plan import contraction_dims, default_config, make_plan
    from fuser_core.runner import choose_strategy

    cascade = derive_backward(_spec(name))
    shape = {"b": 1, "h": 2, "m": 9, "n": 9, "d": 16, "e": 16}
    for spec in (cascade.forward, *(s for s in cascade.specs if "s" in {st.name for st in s.steps})):
        derivation = derive_cascade(spec)
        free, batch = contraction_dims(spec, derivation)
        assert batch == {"b", "h"} and {"m", "n"} <= free, spec.name
        sized = {d: n for d, n in shape.items() if d in spec.sized_dims}
        strategy = choose_strategy(spec, derivation, sized)
        blocks = make_plan(spec, derivation, strategy, sized, default_config(spec, derivation, strategy, sized)).blocks
        assert min(blocks["m"], blocks["n"], blocks["d"]) >= 16 and blocks["h"] == 1, (spec.name, blocks)


def test_dk_dv_holds_its_scores_as_keys_by_queries():
    """dK/dV loops over the queries with its keys as rows: its tiles put n first (structure.facts.tile_dims),
    so the scores are k @ q^T (tutorial 06's qkT) and P^T, dS^T feed the products over m as they are."""
    from fuser_core.codegen.plan import KernelConfig, make_plan
    from fuser_core.codegen.structure.facts import tile_dims

    cascade = derive_backward(_spec("attention_causal"))
    (spec,) = [s for s in cascade.specs if "d_k" in s.outputs]
    forward = cascade.forward
    shape = {"b": 1, "h": 2, "m": 64, "n": 64, "d": 16, "e": 16}
    blocks = {"b": 1, "h": 1, "m": 32, "n": 64, "d": 16, "e": 16}
    plan = make_plan(spec, derive_cascade(spec), "streaming_fused", shape, KernelConfig(blocks))
    assert plan.axis == "m" and tile_dims(plan)[:2] == ("n", "m")
    fplan = make_plan(forward, derive_cascade(forward), "streaming_fused", shape, KernelConfig(blocks))
    assert tile_dims(fplan) == tuple(d for d in forward.dims if blocks[d] > 1)  # the forward's, unchanged
