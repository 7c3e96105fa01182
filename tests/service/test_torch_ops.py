"""The torch op (service/client/torch_ops.py; issue 24, item 4): ``torch.ops.foldwise.run`` / ``run_out``.

Kernels are made in-process from catalog specs (tests/service/test_bundle.py's helpers: make_bundle,
then load_bundle, no server) and run through Triton's interpreter. The op must give what the
kernel gives, match the float64 reference, write into out= tensors (checked, errors naming the
output), give shapes and dtypes on meta tensors, return outputs contiguous in the caller's dim
order without a copy, and compile under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch
from tests.service.test_bundle import MEASURED, bundle_for, check_against_reference, loaded, small_shape

from fuser_core.codegen.plan import default_config
from fuser_core.derive import derive_cascade
from fuser_core.merged import input_to_storage
from fuser_core.problem import bind_shape, make_problem
from fuser_core.reference import random_inputs
from fuser_core.runner import bind_dtypes, to_torch
from fuser_core.spec import load_spec
from service.bundle import BundleError, BundleKernel, load_bundle
from service.bundle_maker import make_bundle
from service.client.torch_ops import foldwise_op, kernel_key, registered_kernel

# masked-off lanes of a tile compute on fill values (0 / 0, inf - inf); they are never stored
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

RMS_SHAPE = {"t": 3, "c": 37}  # rmsnorm's canonical y is (c, t): the case that came back with strides (1, 3)
# attention is made at small_shape (b = h = 1) and run at 2 batches and heads (any b, h: size_limits),
# so that [b, s, h, d] storage viewed as [b, h, s, d] is really strided
ATTN = {"b": 2, "h": 2, "m": 3, "n": 19, "d": 5, "e": 3}


def kernel(name: str, shape=None) -> BundleKernel:
    spec, _ = loaded(name)
    return load_bundle(bundle_for(name, shape), spec=spec)


@pytest.fixture(scope="module")
def rms() -> BundleKernel:
    return kernel("rmsnorm", RMS_SHAPE)


@pytest.fixture(scope="module")
def attn() -> BundleKernel:
    return kernel("attention")


def rms_inputs(t=3, c=37, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(t, c, generator=g).to(device), "w": torch.randn(c, generator=g).to(device)}


def attn_inputs(seed=0):
    """q, k, v as Hugging Face hands them: [b, s, h, d] storage viewed as [b, h, s, d] (strided, no copy)."""
    s = ATTN
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s["b"], s["m"], s["h"], s["d"], generator=g).transpose(1, 2)
    k = torch.randn(s["b"], s["n"], s["h"], s["d"], generator=g).transpose(1, 2)
    v = torch.randn(s["b"], s["n"], s["h"], s["e"], generator=g).transpose(1, 2)
    return {"q": q, "k": k, "v": v}


def rms_reference(x, w, eps=1e-6):
    x, w = x.double(), w.double()
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def attention_reference(q, k, v):
    q, k, v = q.double(), k.double(), v.double()
    p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return p @ v


def close(got, ref, rtol=1e-5):
    """Normwise against a float64 reference."""
    return float((got.double() - ref).abs().max() / ref.abs().max()) <= rtol


# ----------------------------------------------------------------------------- results


@pytest.mark.parametrize("name", ["rmsnorm", "attention"])
def test_op_matches_the_kernel_and_the_float64_reference(name):
    spec, derivation = loaded(name)
    shape = RMS_SHAPE if name == "rmsnorm" else small_shape(name)
    k = kernel(name, shape)
    op = foldwise_op(k)
    # the kernel's own accuracy check, through the op (it takes the inputs dict as the kernel does)
    check_against_reference(spec, derivation, k.strategy, op, shape)
    inputs = rms_inputs() if name == "rmsnorm" else attn_inputs()
    got = op(**inputs)
    direct = k(**inputs)
    assert set(got) == set(direct) == set(spec.output_parts)
    for part in got:
        assert torch.equal(got[part], direct[part]), part
    ref = rms_reference(**inputs) if name == "rmsnorm" else attention_reference(**inputs)
    assert close(got[spec.output_parts[0]], ref)


def test_strided_inputs_reach_the_kernel_without_a_copy_and_outputs_are_written_in_place(attn, monkeypatch):
    """The launcher gets the caller's strided q/k/v themselves, and writes the output tensor the
    op returns (a view of it), so neither side is copied."""
    inputs = attn_inputs()
    seen = {}
    launch = attn._module.launch

    def spy(tensors, shape, out=None, scalars=None):
        seen["inputs"] = {n: t.data_ptr() for n, t in tensors.items()}
        seen["out"] = {p: t.data_ptr() for p, t in out.items()}
        return launch(tensors, shape, out=out, scalars=scalars)

    monkeypatch.setattr(attn._module, "launch", spy)
    o = foldwise_op(attn)(**inputs)["o"]
    assert not inputs["q"].is_contiguous()
    assert seen["inputs"] == {n: t.data_ptr() for n, t in inputs.items()}
    assert list(seen["out"].values()) == [o.data_ptr()]
    assert o.is_contiguous()
    assert close(o, attention_reference(**inputs))


def test_outputs_are_contiguous_in_the_callers_dim_order(rms, attn):
    x, w = rms_inputs().values()
    for y in (rms(x=x, w=w)["y"], foldwise_op(rms)(x=x, w=w)["y"]):
        assert tuple(y.shape) == (3, 37) and y.stride() == (37, 1)  # was (1, 3): a transposed view
    assert rms.output_dims == {"y": ("t", "c")}
    o = foldwise_op(attn)(**attn_inputs())["o"]
    assert o.is_contiguous() and attn.output_dims == {"o": ("b", "h", "m", "e")}


@pytest.mark.parametrize("name", ["rmsnorm", "layernorm", "group_norm", "attention"])
def test_the_launchers_own_layout_is_the_one_callers_hand_it(name, monkeypatch):
    """A catalog caller's contiguous outputs, seen in the bundle's canonical dim order, have the
    strides the launcher's own allocation gives: what the server tunes and compiles its cubins
    for (Triton specialises on strides), so the served kernel is the one called."""
    spec, _ = loaded(name)
    shape = small_shape(name)
    k = kernel(name, shape)
    dtypes = bind_dtypes(spec, "float32")
    inputs = to_torch({n: input_to_storage(spec, n, a, shape)
                       for n, a in random_inputs(spec, shape, np.random.default_rng(0), dtypes).items()}, dtypes, "cpu")
    handed = {}
    launch = k._module.launch

    def spy(tensors, canonical_shape, out=None, scalars=None):
        handed.update({p: t.stride() for p, t in out.items()})
        own = launch(tensors, canonical_shape, scalars=scalars)
        assert {p: t.stride() for p, t in own.items()} == handed
        return launch(tensors, canonical_shape, out=out, scalars=scalars)

    monkeypatch.setattr(k._module, "launch", spy)
    for part, t in k(inputs).items():
        assert t.is_contiguous(), part
    assert handed


def test_a_renamed_spec_gets_its_own_dim_order_contiguous():
    """The same bundle for a spec listing w first: its y is (c, t), contiguous in that order."""
    renamed = load_spec({"foldwise": 1, "name": "norm_cw", "inputs": {"w": {"dims": ["c"]}, "x": {"dims": ["t", "c"]}},
                         "params": {"eps": {"runtime": "float", "default": 1e-6, "positive": True}},
                         "steps": [{"name": "ms", "reduce": "sum", "over": "c", "expr": "x * x / size(c)"},
                                   {"name": "y", "expr": "x * rsqrt(ms + eps) * w"}], "outputs": ["y"]})
    rms = kernel("rmsnorm", RMS_SHAPE)
    mine = rms.for_spec(renamed)
    x, w = rms_inputs().values()
    y = foldwise_op(mine)(x=x, w=w)["y"]
    assert tuple(y.shape) == (37, 3) and y.is_contiguous()
    assert torch.equal(y.T, rms(x=x, w=w)["y"])
    assert kernel_key(mine) != kernel_key(rms)  # its argument order and output layout differ


def test_a_launcher_without_out_is_run_then_copied_into_place():
    """A bundle made before launchers took out= (and runtime scalars: a spec without any, as such
    bundles are): same results, contiguous in the caller's order (rmsnorm's canonical y is (c, t))."""
    renamed = load_spec({"foldwise": 1, "name": "norm_old", "inputs": {"x": {"dims": ["t", "c"]}, "w": {"dims": ["c"]}},
                         "params": {"eps": 1e-6},
                         "steps": [{"name": "ms", "reduce": "sum", "over": "c", "expr": "x * x / size(c)"},
                                   {"name": "y", "expr": "x * rsqrt(ms + eps) * w"}], "outputs": ["y"]})
    config = default_config(renamed, derive_cascade(renamed), "row_resident", RMS_SHAPE).to_dict()
    bundle = make_bundle(make_problem(renamed, RMS_SHAPE, "float32"), target="h100", strategy="row_resident",
                         config=config, measured=MEASURED)
    new = load_bundle(bundle, spec=renamed)
    real = new._module.launch
    old = BundleKernel(bundle, types.SimpleNamespace(launch=lambda inputs, shape: real(inputs, shape)), True,
                       user=renamed)
    x, w = rms_inputs().values()
    y = old(x=x, w=w)["y"]
    assert y.stride() == (37, 1) and torch.equal(y, new(x=x, w=w)["y"])


def test_an_empty_batch_gives_empty_contiguous_outputs(rms):
    y = foldwise_op(rms)(**rms_inputs(t=0))["y"]
    assert tuple(y.shape) == (0, 37) and y.dtype == torch.float32


# ----------------------------------------------------------------------------- out=


def test_out_writes_into_the_given_tensors(rms):
    op = foldwise_op(rms)
    x, w = rms_inputs().values()
    want = rms(x=x, w=w)["y"]
    buf = torch.full((3, 37), float("nan"))
    got = op(x=x, w=w, out={"y": buf})
    assert got["y"] is buf and torch.equal(buf, want)
    # any strides: a transposed buffer is written through its view, a column slice too
    store = torch.full((37, 3), float("nan"))
    op(x=x, w=w, out={"y": store.T})
    assert torch.equal(store.T, want)
    wide = torch.zeros(3, 40)
    rms(x=x, w=w, out={"y": wide[:, 2:39]})
    assert torch.equal(wide[:, 2:39], want) and not wide[:, :2].any() and not wide[:, 39:].any()


@pytest.mark.parametrize("out, message", [
    ({"y": torch.empty(3, 36)}, r"out\.y: has shape \(3, 36\), but the output is \(t, c\) = \(3, 37\)"),
    ({"y": torch.empty(37, 3)}, r"out\.y: has shape \(37, 3\), but the output is \(t, c\) = \(3, 37\)"),
    ({"y": torch.empty(3, 37, dtype=torch.float16)}, r"out\.y: dtype float16, but the kernel writes float32"),
    ({"y": torch.empty(3, 37, device="meta")}, r"out\.y: on meta, but the inputs are on cpu"),
    ({"y": [0.0]}, r"out\.y: expected a torch\.Tensor, got list"),
    ({}, r"out: missing output 'y'; the kernel writes y"),
    ({"y": torch.empty(3, 37), "z": torch.empty(3)}, r"out: unknown output 'z'; the kernel writes y"),
])
def test_bad_out_tensors_are_refused_naming_the_output(rms, out, message):
    x, w = rms_inputs().values()
    for call in (rms, foldwise_op(rms)):
        with pytest.raises(BundleError, match=message):
            call(x=x, w=w, out=out)
    with pytest.raises(BundleError, match=r"out: expected a dict of output part -> tensor, got Tensor"):
        rms(x=x, w=w, out=torch.empty(3, 37))


# ----------------------------------------------------------------------------- meta and fake tensors


def test_meta_tensors_give_shapes_and_dtypes_and_launch_nothing(rms, attn, monkeypatch):
    monkeypatch.setattr(rms._module, "launch", lambda *a, **k: pytest.fail("a meta call launched"))
    meta = rms_inputs(t=5, c=64, device="meta")
    for call in (rms, foldwise_op(rms)):
        y = call(**meta)["y"]
        assert y.device.type == "meta" and tuple(y.shape) == (5, 64) and y.dtype == torch.float32
        assert y.stride() == (64, 1)
    foldwise_op(rms)(**meta, out={"y": torch.empty(5, 64, device="meta")})
    q = {n: t.to("meta") for n, t in attn_inputs().items()}
    o = foldwise_op(attn)(**q)["o"]
    s = ATTN
    assert o.device.type == "meta" and tuple(o.shape) == (s["b"], s["h"], s["m"], s["e"])


def test_the_fake_kernel_under_fake_tensor_mode(rms):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x, w = mode.from_tensor(torch.empty(7, 37)), mode.from_tensor(torch.empty(37))
        (y,) = torch.ops.foldwise.run(kernel_key(rms), [x, w])
        assert tuple(y.shape) == (7, 37) and y.dtype == torch.float32 and y.is_contiguous()


def test_opcheck(rms, attn):
    """torch's own checks of a custom op: schema, fake kernel against the real one, autograd
    registration, and AOT dispatch with dynamic shapes."""
    foldwise_op(rms)
    foldwise_op(attn)
    x, w = rms_inputs().values()
    torch.library.opcheck(torch.ops.foldwise.run.default, (kernel_key(rms), [x, w]))
    torch.library.opcheck(torch.ops.foldwise.run_out.default, (kernel_key(rms), [x, w], [torch.empty(3, 37)]))
    torch.library.opcheck(torch.ops.foldwise.run.default, (kernel_key(attn), list(attn_inputs().values())))


# ----------------------------------------------------------------------------- torch.compile


def qk_norm_attention(rms_op, attn_op):
    """Two Foldwise ops in one function: an RMSNorm over q's head dim (a QK-norm), then attention."""
    def f(q, k, v, w):
        b, h, m, d = q.shape
        qn = rms_op(x=q.reshape(b * h * m, d), w=w)["y"].reshape(b, h, m, d)
        return attn_op(q=qn, k=k, v=v)["o"] * 2.0
    return f


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compile_fullgraph_over_two_ops_compiles_and_matches(backend):
    torch._dynamo.reset()
    s = ATTN
    rms_op = foldwise_op(kernel("rmsnorm", {"t": s["b"] * s["h"] * s["m"], "c": s["d"]}))
    attn_op = foldwise_op(kernel("attention"))
    f = qk_norm_attention(rms_op, attn_op)
    inputs = attn_inputs()
    w = torch.randn(s["d"], generator=torch.Generator().manual_seed(3))
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    got = compiled(**inputs, w=w)
    assert torch.equal(got, f(**inputs, w=w))
    q = inputs["q"]
    qn = rms_reference(q.reshape(-1, s["d"]), w).reshape(q.shape)
    assert close(got, 2.0 * attention_reference(qn, inputs["k"], inputs["v"]))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph_with_out_tensors(rms, backend):
    """out= under torch.compile: functionalised by aot_eager (the mutation is written back)."""
    torch._dynamo.reset()
    op = foldwise_op(rms)

    def f(x, w, buf):
        op(x=x, w=w, out={"y": buf})
        return buf + 1.0

    x, w = rms_inputs().values()
    buf = torch.empty(3, 37)
    got = torch.compile(f, fullgraph=True, backend=backend)(x, w, buf)
    want = rms(x=x, w=w)["y"]
    assert torch.equal(buf, want) and torch.equal(got, want + 1.0)


