"""GPU profiles, the search space, the analytical cost model and the model measurer
(tuner/profiles.py, space.py, analysis.py, cost_model.py, measure.py).

No GPU is needed: spaces and predictions are arithmetic on the profiles; the model measurer's
correctness check runs one small kernel per strategy under Triton's interpreter.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import json
from functools import lru_cache

import pytest
from tests.support.catalog import CATALOG_DIR, load_catalog

from fuser_core.codegen.module import module_source, output_dtypes
from fuser_core.codegen.plan import STRATEGIES, KernelConfig, make_plan, valid_strategies
from fuser_core.codegen.structure import build_structure
from fuser_core.derive import derive_cascade
from fuser_core.problem import make_problem
from fuser_core.runner import bind_dtypes
from fuser_core.spec import load_spec
from tests.support.cascades import red, spec_of
from tuner import measure as measure_mod
from tuner.analysis import Anatomy, tree_cost
from tuner.chain_cost import predict_chain
from tuner.cost_model import KernelLoad, kernel_time, predict
from tuner.measure import Measurement, Measurer, ModelMeasurer, clear_verification_cache, reduced_problem
from tuner.profiles import FLEET, PROFILES, get_profile, profile_for_device_name
from tuner.space import Candidate, SearchSpace

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked tile lanes compute 0/0

CATALOG = load_catalog()
PAPER = json.loads((CATALOG_DIR / "suites.json").read_text())["paper"]
H100 = get_profile("h100")


@lru_cache(maxsize=None)
def loaded(name: str):
    spec = load_spec(CATALOG[name])
    return spec, derive_cascade(spec)


def space_for(name: str, shape: dict, dtype, profile=H100) -> SearchSpace:
    spec, d = loaded(name)
    return SearchSpace(make_problem(spec, shape, dtype), d, profile)


def case_id(case: dict) -> str:
    return f"{case['spec']}-" + "-".join(f"{k}{v}" for k, v in case["shape"].items())


def best_of(space: SearchSpace, strategy: str):
    """(prediction, candidate) of the fastest predicted candidate of one strategy."""
    best = None
    for c in space.enumerate([strategy]):
        p = predict(space.problem, space.derivation, c, space.profile)
        if best is None or p.time_s < best[0].time_s:
            best = (p, c)
    assert best is not None, f"no feasible {strategy} candidate"
    return best


# ------------------------------------------------------------------------------------ profiles


def test_profiles_are_sane() -> None:
    assert set(FLEET) == set(PROFILES) == {"a100", "l40s", "h100", "h200", "b200", "mi300x", "mi355x"}
    for p in PROFILES.values():
        assert p.sm_count > 0 and p.hbm_bytes_per_s > 5e11 and p.l2_bytes >= 32 * 2**20
        assert 0 < p.smem_per_block_max <= p.smem_per_sm
        # 64K 32-bit registers per SM on NVIDIA; AMD's 512 KiB VGPR file per CU holds 128K
        assert p.regs_per_sm == (65536 if p.target.backend == "cuda" else 131072)
        assert p.max_warps_per_sm * p.warp_size <= 2048 and p.launch_overhead_s > 0 and p.sfu_ops_per_s > 1e12
        assert p.peak_flops["fp32"] < p.peak_flops.get("tf32", p.peak_flops["fp16"]) <= p.peak_flops["fp16"]
        assert p.peak_flops["fp16"] == p.peak_flops["bf16"] < p.peak_flops.get("fp8", float("inf"))
        assert json.loads(json.dumps(p.to_dict()))["name"] == p.name
    h100, h200, a100 = PROFILES["h100"], PROFILES["h200"], PROFILES["a100"]
    assert (h100.sm_count, h100.hbm_bytes_per_s, h100.l2_bytes) == (132, 3.35e12, 50 * 2**20)
    assert (h100.smem_per_sm, h100.smem_per_block_max) == (228 * 1024, 227 * 1024)
    assert h100.peak_flops["fp16"] == 989e12 and h100.peak_flops["fp8"] == 1979e12 and h100.peak_flops["fp32"] == 67e12
    assert h200.peak_flops == h100.peak_flops and h200.sm_count == 132 and h200.hbm_bytes_per_s == 4.8e12
    assert h200.hbm_bytes == 141 * 1000**3
    assert (a100.sm_count, a100.arch, a100.smem_per_block_max) == (108, "sm_80", 163 * 1024)
    assert "fp8" not in a100.peak_flops and a100.peak_flops["fp16"] == 312e12


def test_profile_lookup() -> None:
    assert get_profile("H100") is PROFILES["h100"]
    known = "a100, b200, h100, h200, l40s, mi300x, mi355x"
    with pytest.raises(ValueError, match=f"unknown target 'b100'; known targets: {known}"):
        get_profile("b100")
    assert profile_for_device_name("NVIDIA H100 80GB HBM3") == "h100"
    assert profile_for_device_name("NVIDIA H200") == "h200"
    assert profile_for_device_name("NVIDIA A100-SXM4-80GB") == "a100"
    assert profile_for_device_name("NVIDIA H100 PCIe") is None  # 114 SMs, 2 TB/s: not the h100 profile
    assert profile_for_device_name("NVIDIA GeForce RTX 4090") is None


# ------------------------------------------------------------------------------------ the space


@pytest.mark.parametrize("case", PAPER, ids=case_id)
def test_every_paper_case_has_a_feasible_space(case: dict) -> None:
    space = space_for(case["spec"], case["shape"], case["dtype"])
    spec, d = loaded(case["spec"])
    plan_valid = [s for s, r in valid_strategies(spec, d, space.shape).items() if r is None]
    strategies = space.strategies()
    assert strategies and set(strategies) <= set(plan_valid)
    assert "streaming_fused" in strategies or "multi_pass" in strategies
    for s in strategies:
        c = next(space.enumerate([s]))
        assert space.check(c) is None and c.strategy == s
        make_plan(spec, d, s, space.shape, c.config)  # the plan agrees
        params = space.params(s)
        assert all(v and all(x >= 1 and not x & (x - 1) for x in v) for k, v in params.items()
                   if k not in ("num_stages", "per_lane", "combine"))
        assert params.get("per_lane", [1, 0]) == [1, 0]  # per lane or per tile, where the derivation allows lanes
        assert params.get("combine", [0, 1]) == [0, 1]  # a combine kernel, or the last part program (split only)
        assert ("split" in params) == (s == "split_fused")
    for s in set(plan_valid) - set(strategies):  # valid, but nothing fits the target: said why
        assert space.not_valid()[s].startswith("no configuration fits h100")


def test_space_params_follow_the_shape() -> None:
    space = space_for("attention", {"b": 128, "h": 16, "m": 512, "n": 512, "d": 64, "e": 64}, "float16")
    p = space.params("streaming_fused")
    assert p["block_b"] == p["block_h"] == [1]  # batch dims of q.k and p.v
    assert p["block_m"] == [16, 32, 64, 128, 256] and p["block_e"] == [16, 32, 64]  # tl.dot-sized
    assert p["block_n"][0] == 16 and p["block_n"][-1] == 512
    assert p["num_warps"] == [1, 2, 4, 8, 16, 32] and p["num_stages"] == [1, 2, 3, 4, 5]
    assert space.params("split_fused")["split"] == [2, 4, 8, 16, 32]
    decode = space_for("attention", {"b": 32, "h": 32, "m": 1, "n": 8192, "d": 128, "e": 128}, "float16")
    assert decode.params("streaming_fused")["block_m"] == [1]
    softmax = space_for("safe_softmax", {"m": 16384, "n": 1024}, "float16")
    assert softmax.params("row_resident")["block_n"] == [1024] and softmax.params("row_resident")["num_stages"] == [1]
    assert softmax.params("streaming_fused")["block_m"] == [1, 2, 4, 8, 16, 32, 64, 128, 256]


def test_candidates_and_keys() -> None:
    space = space_for("safe_softmax", {"m": 64, "n": 1000}, "float32")
    c = space.candidate("split_fused", {"block_n": 64, "block_m": 2, "num_warps": 2, "num_stages": 3, "split": 4})
    assert c.config == KernelConfig({"n": 64, "m": 2}, num_warps=2, num_stages=3, split=4)
    assert c.key() == json.dumps(c.to_dict(), sort_keys=True)
    assert Candidate.from_dict(json.loads(c.key())) == c
    assert space.candidate(c.strategy, c.values(space)) == c
    row = space.candidate("row_resident", {"block_m": 4, "num_warps": 4})
    assert row.config.blocks == {"n": 1024, "m": 4} and row.config.num_stages == 1  # single choices filled in
    assert space.check(row) is None


def test_check_rejects_what_cannot_fit() -> None:
    softmax = space_for("safe_softmax", {"m": 64, "n": 1000}, "float32")
    base = {"block_n": 256, "block_m": 1, "num_warps": 4, "num_stages": 2}
    assert softmax.check(softmax.candidate("streaming_fused", base)) is None
    # a tile larger than its dim
    assert softmax.check(softmax.candidate("streaming_fused", {**base, "block_n": 2048})) == \
        "BLOCK_n = 2048 is larger than n (1000)"
    assert "larger than m (64)" in softmax.check(softmax.candidate("streaming_fused", {**base, "block_m": 128}))
    # more threads than the tile can use
    assert softmax.check(softmax.candidate("streaming_fused", {**base, "block_n": 16, "num_warps": 16})).startswith(
        "num_warps = 16 (512 threads) for a largest tile of 16 elements")
    # split: more parts than tiles
    assert "some parts would be empty" in softmax.check(
        softmax.candidate("split_fused", {**base, "block_n": 512, "split": 4}))
    # a 262144-long row cannot be resident
    lse = space_for("logsumexp", {"m": 512, "n": 262144}, "float32")
    assert "row_resident" not in lse.strategies()
    reason = lse.check(lse.candidate("row_resident", {"block_n": 262144, "block_m": 1, "num_warps": 8}))
    assert reason.startswith("row_resident is not valid here") and "too long to keep resident" in reason
    # a 32768-long row is a valid plan; on 2 warps even its loaded row alone is 512 registers a thread
    big = space_for("safe_softmax", {"m": 4096, "n": 32768}, "float16")
    reason = big.check(big.candidate("row_resident", {"block_m": 1, "num_warps": 2}))
    assert reason.startswith("registers: at least 513 per thread > 255")
    # on 16 or 32 warps it may fit (ptxas: ~108 and ~47 registers): the compile gate decides
    assert big.check(big.candidate("row_resident", {"block_m": 1, "num_warps": 32})) is None
    # shared memory: float32 tl.dot operands of q.k and p.v, K and V in num_stages - 1 buffers, q and
    # P in one (compiled for sm_80 with 64-key tiles: 136 KiB, as estimated); 128-key tiles overflow
    shape = {"b": 4, "h": 4, "m": 512, "n": 512, "d": 64, "e": 64}
    dots = {"block_m": 16, "block_n": 128, "block_e": 64, "num_warps": 4, "num_stages": 4}
    a100 = space_for("attention", shape, "float32", get_profile("a100"))
    assert a100.check(a100.candidate("streaming_fused", dots)).startswith(
        "shared memory: 205 KiB > 163 KiB per block on a100")
    assert [r.smem_bytes // 1024 for r in a100.resources(
        a100.candidate("streaming_fused", {**dots, "block_n": 64, "num_stages": 5}))] == [137]
    assert a100.check(a100.candidate("streaming_fused", {**dots, "num_stages": 2})) is None
    h100 = space_for("attention", shape, "float32")
    assert h100.check(h100.candidate("streaming_fused", dots)) is None  # 227 KiB per block there
    # the plan's own rules
    # a tl.dot tile never holds [m, d, n] (plan counts operands), but its operands overflow shared memory
    assert h100.check(h100.candidate("streaming_fused", {**dots, "block_m": 256, "block_n": 256})).startswith("shared memory")
    assert softmax.check(Candidate("streaming_fused", KernelConfig({"n": 256, "m": 1, "q": 2}))) == \
        "block_q is not a parameter of streaming_fused"


def test_two_warpgroups_never_compute_the_same_dot() -> None:
    """sm_90's wgmma gives each warpgroup 64 rows: a 64-row attention tile on 8 warps is pruned
    (compiled: 1.5x the HGMMA instructions, 2x the exps of 128 x 64), 128 rows on 8 warps are not;
    an A100's mma splits warps both ways, so the rule is Hopper's only."""
    shape = {"b": 4, "h": 32, "m": 4096, "n": 4096, "d": 128, "e": 128}
    tile = {"block_m": 64, "block_n": 128, "block_e": 128, "num_warps": 8, "num_stages": 2}
    h100 = space_for("attention", shape, "float16")
    assert h100.check(h100.candidate("streaming_fused", tile)).startswith(
        "num_warps = 8 on a tl.dot of BLOCK_m = 64 rows")
    assert h100.check(h100.candidate("streaming_fused", {**tile, "num_warps": 4})) is None
    assert h100.check(h100.candidate("streaming_fused", {**tile, "block_m": 128, "block_n": 64})) is None
    a100 = space_for("attention", shape, "float16", get_profile("a100"))
    assert "warpgroup" not in (a100.check(a100.candidate("streaming_fused", tile)) or "")
    # no tl.dot (a decode's single query row): 8 warps stream its keys
    decode = space_for("attention", {**shape, "m": 1, "n": 8192}, "float16")
    assert decode.check(decode.candidate("streaming_fused", {"block_m": 1, "block_n": 64, "block_e": 128,
                                                             "num_warps": 8, "num_stages": 2})) is None


def test_enumerate_yields_only_feasible_candidates() -> None:
    space = space_for("safe_softmax", {"m": 64, "n": 1000}, "float32")
    seen = list(space.enumerate())
    assert len(seen) == len({c.key() for c in seen}) > 100
    assert {c.strategy for c in seen} == set(space.strategies()) == set(STRATEGIES)
    assert all(space.check(c) is None for c in seen)
    assert len(seen) < space.size()


def _dots_in(op) -> int:
    return (getattr(op, "dot", None) is not None) + sum(_dots_in(c) for c in op.children())


def test_dot_analysis_matches_the_generated_kernels() -> None:
    """The cost model's tl.dot count per kernel equals what the code generator writes."""
    cases = [
        ("attention", {"b": 2, "h": 2, "m": 40, "n": 70, "d": 16, "e": 20}, "float16",
         [{"m": 16, "n": 16, "e": 32}, {"m": 1, "n": 16, "e": 16}, {"m": 16, "n": 8, "e": 16},
          {"m": 16, "n": 32, "e": 8}]),
        ("fp8_quant_gemm", {"m": 40, "n": 40, "k": 64}, {"a": "float16", "w": "float8_e4m3fn", "w_scale": "float32"},
         [{"m": 16, "n": 16, "k": 16}, {"m": 16, "n": 1, "k": 16}]),
    ]
    counted = set()
    for name, shape, dtype, block_sets in cases:
        spec, d = loaded(name)
        dtypes = bind_dtypes(spec, dtype)
        an = Anatomy(spec, d, dtypes)
        for blocks in block_sets:
            for strategy in ("streaming_fused", "split_fused", "multi_pass"):
                config = KernelConfig(blocks, split=2 if strategy == "split_fused" else 1)
                plan = make_plan(spec, d, strategy, shape, config)
                source = module_source(plan, output_dtypes(spec, dtypes), dtypes)
                in_source = sum(1 for line in source.splitlines() if "tl.dot(" in line)
                # a loop split at its tail or mask prints its dots twice; the model counts the pass once
                twins = sum(_dots_in(loop) for k in build_structure(plan, dtypes).kernels for loop in k.loops()
                            if loop.unmasked)
                in_source -= twins
                kernels = an.kernels(strategy, an.full_blocks(blocks, shape))
                analysed = sum(len(p.dots) for k in kernels for p in k.passes)
                assert analysed == in_source, (name, strategy, blocks)
                counted.add(in_source)
    assert counted == {0, 1, 2, 3, 4}


