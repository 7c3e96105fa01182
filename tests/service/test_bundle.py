"""Kernel bundles (service/bundle.py): made, verified, loaded and run against the float64 reference.

Every catalog spec goes through make_bundle -> JSON bytes -> verify -> load -> run (Triton's
interpreter) -> compare with the reference, in the spec's own names. Tampering with any field
breaks verification; bad inputs get errors naming the input; other sizes run within the
bundle's size_limits and are refused beyond them.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.support.catalog import load_catalog

from fuser_core.canonical import canonical_json, spec_hash
from fuser_core.codegen.module import output_dtypes
from fuser_core.codegen.plan import default_config, loop_axis
from fuser_core.derive import derive_cascade
from fuser_core.errors import SpecError
from fuser_core.merged import input_to_storage, to_logical, to_storage
from fuser_core.paged import to_pages
from fuser_core.problem import make_problem, normalize_dtype
from fuser_core.reference import bind_shape, evaluate, random_inputs
from fuser_core.runner import INEXACT_TOLERANCE, TOLERANCE, bind_dtypes, choose_strategy, compare, rel_err, to_torch
from fuser_core.spec import load_spec
from service.bundle import (
    BUNDLE_FORMAT,
    BundleError,
    bundle_sha256,
    canonical_bytes,
    load_bundle,
    verify_bundle,
)
from service.bundle_maker import make_bundle
from tests.support.local_kernels import MEASURED

# masked-off lanes of a tile compute on fill values (0 / 0, inf - inf); they are never stored
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

CATALOG = load_catalog()


@functools.cache
def loaded(name: str):
    spec = load_spec(CATALOG[name])
    return spec, derive_cascade(spec)


def small_shape(name: str, axis_size: int = 37, lane: int = 3, inner: int = 5) -> dict[str, int]:
    """Tiny sizes, never a multiple of a tile: every tile edge is masked."""
    spec, _ = loaded(name)
    axis, inners = loop_axis(spec)
    shape = {}
    for d in spec.dims:
        step = next((s for s in spec.steps if s.as_dim == d), None)
        if step is not None:
            shape[d] = step.k
        elif d == axis:
            shape[d] = 19 if inners else axis_size
        elif d in inners:
            shape[d] = inner
        elif inners and d in ("b", "h"):
            shape[d] = 1
        else:
            shape[d] = lane
    return bind_shape(spec, shape)


def bundle_for(name: str, shape=None, strategy=None, config=None, dtype="float32", measured=MEASURED) -> dict:
    spec, derivation = loaded(name)
    shape = shape or small_shape(name)
    strategy = strategy or choose_strategy(spec, derivation, shape)
    config = config or default_config(spec, derivation, strategy, shape).to_dict()
    return make_bundle(make_problem(spec, shape, dtype), target="h100", strategy=strategy, config=config,
                       measured=measured)


def check_against_reference(spec, derivation, strategy, kernel, shape, dtype="float32", seed=0) -> None:
    """Run ``kernel`` on random inputs and compare every output with the float64 reference."""
    dtypes = bind_dtypes(spec, dtype)
    bound = bind_shape(spec, shape)
    # the caller's tensors (a merged dim as its parts, a per-channel weight as such); the kernels' logical ones
    user = {n: input_to_storage(spec, n, a, bound)
            for n, a in random_inputs(spec, shape, np.random.default_rng(seed), dtypes).items()}
    arrays = {n: to_logical(spec, n, a, bound) for n, a in user.items()}
    tensors = to_torch(user, dtypes, "cpu")
    # a paged KV cache as a server passes it: pages and a table (n is then the table's width in keys)
    pages, tables = to_pages(spec, {n: t for n, t in tensors.items() if spec.input(n).paged is not None}, bound)
    outputs = kernel({**tensors, **pages, **tables})
    reference = {p: to_storage(spec, spec.step(p.split(".")[0]).dims, r, bound)
                 for p, r in evaluate(spec, shape, arrays).items()}
    assert set(outputs) == set(reference)
    for part, ref in reference.items():
        assert tuple(outputs[part].shape) == ref.shape, part
    stores = output_dtypes(spec, dtypes)
    if strategy in ("streaming_fused", "split_fused") and not derivation.exact:  # fp8 casts with running values
        errors = {p: rel_err(outputs[p].float().numpy(), ref, 1.0) for p, ref in reference.items()}
        assert max(errors.values()) <= INEXACT_TOLERANCE, errors
    else:
        errors = compare(spec, outputs, reference, stores)
        for part, err in errors.items():
            assert err <= TOLERANCE[stores[part]], (part, err)


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_catalog_roundtrip_matches_reference(name):
    spec, derivation = loaded(name)
    shape = small_shape(name)
    bundle = bundle_for(name, shape)
    # what a server stores and serves: the canonical bytes; a client parses them back
    served = json.loads(canonical_bytes(bundle))
    verify_bundle(served)
    assert served == bundle
    assert served["format"] == BUNDLE_FORMAT
    assert served["spec_hash"] == spec_hash(spec)
    assert served["sha256"] == bundle_sha256(served)
    for field in ("spec", "shape", "dtype", "target", "strategy", "config", "triton_source", "measured", "derivation"):
        assert field in served
    assert served["measured"] == MEASURED
    assert served["derivation"]["certificate"]["holds"] is True
    kernel = load_bundle(served, spec=spec)
    assert kernel.shape == shape
    check_against_reference(spec, derivation, served["strategy"], kernel, shape)


def test_per_input_dtypes_with_fp8_weights():
    """fp8_quant_gemm with fp16 activations and fp8 weights: the dtype map is kept, the inputs' dtypes checked."""
    spec, derivation = loaded("fp8_quant_gemm")
    dtype = {"a": "float16", "w": "float8_e4m3fn", "w_scale": "float32"}
    shape = small_shape("fp8_quant_gemm")
    bundle = bundle_for("fp8_quant_gemm", shape, strategy="multi_pass", dtype=dtype)
    assert bundle["dtype"] == dtype and bundle["inputs"]["w"]["dtype"] == "float8_e4m3fn"
    kernel = load_bundle(bundle, spec=spec)
    check_against_reference(spec, derivation, "multi_pass", kernel, shape, dtype=dtype)
    # the error says what to ask for to run these tensors: their dtype map (issue 37, 12)
    with pytest.raises(BundleError, match=r"inputs.w: dtype float32, but this kernel was generated for float8_e4m3fn; "
                                          r'for these tensors ask for the dtype map \{"a": "float16", "w": "float32", '
                                          r'"w_scale": "float32"\}'):
        dtypes = bind_dtypes(spec, {**dtype, "w": "float32"})
        kernel(to_torch(random_inputs(spec, shape, np.random.default_rng(0), dtypes), dtypes, "cpu"))