def test_compile_with_dynamic_shapes_does_not_recompile_per_length(rms):
    torch._dynamo.reset()
    op = foldwise_op(rms)
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm

    compiled = torch.compile(lambda x, w: op(x=x, w=w)["y"] + 1.0, fullgraph=True, backend=backend, dynamic=True)
    for t in (3, 5, 11):
        x, w = rms_inputs(t=t, seed=t).values()
        assert torch.equal(compiled(x, w), rms(x=x, w=w)["y"] + 1.0)
    assert len(frames) == 1


def test_size_checks_trace_under_dynamo():
    """The issue's failure: bind_shape's generator expressions stopped fullgraph before any Triton
    code. A merged dim's parts (group_norm) take the most of them."""
    torch._dynamo.reset()
    spec, _ = loaded("group_norm")
    shape = dict(small_shape("group_norm"))

    def f(x):
        return x * len(bind_shape(spec, shape, allow_empty=True))

    got = torch.compile(f, fullgraph=True, backend="eager")(torch.ones(2))
    assert torch.equal(got, torch.ones(2) * len(bind_shape(spec, shape, allow_empty=True)))


# ----------------------------------------------------------------------------- registry and errors


def test_the_same_kernel_loaded_again_gets_the_same_key(rms):
    again = kernel("rmsnorm", RMS_SHAPE)
    assert again is not rms and kernel_key(again) == kernel_key(rms)
    assert foldwise_op(again).key == foldwise_op(rms).key
    assert registered_kernel(kernel_key(rms)).sha256 == rms.sha256


