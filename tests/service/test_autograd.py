"""Autograd through the torch op (issue 39 item 6; service/client/autograd.py): ``loss.backward()``
runs the derived backward's kernels (Triton's interpreter), made in-process as bundles (no server),
against torch's own backward; torch.compile(fullgraph=True) traces forward and backward; a kernel
with no backward says so."""

from __future__ import annotations

import pytest
import torch

from fuser_core import load_spec
from fuser_core.catalog import PACKAGED_DIR
from service.bundle import BundleError
from service.client.torch_ops import foldwise_op
from tests.support.local_kernels import LocalCache, local_kernel

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _trainable(name, shape, dtype="float32"):
    return LocalCache().trainable_op(name, shape, dtype)


@pytest.fixture(scope="module")
def rms():
    return _trainable("rmsnorm", {"t": 3, "c": 37})


def _rms_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    x, w, dy = torch.randn(3, 37, generator=g), torch.randn(37, generator=g), torch.randn(3, 37, generator=g)
    return x.requires_grad_(), w.requires_grad_(), dy


def test_rmsnorm_backward_runs_the_derived_kernels(rms):
    x, w, dy = _rms_case()
    y = rms(x=x, w=w, eps=1e-5)
    assert set(y) == {"y"}  # the saved mean square stays with the op
    (y["y"] * dy).sum().backward()
    rx, rw = (t.detach().clone().requires_grad_() for t in (x, w))
    torch.nn.functional.rms_norm(rx, (37,), rw, 1e-5).backward(dy)
    torch.testing.assert_close(x.grad, rx.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad, rw.grad, rtol=1e-4, atol=1e-5)


def test_softmax_backward_matches_torch():
    op = _trainable("safe_softmax", {"m": 4, "n": 45})
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 45, generator=g) * 3).requires_grad_()
    dy = torch.randn(4, 45, generator=g)
    (op(x=x)["y"] * dy).sum().backward()
    rx = x.detach().clone().requires_grad_()
    torch.softmax(rx, -1).backward(dy)
    torch.testing.assert_close(x.grad, rx.grad, rtol=1e-4, atol=1e-6)  # gradcheck: test_gradcheck_in_float64


