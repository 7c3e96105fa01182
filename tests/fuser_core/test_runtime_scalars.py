"""Runtime scalars (issue 24, item 2): a param declared ``{"runtime": "float"}`` (eps, a scale, a
softcap) is a kernel argument passed at call time, not part of the spec's identity. One generated
module (one compiled kernel) serves every value; the reference evaluates with the value given."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fuser_core.canonical import canonical_json, spec_hash
from fuser_core.codegen.plan import BASELINE, STRATEGIES, KernelConfig
from fuser_core.derive import derive_cascade
from fuser_core.errors import SpecError
from fuser_core.problem import ShapeError
from fuser_core.problem import bind_scalars
from fuser_core.reference import evaluate
from fuser_core.runner import interpreter_quiet, run
from fuser_core.spec import load_spec

ALL = (*STRATEGIES, BASELINE)


def rms_raw(eps=None) -> dict:
    return {
        "foldwise": 1, "name": "rmsnorm", "inputs": {"x": {"dims": ["t", "c"]}, "w": {"dims": ["c"]}},
        "params": {"eps": eps if eps is not None else {"runtime": "float", "default": 1e-6, "positive": True}},
        "steps": [{"name": "ms", "reduce": "sum", "over": "c", "expr": "x * x / size(c)"},
                  {"name": "y", "expr": "x * rsqrt(ms + eps) * w"}],
        "outputs": ["y"],
    }


def config(strategy: str, axis: str) -> KernelConfig | None:
    if strategy in ("row_resident", BASELINE):
        return None
    return KernelConfig({axis: 8}, split=3 if strategy == "split_fused" else 1)


# ---------------------------------------------------------------- the spec


@pytest.mark.parametrize("decl, field, words", [
    ({"runtime": "int"}, "params.eps.runtime", "'runtime' must be 'float'"),
    ({"runtime": "float", "defualt": 1}, "params.eps", "unknown field 'defualt'"),
    ({"runtime": "float", "positive": "yes"}, "params.eps.positive", "true or false"),
    ({"runtime": "float", "default": "x + 1"}, "params.eps.default", "unknown name 'x'"),
    ({"runtime": "float", "default": True}, "params.eps.default", "a number or an expression"),
    ({"runtime": "float", "default": -1e-6, "positive": True}, "params.eps.default", "declared positive"),
    ({"default": 1e-6}, "params.eps.runtime", "'runtime' must be 'float'"),
])
def test_invalid_runtime_params_name_the_field(decl, field, words):
    with pytest.raises(SpecError) as err:
        load_spec(rms_raw(decl))
    assert str(err.value).startswith(field + ":") and words in str(err.value)


def test_an_unused_runtime_param_is_refused():
    raw = rms_raw()
    raw["params"]["temp"] = {"runtime": "float"}
    with pytest.raises(SpecError, match=r"^params\.temp: a runtime param must be used"):
        load_spec(raw)


def test_the_identity_holds_that_eps_is_a_runtime_scalar_but_not_its_value():
    a = load_spec(rms_raw({"runtime": "float", "default": 1e-6, "positive": True}))
    b = load_spec(rms_raw({"runtime": "float", "default": 1e-5, "positive": True}))
    c = load_spec(rms_raw({"runtime": "float", "positive": True}))
    assert spec_hash(a) == spec_hash(b) == spec_hash(c)
    assert spec_hash(a) != spec_hash(load_spec(rms_raw(1e-6)))  # a constant is baked: another computation
    assert spec_hash(a) != spec_hash(load_spec(rms_raw({"runtime": "float", "default": 1e-6})))  # no sign assumed
    canon = json.loads(canonical_json(a))
    assert canon["params"] == {"eps": {"runtime": "float", "positive": True}}  # keeps its name: the call's keyword
    assert spec_hash(load_spec(canon)) == spec_hash(a)


def test_bind_scalars_defaults_and_errors():
    spec = load_spec(rms_raw())
    assert bind_scalars(spec, {"t": 2, "c": 3}, {}) == {"eps": 1e-6}
    assert bind_scalars(spec, {"t": 2, "c": 3}, {"eps": np.float32(1e-5)}) == {"eps": float(np.float32(1e-5))}
    with pytest.raises(ShapeError, match=r"^scalars\.eps: is declared positive"):
        bind_scalars(spec, {"t": 2, "c": 3}, {"eps": 0.0})
    for not_finite in (float("inf"), float("nan")):  # positive means a finite number > 0: the kernels assume it
        with pytest.raises(ShapeError, match=r"^scalars\.eps: is declared positive \(a finite number > 0\)"):
            bind_scalars(spec, {"t": 2, "c": 3}, {"eps": not_finite})
    with pytest.raises(ShapeError, match=r"^scalars\.eps: a runtime scalar takes one real number"):
        bind_scalars(spec, {"t": 2, "c": 3}, {"eps": "1e-5"})
    required = load_spec(rms_raw({"runtime": "float", "positive": True}))
    with pytest.raises(ShapeError, match=r"^scalars\.eps: this runtime scalar has no default"):
        bind_scalars(required, {"t": 2, "c": 3}, {})


# ---------------------------------------------------------------- kernels


@pytest.fixture(scope="module")
def rms():
    spec = load_spec(rms_raw())
    return spec, derive_cascade(spec)


@pytest.mark.parametrize("strategy", ALL)
def test_rmsnorm_matches_torch_for_each_eps_with_one_kernel(rms, strategy):
    spec, d = rms
    assert d.fusible
    rng = np.random.default_rng(0)
    # rows with a mean square near eps: the two values of eps give clearly different outputs
    x = (rng.standard_normal((5, 37)) * 3e-3).astype(np.float32)
    w = rng.standard_normal(37).astype(np.float32)
    sources, outs = set(), []
    for eps in (1e-5, 1e-6):
        with interpreter_quiet():
            r = run(spec, {"t": 5, "c": 37}, "float32", {"x": x, "w": w, "eps": eps}, strategy=strategy,
                    config=config(strategy, "c"), derivation=d)
        want = torch.nn.functional.rms_norm(torch.from_numpy(x), (37,), torch.from_numpy(w), eps)
        torch.testing.assert_close(r.outputs["y"], want, rtol=1e-5, atol=1e-6)
        ref = evaluate(spec, {"t": 5, "c": 37}, {"x": x, "w": w, "eps": eps})["y"]
        np.testing.assert_allclose(r.outputs["y"].numpy(), ref, rtol=1e-5, atol=1e-6)
        sources.add(r.source)
        outs.append(r.outputs["y"])
        assert "scalar_eps" in r.source and "scalar_eps: tl.constexpr" not in r.source
    assert len(sources) == 1  # the same generated module (hence compiled kernel) for both values
    assert (outs[0] - outs[1]).abs().max() > 1e-2  # and the value did reach it


def test_the_default_is_used_when_the_call_gives_none(rms):
    spec, d = rms
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 9)) * 1e-3).astype(np.float32)
    w = np.ones(9, np.float32)
    with interpreter_quiet():
        r = run(spec, {"t": 2, "c": 9}, "float32", {"x": x, "w": w}, derivation=d)
    want = torch.nn.functional.rms_norm(torch.from_numpy(x), (9,), torch.from_numpy(w), 1e-6)
    torch.testing.assert_close(r.outputs["y"], want, rtol=1e-5, atol=1e-6)


def test_a_missing_scalar_without_default_is_an_error_naming_it():
    spec = load_spec(rms_raw({"runtime": "float", "positive": True}))
    x, w = np.ones((2, 3), np.float32), np.ones(3, np.float32)
    with pytest.raises(ShapeError, match=r"^scalars\.eps: this runtime scalar has no default"):
        run(spec, {"t": 2, "c": 3}, "float32", {"x": x, "w": w})


# ---------------------------------------------------------------- bundles and the torch op


@pytest.fixture(scope="module")
def rms_kernel(rms):
    from fuser_core.codegen.plan import default_config
    from fuser_core.problem import make_problem
    from service.bundle import load_bundle
    from service.bundle_maker import make_bundle

    spec, d = rms
    shape = {"t": 3, "c": 37}
    measured = {"time_ms": 0.01, "measurer": "model", "predicted": True, "device": None,
                "triton_version": "x", "torch_version": "y", "date": "2025-01-01T00:00:00+00:00"}
    bundle = make_bundle(make_problem(spec, shape, "float32"), target="h100", strategy="row_resident",
                         config=default_config(spec, d, "row_resident", shape).to_dict(), measured=measured)
    assert bundle["spec"]["params"] == {"eps": {"runtime": "float", "positive": True}}
    return load_bundle(bundle, spec=spec)


def rms_args(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(3, 37, generator=g) * 3e-3), torch.randn(37, generator=g)


def test_bundle_kernel_takes_eps_at_call_time(rms_kernel):
    from service.bundle import BundleError

    x, w = rms_args()
    assert rms_kernel.scalar_names == ("eps",)
    for eps in (1e-5, 1e-6):
        want = torch.nn.functional.rms_norm(x, (37,), w, eps)
        torch.testing.assert_close(rms_kernel(x=x, w=w, eps=eps)["y"], want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rms_kernel({"x": x, "w": w, "eps": eps})["y"], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rms_kernel(x=x, w=w)["y"], torch.nn.functional.rms_norm(x, (37,), w, 1e-6),
                               rtol=1e-5, atol=1e-6)  # the caller's spec's default
    with pytest.raises(BundleError, match=r"^scalars\.eps: is declared positive"):
        rms_kernel(x=x, w=w, eps=-1.0)
    with pytest.raises(BundleError, match=r"^scalars\.eps: a runtime scalar takes one real number"):
        rms_kernel(x=x, w=w, eps="1e-5")


def test_a_scalar_without_default_must_be_passed_to_the_bundle_kernel(rms_kernel):
    from service.bundle import BundleError

    required = load_spec(rms_raw({"runtime": "float", "positive": True}))
    k = rms_kernel.for_spec(required)  # the same bundle: the default is no part of its identity
    x, w = rms_args()
    with pytest.raises(BundleError, match=r"^scalars\.eps: this runtime scalar has no default"):
        k(x=x, w=w)
    torch.testing.assert_close(k(x=x, w=w, eps=1e-5)["y"], torch.nn.functional.rms_norm(x, (37,), w, 1e-5),
                               rtol=1e-5, atol=1e-6)


def test_the_torch_op_takes_eps(rms_kernel):
    from service.client.torch_ops import foldwise_op

    op = foldwise_op(rms_kernel)
    x, w = rms_args(1)
    for eps in (1e-5, 1e-6):
        want = torch.nn.functional.rms_norm(x, (37,), w, eps)
        torch.testing.assert_close(op(x=x, w=w, eps=eps)["y"], want, rtol=1e-5, atol=1e-6)
        out = {"y": torch.empty(3, 37)}
        op(x=x, w=w, eps=eps, out=out)
        torch.testing.assert_close(out["y"], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(op(x=x, w=w)["y"], torch.nn.functional.rms_norm(x, (37,), w, 1e-6), rtol=1e-5, atol=1e-6)
    meta = op(x=x.to("meta"), w=w.to("meta"), eps=1e-5)["y"]  # the fake kernel takes the scalar too
    assert meta.shape == (3, 37) and meta.device.type == "meta"
