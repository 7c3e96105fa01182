"""Issue 12, the compile-aware tuner: every candidate is compiled for the job's target before it
is measured (tuner/compile_gate.py); the compiler's failures and resource overruns prune it with
the compiler's reason, recorded on the trial; the model predicts from the compiled registers,
shared memory and spills.

Compiles run in the session's shared pool (the ``compile_pool`` fixture); no GPU is needed.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import optuna
import pytest
import triton
from tests.support.catalog import CATALOG_DIR, load_catalog

from fuser_core.codegen.gpu_compile import KernelBuild, ModuleBuild
from fuser_core.codegen.module import generate
from fuser_core.derive import derive_cascade
from fuser_core.problem import make_problem
from fuser_core.spec import load_spec
from tuner.compile_gate import CompileGate, CompileVerdict, judge
from tuner.cost_model import predict
from tuner.measure import ModelMeasurer
from tuner.profiles import get_profile
from tuner.search.objective import Objective
from tuner.search.proposals import candidate_params, default_candidates
from tuner.search.tuner import Tuner
from tuner.space import Candidate, SearchSpace

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked tile lanes compute 0/0

CATALOG = load_catalog()
H100, A100 = get_profile("h100"), get_profile("a100")
SOFTMAX = load_spec(CATALOG["safe_softmax"])
SOFTMAX_D = derive_cascade(SOFTMAX)


def softmax_space(shape, dtype="float32", profile=H100) -> SearchSpace:
    return SearchSpace(make_problem(SOFTMAX, shape, dtype), SOFTMAX_D, profile)


def break_streaming_module(space: SearchSpace, candidate) -> None:
    """Write safe_softmax's streaming kernel for ``candidate`` into the module cache with the final
    max read after the loop from a name the loop body assigned (the interpreter accepts it, the
    compiler does not): the gate's compile worker finds it there."""
    module = generate(space.spec, space.derivation, candidate.strategy, space.shape, candidate.config, space.dtypes)
    text = module.path.read_text()
    # mx is bound in the first loop's body only, then read by the output pass (per-lane states: its
    # max over the tile is mx_lane's; per tile, the running max itself)
    broken, n = re.subn(r"^(        mx_lane_anchor = safe_anchor\(mx_lane\).*\n)", r"\1        mx = tl.max(mx_lane, axis=0)\n",
                        text, count=1, flags=re.M)
    if n == 0:
        broken, n = re.subn(r"^(        mx_anchor = safe_anchor\(mx_acc\).*\n)", r"\1        mx = mx_acc\n",
                            text, count=1, flags=re.M)
    broken, m = re.subn(r"(tl\.store\(y_ptr.*?)\bmx_acc\b", r"\1mx", broken, count=1)
    assert n == m == 1, "the generator's softmax kernel changed: update this test"
    module.path.write_text(broken)


def build(**facts) -> ModuleBuild:
    kernel = KernelBuild(**{"kernel": "safe_softmax_streaming_fused_kernel", "ok": True, "registers": 32,
                            "spill_bytes": 0, "stack_bytes": 0, "local_bytes": 0, "shared_bytes": 1024,
                            "num_warps": 4, "num_stages": 2, **facts})
    return ModuleBuild("streaming_fused", None, (kernel,))


# ---------------------------------------------------------------- the gate's rules


