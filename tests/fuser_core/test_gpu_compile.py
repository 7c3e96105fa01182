"""Issues 12 and 25: every generated kernel goes through Triton's GPU compiler, for the whole
fleet (NVIDIA cubins and AMD hsaco), on this machine without a GPU (fuser_core.codegen.gpu_compile).

The matrix: every catalog spec x every valid strategy and the unfused chain x the default
config, at a small ragged size and at every suites.json "paper" size for h100 (sm_90). At the
small size each (spec, strategy) also compiles for one other NVIDIA target (a100 sm_80, l40s
sm_89, b200 sm_100) and one AMD target (mi300x gfx942, mi355x gfx950), taking turns
(catalog_shapes.targets_in_turn; h200 compiles as h100), so every strategy compiles for both
vendors and every target sees every strategy over the catalog. The float dtype (float16,
bfloat16, float32; fp8_quant_gemm: its fp8 weight as in suites.json; fp8_quant_per_token writes
fp8) takes turns too, so each (spec, dtype) compiles in several modules; plus, at the paper sizes,
a fixed-seed sample of the tuner's search space (one config per strategy). Why not the full
product (3 dtypes x 7 targets at every size, 2 sampled configs): cold, 3 dtypes x 2 targets
took 8 of CI's 40 minutes once the serving catalog (issue 24) brought 8 more specs, 5 of them
attention; the AMD turn adds about a third more modules, and an AMD compile costs a fraction of
ptxas's. The Triton 3.6 job (.ci/triton36) compiles the small size with the targets and dtypes
taking turns from another start, so the two jobs see different (strategy, target, dtype) triples.
The interpreter accepts kernels the compiler rejects, so a kernel that is not in this matrix
is not known to run on a GPU. The compiler is the installed Triton's: CI runs this file under
3.9 (.ci/run) and its compile-check tests under 3.6 (.ci/triton36), where the sampled configs
of ``REJECTED_BY_VERSION`` fail.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton
from tests.support.catalog_shapes import distinct_targets, small_shape, targets_in_turn
from tests.support.catalog import CATALOG_DIR, load_catalog

from fuser_core.codegen.compiler_errors import compiler_stderr, pipeline_failure
from fuser_core.codegen.gpu_compile import CompileRequest
from fuser_core.codegen.module import generate
from fuser_core.codegen.plan import BASELINE, KernelConfig, valid_strategies
from fuser_core.derive import derive_cascade
from fuser_core.problem import make_problem
from fuser_core.reference import bind_shape
from fuser_core.runner import bind_dtypes
from fuser_core.spec import load_spec
from tests.support.cascades import every_strategy_passes, red, spec_of
from tuner.compile_gate import judge
from fuser_core.targets import CUDA, HIP, Target
from tuner.profiles import FLEET, get_profile
from tuner.space import SearchSpace

CATALOG = load_catalog()
TARGETS = distinct_targets(["h100", *FLEET])  # h100 first: every strategy compiles for it, at every size
HOME = TARGETS[0][1]  # Target("cuda", 90, 32)
PROFILE_OF = {target: get_profile(name) for name, target in TARGETS}
REGRESSION_TARGETS = tuple(Target.parse(arch) for arch in ("sm_90", "sm_80", "gfx942"))  # a found failure's checks
FLOATS = ("float16", "bfloat16", "float32")
SAMPLED_CONFIGS = 1  # per strategy and paper size, from the tuner's search space
SEED = 12
FP8_INPUTS = {"fp8_quant_gemm": {"w": "float8_e4m3fn", "w_scale": "float32"}}  # as suites.json has it
# Configs a supported Triton rejects where 3.9 compiles them: Triton version prefix -> (strategy,
# dtype of the float inputs, the start of the compiler's reason). Triton 3.6's
# TritonGPUOptimizeThreadLocality pass asserts on some float32 multi_pass tiles (a loop's result
# read by the next loop and by the epilogue): 6 of the sampled configs at the paper sizes. Only a
# sampled (tuning) config may be one, and the compile gate must prune it with the compiler's
# reason and the version; every default config compiles on every version.
REJECTED_BY_VERSION = {
    "3.6.": [("multi_pass", "float32", "RuntimeError: PassManager::run failed (pass TritonGPUOptimizeThreadLocality")],
}


def paper_shapes(name: str) -> list[dict[str, int]]:
    suites = json.loads((CATALOG_DIR / "suites.json").read_text())
    return [case["shape"] for case in suites["paper"] if case["spec"] == name]


def dtypes_for(spec, name: str, floating: str) -> dict[str, str]:
    chosen = {i.name: floating for i in spec.inputs if i.kind == "float"}
    return bind_dtypes(spec, {**chosen, **FP8_INPUTS.get(name, {})})


def sampled_configs(space: SearchSpace, strategy: str, rng: random.Random) -> list[dict]:
    """Up to SAMPLED_CONFIGS candidates the tuner's model judges feasible, drawn uniformly."""
    params = space.params(strategy)
    out: list[dict] = []
    for _ in range(200):
        candidate = space.candidate(strategy, {p: rng.choice(choices) for p, choices in params.items()})
        if space.check(candidate) is None and candidate.config.to_dict() not in out:
            out.append(candidate.config.to_dict())
            if len(out) == SAMPLED_CONFIGS:
                break
    return out


