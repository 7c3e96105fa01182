"""split_fused's combine in the part kernel's launch (issue 35, 6; KernelConfig.combine "last_part"):
the last program of each lane block to finish its chunk, found by an atomic ticket, merges the
partial states and writes the outputs. One launch instead of two; the same bits as the combine
kernel, special values included; the tickets are 0 again after every launch; it compiles for every
vendor; the tuner can pick it."""

from __future__ import annotations

import numpy as np
import pytest

from fuser_core.catalog import load_catalog_spec
from fuser_core.codegen.config import KernelConfig, NotValid
from fuser_core.codegen.gpu_compile import CompileRequest
from fuser_core.codegen.module import generate
from fuser_core.codegen.plan import make_plan
from fuser_core.derive import derive_cascade
from fuser_core.edge_rows import edge_inputs
from fuser_core.reference import bind_shape, evaluate, random_inputs
from fuser_core.runner import bind_dtypes, interpreter_quiet, run
from fuser_core.targets import Target

CASES = [  # no output keeps the split axis: decode attention, logsumexp, cross-entropy (its loss per row)
    ("attention", {"b": 2, "h": 3, "m": 1, "n": 300, "d": 16, "e": 16}, {"n": 32}),
    ("logsumexp", {"m": 5, "n": 300}, {"n": 32}),
    ("cross_entropy", {"t": 5, "v": 300}, {"v": 32}),
]


def outputs(name, shape, blocks, inputs, combine: str, dtype: str = "float32"):
    spec = load_catalog_spec(name)
    with interpreter_quiet():
        result = run(spec, bind_shape(spec, shape), dtype, inputs, strategy="split_fused",
                     config=KernelConfig(blocks, split=4, combine=combine))
    return {p: t.float().cpu().numpy() for p, t in result.outputs.items()}, result.source


@pytest.mark.parametrize("name,shape,blocks", CASES)
def test_the_last_part_merges_as_the_combine_kernel_does(name, shape, blocks):
    spec = load_catalog_spec(name)
    bound = bind_shape(spec, shape)
    for inputs in (random_inputs(spec, bound, np.random.default_rng(5)), edge_inputs(spec, bound)):
        in_launch, source = outputs(name, shape, blocks, inputs, "last_part")
        two_launches, _ = outputs(name, shape, blocks, inputs, "kernel")
        assert "ticket = tl.atomic_add(tickets_ptr + tl.program_id(0), 1, sem=\"acq_rel\")" in source
        for part, want in two_launches.items():
            np.testing.assert_array_equal(in_launch[part], want)  # NaN where it is NaN, inf where inf
    with np.errstate(all="ignore"):
        reference = evaluate(spec, bound, inputs := random_inputs(spec, bound, np.random.default_rng(5)))
    got, _ = outputs(name, shape, blocks, inputs, "last_part")
    for part, want in reference.items():
        np.testing.assert_allclose(got[part], np.asarray(want, dtype=np.float64), rtol=2e-5, atol=1e-5)


def test_one_launch_and_the_tickets_are_zero_after_it():
    name, shape, blocks = CASES[0]
    spec = load_catalog_spec(name)
    bound = bind_shape(spec, shape)
    inputs = random_inputs(spec, bound, np.random.default_rng(1))
    _, source = outputs(name, shape, blocks, inputs, "last_part")
    launcher = source.split("def launch(")[1]
    assert launcher.count("](") == 1 and "_combine_kernel[" not in launcher
    assert "tickets = split_tickets(" in launcher
    again, _ = outputs(name, shape, blocks, inputs, "last_part")  # a second launch on the same tickets
    first, _ = outputs(name, shape, blocks, inputs, "kernel")
    np.testing.assert_array_equal(again["o"], first["o"])
    # the module's own copy of split_tickets keeps them (the module run() loaded: same key)
    module = generate(spec, derive_cascade(spec), "split_fused", bound,
                      KernelConfig(blocks, split=4, combine="last_part"), bind_dtypes(spec, "float32")).load()
    assert module.SPLIT_TICKETS and all(int(t.abs().sum()) == 0 for t in module.SPLIT_TICKETS.values())


def test_the_config_names_it_only_where_it_is_not_the_default():
    c = KernelConfig({"n": 32}, split=4, combine="last_part")
    assert c.to_dict()["combine"] == "last_part" and KernelConfig.from_dict(c.to_dict()) == c
    assert "combine" not in KernelConfig({"n": 32}, split=4).to_dict()  # stored configs keep their keys
    with pytest.raises(ValueError, match="config.combine must be one of kernel, last_part"):
        KernelConfig.from_dict({"combine": "cluster"})


def test_it_is_refused_where_it_cannot_be_the_combine():
    spec = load_catalog_spec("safe_softmax")  # y keeps n: with few rows its combine writes it in parallel
    d = derive_cascade(spec)
    with pytest.raises(NotValid, match="combine = last_part: the outputs keep n"):
        make_plan(spec, d, "split_fused", {"m": 4, "n": 4096}, KernelConfig({"n": 256}, split=4, combine="last_part"))
    with pytest.raises(NotValid, match="it is for split strategies"):
        make_plan(spec, d, "streaming_fused", {"m": 4, "n": 4096}, KernelConfig({"n": 256}, combine="last_part"))
    # many lane blocks: one program per lane block writes its row, so the last part can be it
    make_plan(spec, d, "split_fused", {"m": 4096, "n": 4096}, KernelConfig({"n": 256}, split=4, combine="last_part"))


def test_it_compiles_for_each_vendor(compile_pool):
    spec = load_catalog_spec("attention")
    shape = {"b": 4, "h": 8, "m": 1, "n": 2048, "d": 128, "e": 128}
    config = {"blocks": {"n": 64}, "num_warps": 4, "num_stages": 3, "split": 8, "combine": "last_part"}
    dtypes = bind_dtypes(spec, "float16")
    builds = compile_pool.compile([CompileRequest(spec, shape, dtypes, "split_fused", config, Target.parse(arch), sass=True)
                                   for arch in ("sm_90", "sm_80", "gfx942")])
    for build in builds:
        assert build.ok, build.first_error()
        assert [k.kernel for k in build.kernels] == ["attention_split_fused_kernel"]  # one launch


def test_the_tuner_can_pick_it():
    from fuser_core.problem import make_problem
    from tuner.measure import ModelMeasurer
    from tuner.profiles import get_profile
    from tuner.space import SearchSpace

    spec = load_catalog_spec("attention")
    derivation = derive_cascade(spec)
    problem = make_problem(spec, {"b": 32, "h": 32, "m": 1, "n": 8192, "d": 128, "e": 128}, "float16")
    space = SearchSpace(problem, derivation, get_profile("h100"))
    assert space.params("split_fused")["combine"] == [0, 1]
    values = {"block_n": 64, "num_warps": 4, "num_stages": 3, "split": 8}
    two, one = (space.candidate("split_fused", {**values, "combine": c}) for c in (0, 1))
    assert one.config.combine == "last_part" and space.check(one) is None
    measurer = ModelMeasurer(problem, derivation, get_profile("h100"), verify=False)
    t_two, t_one = measurer.measure(two).time_ms, measurer.measure(one).time_ms
    assert t_one < t_two  # the same merge, one launch fewer
    softmax = load_catalog_spec("safe_softmax")
    rows = SearchSpace(make_problem(softmax, {"m": 64, "n": 4096}, "float16"), derive_cascade(softmax),
                       get_profile("h100"))
    assert "combine" not in rows.params("split_fused")  # y keeps the split axis: the combine kernel writes it