def test_judge_prunes_failures_and_overruns_and_keeps_spills():
    assert judge(build(), H100).reason is None
    failed = judge(build(ok=False, error="k: line 7: mx is not defined", registers=None), H100)
    assert failed.pruned and failed.reason == "does not compile for sm_90: k: line 7: mx is not defined"
    failed_36 = dataclasses.replace(build(ok=False, error="k: PassManager::run failed"), triton_version="3.6.0")
    by_36 = judge(failed_36, H100)
    assert by_36.reason == "does not compile for sm_90 with Triton 3.6.0: k: PassManager::run failed"
    smem = judge(build(shared_bytes=H100.smem_per_block_max + 1), H100)
    assert smem.pruned and smem.reason.startswith("shared memory (safe_softmax_streaming_fused_kernel)")
    assert not judge(build(shared_bytes=A100.smem_per_block_max), A100).pruned  # the limit itself fits
    regs = judge(build(registers=255, num_warps=16), H100)  # 256 x 512 threads > 65536 per SM
    assert regs.pruned and "per SM on h100" in regs.reason
    assert judge(build(registers=128, num_warps=16), H100).reason is None  # exactly the register file
    spilled = judge(build(spill_bytes=96, stack_bytes=96), H100)
    assert not spilled.pruned and spilled.spill_bytes == 96
    refused = judge(ModuleBuild("row_resident", None, (), "the row is too long"), H100)
    assert refused.pruned and "the row is too long" in refused.reason


def test_gate_compiles_a_candidate_once_with_real_facts(compile_pool):
    space = softmax_space({"m": 8, "n": 3000}, "float16")
    gate = CompileGate.for_space(space, pool=compile_pool)
    candidate = space.candidate("streaming_fused", {"block_n": 256, "block_m": 1, "num_warps": 4, "num_stages": 2})
    verdict = gate.check(candidate)
    assert not verdict.pruned and verdict.arch == "sm_90"
    [facts] = verdict.facts()
    assert facts["kernel"] == "safe_softmax_streaming_fused_kernel" and facts["ok"]
    assert facts["registers"] > 0 and facts["spill_bytes"] == 0 and facts["shared_bytes"] >= 0
    assert facts["num_warps"] == 4
    assert gate.check(candidate) is verdict and gate.compiled == 1  # cached by the candidate's key


def test_judge_holds_amd_kernels_to_the_cus_lds_and_vgpr_file():
    """On AMD the compiler's registers are VGPRs per lane (AGPRs included, up to 512) over
    64-lane wavefronts, and shared memory is the CU's LDS."""
    mi300x = get_profile("mi300x")
    assert judge(build(shared_bytes=64 * 1024), mi300x).reason is None  # the whole LDS fits
    lds = judge(build(shared_bytes=64 * 1024 + 1), mi300x)
    assert lds.reason == ("shared memory (safe_softmax_streaming_fused_kernel): the compiler allocates 65537 bytes "
                          "> 65536 LDS per CU on mi300x (gfx942)")
    assert judge(build(registers=300), mi300x).reason is None  # > 255: an NVIDIA thread's most, not a lane's
    # 256 VGPRs x 64 lanes x 16 wavefronts = 2 x the CU's 131072
    vgprs = judge(build(registers=256, num_warps=16), mi300x)
    assert vgprs.reason.endswith("256 per thread x 1024 threads need 262144 > 131072 per CU on mi300x")
    assert judge(build(registers=128, num_warps=16), mi300x).reason is None  # exactly the VGPR file


def test_gate_compiles_for_amd(compile_pool):
    """The gate compiles for the profile's target: an hsaco for gfx942, whose LDS decides."""
    mi300x = get_profile("mi300x")
    space = softmax_space({"m": 8, "n": 3000}, "float16", mi300x)
    gate = CompileGate.for_space(space, pool=compile_pool)
    verdict = gate.check(space.candidate("streaming_fused", {"block_n": 256, "block_m": 1, "num_warps": 4,
                                                             "num_stages": 2}))
    assert not verdict.pruned and verdict.arch == "gfx942"
    [facts] = verdict.facts()
    assert facts["ok"] and 0 < facts["registers"] <= 512 and facts["num_warps"] == 4
    # attention at d = e = 128 on a 64 x 128 tile: 80 KiB of LDS on gfx942 (the space refuses it first)
    spec = load_spec(CATALOG["attention"])
    attention = SearchSpace(make_problem(spec, {"b": 1, "h": 1, "m": 64, "n": 256, "d": 128, "e": 128}, "float16"),
                            derive_cascade(spec), mi300x)
    tile = attention.candidate("streaming_fused", {"block_m": 64, "block_n": 128, "block_e": 128, "num_warps": 4,
                                                   "num_stages": 2})
    assert attention.check(tile).startswith("shared memory")
    over = CompileGate.for_space(attention, pool=compile_pool).check(tile)
    assert over.pruned and over.reason.startswith("shared memory (attention_streaming_fused_kernel): the compiler "
                                                  "allocates 81920 bytes > 65536 LDS per CU on mi300x"), over.reason