def matrix() -> list[tuple[str, CompileRequest]]:
    """Default configs for every (size, strategy): at the paper sizes for h100, at the small size
    for h100 and one target of each vendor in turn (the k-th spec's j-th strategy: turn k + j);
    the dtypes taking turns; at the paper sizes also SAMPLED_CONFIGS configs of h100's search
    space per strategy, the dtypes taking turns again (a tiny shape leaves the search little to
    choose)."""
    rng = random.Random(SEED)
    out = []
    for k, name in enumerate(sorted(CATALOG)):
        spec = load_spec(CATALOG[name])
        derivation = derive_cascade(spec)
        paper = [bind_shape(spec, s) for s in paper_shapes(name)]
        for shape in [small_shape(spec), *paper]:
            valid = valid_strategies(spec, derivation, shape)
            strategies = [s for s, why in valid.items() if why is None] + [BASELINE]

            def add(strategy, dtypes, config, floating, target_name, target):
                label = f"{name} {strategy} {shape} {floating} {target_name} config={config or 'default'}"
                out.append((label, CompileRequest(spec, shape, dtypes, strategy, config, target)))

            for j, strategy in enumerate(strategies):
                for target_name, target in (targets_in_turn(TARGETS, k + j) if shape not in paper else TARGETS[:1]):
                    floating = FLOATS[len(out) % len(FLOATS)]
                    add(strategy, dtypes_for(spec, name, floating), None, floating, target_name, target)
            if shape not in paper:
                continue
            turns = iter(FLOATS * 8)
            for strategy in strategies[:-1]:
                floating = next(turns)
                dtypes = dtypes_for(spec, name, floating)
                space = SearchSpace(make_problem(spec, shape, dtypes), derivation, PROFILE_OF[HOME])
                if strategy in space.strategies():
                    for config in sampled_configs(space, strategy, rng):
                        add(strategy, dtypes, config, floating, *TARGETS[0])
    return out


@pytest.fixture(scope="module")
def catalog_builds(compile_pool):
    labelled = matrix()
    builds = compile_pool.compile([r for _, r in labelled])
    return [(label, request, build) for (label, request), build in zip(labelled, builds)]