# ------------------------------------------------------------------------------------ the cost model


def test_more_bytes_take_more_time() -> None:
    base = KernelLoad("k", programs=4096, num_warps=4, num_stages=3, looped=True, regs=64, smem=16384,
                      hbm_bytes=1e8, l2_bytes=1e8, alu=1e8, sfu=1e6, dot_flops={}, bytes_in_flight=32768)
    times = []
    for scale in (1, 2, 4, 8):
        load = KernelLoad(**{**base.__dict__, "hbm_bytes": base.hbm_bytes * scale, "l2_bytes": base.l2_bytes * scale})
        times.append(kernel_time(load, H100)[0])
    assert times == sorted(times) and times[-1] > 7 * times[0] * 0.9
    # the same candidate on a longer row: more bytes, more time; a faster memory: less time
    spec, d = loaded("safe_softmax")
    c = Candidate("streaming_fused", KernelConfig({"n": 1024, "m": 1}, num_warps=4, num_stages=3))
    preds = [predict(make_problem(spec, {"m": 4096, "n": n}, "float16"), d, c, H100) for n in (4096, 16384, 65536)]
    assert [p.bytes for p in preds] == sorted(p.bytes for p in preds)
    assert [p.time_s for p in preds] == sorted(p.time_s for p in preds)
    h200 = predict(make_problem(spec, {"m": 4096, "n": 65536}, "float16"), d, c, get_profile("h200"))
    a100 = predict(make_problem(spec, {"m": 4096, "n": 65536}, "float16"), d, c, get_profile("a100"))
    assert h200.time_s < preds[-1].time_s < a100.time_s
    # deeper pipelining keeps more bytes in flight: never slower for a memory-bound loop
    stages = [predict(make_problem(spec, {"m": 512, "n": 65536}, "float16"), d,
                      Candidate("streaming_fused", KernelConfig({"n": 256, "m": 1}, num_warps=1, num_stages=s)), H100)
              for s in (1, 2, 3)]
    assert stages[0].time_s > stages[1].time_s >= stages[2].time_s