def test_cross_entropy_gradient_written_by_the_forward():
    op = _trainable("cross_entropy", {"t": 5, "v": 70})
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(5, 70, generator=g) * 2 + 100).requires_grad_()  # logits near 100
    target = torch.randint(0, 70, (5,), generator=g)
    dloss = torch.randn(5, generator=g)
    (op(logits=logits, target=target)["loss"] * dloss).sum().backward()
    ref = logits.detach().clone().requires_grad_()
    torch.nn.functional.cross_entropy(ref, target, reduction="none").backward(dloss)
    torch.testing.assert_close(logits.grad, ref.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("t, v, d", [(37, 300, 80), (9, 40, 1100)])
def test_linear_cross_entropy_trains_without_the_logits(t, v, d):
    """An LM head and its loss (issue 39 item 4): d_h and d_w from the derived backward. While d fits
    a tile it recomputes the logits per tile (d_h loops over the vocabulary, d_w over the tokens) and
    writes neither them nor their gradient; past 1024 a stage writes d_logits [t, v] (its logits
    summed over d in a loop) and d_h and d_w are a GEMM each (packing rule 8). Each gradient within
    2x torch float32's own error against float64 autograd."""
    op = _trainable("linear_cross_entropy", {"t": t, "v": v, "d": d})
    assert len(op.plan.kernels) == (3 if d > 1024 else 2)  # d_logits' stage, d_h, d_w
    g = torch.Generator().manual_seed(4)
    h = torch.randn(t, d, generator=g, requires_grad=True)
    # at d = 1100 logits reach 30: the stage must sum them in the forward's K tiles, else exp(logits - mx)
    # / den turns their 1e-5 difference into p's (plan.k_tile_pinned: with tiles of 128, 11x torch's error)
    w = (torch.randn(v, d, generator=g) * 0.3).requires_grad_()
    target = torch.randint(0, v, (t,), generator=g)
    dloss = torch.randn(t, generator=g)
    (op(h=h, w=w, target=target)["loss"] * dloss).sum().backward()
    grads = {}
    for dtype in (torch.float64, torch.float32):
        rh, rw = (x.detach().to(dtype).requires_grad_() for x in (h, w))
        torch.nn.functional.cross_entropy(rh @ rw.T, target, reduction="none").backward(dloss.to(dtype))
        grads[dtype] = (rh.grad.double(), rw.grad.double())
    for got, want, plain in zip((h.grad, w.grad), grads[torch.float64], grads[torch.float32]):
        assert (got.double() - want).abs().max() <= 2 * (plain - want).abs().max() + 1e-7


def test_bfloat16_linear_cross_entropy_past_one_block_is_as_accurate_as_torch():
    """d = 1100 in bfloat16: the staged d_logits is stored in bfloat16, as torch's backward rounds its
    logits' gradient; d_h and d_w within 2x torch bfloat16's own error against float64 autograd."""
    t, v, d = 9, 40, 1100
    op = _trainable("linear_cross_entropy", {"t": t, "v": v, "d": d}, "bfloat16")
    g = torch.Generator().manual_seed(4)
    h = torch.randn(t, d, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.3).bfloat16().requires_grad_()
    target, dloss = torch.randint(0, v, (t,), generator=g), torch.randn(t, generator=g)
    (op(h=h, w=w, target=target)["loss"].float() * dloss).sum().backward()
    want, plain = [], []
    for dtype, out in ((torch.float64, want), (torch.bfloat16, plain)):
        rh, rw = (x.detach().to(dtype).requires_grad_() for x in (h, w))
        loss = torch.nn.functional.cross_entropy(rh @ rw.T, target, reduction="none")
        (loss.double() * dloss.double()).sum().backward()
        out += [rh.grad.double(), rw.grad.double()]
    for got, exact, torchs in zip((h.grad, w.grad), want, plain):
        assert got.dtype == torch.bfloat16
        assert (got.double() - exact).abs().max() <= 2 * (torchs - exact).abs().max(), (got.double() - exact).abs().max()


def test_a_transposed_gradient_is_written_in_its_inputs_layout():
    """d_w comes out of its backward spec as [d, v] for w[v, d] (attention's d_k likewise): the kernel
    writes it where w's layout puts it, so autograd keeps the kernel's tensor as w.grad instead of
    copying a transposed view (one weight-sized tensor less: benchmarks/linear_ce_memory.py)."""
    op = _trainable("linear_cross_entropy", {"t": 7, "v": 30, "d": 16})
    g = torch.Generator().manual_seed(5)
    h = torch.randn(7, 16, generator=g, requires_grad=True)
    w = torch.randn(30, 16, generator=g, requires_grad=True)
    handed = []
    w.register_hook(lambda grad: handed.append((grad.data_ptr(), grad.stride())))
    op(h=h, w=w, target=torch.randint(0, 30, (7,), generator=g))["loss"].sum().backward()
    assert handed == [(w.grad.data_ptr(), (16, 1))]  # the kernel's own tensor, contiguous as w


# the catalog's specs with a backward whose outputs are smooth (the fp8 quantisers' casts are steps; paged,
# topk and merged-dim specs have no backward): each gradient through the torch op against finite differences.
# Attention's kernels take seconds a call in the interpreter: three masks of it, each dim 2, in gradcheck's
# fast mode (one random projection of the Jacobian, torch's own check for costly ops); the rest element by element
GRADCHECKED = ["safe_softmax", "logsumexp", "rmsnorm", "rmsnorm_residual", "layernorm", "cross_entropy",
               "cross_entropy_ignore", "linear_cross_entropy", "attention_causal", "attention_gqa", "attention_softcap"]


@pytest.mark.parametrize("name", GRADCHECKED)
def test_gradcheck_in_float64(name):
    """Issue 39's must-show: torch.autograd.gradcheck at its float64 defaults (step 1e-6, atol 1e-5,
    rtol 1e-3) through the trainable op, whose kernels compute in float64."""
    import numpy as np

    from fuser_core import load_spec
    from fuser_core.reference import random_inputs
    from tests.support.catalog_shapes import small_shape

    spec = load_spec((PACKAGED_DIR / f"{name}.json").read_text())
    attention = name.startswith("attention")
    shape = {d: min(n, 2 if attention else 3) for d, n in small_shape(spec).items()}
    op = LocalCache().trainable_op(name, shape, "float64")
    arrays = random_inputs(spec, shape, np.random.default_rng(7), "float64")
    args = {k: torch.tensor(v) for k, v in arrays.items()}
    floats = [i.name for i in spec.inputs if i.is_float]
    for n in floats:
        args[n].requires_grad_()

    def outputs(*xs):
        got = op(**{**args, **dict(zip(floats, xs))})
        return tuple(t for t in got.values() if t.dtype.is_floating_point)

    assert all(t.dtype == torch.float64 for t in outputs(*(args[n] for n in floats)))
    assert torch.autograd.gradcheck(outputs, tuple(args[n] for n in floats), fast_mode=attention)


def test_compile_fullgraph_traces_forward_and_backward(rms):
    x, w, dy = _rms_case(seed=3)

    def step(x, w):
        return (rms(x=x, w=w, eps=1e-5)["y"] * dy).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled(x, w).backward()
    rx, rw = (t.detach().clone().requires_grad_() for t in (x, w))
    step(rx, rw).backward()
    torch.testing.assert_close(x.grad, rx.grad)
    torch.testing.assert_close(w.grad, rw.grad)


def test_a_kernel_without_a_backward_says_so():
    spec = load_spec((PACKAGED_DIR / "rmsnorm.json").read_text())
    op = foldwise_op(local_kernel(spec, {"t": 2, "c": 19}))
    x = torch.randn(2, 19, requires_grad=True)
    y = op(x=x, w=torch.randn(19))["y"]
    with pytest.raises(BundleError, match="has no backward registered"):
        y.sum().backward()


def test_fetch_trainable_asks_for_the_saving_forward_and_each_backward_spec():
    """What KernelCache.trainable_op fetches (service.client.autograd.fetch_trainable): each spec
    by its JSON, at its own dims, the backward's saved statistics and upstream gradient in the
    forward output's dtype."""
    from service.client.autograd import fetch_trainable

    calls = []

    def get(requests):
        calls.extend((raw["name"], shape, dtype) for raw, shape, dtype in requests)
        return [local_kernel(load_spec(raw, printed=True), shape, dtype) for raw, shape, dtype in requests]

    spec = load_spec((PACKAGED_DIR / "rmsnorm.json").read_text())
    op = fetch_trainable(get, spec, {"t": 3, "c": 37}, "float32")
    assert [c[0] for c in calls] == ["rmsnorm_saving", "rmsnorm_backward_x", "rmsnorm_backward_w"]
    assert calls[1][2] == {"x": "float32", "w": "float32", "ms": "float32", "d_y": "float32"}
    assert calls[2][1] == {"t": 3, "c": 37}
    x, w, dy = _rms_case(seed=4)
    (op(x=x, w=w)["y"] * dy).sum().backward()
    rx, rw = (t.detach().clone().requires_grad_() for t in (x, w))
    torch.nn.functional.rms_norm(rx, (37,), rw, 1e-6).backward(dy)
    torch.testing.assert_close(x.grad, rx.grad, rtol=1e-4, atol=1e-5)
    with pytest.raises(BundleError, match="shape: a trainable op is for one shape"):
        fetch_trainable(get, spec, {"t": {"min": 1, "max": 8}, "c": 37}, "float32")


def test_a_backward_with_no_kernel_is_refused_by_name():
    """A backward with no reduction whose gradient reads the upstream gradients through two names
    (lse's and sq's Jacobians differ per element: no factor, so the forward cannot write it):
    refused before anything is fetched."""
    from service.client.autograd import fetch_trainable

    spec = load_spec({"foldwise": 1, "name": "two_heads", "inputs": {"x": {"dims": ["t", "v"]}},
                      "steps": [{"name": "mx", "reduce": "max", "over": "v", "expr": "x"},
                                {"name": "den", "reduce": "sum", "over": "v", "expr": "exp(x - mx)"},
                                {"name": "lse", "expr": "mx + log(den)"}, {"name": "sq", "expr": "x * x"}],
                      "outputs": ["lse", "sq"]})
    with pytest.raises(BundleError, match="two_heads_backward is elementwise"):
        fetch_trainable(lambda requests: pytest.fail("fetched"), spec, {"t": 4, "v": 30}, "float32")


@pytest.mark.parametrize("compiled", [False, True])
def test_cross_entropy_with_ignore_index_both_outputs(compiled):
    """cross_entropy_ignore: per-token losses and their mean over the counted tokens. The forward
    writes the gradient for a factor of 1 and the saved count; the factor d_loss + d_mean /
    max(counted, 1) is evaluated after it. Against torch's cross_entropy with ignore_index, through
    both outputs at once, logits near 100, a third of the labels ignored; and under torch.compile."""
    op = _trainable("cross_entropy_ignore", {"t": 6, "v": 70})
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 70, generator=g) * 2 + 100).requires_grad_()
    target = torch.randint(0, 70, (6,), generator=g)
    target[::3] = -100
    d_loss, d_mean = torch.randn(6, generator=g), torch.randn((), generator=g)

    def total(x):
        out = op(logits=x, target=target)
        return (out["loss"] * d_loss).sum() + out["mean"] * d_mean

    fn = torch.compile(total, fullgraph=True, backend="aot_eager") if compiled else total
    fn(logits).backward()
    ref = logits.detach().clone().requires_grad_()
    loss = torch.nn.functional.cross_entropy(ref, target, ignore_index=-100, reduction="none")
    ((loss * d_loss).sum() + torch.nn.functional.cross_entropy(ref, target, ignore_index=-100) * d_mean).backward()
    torch.testing.assert_close(logits.grad, ref.grad, rtol=1e-4, atol=1e-6)
    assert (logits.grad[::3] == 0).all()  # ignored tokens: no gradient