def rejected_by_this_triton(request: CompileRequest, build) -> bool:
    """A sampled config this Triton is known to reject (REJECTED_BY_VERSION), with that reason."""
    error = build.first_error() or ""
    return request.config is not None and any(
        triton.__version__.startswith(version) and request.strategy == strategy
        and floating in request.dtypes.values() and f"_kernel: {reason}" in error
        for version, rules in REJECTED_BY_VERSION.items() for strategy, floating, reason in rules)


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_catalog_kernels_compile_for_the_fleet(name, catalog_builds):
    mine = [(label, r, b) for label, r, b in catalog_builds if r.spec.name == name]
    failures = [f"{label}: {b.first_error()}" for label, r, b in mine if not b.ok and not rejected_by_this_triton(r, b)]
    assert not failures, f"{len(failures)} modules fail to compile:\n" + "\n".join(failures[:10])
    for _, r, b in mine:
        if not b.ok:  # a known rejection: the tuner never measures it, and says why
            profile = PROFILE_OF[r.target]
            by = f"with Triton {triton.__version__}"
            assert judge(b, profile).reason == f"does not compile for {profile.arch} {by}: {b.first_error()}"
    # every request of the matrix produced kernels (a default config is valid by construction)
    assert all(b.kernels for _, _, b in mine if b.refused is None)
    compiled = {(r.strategy, r.target) for _, r, b in mine if b.kernels}
    fused = {s for s, _ in compiled} - {BASELINE, "multi_pass"}
    assert fused, f"{name}: no fused strategy compiled"
    backends = {t.backend for _, t in compiled}
    assert HOME in {t for _, t in compiled} and backends == {CUDA, HIP}, compiled
    for _, r, b in mine:
        for k in b.kernels if b.ok else ():
            assert k.registers and k.registers > 0 and k.spill_bytes is not None and k.shared_bytes is not None
            if r.target.backend == CUDA:
                assert k.spill_bytes == k.stack_bytes + k.local_bytes and k.sgprs is None
            else:  # AMD: VGPRs per lane and SGPRs per wavefront from the hsaco's metadata, scratch as spills
                assert k.sgprs and k.sgprs > 0 and k.stack_bytes is None and k.local_bytes is None


def test_the_matrix_covers_sampled_configs_and_every_size(catalog_builds):
    """The sample of the search space really adds configs, and paper sizes are compiled."""
    sampled = [r for _, r, b in catalog_builds if r.config is not None and b.kernels]
    assert len(sampled) >= 3 * sum(1 for name in CATALOG if paper_shapes(name))
    sizes = {(r.spec.name, tuple(sorted(r.shape.items()))) for _, r, _ in catalog_builds}
    for name in CATALOG:
        assert sum(1 for n, _ in sizes if n == name) == 1 + len(paper_shapes(name))


def test_the_matrix_compiles_each_strategy_for_each_target_and_each_dtype():
    """The turns leave nothing out: every (spec, valid strategy) has a default config compiled for
    h100, another NVIDIA target and an AMD one; over the catalog every target of the fleet
    compiles every strategy and the chain; every spec each float dtype (two at least with one
    strategy)."""
    labelled = matrix()
    defaults = {(r.spec.name, r.strategy, r.target) for _, r in labelled if r.config is None}
    floats = {(r.spec.name, r.dtypes[next(i.name for i in r.spec.inputs if i.kind == "float")]) for _, r in labelled}
    everywhere = {s for _, s, _ in defaults}
    assert everywhere >= {"row_resident", "streaming_fused", "split_fused", "multi_pass", BASELINE}
    assert {t for _, t in TARGETS} == {get_profile(p).target for p in FLEET} and len(TARGETS) == 6
    for _, target in TARGETS:
        assert {s for _, s, t in defaults if t == target} == everywhere, target
    for name in CATALOG:
        spec = load_spec(CATALOG[name])
        valid = valid_strategies(spec, derive_cascade(spec), small_shape(spec))
        strategies = {s for s, why in valid.items() if why is None} | {BASELINE}
        for s in strategies:
            targets = {t for n, s2, t in defaults if n == name and s2 == s}
            assert HOME in targets and {t.backend for t in targets - {HOME}} == {CUDA, HIP}, (name, s, targets)
        assert {s for n, s, _ in defaults if n == name} == strategies, name
        assert {f for n, f in floats if n == name} >= set(FLOATS[:2 if len(strategies) == 1 else 3]), name


# ---------------------------------------------------------------- a broken kernel fails the gate


def broken_softmax_request(tmp_config: dict) -> tuple[CompileRequest, Path]:
    """safe_softmax's streaming kernel with the final max read after the loop from a name the
    loop body assigned (what the generator wrote before issue 12): written into the module cache,
    where the gate's worker finds it."""
    spec = load_spec(CATALOG["safe_softmax"])
    shape = bind_shape(spec, {"m": 3, "n": 1000})
    dtypes = bind_dtypes(spec, "float32")
    module = generate(spec, derive_cascade(spec), "streaming_fused", shape, KernelConfig.from_dict(tmp_config), dtypes)
    text = module.path.read_text()
    # mx bound in the first loop's body only, then read by the output pass (the second loop)
    # (the loop keeps per-lane states, structure.per_lane: its max over the tile is mx_lane's)
    broken, n = re.subn(r"^(        mx_lane_anchor = safe_anchor\(mx_lane\).*\n)", r"\1        mx = tl.max(mx_lane, axis=0)\n",
                        text, count=1, flags=re.M)
    broken, m = re.subn(r"(tl\.store\(y_ptr.*?)\bmx_acc\b", r"\1mx", broken, count=1)
    assert n == m == 1, "the generator's softmax kernel changed: update this test"
    module.path.write_text(broken)
    return CompileRequest(spec, shape, dtypes, "streaming_fused", tmp_config, HOME), module.path