def test_bundle_speaks_canonical_names_and_callers_get_their_own():
    """Renaming dims and steps gives the same bundle; each caller gets outputs in its names and dim order
    (a runtime param keeps its name: it is the call's keyword, eps=...)."""
    renamed = load_spec({
        "foldwise": 1, "name": "my_norm",
        "inputs": {"x": {"dims": ["row", "col"]}, "gamma": {"dims": ["col"]}, "beta": {"dims": ["col"]}},
        "params": {"eps": {"runtime": "float", "default": 1e-05, "positive": True}},
        "steps": [{"name": "mu", "reduce": "sum", "over": "col", "expr": "x / size(col)"},
                  {"name": "sigma2", "reduce": "sum", "over": "col", "expr": "(x - mu)**2 / size(col)"},
                  {"name": "out", "expr": "(x - mu) * rsqrt(sigma2 + eps) * gamma + beta"}],
        "outputs": ["out"]})
    original, _ = loaded("layernorm")
    assert spec_hash(renamed) == spec_hash(original)
    assert renamed.output_parts == ("out",)
    shape = {"row": 3, "col": 37}
    b_orig = bundle_for("layernorm", {"t": 3, "c": 37})
    b_renamed = make_bundle(make_problem(renamed, shape, "float32"), target="h100", strategy=b_orig["strategy"],
                            config={**b_orig["config"], "blocks": {"col": b_orig["config"]["blocks"]["d0"]}},
                            measured=MEASURED)
    assert b_renamed == b_orig  # one bundle per spec_hash, whoever asked
    # layernorm's canonical dims put c first (inputs sorted: beta, gamma, x), so y is (c, t) there
    assert b_orig["outputs"]["s2"]["dims"] == ["d0", "d1"] and b_orig["shape"] == {"d0": 37, "d1": 3}
    kernel = load_bundle(b_orig, spec=renamed)
    assert kernel.shape == shape and kernel.output_parts == ("out",)
    check_against_reference(renamed, derive_cascade(renamed), b_orig["strategy"], kernel, shape)
    # the canonical kernel itself: canonical part names and dim order
    canon = load_bundle(b_orig)
    dtypes = bind_dtypes(original, "float32")
    arrays = random_inputs(original, {"t": 3, "c": 37}, np.random.default_rng(1), dtypes)
    out = canon({**to_torch(arrays, dtypes, "cpu"), "eps": 1e-05})  # the canonical spec has no default (no part of a kernel)
    assert set(out) == {"s2"} and tuple(out["s2"].shape) == (37, 3)
    mine = kernel(to_torch(arrays, dtypes, "cpu"))["out"]
    assert torch.equal(out["s2"].T, mine)