# ---------------------------------------------------------------- a failing compile prunes the trial


def test_a_candidate_that_does_not_compile_is_pruned_with_the_compilers_reason(compile_pool):
    space = softmax_space({"m": 3, "n": 1000})
    candidate = space.candidate("streaming_fused", {"block_n": 128, "block_m": 1, "num_warps": 2, "num_stages": 3})
    assert space.check(candidate) is None  # the estimate says it fits
    break_streaming_module(space, candidate)
    gate = CompileGate.for_space(space, pool=compile_pool)
    measurer = ModelMeasurer(space.problem, SOFTMAX_D, H100, gate=gate)

    class Never:  # the gate must answer before any measurement
        name = "never"

        def measure(self, candidate):
            raise AssertionError("a candidate that does not compile was measured")

    study = optuna.create_study()
    study.enqueue_trial(candidate_params(space, "streaming_fused", candidate.values(space)))
    objective = Objective(space, Never(), gate=gate)
    study.optimize(objective, n_trials=1)
    [trial] = study.trials
    assert trial.state == optuna.trial.TrialState.PRUNED
    result = trial.user_attrs["result"]
    assert result["outcome"] == "infeasible"
    assert result["reason"].startswith(f"does not compile for sm_90 with Triton {triton.__version__}: "
                                      "safe_softmax_streaming_fused_kernel: line ")
    assert "mx is not defined" in result["reason"]
    assert result["compile"][0]["ok"] is False and "mx is not defined" in result["compile"][0]["error"]
    assert objective.counts["compile_pruned"] == 1 and objective.counts["infeasible"] == 1
    # the model measurer, asked directly, refuses it with the same reason rather than predicting
    assert measurer.measure(candidate).error == result["reason"]


def test_tune_json_shows_the_compile_pruned_trial_and_the_best_trials_facts(tmp_path):
    """`foldwise tune --json`: the first trial, the streaming default (broken in the module cache),
    is pruned with the compiler's reason; the best trial carries its compile facts."""
    shape = {"m": 4, "n": 70000}  # too long for row_resident: the first default streams
    space = softmax_space(shape)
    strategy, values = default_candidates(space)[0]
    assert strategy == "streaming_fused"
    break_streaming_module(space, space.candidate(strategy, values))
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "tune", str(CATALOG_DIR / "safe_softmax.json"), "--shape", "m=4,n=70000",
         "--trials", "3", "--json"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["counts"]["compile_pruned"] >= 1 and result["counts"]["infeasible"] >= 1
    first = result["compile_pruned_trials"][0]
    assert first["number"] == 0 and first["strategy"] == "streaming_fused"
    assert first["reason"].startswith(f"does not compile for sm_90 with Triton {triton.__version__}: "
                                     "safe_softmax_streaming_fused_kernel: line ")
    assert result["compile"] and all(k["ok"] and k["registers"] > 0 for k in result["compile"])
    # without the check nothing is compiled, and nothing is pruned by the compiler
    off = subprocess.run(
        [sys.executable, "-m", "service.cli", "tune", str(CATALOG_DIR / "safe_softmax.json"), "--shape", "m=4,n=70000",
         "--trials", "1", "--json", "--no-compile-check"], capture_output=True, text=True, timeout=600)
    assert off.returncode == 0, off.stderr
    plain = json.loads(off.stdout)
    assert "compile_pruned" not in plain["counts"] and plain["compile"] is None