# what Triton 3.6's compiler printed on stderr for a float32 multi_pass config it rejects (the
# module's reproducer cut), while its exception said only "PassManager::run failed"
FAILED_PIPELINE = """\
python3: /project/lib/Dialect/TritonGPU/Transforms/OptimizeThreadLocality.cpp:341: virtual void \
mlir::triton::gpu::(anonymous namespace)::TritonGPUOptimizeThreadLocalityPass::runOnOperation(): \
Assertion `loopResult.hasOneUse()' failed.
module {
}
/tmp/kernels/logsumexp_multi_pass_35e9ddc1797ae87d.py:15:0: error: Failures have been detected while processing an \
MLIR pass pipeline
/tmp/kernels/logsumexp_multi_pass_35e9ddc1797ae87d.py:15:0: note: Pipeline failed while executing \
[`TritonGPUOptimizeThreadLocality` on 'builtin.module' operation]: reproducer generated at `std::errs, please share \
the reproducer above with Triton project.`
"""


def test_a_failed_pass_is_named_from_what_the_compiler_printed():
    assert pipeline_failure(FAILED_PIPELINE) == "pass TritonGPUOptimizeThreadLocality: assertion loopResult.hasOneUse()"
    assert pipeline_failure("warning: something else\n") is None
    with compiler_stderr() as printed:  # what the C++ compiler writes to file descriptor 2 is kept
        os.write(2, b"note: Pipeline failed while executing [`SomePass` on 'builtin.module' operation]\n")
    assert pipeline_failure("".join(printed)) == "pass SomePass"


def test_a_loop_scoped_name_fails_the_gate_naming_kernel_and_line(compile_pool):
    request, path = broken_softmax_request({"blocks": {"n": 128}, "num_warps": 2})
    [build] = compile_pool.compile([request])
    assert not build.ok
    error = build.first_error()
    assert error.startswith("safe_softmax_streaming_fused_kernel: line "), error
    assert "mx is not defined" in error
    line = int(re.search(r"line (\d+)", error).group(1))
    source_line = path.read_text().split("\n")[line - 1]
    assert re.search(r"\bmx\b", source_line) and source_line.startswith("        ")  # the read, in the 2nd loop


# ---------------------------------------------------------------- foldwise compile