def test_prediction_fields() -> None:
    space = space_for("attention", {"b": 32, "h": 32, "m": 1, "n": 8192, "d": 128, "e": 128}, "float16")
    c = space.candidate("split_fused", {"block_n": 32, "block_e": 128, "num_warps": 8, "num_stages": 2, "split": 8})
    assert space.check(c) is None
    p = predict(space.problem, space.derivation, c, H100)
    assert [k["kernel"] for k in p.details["kernels"]] == ["attention_split_fused_kernel", "attention_split_fused_combine_kernel"]
    assert p.time_s == pytest.approx(sum(k["time_s"] for k in p.details["kernels"]))
    assert p.time_s > 2 * H100.launch_overhead_s and p.programs == 32 * 32 * 8
    kv = 2 * 32 * 32 * 8192 * 128 * 2  # K and V in fp16
    assert kv <= p.bytes < 1.05 * kv
    assert p.waves > 0 and 0 < p.occupancy <= 1 and p.flops > 2 * 2 * 32 * 32 * 8192 * 128
    assert p.details["predicted"] and p.details["target"] == "h100"
    json.dumps(p.to_dict())


def test_multi_pass_is_slower_than_streaming_for_softmax() -> None:
    space = space_for("safe_softmax", {"m": 4096, "n": 32768}, "float16")
    streaming, _ = best_of(space, "streaming_fused")
    multi, _ = best_of(space, "multi_pass")
    assert multi.time_s > 1.05 * streaming.time_s
    assert streaming.details["kernels"][0]["bound"] == "memory (HBM)"
    # near the roofline: x read once and y written once at the achievable bandwidth
    assert streaming.time_s < 1.3 * 2 * 4096 * 32768 * 2 / H100.hbm_bytes_per_s


