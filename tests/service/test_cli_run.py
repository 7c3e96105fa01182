"""``foldwise run`` end to end, as a subprocess (docs/API.md): the random self-check report,
npz in / npz out by output name, and exit code 2 with a message for every bad argument."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]


def foldwise_run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "service.cli", "run", *map(str, args)],
        cwd=cwd or REPO, env=env, capture_output=True, text=True, timeout=300,
    )


@pytest.fixture(scope="module")
def softmax(catalog_dir: Path) -> Path:
    return catalog_dir / "safe_softmax.json"


def softmax_np(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


# ---------------------------------------------------------------------------------------------
# random self-check


def test_self_check_prints_report(softmax: Path) -> None:
    proc = foldwise_run(softmax, "--shape", "m=3,n=37", "--strategy", "split_fused",
                        "--config", '{"blocks": {"n": 8}, "split": 3}')
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["strategy"] == "split_fused"
    assert report["config"] == {"blocks": {"n": 8}, "num_stages": 2, "num_warps": 4, "split": 3}
    assert report["passed"] is True
    assert 0 <= report["max_rel_err"] <= 1e-4
    assert report["shape"] == {"m": 3, "n": 37}


def test_an_empty_shape_runs_cleanly(softmax: Path) -> None:
    """n = 0 (issue 37, 10): nothing is launched, the output is empty, and the accuracy families run
    at their own shapes (axis1 at n = 1) with the strategy those shapes pick: exit 0, no traceback."""
    r = foldwise_run(softmax, "--shape", "m=4,n=0")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    report = json.loads(r.stdout)
    assert report["strategy"] == "none" and report["passed"] and report["accuracy"]["passed"]
    assert {f["family"] for f in report["accuracy"]["families"]} >= {"axis1", "empty"}


def test_self_check_default_strategy_and_16bit(catalog_dir: Path) -> None:
    proc = foldwise_run(catalog_dir / "layernorm.json", "--shape", "t=2,c=19", "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["strategy"] in ("row_resident", "streaming_fused", "split_fused", "multi_pass")
    assert report["passed"] is True and report["max_rel_err"] <= 1e-2
    assert isinstance(report["config"], dict) and "blocks" in report["config"]


def test_self_check_fp8_dtype_map(catalog_dir: Path) -> None:
    dtype = json.dumps({"a": "float16", "w": "float8_e4m3fn", "w_scale": "float32"})
    proc = foldwise_run(catalog_dir / "fp8_quant_gemm.json", "--shape", "m=2,n=3,k=37", "--dtype", dtype,
                        "--strategy", "streaming_fused", "--config", '{"blocks": {"k": 8}}')
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["passed"] is True and report["exact"] is False
    assert report["dtype"] == {"a": "float16", "w": "float8_e4m3fn", "w_scale": "float32"}


# ---------------------------------------------------------------------------------------------
# --inputs / --out


def test_inputs_and_out_softmax(softmax: Path, tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((3, 37)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    proc = foldwise_run(softmax, "--shape", "m=3,n=37", "--inputs", tmp_path / "in.npz", "--out", tmp_path / "out.npz",
                        "--strategy", "streaming_fused", "--config", '{"blocks": {"n": 8}}')
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["strategy"] == "streaming_fused"
    assert summary["outputs"] == {"y": {"shape": [3, 37], "dtype": "float32"}}
    with np.load(tmp_path / "out.npz") as out:
        assert out.files == ["y"]
        np.testing.assert_allclose(out["y"], softmax_np(x), rtol=1e-5, atol=1e-7)


def test_out_dims_follow_the_inputs_order(tmp_path: Path) -> None:
    """Dims are ordered by first appearance in the inputs' dims: here n before m (a transposed softmax)."""
    spec = {
        "foldwise": 1, "name": "softmax_over_rows", "inputs": {"x": {"dims": ["n", "m"]}},
        "steps": [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
                  {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - mx)"},
                  {"name": "y", "expr": "exp(x - mx) / den"}],
        "outputs": ["y", "mx"],
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    x = np.random.default_rng(1).standard_normal((19, 3)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    proc = foldwise_run(tmp_path / "spec.json", "--shape", "m=3,n=19", "--inputs", tmp_path / "in.npz",
                        "--out", tmp_path / "out.npz")
    assert proc.returncode == 0, proc.stderr
    with np.load(tmp_path / "out.npz") as out:
        assert sorted(out.files) == ["mx", "y"]
        assert out["y"].shape == (19, 3) and out["mx"].shape == (3,)
        np.testing.assert_allclose(out["y"], softmax_np(x, axis=0), rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(out["mx"], x.max(axis=0))


def test_inputs_and_out_moe_routing(catalog_dir: Path, tmp_path: Path) -> None:
    logits = np.random.default_rng(2).standard_normal((4, 37)).astype(np.float32)
    np.savez(tmp_path / "in.npz", logits=logits)
    proc = foldwise_run(catalog_dir / "moe_routing.json", "--shape", "t=4,x=37", "--inputs", tmp_path / "in.npz",
                        "--out", tmp_path / "out.npz", "--strategy", "split_fused",
                        "--config", '{"blocks": {"x": 8}, "split": 3}')
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["outputs"]["gate.indices"]["dtype"] == "int32"
    with np.load(tmp_path / "out.npz") as out:
        assert sorted(out.files) == ["gate.indices", "gate.values"]
        values, indices = out["gate.values"], out["gate.indices"]
    p = softmax_np(logits)
    order = np.argsort(-p, axis=1, kind="stable")[:, :8]
    assert values.shape == indices.shape == (4, 8)  # (t, j): the `as` dim last
    assert indices.dtype == np.int32
    np.testing.assert_array_equal(indices, order)
    np.testing.assert_allclose(values, np.take_along_axis(p, order, axis=1), rtol=1e-5, atol=1e-7)


def test_inputs_16bit_outputs_written_as_float32(softmax: Path, tmp_path: Path) -> None:
    x = np.random.default_rng(3).standard_normal((2, 19)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    proc = foldwise_run(softmax, "--shape", "m=2,n=19", "--dtype", "float16", "--inputs", tmp_path / "in.npz",
                        "--out", tmp_path / "out.npz")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["outputs"]["y"]["dtype"] == "float16"
    with np.load(tmp_path / "out.npz") as out:
        np.testing.assert_allclose(out["y"], softmax_np(x.astype(np.float16)), rtol=1e-2, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# invalid arguments: exit 2, a message on stderr that names the problem


BAD_ARGS = {
    "bad-shape-syntax": (["--shape", "m=3,n=lots"], ["--shape", "n=lots"]),
    "bad-shape-no-equals": (["--shape", "m3,n=37"], ["--shape", "m3"]),
    "unknown-dim": (["--shape", "m=3,n=37,q=2"], ["'q'", "unknown dim"]),
    "missing-dim": (["--shape", "m=3"], ["n", "no size given"]),
    "negative-size": (["--shape", "m=-1,n=37"], ["--shape", "m=-1"]),  # 0 runs: empty outputs, no launch
    "bad-dtype": (["--shape", "m=3,n=37", "--dtype", "float128"], ["float128", "dtype"]),
    "bad-dtype-json": (["--shape", "m=3,n=37", "--dtype", '{"x": '], ["--dtype", "JSON"]),
    "dtype-unknown-input": (["--shape", "m=3,n=37", "--dtype", '{"z": "float16"}'], ["'z'"]),
    "bad-config-json": (["--shape", "m=3,n=37", "--config", "{blocks"], ["--config"]),
    "bad-config-block": (["--shape", "m=3,n=37", "--config", '{"blocks": {"n": 12}}'], ["--config", "power of two"]),
    "bad-config-field": (["--shape", "m=3,n=37", "--config", '{"tiles": 3}'], ["--config", "'tiles'"]),
    "bad-config-warps": (["--shape", "m=3,n=37", "--config", '{"num_warps": 3}'], ["--config", "num_warps"]),
    "config-unknown-dim": (["--shape", "m=3,n=37", "--config", '{"blocks": {"k": 8}}'], ["'k'"]),
    "strategy-invalid-for-shape": (
        ["--shape", "m=3,n=37", "--strategy", "row_resident", "--config", '{"blocks": {"n": 8}}'],
        ["row_resident", "BLOCK_n >= size(n)"]),
    "row-too-long": (["--shape", "m=1,n=70000", "--strategy", "row_resident"],
                     ["--strategy", "too long to keep resident"]),
    "split-without-split": (["--shape", "m=3,n=37", "--strategy", "split_fused", "--config", '{"split": 1}'],
                            ["split_fused", "split >= 2"]),
    "unknown-strategy": (["--shape", "m=3,n=37", "--strategy", "fastest"], ["fastest", "strategy"]),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGS))
def test_bad_arguments_exit_2(softmax: Path, case: str) -> None:
    args, needles = BAD_ARGS[case]
    proc = foldwise_run(softmax, *args)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    # a check that needs the derivation comes after the stage line saying it is deriving (issue 37, 8)
    said = [line for line in proc.stderr.splitlines() if not line.startswith("run: ")]
    assert said[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)
    assert proc.stdout == ""


def test_non_fusible_spec_refused_by_fused_strategy_exit_2(tmp_path: Path) -> None:
    spec = {
        "foldwise": 1, "name": "sin_cascade", "inputs": {"x": {"dims": ["m", "n"]}},
        "steps": [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
                  {"name": "s", "reduce": "sum", "over": "n", "expr": "sin(x * mx)"}],
        "outputs": ["s"],
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = foldwise_run(tmp_path / "spec.json", "--shape", "m=2,n=19", "--strategy", "streaming_fused")
    assert proc.returncode == 2 and "sin(mx*x)" in proc.stderr, proc.stderr


def test_missing_input_in_npz_exit_2(catalog_dir: Path, tmp_path: Path) -> None:
    np.savez(tmp_path / "in.npz", x=np.zeros((3, 19), np.float32), gamma=np.ones(19, np.float32))
    proc = foldwise_run(catalog_dir / "layernorm.json", "--shape", "t=3,c=19", "--inputs", tmp_path / "in.npz",
                        "--out", tmp_path / "out.npz")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "'beta'" in proc.stderr and "in.npz" in proc.stderr
    assert not (tmp_path / "out.npz").exists()


def test_unreadable_inputs_exit_2(softmax: Path, tmp_path: Path) -> None:
    (tmp_path / "in.npz").write_text("not an npz")
    proc = foldwise_run(softmax, "--shape", "m=3,n=19", "--inputs", tmp_path / "in.npz")
    assert proc.returncode == 2 and "--inputs" in proc.stderr, proc.stderr
    proc = foldwise_run(softmax, "--shape", "m=3,n=19", "--inputs", tmp_path / "absent.npz")
    assert proc.returncode == 2 and "--inputs" in proc.stderr, proc.stderr


WRONG_ARRAYS = {
    # (spec, shape, arrays): each disagrees with --shape or with the input's kind
    "too-wide": ("safe_softmax", "m=3,n=19", {"x": np.zeros((3, 20), np.float32)}),
    "too-few-rows": ("safe_softmax", "m=3,n=19", {"x": np.zeros((2, 19), np.float32)}),  # reads past the buffer
    "rank-1": ("safe_softmax", "m=3,n=19", {"x": np.zeros(57, np.float32)}),
    "index-input-as-float": ("cross_entropy", "t=2,v=19",
                             {"logits": np.zeros((2, 19), np.float32), "target": np.array([1.5, 2.0])}),
}


@pytest.mark.parametrize("case", sorted(WRONG_ARRAYS))
def test_input_array_disagreeing_with_shape_exit_2(catalog_dir: Path, tmp_path: Path, case: str) -> None:
    """An npz array whose shape (or kind) disagrees with --shape is bad input: exit 2 naming the
    input, never a kernel reading out of bounds, and no --out written."""
    name, shape, arrays = WRONG_ARRAYS[case]
    np.savez(tmp_path / "in.npz", **arrays)
    proc = foldwise_run(catalog_dir / f"{name}.json", "--shape", shape, "--inputs", tmp_path / "in.npz",
                        "--out", tmp_path / "out.npz")
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-300:], proc.stderr[-1500:])
    bad = "target" if case == "index-input-as-float" else "x"
    assert f"{bad}" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out.npz").exists()