def foldwise(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_compiles_every_strategy_and_lists_refused_ones():
    spec = str(CATALOG_DIR / "safe_softmax.json")
    done = foldwise("compile", spec, "--shape", "m=4,n=70000", "--dtype", "bfloat16", "--target", "a100",
                    "--strategy", "all", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["arch"] == "sm_80" and report["triton_version"] == triton.__version__  # the facts are its
    strategies = {k["strategy"] for k in report["kernels"]}
    assert strategies == {"streaming_fused", "split_fused", "multi_pass", BASELINE}
    assert "too long to keep resident" in report["refused"]["row_resident"]
    kernels = {k["kernel"] for k in report["kernels"] if k["strategy"] == "split_fused"}
    assert kernels == {"safe_softmax_split_fused_kernel", "safe_softmax_split_fused_combine_kernel"}
    for k in report["kernels"]:
        assert set(k) >= {"strategy", "kernel", "ok", "error", "registers", "spill_bytes", "shared_bytes"}
        assert k["ok"] and k["error"] is None and k["registers"] > 0
        # what the cubin issues (fuser_core.codegen.sass) and, for a fused kernel, its static bound
        assert k["sass"]["total"]["instructions"] > 0 and k["sass"]["total"]["load_bits"]
        if k["strategy"] != BASELINE:
            b = k["static_bound"]
            assert b["bound"] in b["terms_s"] and b["time_s"] == max(b["terms_s"].values()) > 0
    # 4 rows of 70000 bf16 values on an A100: nothing but bytes bounds the streamed kernel
    streamed = next(k for k in report["kernels"] if k["strategy"] == "streaming_fused")
    assert streamed["static_bound"]["bound"] in ("memory", "issue")


def test_cli_compiles_for_every_target_of_the_fleet(tmp_path):
    """Issue 25's must-show: safe_softmax for all seven targets, NVIDIA cubins and AMD hsaco, one
    row per target; a target named by its arch, and an AMD kernel's binary written to --out."""
    args = ["compile", "safe_softmax", "--shape", "m=64,n=4096", "--dtype", "float16", "--target", "all"]
    done = foldwise(*args, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert [t["target"] for t in report["targets"]] == list(FLEET) and report["triton_version"] == triton.__version__
    assert {t["target"]: (t["binary_arch"], t["binary_kind"]) for t in report["targets"]} == {
        "a100": ("sm_80", "cubin"), "l40s": ("sm_89", "cubin"), "h100": ("sm_90a", "cubin"), "h200": ("sm_90a", "cubin"),
        "b200": ("sm_100a", "cubin"), "mi300x": ("gfx942", "hsaco"), "mi355x": ("gfx950", "hsaco")}
    kernels = {(k["strategy"], k["kernel"]) for k in report["targets"][0]["kernels"]}
    assert {s for s, _ in kernels} == {"row_resident", "streaming_fused", "split_fused", "multi_pass", BASELINE}
    for t in report["targets"]:
        assert {(k["strategy"], k["kernel"]) for k in t["kernels"]} == kernels, t["target"]
        assert all(k["ok"] and k["registers"] > 0 and k["shared_bytes"] is not None for k in t["kernels"]), t["target"]
        assert all((k["sgprs"] is not None) == (t["binary_kind"] == "hsaco") for k in t["kernels"]), t["target"]
    text = foldwise(*args)  # the same compiles, answered from the compile cache
    assert text.returncode == 0, text.stdout + text.stderr
    assert "7 of 7 targets compile every kernel" in text.stdout
    rows = [line.split() for line in text.stdout.splitlines()[2:9]]
    assert [r[:4] for r in rows] == [[t["target"], t["binary_arch"], t["binary_kind"], f"{len(kernels)}/{len(kernels)}"]
                                     for t in report["targets"]]
    one = foldwise("compile", "safe_softmax", "--shape", "m=64,n=4096", "--dtype", "float16", "--target", "gfx942",
                   "--strategy", "streaming_fused", "--json", "--out", str(tmp_path))
    assert one.returncode == 0, one.stdout + one.stderr
    single = json.loads(one.stdout)
    assert (single["target"], single["arch"], single["binary_kind"]) == ("gfx942", "gfx942", "hsaco")
    hsaco = (tmp_path / "streaming_fused" / "safe_softmax_streaming_fused_kernel.hsaco").read_bytes()
    assert hsaco[:4] == b"\x7fELF" and int.from_bytes(hsaco[18:20], "little") == 224  # EM_AMDGPU
    assert ".amdgcn_target" in (tmp_path / "streaming_fused" / "safe_softmax_streaming_fused_kernel.amdgcn").read_text()


def test_cli_exits_1_when_a_kernel_fails_and_names_it():
    config = {"blocks": {"n": 256}, "num_warps": 2}
    broken_softmax_request(config)
    done = foldwise("compile", str(CATALOG_DIR / "safe_softmax.json"), "--shape", "m=3,n=1000",
                    "--strategy", "streaming_fused", "--config", json.dumps(config))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "safe_softmax_streaming_fused_kernel" in done.stdout and "NO" in done.stdout
    assert "mx is not defined" in done.stdout


@pytest.mark.parametrize(("args", "field"), [
    (["--target", "v100"], "--target"),
    (["--strategy", "fastest"], "--strategy"),
    (["--config", "{"], "--config"),
    (["--shape", "m=four"], "--shape"),
])
def test_cli_bad_input_exits_2_naming_the_flag(args, field):
    base = ["compile", str(CATALOG_DIR / "safe_softmax.json"), "--shape", "m=2,n=64"]
    if "--shape" in args:
        base = base[:2]
    done = foldwise(*base, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert field in done.stderr


def test_specs_equal_up_to_names_compile_in_one_worker(compile_pool):
    """A worker keeps derivations between requests: one per spec, names included (two specs with
    the same canonical hash once shared one, and the second's launcher failed; found by fuzzing)."""
    def spec_named(mx: str, total: str):
        return load_spec({"foldwise": 1, "name": "a", "inputs": {"x": {"dims": ["m"]}},
                          "steps": [{"name": mx, "reduce": "max", "over": "m", "expr": "x"},
                                    {"name": total, "reduce": "sum", "over": "m", "expr": f"(x - {mx}) ** 2"}],
                          "outputs": [total]})

    requests = [CompileRequest(spec_named(a, b), {"m": 13}, {"x": "float32"}, "streaming_fused", None, HOME)
                for a, b in [("h", "total"), ("u", "total"), ("o", "idx")] * 2]  # both workers see each
    builds = compile_pool.compile(requests)
    assert all(b.ok and b.kernels for b in builds), [b.first_error() for b in builds]


def test_a_combine_kernel_reading_an_input_after_its_split_loop_compiles(compile_pool):
    """Fuzz seed 43's compile failure: the combine kernel loaded ``x`` (constant along the split
    loop) inside ``for split in range(SPLIT)`` and read it after the loop (NameError on sm_90)."""
    spec = load_spec({"foldwise": 1, "name": "a",
                      "inputs": {"kk": {"dims": ["n"]}, "x": {"dims": ["j2"]}, "a": {"dims": ["seq"]}},
                      "steps": [{"name": "offs", "reduce": "max", "over": "n", "expr": "where(index(seq) <= index(j2), kk, a)"},
                                {"name": "mx_old", "reduce": "max", "over": "n", "expr": "(kk + x) - offs"}],
                      "outputs": ["mx_old"]})
    config = {"blocks": {"n": 4}, "num_warps": 4, "num_stages": 2, "split": 2}
    requests = [CompileRequest(spec, {"n": 13, "j2": 2, "seq": 1}, bind_dtypes(spec, "float32"), "split_fused", config, target)
                for target in REGRESSION_TARGETS]
    builds = compile_pool.compile(requests)
    assert all(b.ok and len(b.kernels) == 2 for b in builds), [b.first_error() for b in builds]


@pytest.mark.parametrize("strategy", ["row_resident", "streaming_fused", "split_fused", "multi_pass"])
def test_a_sum_over_top_k_slots_in_the_epilogue_compiles(compile_pool, strategy):
    """A router renormalising its top-k gate weights over j: the sum over j runs after the loop
    over the experts, in the selecting kernel (tests/fuser_core/test_codegen_general.py runs it)."""
    spec = load_spec({"foldwise": 1, "name": "router_renorm", "inputs": {"logits": {"dims": ["t", "x"]}},
                      "steps": [{"name": "mx", "reduce": "max", "over": "x", "expr": "logits"},
                                {"name": "den", "reduce": "sum", "over": "x", "expr": "exp(logits - mx)"},
                                {"name": "gate", "reduce": "topk", "k": 8, "as": "j", "over": "x",
                                 "expr": "exp(logits - mx) / den"},
                                {"name": "norm", "reduce": "sum", "over": "j", "expr": "gate.values"},
                                {"name": "w", "expr": "gate.values / norm"}],
                      "outputs": ["w", "gate"]})
    shape = {"t": 4096, "x": 256}
    blocks = {"t": 2} if strategy == "row_resident" else {"t": 2, "x": 64}
    config = {"blocks": blocks, "num_warps": 4, "num_stages": 2, "split": 2 if strategy == "split_fused" else 1}
    requests = [CompileRequest(spec, shape, bind_dtypes(spec, "float16"), strategy, config, target)
                for target in REGRESSION_TARGETS]
    builds = compile_pool.compile(requests)
    assert all(b.ok for b in builds), [b.first_error() for b in builds]


PADDED_CAUSAL = {  # a padding mask and the causal mask in one condition (issue 23): one fused kernel
    "foldwise": 1, "name": "attention_causal_padded",
    "inputs": {"q": {"dims": ["b", "h", "m", "d"]}, "k": {"dims": ["b", "h", "n", "d"]}, "v": {"dims": ["b", "h", "n", "e"]},
               "kv_len": {"dims": ["b"], "kind": "index"}},
    "params": {"scale": "1 / sqrt(size(d))"},
    "steps": [{"name": "s", "reduce": "sum", "over": "d", "expr": "q * k * scale"},
              {"name": "s0", "expr": "where(index(n) <= index(m) and index(n) < kv_len, s, -inf)"},
              {"name": "mx", "reduce": "max", "over": "n", "expr": "s0"},
              {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(s0 - mx)"},
              {"name": "o", "reduce": "sum", "over": "n", "expr": "exp(s0 - mx) * v / den"}],
    "outputs": ["o"]}


@pytest.mark.parametrize("strategy", ["row_resident", "streaming_fused", "split_fused", "multi_pass"])
def test_a_padding_and_a_causal_mask_in_one_condition_compile(compile_pool, strategy):
    spec = load_spec(PADDED_CAUSAL)
    shape = {"b": 2, "h": 4, "m": 256, "n": 256, "d": 64, "e": 64}
    blocks = {"m": 64} if strategy == "row_resident" else {"m": 64, "n": 64}
    config = {"blocks": blocks, "num_warps": 4, "num_stages": 2, "split": 2 if strategy == "split_fused" else 1}
    requests = [CompileRequest(spec, shape, bind_dtypes(spec, "float16"), strategy, config, target)
                for target in REGRESSION_TARGETS]
    builds = compile_pool.compile(requests)
    assert all(b.ok for b in builds), [b.first_error() for b in builds]


def test_a_kernel_with_a_runtime_scalar_compiles(compile_pool):
    """Runtime scalars (issue 24, 2): eps is an fp32 kernel argument, not a constexpr, and the
    compiler takes it for every strategy and the chain."""
    spec = load_spec({"foldwise": 1, "name": "rmsnorm", "inputs": {"x": {"dims": ["t", "c"]}, "w": {"dims": ["c"]}},
                      "params": {"eps": {"runtime": "float", "default": 1e-6, "positive": True}},
                      "steps": [{"name": "ms", "reduce": "sum", "over": "c", "expr": "x * x / size(c)"},
                                {"name": "y", "expr": "x * rsqrt(ms + eps) * w"}],
                      "outputs": ["y"]})
    shape = {"t": 64, "c": 4096}
    requests = [CompileRequest(spec, shape, bind_dtypes(spec, "bfloat16"), strategy, None, HOME)
                for strategy in ("row_resident", "streaming_fused", "multi_pass", "unfused_chain")]
    builds = compile_pool.compile(requests)
    assert all(b.ok and b.kernels for b in builds), [b.first_error() for b in builds]


# --- regressions the cascade fuzzer (tests/support/fuzz_strategies.py) found, each with the smallest
# spec that showed it (small specs built with tests/support/cascades.py)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked lanes compute on fill values
def test_a_cast_of_a_size_compiles_where_the_size_is_1(compile_pool):
    """cast(size(n) / 2, "float8_e4m3fn"): Triton passes a size of 1 as a constant, so the cast's
    operand was a Python float, and the GPU compiler refused `x.to(...)` in fp8e4m3_round (the
    interpreter accepted it; fuzz seed 43). It is rounded as a 0-d tensor now."""
    from fuser_core.codegen.gpu_compile import CompileRequest

    spec = spec_of([red("nblk", "argmin", "x", over="m"), red("u", "sum", "x * x", over="j"),
                    {"name": "total", "expr": "-where(-u >= where(index(m) != nblk, scale, -1), cast(scale, \"float8_e4m3fn\"), -1)"},
                    red("t", "argmax", "total", over="m"), red("acc", "sum", "-u", over="m")],
                   ["t", "acc"], inputs={"x": {"dims": ["m", "j", "n"]}}, params={"scale": "size(n) * 0.5"})
    shape = {"m": 13, "j": 1, "n": 1}
    for r in every_strategy_passes(spec, shape):
        [build] = compile_pool.compile([CompileRequest(spec, shape, {"x": "float32"}, r["strategy"], r["config"])])
        assert build.ok and build.kernels, build.first_error()