def _dependent_long(case: dict) -> bool:
    """Two or more dependent reductions over a long (>= 1024) axis."""
    spec, d = loaded(case["spec"])
    return any(g.edges and case["shape"][g.axis] >= 1024 for g in d.groups)


@pytest.mark.parametrize("case", [c for c in PAPER if _dependent_long(c)], ids=case_id)
def test_unfused_chain_is_slower_than_streaming(case: dict) -> None:
    space = space_for(case["spec"], case["shape"], case["dtype"])
    spec, d = loaded(case["spec"])
    chain = predict_chain(space.problem, d, H100)
    # the tuned-for-the-model streaming kernel, searched over its tilings with the warps and
    # stages most kernels use (the full space is the exhaustive benchmark's job)
    best = min(predict(space.problem, d, c, H100).time_s
               for c in space.enumerate(["streaming_fused"])
               if c.config.num_warps in (2, 4, 8) and c.config.num_stages in (2, 3))
    assert chain.time_s > best
    assert chain.details["strategy"] == "unfused_chain"
    assert len(chain.details["kernels"]) == sum(s.is_reduction for s in spec.steps) + \
        any(not spec.step(o).is_reduction for o in spec.outputs)


def test_chain_materialises_attention_scores() -> None:
    shape = {"b": 128, "h": 16, "m": 512, "n": 512, "d": 64, "e": 64}
    spec, d = loaded("attention")
    chain = predict_chain(make_problem(spec, shape, "float16"), d, H100)
    s_bytes = 128 * 16 * 512 * 512 * 4  # s in float32, written once and read by mx, den and o
    assert chain.bytes > 2 * s_bytes
    assert [k["kernel"] for k in chain.details["kernels"]] == [
        "chain:s (row_resident)", "chain:mx (row_resident)", "chain:den (row_resident)", "chain:o (row_resident)"]