# ---------------------------------------------------------------- the model uses the compile facts


def test_occupancy_follows_the_compiled_registers_and_shared_memory():
    space = softmax_space({"m": 4096, "n": 32768}, "float16")
    candidate = space.candidate("streaming_fused", {"block_n": 2048, "block_m": 1, "num_warps": 4, "num_stages": 3})
    args = (space.problem, SOFTMAX_D, candidate, H100)

    def verdict(registers, shared=1024):
        return CompileVerdict("sm_90", build(registers=registers, shared_bytes=shared).kernels)

    def occupancy(v):
        kernel = predict(*args, v).details["kernels"][0]
        return kernel["blocks_per_sm"], kernel["regs_per_thread"], kernel["compiled"]

    estimated = predict(*args).details["kernels"][0]
    assert not estimated["compiled"]
    # 4 warps: 64K registers / (regs rounded to 8 x 128 threads); 64 warps per SM allow 16 blocks
    assert occupancy(verdict(32)) == (16, 32, True)
    assert occupancy(verdict(96)) == (65536 // (96 * 128), 96, True)
    assert occupancy(verdict(250)) == (65536 // (256 * 128), 250, True)  # allocated in units of 8
    assert occupancy(verdict(32, shared=100 * 1024)) == (H100.smem_per_sm // (100 * 1024), 32, True)
    # and the time follows (fewer resident programs: more waves; here the second pass of x also
    # finds more of it in L2, so the sign of the change is the model's, not fixed)
    few, many = predict(*args, verdict(250)), predict(*args, verdict(32))
    assert few.waves > many.waves and few.time_s != many.time_s


def test_a_spilling_candidate_is_penalised():
    space = softmax_space({"m": 4096, "n": 32768}, "float16")
    candidate = space.candidate("streaming_fused", {"block_n": 2048, "block_m": 1, "num_warps": 4, "num_stages": 3})
    args = (space.problem, SOFTMAX_D, candidate, H100)
    clean = predict(*args, CompileVerdict("sm_90", build(registers=64).kernels))
    spills = predict(*args, CompileVerdict("sm_90", build(registers=64, spill_bytes=256, stack_bytes=256).kernels))
    assert spills.time_s > clean.time_s * 1.05
    kernel = spills.details["kernels"][0]
    assert kernel["spill_bytes"] == 256 and kernel["spill_l2_bytes"] > 0
    assert clean.details["kernels"][0]["spill_l2_bytes"] == 0


def test_model_measurer_records_the_facts_it_predicted_from(compile_pool):
    space = softmax_space({"m": 8, "n": 3000}, "float16")
    gate = CompileGate.for_space(space, pool=compile_pool)
    measurer = ModelMeasurer(space.problem, SOFTMAX_D, H100, gate=gate)
    result = Tuner(space, measurer, seed=0, gate=gate, startup=2).run(3)
    assert result.counts["compile_pruned"] == 0 and result.compile[0]["registers"] > 0
    assert gate.compiled >= 1
    best = measurer.measure(Candidate.from_dict({"strategy": result.strategy, "config": result.config}))
    assert best.details["compile"] == result.compile
    assert all(k["compiled"] for k in best.details["model"]["kernels"])


def test_the_model_charges_what_the_compiled_kernel_issues(compile_pool):
    """Issue 35: with SASS facts the model's compute is the kernel's issued instructions and MUFU
    ops (every loop body times its trips), not its own estimate. Softmax 4096 x 32768 fp16 on an
    H200: the streaming kernel's loop issues ~3 exps per element and reads x twice; the
    row-resident one reads once with one exp per element. The GPU timed row_resident at 0.184 ms
    (benchmarks/results/gpu-2026-11-26-h200*), and the model predicts that kernel within 10%. (It
    timed the streaming kernel of that day at 0.280 ms; the model's estimate alone, without the
    SASS, had ordered the two the other way. Today's streaming loop issues a sixth fewer
    instructions, the rescale guard per row, and the model, estimate or SASS, puts it level with
    row_resident under Triton 3.6: an order the GPU has not timed.)"""
    space = softmax_space({"m": 4096, "n": 32768}, "float16", get_profile("h200"))
    gate = CompileGate.for_space(space, pool=compile_pool)
    measurer = ModelMeasurer(space.problem, SOFTMAX_D, space.profile, gate=gate, verify=False)
    resident = space.candidate("row_resident", {"block_n": 32768, "block_m": 1, "num_warps": 16, "num_stages": 1})
    streaming = space.candidate("streaming_fused", {"block_n": 4096, "block_m": 1, "num_warps": 4, "num_stages": 3})
    times = {}
    for c in (resident, streaming):
        r = measurer.measure(c)
        issued = r.details["model"]["kernels"][0]
        times[c.strategy] = r.time_ms
        # the model's kernel record names the instructions it charged
        assert r.error is None and issued["kernel"].endswith("_kernel")
    assert abs(times["row_resident"] / 0.1844 - 1) < 0.1  # the time the H200 measured for this kernel
    p = predict(space.problem, SOFTMAX_D, streaming, space.profile, gate.check(streaming))
    counts = p.details["kernels"][0]["issued"]
    assert counts["mufu"] * 32 >= 2.5 * 4096 * 32768  # the streaming loop's exps, read off the SASS
    bare = predict(space.problem, SOFTMAX_D, streaming, space.profile, gate.check(streaming).without_sass())
    # without SASS the model falls back on its own estimate (which, for today's loop, counts as many exps)
    assert bare.details["kernels"][0]["issued"] is None and counts["warp_instructions"] > 0
    # one verdict's bounds are derived once however many ask (the model's counts, the static floor)
    from tuner.static_bound import problem_bounds

    builds = gate.check(streaming).kernels
    first = problem_bounds(space.problem, SOFTMAX_D, "streaming_fused", streaming.config, builds, space.profile)
    assert first and problem_bounds(space.problem, SOFTMAX_D, "streaming_fused", streaming.config, builds,
                                    space.profile) is first
    other = gate.check(resident).kernels
    assert problem_bounds(space.problem, SOFTMAX_D, "row_resident", resident.config, other, space.profile) != first


def test_a_kernel_known_by_its_cubin_alone_is_predicted_from_its_sass(compile_pool):
    """tuner.cost_model.predict_compiled (what benchmarks/model_calibration.py predicts Liger's and
    the split-KV decoder's kernels with): the same kernel_time from the SASS alone. On Foldwise's
    own row-resident softmax it lands near the model's prediction, and more rows take longer."""
    from tuner.cost_model import predict_compiled

    h200 = get_profile("h200")
    times = []
    for rows in (1024, 4096):
        space = softmax_space({"m": rows, "n": 32768}, "float16", h200)
        gate = CompileGate.for_space(space, pool=compile_pool)
        c = space.candidate("row_resident", {"block_n": 32768, "block_m": 1, "num_warps": 16, "num_stages": 1})
        verdict = gate.check(c)
        unique = 2 * rows * 32768 * 2  # x read once, y written once
        p = predict_compiled([{"build": verdict.kernels[0], "programs": rows, "num_warps": 16, "trips": [1]}], h200,
                             unique)
        model = predict(space.problem, SOFTMAX_D, c, h200, verdict)
        assert p.details["kernels"][0]["issued"]["warp_instructions"] > 0 and p.bytes == unique
        assert 0.5 < p.time_s / model.time_s < 2.0
        times.append(p.time_s)
    assert times[1] > 2 * times[0]


def test_a_fallback_pass_is_not_charged_to_the_static_bound(compile_pool):
    """A bottom-right causal mask (attention_gqa) may leave a query row with no key, so its kernel
    carries fallback passes that run only for such rows (a dependency ended +-inf or NaN). The
    static bound, a floor, counts them as not run: its tensor work is the top-left causal
    kernel's at m = n (the same mask), not the four times that counting the passes gave."""
    from tuner.static_bound import problem_bounds

    shape = {"b": 1, "m": 1024, "n": 1024, "d": 64, "e": 64}
    tile = {"blocks": {"b": 1, "e": 64, "m": 128, "n": 64}, "num_warps": 4, "num_stages": 2}
    tensor = {}
    for name, extra in (("attention_causal", {"h": 1}), ("attention_gqa", {"g": 1, "r": 1})):
        spec = load_spec(load_catalog()[name])
        problem = make_problem(spec, {**shape, **extra}, "bfloat16")
        space = SearchSpace(problem, derive_cascade(spec), H100)
        blocks = {**tile["blocks"], **{d: 1 for d in extra}}
        candidate = space.candidate("streaming_fused", {f"block_{d}": v for d, v in blocks.items()} | {
            "num_warps": 4, "num_stages": 2})
        gate = CompileGate.for_space(space, pool=compile_pool)
        verdict = gate.check(candidate)
        assert not verdict.pruned, verdict.reason
        [bound] = problem_bounds(problem, space.derivation, "streaming_fused", candidate.config, verdict.kernels, H100)
        tensor[name] = bound["terms_s"]["tensor"]
    assert tensor["attention_gqa"] == pytest.approx(tensor["attention_causal"], rel=0.05), tensor


@pytest.mark.parametrize("dtype,unit", [("bfloat16", "bf16"), ("float16", "fp16")])
def test_blackwell_tensor_work_is_counted_from_the_kernels_dots(compile_pool, dtype, unit):
    """On sm_100 the dots become UTCHMMA (tcgen05.mma), whose tile is in an instruction
    descriptor, not in the SASS: the static bound counts the kernel's dots instead. Attention's
    tensor work on b200 is then the same multiply-adds H100's HGMMA count gives (two dots of
    128 x 128 x 64 per tile), at b200's rate, where before it was 0 and attention read as
    issue-bound."""
    from fuser_core.codegen.sass import TCGEN05_MMA
    from tuner.static_bound import problem_bounds

    spec = load_spec(load_catalog()["attention"])
    shape = {"b": 1, "h": 2, "m": 512, "n": 512, "d": 64, "e": 64}
    problem = make_problem(spec, shape, dtype)
    macs = {}
    for profile in (H100, get_profile("b200")):
        space = SearchSpace(problem, derive_cascade(spec), profile)
        candidate = space.candidate("streaming_fused", {"block_b": 1, "block_h": 1, "block_m": 128, "block_n": 64,
                                                        "block_e": 64, "num_warps": 4, "num_stages": 2})
        verdict = CompileGate.for_space(space, pool=compile_pool).check(candidate)
        assert not verdict.pruned, verdict.reason
        [bound] = problem_bounds(problem, space.derivation, "streaming_fused", candidate.config, verdict.kernels,
                                 profile)
        kinds = set(verdict.kernels[0].sass["total"]["tensor"])
        macs[profile.name] = bound["tensor_macs"]
        # sm_100's kind::f16 is fp16 and bf16 alike (one rate)
        assert bound["tensor_unit"] == (unit if profile.name == "h100" else "fp16"), (profile.name, kinds)
        assert bound["terms_s"]["tensor"] > 0
        if profile.name == "b200":
            assert kinds <= set(TCGEN05_MMA.values()) and kinds, kinds
    minimum = 2 * shape["h"] * shape["m"] * shape["n"] * shape["d"]  # QK^T and PV
    assert macs["b200"] == pytest.approx(macs["h100"], rel=0.02) and macs["h100"] >= minimum, macs