def test_canonical_spec_gives_the_same_bundle():
    spec, _ = loaded("attention")
    canon = load_spec(canonical_json(spec), printed=True)
    shape = small_shape("attention")
    b1 = bundle_for("attention", shape)
    from fuser_core import canonical_shape

    b2 = make_bundle(make_problem(canon, canonical_shape(spec, shape), "float32"), target="H100",
                     strategy=b1["strategy"], config=b1["config"], measured=MEASURED)
    assert b2 == b1


def test_make_bundle_is_deterministic_and_fills_versions():
    b1 = bundle_for("safe_softmax")
    b2 = bundle_for("safe_softmax")
    assert b1["sha256"] == b2["sha256"]
    b3 = bundle_for("safe_softmax", measured={"time_ms": 1.5, "measurer": "cuda"})
    assert b3["measured"]["time_ms"] == 1.5
    assert {"triton_version", "torch_version", "date"} <= set(b3["measured"])
    assert b3["measured"]["torch_version"] == torch.__version__
    assert b3["sha256"] != b1["sha256"]
    assert normalize_dtype(loaded("safe_softmax")[0], {"x": "float16"}) == "float16"


# ----------------------------------------------------------------------------- tampering

TAMPERS = {
    "triton_source": lambda b: b.__setitem__("triton_source", b["triton_source"] + "\n# changed\n"),
    "source_constant": lambda b: b.__setitem__("triton_source",
                                               re.sub(r"num_warps=(\d+)", lambda m: f"num_warps={2 * int(m[1])}",
                                                      b["triton_source"], count=1)),
    "spec": lambda b: b["spec"]["steps"][0].__setitem__("expr", "x * 2"),
    "spec_hash": lambda b: b.__setitem__("spec_hash", "0" * 64),
    "shape": lambda b: b["shape"].__setitem__(next(iter(b["shape"])), 1000),
    "dtype": lambda b: b.__setitem__("dtype", "float16"),
    "target": lambda b: b.__setitem__("target", "a100"),
    "strategy": lambda b: b.__setitem__("strategy", "multi_pass"),
    "config": lambda b: b["config"].__setitem__("num_warps", 2 * b["config"]["num_warps"]),
    "measured": lambda b: b["measured"].__setitem__("time_ms", 0.001),
    "derivation": lambda b: b["derivation"].__setitem__("fusible", not b["derivation"]["fusible"]),
    "inputs": lambda b: b["inputs"]["x"].__setitem__("dtype", "float16"),
    "size_limits": lambda b: b.__setitem__("size_limits", {"d1": 1 << 20}),
    "format": lambda b: b.__setitem__("format", "foldwise-bundle/2"),
    "extra_field": lambda b: b.__setitem__("note", "hello"),
    "removed_field": lambda b: b.pop("derivation"),
    "sha256": lambda b: b.__setitem__("sha256", "f" * 64),
    "no_sha256": lambda b: b.pop("sha256"),
}


