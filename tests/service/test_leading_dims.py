"""Model-shaped tensors (issue 37, 12): a kernel takes a model's activations as they are,
``x[b, s, c]`` for a spec's ``x[t, c]``, as torch's own norms do (service/bundle/leading.py): the
leading dims fold into the input's first dim and come back on every output whose first dim it is,
through the kernel, ``out=``, a range kernel's bucket choice, the torch op and torch.compile."""

from __future__ import annotations

import pytest
import torch
from tests.service.test_torch_ops import kernel, rms_reference

from service.bundle import BundleError
from service.client.torch_ops import foldwise_op

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(scope="module")
def rms():
    return kernel("rmsnorm", {"t": 6, "c": 37})


def activations(*lead, c=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*lead, c, generator=g), torch.randn(c, generator=g)


def test_a_3d_activation_runs_and_comes_back_3d(rms):
    x, w = activations(2, 3)
    y = rms(x=x, w=w)["y"]
    assert tuple(y.shape) == (2, 3, 37)
    assert torch.equal(y, rms(x=x.reshape(6, 37), w=w)["y"].reshape(2, 3, 37))  # the same kernel, flat
    assert float((y.double() - rms_reference(x, w)).abs().max()) < 1e-5
    x4, _ = activations(2, 1, 3)  # any number of leading dims
    assert tuple(rms(x=x4, w=w)["y"].shape) == (2, 1, 3, 37)


def test_a_strided_3d_activation_is_copied_and_out_is_written_in_place(rms):
    x, w = activations(3, 2)
    strided = x.transpose(0, 1)  # [2, 3, c], not viewable as [6, c]
    buf = torch.empty(2, 3, 37)
    got = rms(x=strided, w=w, out={"y": buf})
    assert got["y"] is buf and torch.equal(buf, rms(x=strided.contiguous(), w=w)["y"])
    with pytest.raises(BundleError, match=r"^out\.y: its leading dims \(2, 3\) cannot be viewed as one"):
        rms(x=strided, w=w, out={"y": torch.empty(3, 2, 37).transpose(0, 1)})


def test_inputs_that_fold_differently_are_refused_naming_them():
    k = kernel("rmsnorm_residual")
    names = k.input_names
    x, w = activations(2, 3)
    with pytest.raises(BundleError, match=r"^inputs\.\w+: its leading sizes \(3, 2\) fold into t, but those of "
                                          r"inputs\.\w+ are \(2, 3\)"):
        k({n: (w if k.input_dims[n] == ("c",) else (x if i == 0 else x.reshape(3, 2, 37)))
           for i, n in enumerate(names)})


def test_the_torch_op_and_torch_compile_take_3d_activations(rms):
    torch._dynamo.reset()
    op = foldwise_op(rms)
    x, w = activations(2, 3)
    want = rms(x=x, w=w)["y"]
    assert torch.equal(op(x=x, w=w)["y"], want)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:  # the fake kernel's shapes fold as the kernel does
        (y,) = torch.ops.foldwise.run(op.key, [mode.from_tensor(x), mode.from_tensor(w)])
        assert tuple(y.shape) == (2, 3, 37)
    compiled = torch.compile(lambda x, w: op(x=x, w=w)["y"] * 2.0, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, w), want * 2.0)
