"""``foldwise bench`` (tuner/bench/) and the PyTorch baselines (tuner/torch_ref/).

Without a GPU the bench must refuse (exit 2); ``--device cpu`` runs the whole pipeline
(tuning with the cuda measurer's worker, the baselines checked then timed, the writers)
through Triton's interpreter at tiny shapes, labelled as such, targets not evaluated. The
torch.compile baseline runs once here on a tiny shape (Inductor on the CPU takes ~10 s).
The targets' logic is tested on hand-made entries (their times are inputs to the logic, not
measurements).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from tests.support.catalog import load_catalog, load_catalog_suites

from fuser_core.canonical import spec_hash
from fuser_core.codegen.module import output_dtypes
from fuser_core.derive import derive_cascade
from fuser_core.problem import make_problem
from fuser_core.reference import bind_shape, evaluate, random_inputs
from fuser_core.runner import TOLERANCE, bind_dtypes, compare, to_torch
from fuser_core.spec import load_spec
from service.cli import main
from tuner.bench.errors import BenchError
from tuner.bench.report import write_outputs
from tuner.bench.run import run_bench
from tuner.bench.suites import case_id
from tuner.bench.targets import TARGETS, dependent_long_axes, evaluate_case, roofline, summarize_targets
from tuner.device.inputs import problem_payload
from tuner.device.timing import CPU_LABEL, TimingSettings
from tuner.device.worker import WorkerProcess
from tuner.measure import reduced_problem
from tuner.profiles import get_profile
from tuner.static_bound import min_bytes
from tuner.torch_ref.builder import build
from tuner.torch_ref.contractions import contraction_flops
from tuner.torch_ref.handwritten import HANDWRITTEN_TEMPLATES, handwritten, handwritten_reason

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked tile lanes compute 0/0

CATALOG = load_catalog()
SUITES = load_catalog_suites()
HAS_CUDA = __import__("torch").cuda.is_available()


@cache
def loaded(name: str):
    spec = load_spec(CATALOG[name])
    return spec, derive_cascade(spec)


def case_name(case: dict) -> str:
    return case_id(case)


# ------------------------------------------------------------------------------ torch baselines


@pytest.mark.parametrize("case", SUITES["paper"], ids=case_name)
def test_torch_eager_and_handwritten_match_the_reference(case: dict) -> None:
    """The generic torch implementation of every suite case (reduced shape, the case's dtypes)
    and the hand-written kernel where one exists pass the project's tolerances."""
    spec, d = loaded(case["spec"])
    shape = bind_shape(spec, reduced_problem(spec, d, case["shape"], "multi_pass")[0])
    dtypes = bind_dtypes(spec, case["dtype"])
    inputs = random_inputs(spec, shape, np.random.default_rng(0), dtypes)
    reference = evaluate(spec, shape, inputs)
    stores = output_dtypes(spec, dtypes)
    tensors = to_torch(inputs, dtypes, "cpu")
    hand = handwritten(spec)
    variants = [build(make_problem(spec, shape, dtypes))] + ([lambda t: hand.fn(t, shape)] if hand is not None else [])
    for fn in variants:
        out = fn(tensors)
        for part in reference:
            assert tuple(out[part].shape) == reference[part].shape
            assert str(out[part].dtype) == f"torch.{stores[part]}"
        errors = compare(spec, out, reference, stores)
        assert all(e <= TOLERANCE[stores[p]] for p, e in errors.items()), errors


def test_handwritten_needs_the_catalog_structure() -> None:
    for name in HANDWRITTEN_TEMPLATES:  # the templates are the catalog's specs
        assert spec_hash(load_spec(CATALOG[name])) == spec_hash(load_spec(HANDWRITTEN_TEMPLATES[name])), name
        assert handwritten(load_spec(CATALOG[name])) is not None
    raw = json.loads(json.dumps(CATALOG["safe_softmax"]))
    raw["steps"][2]["expr"] = "exp(x - mx) / den * 2"  # same name, another computation
    reason = handwritten_reason(load_spec(raw))
    assert reason is not None and "does not have the structure" in reason
    renamed = json.loads(json.dumps(CATALOG["safe_softmax"]).replace('"m"', '"rows"').replace('"n"', '"cols"')
                         .replace('over": "n', 'over": "cols'))
    assert handwritten(load_spec(renamed)) is not None  # dims renamed: the same structure
    assert "no hand-written kernel" in handwritten_reason(loaded("moe_routing")[0])


def test_contractions_use_einsum_not_the_broadcast_product() -> None:
    """Attention at a size whose [b,h,m,n,d] product would need GBs runs in MBs."""
    import torch

    spec, _ = loaded("attention")
    shape = {"b": 1, "h": 1, "m": 512, "n": 512, "d": 1024, "e": 16}  # q*k*scale broadcast: 2^28 floats
    assert contraction_flops(spec, shape) == 2 * 512 * 512 * 1024 + 2 * 512 * 512 * 16
    g = torch.Generator().manual_seed(0)
    t = {k: torch.randn(1, 1, 512, n, generator=g) for k, n in (("q", 1024), ("k", 1024), ("v", 16))}
    o = build(make_problem(spec, shape, "float32"))(t)["o"]
    expected = torch.softmax(t["q"] @ t["k"].transpose(-1, -2) / 32.0, dim=-1) @ t["v"]
    assert torch.allclose(o, expected, atol=1e-5)


# ------------------------------------------------------------------------------ case facts


def test_case_classification_for_the_paper_suite() -> None:
    h100 = get_profile("h100")
    facts = {}
    for case in SUITES["paper"]:
        spec, d = loaded(case["spec"])
        shape = bind_shape(spec, case["shape"])
        dtypes = bind_dtypes(spec, case["dtype"])
        r = roofline(spec, shape, dtypes, h100)
        facts[case_name(case)] = (r["memory_bound"], dependent_long_axes(spec, d, shape))
    by_spec = {}
    for case in SUITES["paper"]:
        by_spec.setdefault(case["spec"], []).append(facts[case_name(case)])
    assert by_spec["attention"] == [(False, []), (True, ["n"])]  # prefill compute-bound; decoding memory-bound
    assert by_spec["attention_causal"] == [(False, [])]
    assert by_spec["fp8_quant_gemm"] == [(False, ["k"])]
    assert by_spec["safe_softmax"] == [(True, ["n"]), (True, [])]  # n=32768 long, n=1024 not
    assert by_spec["rmsnorm"] == [(True, [])]  # one reduction only
    assert by_spec["layernorm"] == [(True, ["c"])] and by_spec["cross_entropy"] == [(True, ["v"])]
    spec, _ = loaded("rmsnorm")
    assert min_bytes(spec, {"t": 8, "c": 16}, {"x": "bfloat16", "w": "bfloat16"}) == (8 * 16 + 16 + 8 * 16) * 2


def _entry(times: dict, *, memory_bound: bool = True, long_axes=("n",), hand: bool = True) -> dict:
    variants = {k: {"status": "ok", "time_ms": v} for k, v in times.items()}
    if not hand:
        variants["handwritten"] = {"status": "none", "reason": "torch has no hand-written kernel"}
    return {"id": "x", "min_bytes": 3_000_000, "roofline": {"memory_bound": memory_bound},
            "dependent_long_axes": list(long_axes), "variants": variants}


def test_targets_are_judged_only_on_a_gpu() -> None:
    copy = {"bytes_per_s": 3e12}
    e = _entry({"fused": 1e-3, "chain": 2.5e-3, "compile": 0.9e-3, "handwritten": 1.05e-3, "eager": 4e-3})
    evaluate_case(e, copy, "cuda")
    t = e["targets"]
    assert t["chain_2x"]["status"] == "met" and t["chain_2x"]["value"] == pytest.approx(2.5)
    assert t["compile_1x"]["status"] == "missed" and t["compile_1x"]["value"] == pytest.approx(0.9)
    assert t["handwritten_0.9x"]["status"] == "met"
    assert t["copy_bw_80"]["status"] == "met" and t["copy_bw_80"]["value"] == pytest.approx(1.0)  # 3 MB in 1 us
    e = _entry({"fused": 2e-3, "chain": 2.5e-3}, memory_bound=False, long_axes=(), hand=False)
    e["variants"]["compile"] = {"status": "wrong", "error": "wrong result"}
    evaluate_case(e, copy, "cuda")
    t = e["targets"]
    assert [t[k]["status"] for k in TARGETS] == ["n/a", "not measured", "n/a", "n/a"]
    assert "torch.compile: wrong" in t["compile_1x"]["reason"]
    e = _entry({"fused": 1e-3, "chain": 2.5e-3, "compile": 2e-3, "handwritten": 2e-3})
    evaluate_case(e, copy, "cpu")
    assert {t["status"] for t in e["targets"].values()} == {"not evaluated"}


# ------------------------------------------------------------------------------ the pipeline


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a machine without a GPU")
def test_bench_refuses_without_a_gpu(capsys, tmp_path) -> None:
    assert main(["bench", "--suite", "smoke", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no" in err and "CUDA GPU" in err and "--device cpu" in err
    assert not (tmp_path / "out").exists()


def test_bench_bad_options_exit_2(capsys, tmp_path) -> None:
    assert main(["bench", "--suite", "nope", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "unknown suite 'nope'" in capsys.readouterr().err
    assert main(["bench", "--baselines", "chain,magic", "--device", "cpu"]) == 2
    assert "--baselines: unknown baseline 'magic'" in capsys.readouterr().err
    assert main(["bench", "--trials", "0", "--device", "cpu"]) == 2
    with pytest.raises(BenchError, match="no case of spec 'layernorm'"):
        run_bench("smoke", None, trials=1, device="cpu", only=["layernorm"])


def test_bench_cpu_smoke_runs_the_whole_pipeline(capfd, tmp_path) -> None:
    out = tmp_path / "out"
    rc = main(["bench", "--suite", "smoke", "--device", "cpu", "--trials", "2", "--baselines", "chain,eager,handwritten",
               "--out", str(out)])
    captured = capfd.readouterr()  # the measurement worker's stderr too
    assert rc == 0, captured.err
    assert "RuntimeWarning" not in captured.err  # the interpreter's, about lanes whose values are discarded
    results = json.loads((out / "bench_smoke.json").read_text())
    assert results["suite"] == "smoke" and results["gpu"] is False and results["timing_label"] == CPU_LABEL
    assert {"torch", "triton", "python"} <= set(results["versions"]) and results["date"][:2] == "20"
    assert "interpreter" in results["device"]["device_name"] and results["copy_bandwidth"]["bytes_per_s"] > 0
    assert [c["spec"] for c in results["cases"]] == [c["spec"] for c in SUITES["smoke"]]
    for c in results["cases"]:
        v = c["variants"]
        assert set(v) == {"fused", "chain", "eager", "handwritten"}
        assert v["fused"]["status"] == "ok" and v["fused"]["check"]["passed"], v["fused"]
        assert v["fused"]["timing"]["clock"] == CPU_LABEL and c["tuning"]["measurer"] == "cuda-interpreter"
        assert v["eager"]["status"] == "ok" and v["eager"]["check"]["passed"]
        assert v["chain"]["status"] in ("ok", "wrong")  # fp32 attention sits at the fp32 tolerance (README)
        assert v["handwritten"]["status"] == ("none" if c["spec"] == "moe_routing" else "ok")
        assert c["shape"] != c["suite_shape"]  # reduced: tiny shapes in the interpreter
        for t in c["targets"].values():
            assert t["status"] in ("n/a", "not evaluated", "not measured")  # never met/missed off a GPU
        assert c["targets"]["compile_1x"]["status"] == "not measured"
        assert c["speedup"]["eager"] == pytest.approx(v["eager"]["time_ms"] / v["fused"]["time_ms"])
    md = (out / "bench_smoke.md").read_text()
    assert CPU_LABEL in md and "| case | dtype | fused (strategy) ms |" in md and "## Targets" in md
    assert md in captured.out
    png = (out / "bench_smoke.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(str(out / "bench_smoke.png")).shape[0] > 100


def test_torch_compile_baseline_runs_on_cpu() -> None:
    """Inductor compiles the generic torch function (once, tiny shape) and passes the check."""
    spec, d = loaded("safe_softmax")
    shape = {"m": 3, "n": 40}
    with WorkerProcess("cpu") as worker:
        r = worker.call("variant", {"problem": problem_payload(make_problem(spec, shape, {"x": "float32"}), d),
                                    "variant": {"kind": "compile"},
                                    "timing": TimingSettings(cpu_warmup=0, cpu_reps=1).to_dict()}, timeout_s=300)
    assert r.ok, r.error
    assert r.value["check"]["passed"] and r.value["check"]["max_rel_err"] < 1e-5 and r.value["time_ms"] > 0


def test_writers_render_gpu_results(tmp_path) -> None:
    """Markdown and PNG from a GPU-shaped result (hand-made entries; nothing here is a measurement)."""
    copy = {"bytes_per_s": 3e12}
    cases = []
    for name, times in (("a", {"fused": 1.0, "chain": 2.5, "compile": 0.8, "eager": 3.0}),
                        ("b", {"fused": 2.0, "chain": 2.2, "compile": 2.4, "eager": 9.0, "handwritten": 1.9})):
        e = _entry(times, hand="handwritten" in times)
        e.update(id=name, spec=name, shape={"n": 8}, suite_shape={"n": 8}, dtype={"x": "float16"},
                 tuning={"strategy": "streaming_fused"})
        evaluate_case(e, copy, "cuda")
        cases.append(e)
    results = {"suite": "paper", "gpu": True, "device": {"device_name": "GPU"}, "versions": {"torch": "x"},
               "date": "2030-01-01", "timing_label": "GPU", "target": "h100", "copy_bandwidth": copy,
               "settings": {"trials": 1}, "cases": cases, "summary": summarize_targets(cases)}
    paths = write_outputs(results, tmp_path)
    md = paths["markdown"].read_text()
    assert "| a | float16 | 1 (streaming_fused) | 2.5 | 3 | 0.8 | none | 2.5x | 0.8x | - |" in md
    assert "met (2.50x)" in md and "**missed** (0.80x)" in md and CPU_LABEL not in md
    assert json.loads(paths["json"].read_text())["cases"][1]["targets"]["handwritten_0.9x"]["status"] == "met"
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    assert Path(paths["png"]).stat().st_size > 1000