def test_decoding_attention_prefers_split_fused() -> None:
    """One query per head, a long KV: with few heads streaming_fused has too few programs to
    keep the GPU's bytes in flight, split_fused spreads the axis over many. (At the paper's
    b*h = 1024 rows both sit at the HBM roofline and the model predicts them within 1%.)"""
    space = space_for("attention", {"b": 1, "h": 16, "m": 1, "n": 8192, "d": 128, "e": 128}, "float16")
    streaming, _ = best_of(space, "streaming_fused")
    split, c = best_of(space, "split_fused")
    assert split.time_s < 0.8 * streaming.time_s and c.config.split >= 2
    paper = space_for("attention", {"b": 32, "h": 32, "m": 1, "n": 8192, "d": 128, "e": 128}, "float16")
    s_paper = [best_of(paper, s)[0].time_s for s in ("streaming_fused", "split_fused")]
    assert abs(s_paper[0] - s_paper[1]) < 0.01 * s_paper[0]


# ------------------------------------------------------------------------------------ the measurer


def test_reduced_problem_keeps_the_structure() -> None:
    spec, d = loaded("attention")
    small, config = reduced_problem(spec, d, {"b": 128, "h": 16, "m": 512, "n": 512, "d": 64, "e": 64}, "split_fused")
    assert small == {"b": 2, "h": 2, "m": 20, "d": 16, "n": 40, "e": 20}
    assert config.blocks == {"b": 1, "h": 1, "m": 16, "n": 16, "e": 16} and config.split == 2
    spec, d = loaded("moe_routing")
    small, config = reduced_problem(spec, d, {"t": 4096, "x": 4096, "j": 8}, "row_resident")
    assert small == {"t": 3, "x": 40, "j": 8} and config.blocks == {"t": 2, "x": 64}


