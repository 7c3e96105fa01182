"""A sum over an inner dim a block at a time (issue 39 item 4): ``linear_cross_entropy``'s logits
``h @ w^T`` summed over the hidden size d in a K loop inside each tile of the vocabulary, so d =
4096-8192 runs (it was refused past one block: "inner axis d (2048) does not fit one block"). Every
strategy is checked against float64 on inputs a language model's head produces (logits near 100,
a peaked row, ties, NaN and infinities), at sizes that are not multiples of the tiles; the K loop's
structure, the cost model's count of it and the sm_90 compile are checked too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fuser_core.catalog import load_catalog_spec
from fuser_core.codegen.plan import STRATEGIES, KernelConfig, NotValid, default_config, make_plan
from fuser_core.codegen.ops import Load, Loop, Reduce
from fuser_core.codegen.structure import build_structure
from fuser_core.derive import derive_cascade
from fuser_core.problem import make_problem
from fuser_core.runner import interpreter_quiet, run
from fuser_core.spec import load_spec

NAME = "linear_cross_entropy"


@pytest.fixture(scope="module")
def derived():
    spec = load_catalog_spec(NAME)
    return spec, derive_cascade(spec)


def head_inputs(t: int, v: int, d: int, family: str = "normal", seed: int = 0) -> dict[str, np.ndarray]:
    """Hidden states and a head weight scaled as a trained model's (logits of a few units), float32
    values; ``family``: ``offset100`` (every logit near 100: one hidden unit is 100 and its weight
    column 1), ``peaked`` (one class far above the rest), ``ties`` (two equal rows of w), ``nan``
    and ``inf`` (in one token's hidden state)."""
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((t, d))
    w = rng.standard_normal((v, d)) * (3 / np.sqrt(d))
    target = rng.integers(0, v, t)
    if family == "offset100":
        h[:, 0], w[:, 0] = 100.0, 1.0
    elif family == "peaked":
        w[7] = h[0] * (40 / np.linalg.norm(h[0]) ** 2)  # token 0's logit of class 7: 40
    elif family == "ties":
        w[1] = w[0]
        target[:3] = [0, 1, 0]
    elif family == "nan":
        h[2, d // 2] = np.nan
    elif family == "inf":
        h[3, 5] = np.inf
    return {"h": h.astype(np.float32).astype(np.float64), "w": w.astype(np.float32).astype(np.float64),
            "target": target}


def torch_loss(inputs: dict[str, np.ndarray], dtype: torch.dtype) -> np.ndarray:
    h, w = (torch.tensor(inputs[k], dtype=dtype) for k in ("h", "w"))
    return torch.nn.functional.cross_entropy(h @ w.T, torch.tensor(inputs["target"]), reduction="none").double().numpy()


def kernel_loss(derived, shape, inputs, strategy, config=None, dtype="float32") -> np.ndarray:
    spec, derivation = derived
    with interpreter_quiet():
        result = run(spec, shape, {"h": dtype, "w": dtype, "target": "int64"}, inputs, strategy=strategy,
                     config=config, derivation=derivation)
    return result.outputs["loss"].double().cpu().numpy()


def test_a_hidden_size_past_one_block_is_summed_in_a_k_loop(derived):
    spec, derivation = derived
    shape = {"t": 37, "v": 300, "d": 2500}
    for strategy in STRATEGIES:
        plan = make_plan(spec, derivation, strategy, shape, default_config(spec, derivation, strategy, shape))
        assert plan.contraction_loops == ("d",) and plan.blocks["d"] == 64, strategy
    kernel = build_structure(make_plan(spec, derivation, "streaming_fused", shape,
                                       default_config(spec, derivation, "streaming_fused", shape)),
                             {"h": "float32", "w": "float32", "target": "int64"}).kernels[0]
    (axis_loop,) = [op for op in kernel.ops if isinstance(op, Loop)]
    (k_loop,) = [op for op in axis_loop.body if isinstance(op, Loop)]
    assert (k_loop.span, k_loop.dim) == ("contraction", "d")
    # h moves with the K loop: loaded inside it, not hoisted before the loops as a row's input would be
    assert {op.input for op in k_loop.body if isinstance(op, Load)} == {"h", "w"}
    assert not kernel.hoisted or all(op.input == "target" for op in kernel.hoisted)
    (dot,) = [op for op in k_loop.body if isinstance(op, Reduce)]
    assert dot.into and dot.dot is not None  # logits = logits + tl.dot(h, w^T)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_matches_float64_past_one_block(derived, strategy):
    shape = {"t": 37, "v": 300, "d": 1100}  # K tiles of 64: 17 whole and a tail of 12
    inputs = head_inputs(**shape)
    want = torch_loss(inputs, torch.float64)
    bar = 2 * np.abs(torch_loss(inputs, torch.float32) - want).max() + 1e-6
    got = kernel_loss(derived, shape, inputs, strategy)
    assert np.abs(got - want).max() <= bar, strategy


@pytest.mark.parametrize("family", ["offset100", "peaked", "ties", "nan", "inf"])
def test_model_inputs_and_special_values_agree_in_every_strategy(derived, family):
    """The K loop (d = 50 in tiles of 16, a tail of 2) against the whole-d kernel and float64: the same
    special values in every strategy (a NaN or infinite hidden state makes that token's loss NaN, as
    torch's does), the same errors elsewhere."""
    shape = {"t": 11, "v": 70, "d": 50}
    inputs = head_inputs(**shape, family=family)
    want = torch_loss(inputs, torch.float64)
    bar = 2 * np.nan_to_num(np.abs(torch_loss(inputs, torch.float32) - want), nan=0.0).max() + 1e-6
    for strategy in STRATEGIES:
        blocks = {"t": 16, "v": 128 if strategy == "row_resident" else 16}  # row_resident: the whole row
        looped = kernel_loss(derived, shape, inputs, strategy,
                             KernelConfig({**blocks, "d": 16}, split=2 if strategy == "split_fused" else 1))
        whole = kernel_loss(derived, shape, inputs, strategy,
                            KernelConfig(blocks, split=2 if strategy == "split_fused" else 1))
        np.testing.assert_array_equal(np.isnan(looped), np.isnan(want), err_msg=f"{family} {strategy}")
        np.testing.assert_array_equal(np.isnan(whole), np.isnan(looped), err_msg=f"{family} {strategy}")
        fine = ~np.isnan(want)
        assert np.abs(looped[fine] - want[fine]).max() <= bar, (family, strategy)


def test_bfloat16_k_loop_is_as_accurate_as_torch(derived):
    shape = {"t": 20, "v": 130, "d": 1300}
    inputs = head_inputs(**shape, family="offset100", seed=3)
    # the inputs as bfloat16 holds them: the formula's own error in bfloat16, not the rounding of the inputs
    for k in ("h", "w"):
        inputs[k] = torch.tensor(inputs[k]).to(torch.bfloat16).double().numpy()
    want = torch_loss(inputs, torch.float64)
    torch_err = np.abs(torch_loss(inputs, torch.bfloat16) - want).max()
    got = kernel_loss(derived, shape, inputs, "streaming_fused", dtype="bfloat16")
    assert np.abs(got - want).max() <= max(2 * torch_err, 0.5), (np.abs(got - want).max(), torch_err)


def test_a_dim_a_value_keeps_is_not_looped():
    """A dim that is not only summed (here x carries d into an output) is held whole whatever the
    configuration's block for it, and refused past one block."""
    spec = load_spec({
        "foldwise": 1, "name": "kept", "inputs": {"x": {"dims": ["t", "d"]}, "w": {"dims": ["v", "d"]}},
        "steps": [{"name": "s", "reduce": "sum", "over": "d", "expr": "x * w"},
                  {"name": "mx", "reduce": "max", "over": "v", "expr": "s"},
                  {"name": "y", "expr": "x * mx"}],
        "outputs": ["y"]})
    derivation = derive_cascade(spec)
    plan = make_plan(spec, derivation, "streaming_fused", {"t": 4, "v": 40, "d": 64}, KernelConfig({"d": 16}))
    assert plan.blocks["d"] == 64 and plan.contraction_loops == ()
    with pytest.raises(NotValid, match=r"inner axis d \(2048\) does not fit one block"):
        make_plan(spec, derivation, "streaming_fused", {"t": 4, "v": 40, "d": 2048}, KernelConfig())


def test_the_cost_model_counts_every_trip_of_the_k_loop(derived):
    """The model's work grows with d (the K loop's trips), and its tensor work is the GEMM's t * v * d."""
    from tuner.cost_model import predict
    from tuner.profiles import get_profile
    from tuner.space import Candidate, SearchSpace

    spec, derivation = derived
    profile = get_profile("h100")
    times = {}
    for d in (2048, 8192):
        problem = make_problem(spec, {"t": 4096, "v": 32768, "d": d}, "bfloat16")
        config = KernelConfig({"t": 128, "v": 64, "d": 64}, num_warps=8, num_stages=3)
        times[d] = predict(problem, derivation, Candidate("streaming_fused", config), profile).time_ms
        space = SearchSpace(problem, derivation, profile)
        assert space.params("streaming_fused")["block_d"] == [64]  # K tiles of 64 in every kernel (k_tile_pinned)
        assert space.check(Candidate("streaming_fused", config)) is None
    assert 3.0 < times[8192] / times[2048] < 5.0, times
    flops = 2 * 4096 * 32768 * 8192
    assert times[8192] * 1e-3 >= flops / profile.peak_flops["bf16"], times  # no faster than the tensor cores allow


def test_llama3_head_compiles_for_sm90_with_tensor_cores_and_tma_in_the_k_loop(compile_pool):
    """Llama 3 8B's head and loss (t 4096, v 128256, d 4096, bfloat16) at the tuner's model pick on
    h100: Triton's sm_90 compiler accepts it, without spills, and the K loop (the innermost SASS
    loop) issues bf16 wgmma and TMA loads; its static bound is the tensor cores'."""
    from fuser_core.codegen.gpu_compile import CompileRequest
    from tuner.static_bound import innermost_trips, static_bound
    from tuner.profiles import get_profile

    spec = load_catalog_spec(NAME)
    shape = {"t": 4096, "v": 128256, "d": 4096}
    dtypes = {"h": "bfloat16", "w": "bfloat16", "target": "int64"}
    config = {"blocks": {"d": 128, "t": 128, "v": 32}, "combine": "last_part", "num_stages": 2, "num_warps": 4,
              "split": 8}
    (build,) = compile_pool.compile([CompileRequest(spec, shape, dtypes, "split_fused", config, sass=True)])
    assert build.ok, build.first_error()
    (kernel,) = build.kernels
    assert kernel.spill_bytes == 0
    # the innermost loops: the K loop (the v loop holds it), then the last part's merge of the partial states
    k_loop, merge = kernel.sass["loops"]
    assert set(k_loop["tensor"]) == {"hgmma.bf16"} and k_loop["classes"].get("tma"), k_loop
    assert not merge["tensor"] and not merge["classes"].get("tma")
    derivation = derive_cascade(spec)
    plan = make_plan(spec, derivation, "split_fused", shape, KernelConfig.from_dict(config))
    structure_kernel = build_structure(plan, dtypes).kernels[0]  # the part kernel (last_part: the only launch)
    trips = innermost_trips(plan, structure_kernel, shape)
    assert trips[0] == -(-128256 // 8 // 32) * 4096 / 128  # a part's v tiles (of 32) times d's K tiles (of 128)
    assert len(trips) == 2
    bound = static_bound(kernel.sass, programs=32 * 8, num_warps=4, trips=trips, profile=get_profile("h100"))
    assert bound["bound"] == "tensor", bound["terms_s"]
    assert bound["tensor_macs"] >= 4096 * 128256 * 4096  # the GEMM's multiply-adds, every one


def test_the_backward_loops_over_the_vocabulary_and_the_tokens():
    """d_h = sum over v of d_logits * w reads logits = sum over d: it loops over v with the logits
    computed per tile inside (looping over d would hold all 128256 classes whole), d_w over the
    tokens; both plan at Llama 3.2's vocabulary with a hidden size of one block, where the default
    tile of d_w's rows shrinks to hold [v, d] (64 x 1024)."""
    from fuser_core.backward.derive import derive_backward
    from fuser_core.codegen.plan import loop_axis, valid_strategies

    cascade = derive_backward(load_catalog_spec(NAME))
    axes = {spec.name: loop_axis(spec) for spec in cascade.specs}
    assert axes == {f"{NAME}_backward_h": ("v", ("d",)), f"{NAME}_backward_w": ("t", ("d",))}
    for spec in cascade.specs:
        shape = {k: n for k, n in {"t": 4096, "v": 128256, "d": 1024}.items() if k in spec.sized_dims}
        valid = valid_strategies(spec, derive_cascade(spec), shape)
        assert valid["streaming_fused"] is None and valid["split_fused"] is None, (spec.name, valid)


def test_past_one_block_the_backward_stages_d_logits_and_sums_it_in_the_forwards_k_tiles():
    """Packing rule 8: at d = 4096 d_h and d_w (which keep d) cannot hold d whole, so a stage writes
    d_logits [t, v] (a GEMM over d, the softmax its epilogue) and each gradient is a GEMM reading it;
    without the sizes, or at d = 1024, the two fused kernels recompute the logits per tile. The stage
    sums d in the forward's K tiles of 64, in order (plan.k_tile_pinned): its default tile and the
    tuner's only choice are 64, strategies that hold or split d are refused; the gradients' plain
    GEMMs and the forward are not pinned."""
    from fuser_core.backward.derive import derive_backward
    from fuser_core.codegen.plan import k_tile_pinned, valid_strategies

    spec = load_catalog_spec(NAME)
    big = {"t": 4096, "v": 128256, "d": 4096}
    assert [s.name for s in derive_backward(spec).specs] == [f"{NAME}_backward_h", f"{NAME}_backward_w"]
    assert len(derive_backward(spec, sizes={**big, "d": 1024}).specs) == 2
    cascade = derive_backward(spec, sizes=big)
    stage, d_h, d_w = cascade.specs
    assert cascade.staged == ("d_logits",) and stage.outputs == ("d_logits",) and not dict(stage.output_dtypes)
    assert {i.name for i in d_h.inputs} == {"w", "d_logits"} and {i.name for i in d_w.inputs} == {"h", "d_logits"}
    pinned = {s.name: k_tile_pinned(s, derive_cascade(s)) for s in (cascade.forward, *cascade.specs)}
    assert pinned == {cascade.forward.name: False, stage.name: True, d_h.name: False, d_w.name: False}
    derivation = derive_cascade(stage)
    shape = {"t": 4096, "v": 128256, "d": 4096}
    valid = valid_strategies(stage, derivation, shape)
    assert valid["streaming_fused"] is None and valid["multi_pass"] is None, valid
    assert "holds it whole" in valid["row_resident"] and "splits it" in valid["split_fused"], valid
    config = default_config(stage, derivation, "streaming_fused", shape)
    assert config.blocks["d"] == 64
    from tuner.profiles import get_profile
    from tuner.space import SearchSpace

    dtypes = {"h": "bfloat16", "w": "bfloat16", "target": "int64", "mx": "float32", "den": "float32",
              "d_loss": "bfloat16"}
    space = SearchSpace(make_problem(stage, shape, dtypes), derivation, get_profile("h100"))
    assert set(space.strategies()) <= {"streaming_fused", "multi_pass"} and "streaming_fused" in space.strategies()
    assert space.params("streaming_fused")["block_d"] == [64]


def test_a_k_loop_kernel_takes_any_hidden_size(derived):
    """A bundle's size_limits name the dims a kernel holds whole: d summed in a K loop is not one of
    them (the loop runs to the call's d; the torch op refused d = 1100 before), d held whole is."""
    from tests.support.local_kernels import local_kernel

    spec, _ = derived
    limits = {d: local_kernel(spec, {"t": 5, "v": 40, "d": d}).size_limits for d in (80, 1100)}
    assert limits[80].get("d") == 128 and "d" not in limits[1100], limits


def test_the_staged_backward_compiles_for_sm90_on_the_tensor_cores(compile_pool):
    """Llama 3 8B's head (t 4096, v 128256, d 4096, bfloat16), as the torch op asks for its kernels
    (service.client.autograd.fetch_trainable: d_logits staged in bfloat16): the stage (a GEMM over d,
    K tiles of 64, the softmax its epilogue) and the two gradients' GEMMs compile for sm_90 at their
    default configurations, without spills, each main loop on bf16 wgmma; and for every target of the
    fleet (sm_80, AMD, ...), the stage in multi_pass too."""
    from fuser_core.codegen.gpu_compile import CompileRequest
    from service.client.autograd import fetch_trainable

    shape = {"t": 4096, "v": 128256, "d": 4096}
    asked = []

    class Asked(Exception):
        pass

    def fetch_all(requests):
        asked.extend(requests)
        raise Asked

    with pytest.raises(Asked):
        fetch_trainable(fetch_all, load_catalog_spec(NAME), shape, "bfloat16")
    backward = [(load_spec(raw, printed=True), sizes, dtypes) for raw, sizes, dtypes in asked[1:]]
    assert [s.name for s, _, _ in backward] == [f"{NAME}_backward_stage1", f"{NAME}_backward_h", f"{NAME}_backward_w"]
    assert backward[1][2]["d_logits"] == "bfloat16" and backward[2][2]["d_logits"] == "bfloat16"
    requests = [CompileRequest(spec, sizes, dtypes, "streaming_fused",
                               default_config(spec, derive_cascade(spec), "streaming_fused", sizes).to_dict(), sass=True)
                for spec, sizes, dtypes in backward]
    for request, build in zip(requests, compile_pool.compile(requests)):
        assert build.ok, (request.spec.name, build.first_error())
        (kernel,) = build.kernels
        assert kernel.spill_bytes == 0, request.spec.name
        assert "hgmma.bf16" in kernel.sass["loops"][0]["tensor"], (request.spec.name, kernel.sass["loops"])
    # every other target of the fleet (sm_80, AMD, Blackwell...), and the stage's other valid strategy
    from tests.support.catalog_shapes import distinct_targets
    from tuner.profiles import FLEET

    others = [CompileRequest(spec, sizes, dtypes, strategy, default_config(spec, derive_cascade(spec), strategy,
                                                                           sizes).to_dict(), target)
              for name, target in distinct_targets(list(FLEET)) if name != "h100" for spec, sizes, dtypes in backward
              for strategy in ("streaming_fused", "multi_pass") if strategy == "streaming_fused" or "stage" in spec.name]
    for request, build in zip(others, compile_pool.compile(others)):
        assert build.ok, (request.spec.name, request.strategy, request.target, build.first_error())