def test_a_module_whose_kernels_load_by_tma_is_served():
    """A kernel that may load its tiles by TMA (a 16-bit attention at tiles of 16 and more) carries the
    helper that sets Triton's allocator; the bundle check (a served module imports only os, torch and
    triton) refused its ``from triton.runtime import`` until the helper read it as an attribute."""
    spec = load_spec((PACKAGED_DIR / "attention.json").read_text())
    kernel = local_kernel(spec, {"b": 1, "h": 2, "m": 64, "n": 64, "d": 64, "e": 64}, "float16")
    assert "tma_loads" in kernel.bundle["triton_source"]


def test_bfloat16_attention_trains_with_float32_statistics():
    """bfloat16 training through the derived backward: the forward saves its row max and sum, and the
    stage its Delta, in float32 (``output_dtypes``; in bfloat16 a max near 100 moves exp(s - mx) by up
    to 28%, and the stage's bfloat16 Delta met a kernel built for float32: the op raised), the
    products stay bf16 on the tensor cores (the inputs of most dims decide), and every gradient is
    within 2x torch's bfloat16 SDPA's error against float64 autograd (measured 0.74x to 1.14x over 6
    samples; 1.15x to 1.43x while the interpreter truncated bfloat16 stores, before bf16_store)."""
    from fuser_core import derive_backward
    from fuser_core.problem import make_problem

    spec = load_spec((PACKAGED_DIR / "attention_causal.json").read_text())
    shape = {"b": 1, "h": 2, "m": 40, "n": 40, "d": 16, "e": 16}
    cascade = derive_backward(spec)
    stored = make_problem(cascade.forward, shape, "bfloat16").output_dtypes
    assert stored == {"o": "bfloat16", "mx": "float32", "den": "float32"}
    op = LocalCache().trainable_op("attention_causal", shape, "bfloat16")
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 40, 16, generator=gen, dtype=torch.float64) * 6 for _ in range(2))
    v, do = (torch.randn(1, 2, 40, 16, generator=gen, dtype=torch.float64) for _ in range(2))

    def grads(dtype, attend):
        t = [x.detach().to(dtype).clone().requires_grad_() for x in (q, k, v)]
        (attend(*t).double() * do).sum().backward()
        return [x.grad.double() for x in t]

    sdpa = lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True)  # noqa: E731
    want, plain = grads(torch.float64, sdpa), grads(torch.bfloat16, sdpa)
    ours = grads(torch.bfloat16, lambda a, b, c: op(q=a, k=b, v=c)["o"])
    for name, ref, g, t in zip("qkv", want, ours, plain):
        error, torch_error = ((x - ref).abs().max() / ref.abs().max() for x in (g, t))
        assert error <= 2 * torch_error, (name, float(error), float(torch_error))