@pytest.fixture(scope="module")
def softmax_bundle():
    return bundle_for("safe_softmax")


@pytest.mark.parametrize("how", sorted(TAMPERS))
def test_tampered_bundle_fails_verification(softmax_bundle, how):
    bundle = copy.deepcopy(softmax_bundle)
    verify_bundle(bundle)
    TAMPERS[how](bundle)
    assert bundle != softmax_bundle, "the tamper changed nothing"
    with pytest.raises(BundleError):
        verify_bundle(bundle)
    with pytest.raises(BundleError):
        load_bundle(bundle)


def test_rehashed_bundle_with_foreign_import_is_refused(softmax_bundle):
    """A hash only proves integrity; the loader also refuses sources that are not ours in shape."""
    bundle = copy.deepcopy(softmax_bundle)
    bundle["triton_source"] = "import subprocess\n" + bundle["triton_source"]
    bundle["sha256"] = bundle_sha256(bundle)
    with pytest.raises(BundleError, match="imports 'subprocess'"):
        load_bundle(bundle)
    # imports nested in blocks of every kind are found too
    for nested in ("class K:\n    def f(self):\n        import socket\n",
                   "try:\n    pass\nexcept Exception:\n    import socket\nfinally:\n    pass\n",
                   "match 1:\n    case 1:\n        with open('x') as f:\n            if f:\n                pass\n"
                   "            else:\n                for i in []:\n                    pass\n"
                   "                else:\n                    import socket\n"):
        bundle["triton_source"] = nested + "def launch(inputs, shape):\n    return {}\n"
        bundle["sha256"] = bundle_sha256(bundle)
        with pytest.raises(BundleError, match="imports 'socket'"):
            verify_bundle(bundle)
    bundle["triton_source"] = "def launch(inputs, shape):\n    from os import path as p\n    return {}\n"
    bundle["sha256"] = bundle_sha256(bundle)
    verify_bundle(bundle)  # from os import ... is allowed
    bundle["triton_source"] = "def nothing(:\n"
    bundle["sha256"] = bundle_sha256(bundle)
    with pytest.raises(BundleError, match="not valid Python"):
        verify_bundle(bundle)


def test_rehashed_bundle_must_be_consistent(softmax_bundle):
    """Extra fields the loader relies on are checked against the spec, not only hashed."""
    for field, value in (("inputs", {"x": {"dims": ["d0", "d1"], "dtype": "float16"}}),
                         ("outputs", {}), ("size_limits", {"zz": 4}), ("shape", {"d0": 3})):
        bundle = copy.deepcopy(softmax_bundle)
        bundle[field] = value
        bundle["sha256"] = bundle_sha256(bundle)
        with pytest.raises(BundleError, match=field):
            verify_bundle(bundle)


def test_non_json_values_are_refused():
    with pytest.raises(BundleError, match="not plain JSON"):
        bundle_for("safe_softmax", measured={"time_ms": float("nan"), "measurer": "model"})
    with pytest.raises(BundleError):
        verify_bundle("not a bundle")


# ----------------------------------------------------------------------------- inputs and sizes