def test_measurer_contract_is_measure_measured_binary_and_close() -> None:
    space = space_for("safe_softmax", {"m": 64, "n": 256}, "float16")
    m = ModelMeasurer(space.problem, space.derivation, H100)
    assert isinstance(m, Measurer)
    assert m.measured_binary("streaming_fused", {"blocks": {"n": 256}}) is None  # a prediction ran no kernel
    m.close()
    m.close()  # idempotent: nothing is held

    class MeasureOnly:  # what the search alone would need: not the contract
        name = "partial"

        def measure(self, candidate: Candidate) -> Measurement:
            return Measurement(1.0)

    assert not isinstance(MeasureOnly(), Measurer)


def test_model_measurer_verifies_each_strategy_once(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_verification_cache()
    shape = {"m": 4096, "n": 32768}
    space = space_for("safe_softmax", shape, "float16")
    m = ModelMeasurer(space.problem, space.derivation, H100)
    assert isinstance(m, Measurer) and m.name == "model"
    a = space.candidate("streaming_fused", {"block_n": 2048, "block_m": 1, "num_warps": 8, "num_stages": 3})
    b = space.candidate("streaming_fused", {"block_n": 4096, "block_m": 1, "num_warps": 8, "num_stages": 2})
    ra, rb = m.measure(a), m.measure(b)
    assert m.interpreter_runs == ["streaming_fused"]  # the second candidate did not re-run it
    for r in (ra, rb):
        assert isinstance(r, Measurement) and r.predicted and r.error is None and r.time_ms > 0
        assert r.details["predicted"] and r.details["measurer"] == "model" and r.details["target"] == "h100"
        assert r.details["verified"]["passed"] and r.details["verified"]["shape"] == {"m": 3, "n": 40}
        json.dumps(r.to_dict())
    p = predict(space.problem, space.derivation, a, H100)
    assert ra.time_ms == pytest.approx(p.time_s * 1e3)
    # another measurer of the same spec, strategy and dtypes reuses the check
    again = ModelMeasurer(make_problem(space.spec, shape, "float16"), space.derivation, get_profile("a100"))
    assert again.measure(a).time_ms > ra.time_ms and again.interpreter_runs == []

    # a strategy whose kernels are wrong: every candidate fails with the error, checked once
    calls = []

    def wrong(spec, shape, dtype, **kw):
        calls.append(kw["strategy"])
        return {"passed": False, "max_rel_err": 0.5, "tolerances": {"y": 1e-2}, "device": "cpu"}

    monkeypatch.setattr("fuser_core.runner.self_check", wrong)
    c1 = space.candidate("multi_pass", {"block_n": 2048, "block_m": 1, "num_warps": 8, "num_stages": 3})
    c2 = space.candidate("multi_pass", {"block_n": 1024, "block_m": 1, "num_warps": 4, "num_stages": 3})
    r1, r2 = m.measure(c1), m.measure(c2)
    assert calls == ["multi_pass"]
    for r in (r1, r2):
        assert r.time_ms is None and r.predicted and "multi_pass is wrong at the reduced shape" in r.error
    assert m.measure(a).error is None  # other strategies unaffected

    def crash(spec, shape, dtype, **kw):
        raise RuntimeError("illegal memory access")

    monkeypatch.setattr("fuser_core.runner.self_check", crash)
    r = m.measure(space.candidate("split_fused", {"block_n": 2048, "block_m": 1, "num_warps": 8, "num_stages": 3,
                                                  "split": 2}))
    assert r.time_ms is None and "RuntimeError: illegal memory access" in r.error
    clear_verification_cache()
    assert measure_mod._VERIFIED == {}


def test_taylor_shifted_sums_are_modelled() -> None:
    """A second moment about the max realised as Taylor-shifted accumulators (two of them, the third
    coefficient being the count; moved by a binomial shift each tile): more state and work than a
    plain scaled sum."""
    spec = load_spec({"foldwise": 1, "name": "wvar", "inputs": {"x": {"dims": ["m", "n"]}},
                      "steps": [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
                                {"name": "v", "reduce": "sum", "over": "n", "expr": "(x - mx) ** 2"}],
                      "outputs": ["v"]})
    d = derive_cascade(spec)
    assert d.forms["v"].kind == "taylor"
    space = SearchSpace(make_problem(spec, {"m": 4096, "n": 8192}, "float32"), d, H100)
    values = {"block_n": 1024, "block_m": 1, "num_warps": 4, "num_stages": 2}
    streaming = space.candidate("streaming_fused", values)
    split = space.candidate("split_fused", {**values, "split": 4})
    kernels = space.anatomy.kernels("split_fused", space.blocks_of(split))
    assert len(kernels[0].ws_stores) == 1 + 2 + 1  # mx, two Taylor coefficients, the mx anchor
    for c in (streaming, split):
        assert space.check(c) is None
        p = predict(space.problem, d, c, H100)
        assert p.bytes >= 4096 * 8192 * 4 and p.time_s > 0
    plain = load_spec({"foldwise": 1, "name": "den", "inputs": {"x": {"dims": ["m", "n"]}},
                       "steps": [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
                                 {"name": "v", "reduce": "sum", "over": "n", "expr": "exp(x - mx)"}],
                       "outputs": ["v"]})
    p_plain = predict(make_problem(plain, space.shape, "float32"), derive_cascade(plain), streaming, H100)
    p_taylor = predict(space.problem, d, streaming, H100)
    # the plain scaled sum keeps per-lane states (structure.per_lane: its rescale and anchor run on every
    # element, so it counts more flops); the Taylor shift stays per tile: its joint moves are counted once
    # per tile and row, each moved coefficient's whole expression
    assert p_taylor.flops > 0 and p_plain.flops > 0
    loop = next(p for p in space.anatomy.kernels("streaming_fused", space.blocks_of(streaming))[0].passes if p.loop == "axis")
    moves = sum(tree_cost(a.moved)[0] for a in d.forms["v"].realisation.accumulators if a.move == "joint")
    assert moves > 0 and loop.ops[frozenset({"m"})][0] >= moves
    assert len(space.anatomy.kernels("streaming_fused", space.blocks_of(streaming))[0].state) == 3  # mx, two coefficients


# --- regressions the cascade fuzzer (tests/support/fuzz_strategies.py) found, each with the smallest
# spec that showed it (small specs built with tests/support/cascades.py)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_the_fallback_passes_are_not_counted_by_the_tuner():
    """The tuner's analysis skips the fallback loops: on finite rows they run 0 times."""
    from tuner.analysis import Anatomy

    spec = spec_of([red("mask", "sum", "x"), red("acc", "sum", "x * mask")], ["acc"])
    an = Anatomy(spec, derive_cascade(spec), {"x": "float32"})
    (kernel,) = an.kernels("streaming_fused", {"m": 1, "n": 1024})
    assert [p.loop for p in kernel.passes if p.loop != "once"] == ["axis"]