def test_errors_name_the_argument(rms):
    op = foldwise_op(rms)
    x, w = rms_inputs().values()
    with pytest.raises(BundleError, match=r"kernel_key: no Foldwise kernel is registered under 'nope'"):
        torch.ops.foldwise.run("nope", [x, w])
    with pytest.raises(BundleError, match=r"inputs: 1 tensors given, the kernel takes 2 \(x, w\)"):
        torch.ops.foldwise.run(op.key, [x])
    with pytest.raises(BundleError, match=r"inputs: missing input 'w'"):
        op(x=x)
    with pytest.raises(BundleError, match=r"inputs: unknown input 'z'"):
        op(x=x, w=w, z=w)
    with pytest.raises(BundleError, match=r"inputs\.x: has 1 dims"):
        op(x=w, w=w)
    with pytest.raises(BundleError, match=r"kernel: expected a BundleKernel"):
        foldwise_op("rmsnorm")



def test_a_plain_call_runs_the_kernel_and_autograd_goes_through_the_operator(rms):
    """A served forward pass (plain tensors, no gradient wanted) runs the kernel directly: the
    operator's dispatch cost 20-60 µs a call (benchmarks/client_warm_call.py). Its results are the
    operator's. An input that wants a gradient goes through the operator, whose autograd formula
    fails the backward loudly for a kernel with no backward (service.client.autograd gives one)
    instead of giving silently no gradient."""
    op = foldwise_op(rms)
    x, w = rms_inputs().values()
    direct = op(x=x, w=w, eps=1e-5)["y"]
    through = torch.ops.foldwise.run(op.key, [x, w], "eps", [1e-5])[0]
    assert torch.equal(direct, through) and direct.stride() == through.stride()
    x.requires_grad_()
    with pytest.raises(BundleError, match="has no backward registered"):
        op(x=x, w=w)["y"].sum().backward()