def test_inputs_are_checked_before_launch(softmax_bundle):
    spec, _ = loaded("safe_softmax")
    kernel = load_bundle(softmax_bundle, spec=spec)
    (inp,) = spec.inputs
    m, n = (kernel.shape[d] for d in inp.dims)
    good = torch.randn(m, n)
    assert set(kernel(**{inp.name: good})) == set(spec.output_parts)
    cases = [
        ({}, "missing input 'x'"),
        ({inp.name: good, "w": good}, "unknown input 'w'"),
        ({inp.name: good.double()}, "dtype float64, but this kernel was generated for float32"),
        ({inp.name: good[0]}, "has 1 dims"),
        ({inp.name: good.numpy()}, "expected a torch.Tensor"),
    ]
    for given, message in cases:
        with pytest.raises(BundleError, match=message):
            kernel(given)
    with pytest.raises(BundleError, match="not both"):
        kernel({inp.name: good}, **{inp.name: good})


def test_inconsistent_sizes_are_refused():
    spec, _ = loaded("attention")
    kernel = load_bundle(bundle_for("attention"), spec=spec)
    shape = kernel.shape
    q = torch.randn(1, 1, shape["m"], shape["d"])
    k = torch.randn(1, 1, shape["n"], shape["d"] + 1)
    v = torch.randn(1, 1, shape["n"], shape["e"])
    with pytest.raises(BundleError, match="dim d has size"):
        kernel(q=q, k=k, v=v)


def test_other_sizes_run_within_size_limits():
    """A kernel tuned for one shape runs other lane counts and axis lengths correctly."""
    for name in ("safe_softmax", "attention", "moe_routing"):
        spec, derivation = loaded(name)
        bundle = bundle_for(name, small_shape(name))
        kernel = load_bundle(bundle, spec=spec)
        other = small_shape(name, axis_size=70, lane=5, inner=3)
        if name == "attention":
            other = {**other, "n": 23, "m": 2}
        assert other != kernel.shape
        check_against_reference(spec, derivation, bundle["strategy"], kernel, other, seed=2)
        exact = load_bundle(bundle, spec=spec, exact_shape=True)
        dtypes = bind_dtypes(spec, "float32")
        arrays = to_torch(random_inputs(spec, other, np.random.default_rng(0), dtypes), dtypes, "cpu")
        with pytest.raises(BundleError, match="not the tuned shape"):
            exact(arrays)


def test_sizes_beyond_a_whole_block_are_refused():
    spec, derivation = loaded("safe_softmax")
    shape = small_shape("safe_softmax")
    axis, _ = loop_axis(spec)
    bundle = bundle_for("safe_softmax", shape, strategy="row_resident")
    assert bundle["size_limits"] == {bundle_dim(spec, axis): 64}
    kernel = load_bundle(bundle, spec=spec)
    check_against_reference(spec, derivation, "row_resident", kernel, {**shape, axis: 64})
    dtypes = bind_dtypes(spec, "float32")
    big = {**shape, axis: 65}
    arrays = to_torch(random_inputs(spec, big, np.random.default_rng(0), dtypes), dtypes, "cpu")
    for _ in range(2):  # checked sizes are remembered (BundleKernel._checked); a refusal is not
        with pytest.raises(BundleError, match=f"dim {axis} = 65 is larger than 64"):
            kernel(arrays)
    # attention holds its inner axis d whole
    spec, _ = loaded("attention")
    kernel = load_bundle(bundle_for("attention"), spec=spec)
    assert kernel.size_limits == {"d": 8}
    shape = {**kernel.shape, "d": 9}
    dtypes = bind_dtypes(spec, "float32")
    arrays = to_torch(random_inputs(spec, shape, np.random.default_rng(0), dtypes), dtypes, "cpu")
    with pytest.raises(BundleError, match="dim d = 9 is larger than 8"):
        kernel(arrays)


def test_checked_sizes_are_remembered_within_a_bound(monkeypatch):
    """A warm call skips the size rules for sizes it has checked; the memo stays bounded."""
    from service.bundle import kernel as kernel_module

    monkeypatch.setattr(kernel_module, "CHECKED_SIZES_KEPT", 2)
    spec, derivation = loaded("safe_softmax")
    shape = small_shape("safe_softmax")
    axis, _ = loop_axis(spec)
    kernel = load_bundle(bundle_for("safe_softmax", shape), spec=spec)
    checks = []
    real = kernel._check_sizes
    monkeypatch.setattr(kernel, "_check_sizes", lambda sizes: checks.append(dict(sizes)) or real(sizes))
    dtypes = bind_dtypes(spec, "float32")
    for n in (5, 5, 6, 5, 7, 8):
        arrays = to_torch(random_inputs(spec, {**shape, axis: n}, np.random.default_rng(n), dtypes), dtypes, "cpu")
        kernel(arrays)
    assert [c[axis] for c in checks] == [5, 6, 7, 8]  # 5 again was remembered
    assert sorted(dict(k)[axis] for k in kernel._checked_sizes) == [7, 8]  # 7 found it full: cleared, then kept


def bundle_dim(spec, dim: str) -> str:
    from fuser_core.canonical import canonical_names

    return canonical_names(spec)[dim]


def test_for_spec_refuses_another_spec(softmax_bundle):
    other, _ = loaded("logsumexp")
    with pytest.raises(BundleError, match="spec_hash"):
        load_bundle(softmax_bundle, spec=other)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "unfused_chain"}, "strategy: 'unfused_chain' cannot be bundled"),
        ({"strategy": "row_resident", "config": {"blocks": {"n": 8}}}, "row_resident needs BLOCK_"),
        ({"config": {"blocks": {"zz": 8}}}, "config: blocks names unknown dim 'zz'"),
        ({"config": {"num_warps": 3}}, "config: num_warps"),
        ({"target": "tpu"}, "target: unknown target"),
        ({"measured": [1, 2]}, "measured: expected an object"),
        ({"problem": {"m": 3, "n": 37}}, "problem: expected a bound Problem"),
    ],
)
def test_make_bundle_errors_name_the_field(kwargs, message):
    spec, derivation = loaded("safe_softmax")
    args = {"problem": make_problem(spec, {"m": 3, "n": 37}, "float32"), "target": "h100",
            "strategy": "streaming_fused", "config": {"blocks": {"n": 8}}, "measured": MEASURED, **kwargs}
    with pytest.raises(BundleError, match=message):
        make_bundle(args.pop("problem"), **args)


@pytest.mark.parametrize(
    ("shape", "dtype", "message"),
    [({"m": 3, "n": 37}, "float128", "unknown dtype 'float128'"), ({"m": 3}, "float32", "shape.n: no size given")],
)
def test_a_problem_is_bound_before_a_bundle_is_made(shape, dtype, message):
    """A bad shape or dtype never reaches make_bundle: make_problem refuses it, naming the field."""
    spec, _ = loaded("safe_softmax")
    with pytest.raises(SpecError, match=message):
        make_problem(spec, shape, dtype)


def test_an_empty_batch_through_a_loaded_kernel_gives_empty_outputs_without_a_launch(monkeypatch):
    """Serving code calls with an empty batch: empty outputs in the caller's names and dtypes; an
    empty reduced axis gives the formula at the identities (logsumexp: -inf, torch's answer)."""
    import torch

    kernel = load_bundle(bundle_for("logsumexp"), spec=loaded("logsumexp")[0])
    monkeypatch.setattr(kernel._module, "launch", lambda *a: pytest.fail("launched for a zero-size problem"))
    out = kernel(x=torch.zeros(0, 37))
    assert out["lse"].shape == (0,) and out["lse"].dtype == torch.float32
    out = kernel(x=torch.zeros(3, 0))
    assert torch.equal(out["lse"], torch.logsumexp(torch.zeros(3, 0), -1))


def test_the_bundle_package_stays_light():
    """service.bundle is on an inference server's start-up path (service.client): importing it
    imports no derivation (sympy, SciPy, NumPy), no database layer and neither torch nor triton."""
    code = ("import sys, service.bundle; "
            "print(sorted(m for m in ('sympy', 'scipy', 'numpy', 'sqlalchemy', 'torch', 'triton') if m in sys.modules))")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