def test_only_plain_calls_skip_the_operator(rms, monkeypatch):
    """The direct path is taken for plain tensors and parameters under no_grad; a torch dispatch
    mode (a recording one here, as make_fx's proxy mode or a FakeTensorMode would be) or a tensor
    subclass sends the call through the operator, where the mode sees it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from service.client.torch_ops import FoldwiseOp

    class Seen(TorchDispatchMode):  # records the operators dispatched under it
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    direct = []
    real = FoldwiseOp._eager
    monkeypatch.setattr(FoldwiseOp, "_eager", staticmethod(lambda args: direct.append(real(args)) or direct[-1]))
    op = foldwise_op(rms)
    x, w = rms_inputs().values()
    with torch.no_grad():
        want = op(x=x, w=torch.nn.Parameter(w))["y"]
    assert direct == [True]  # the kernel itself
    with Seen() as mode:
        got = op(x=x, w=w)["y"]
    assert direct == [True, False] and "foldwise.run.default" in mode.ops
    assert torch.equal(got, want)

    class Tagged(torch.Tensor):
        pass

    op(x=x.as_subclass(Tagged), w=w)
    assert direct == [True, False, False]


@pytest.mark.parametrize("given_out", [False, True])
def test_a_warm_call_allocates_its_outputs_and_nothing_else(attn, monkeypatch, given_out):
    """What CUDA-graph capture asks of the call path besides no sync and no I/O: no allocation but
    the outputs (none with out=). The launch is stubbed, so only the host side is counted: every
    torch factory call the op and the kernel make."""
    op = foldwise_op(attn)
    inputs = attn_inputs()
    want = op(**inputs)  # warm: loaded, sizes checked
    kernel = registered_kernel(op.key)
    monkeypatch.setattr(kernel, "_module", types.SimpleNamespace(launch=lambda inputs, shape, out=None, **kw: out))
    made = []
    for name in ("empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "full", "tensor"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, _name=name, **k: made.append(_name) or _real(*a, **k))
    out = {part: torch.empty_like(t) for part, t in want.items()} if given_out else None
    made.clear()
    got = op(**inputs, out=out) if given_out else op(**inputs)
    assert made == ([] if given_out else ["empty"] * len(want))
    assert set(got) == set(want)


def test_a_raw_kernel_under_torch_compile_points_to_torch_op(rms):
    """Issue 37, 11: a raw kernel is left out of the graph: without fullgraph it runs eagerly (it
    crashed inside the trace), and fullgraph's error names the traceable form, torch_op()."""
    x, w = rms_inputs()["x"], rms_inputs()["w"]
    eager = rms(x=x, w=w)["y"]
    broken = torch.compile(lambda x, w: rms(x=x, w=w)["y"], backend="eager")
    assert torch.equal(broken(x, w), eager)
    whole = torch.compile(lambda x, w: rms(x=x, w=w)["y"], backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"KernelCache\.torch_op"):
        whole(x, w)
