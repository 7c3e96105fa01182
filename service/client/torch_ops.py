"""Foldwise kernels as torch operators: ``torch.ops.foldwise.run`` and ``torch.ops.foldwise.run_out``.

What an inference server puts in its forward pass (issue 24, item 4)::

    from service.client.torch_ops import foldwise_op
    rmsnorm = foldwise_op(KernelCache(url).get("rmsnorm", {"t": 128, "c": 4096}, "bfloat16"))
    y = rmsnorm(x=x, w=w)["y"]                  # or rmsnorm(x=x, w=w, out={"y": buf})

**Design.** Two generic operators, registered once with :func:`torch.library.custom_op`, serve
every kernel; the kernel is named by a string argument, a key into a process-wide registry of
loaded :class:`~service.bundle.BundleKernel`\\ s:

- ``foldwise::run(str kernel_key, Tensor[] inputs) -> Tensor[]``: inputs in the order the
  caller's spec lists them (:attr:`BundleKernel.input_names`), outputs in the order of its
  output parts (:attr:`BundleKernel.output_parts`).
- ``foldwise::run_out(str kernel_key, Tensor[] inputs, Tensor(a!)[] outs) -> ()``: the same,
  writing into ``outs`` (every part, in that order); shapes, dtypes and device are checked and
  an error names the output (``out.y: has shape ...``).

Why one generic operator rather than one per kernel: registering an operator is a process-wide,
permanent act (its name cannot be freed), while kernels come and go (a better one from the
server, other shapes). A registry key costs a dict entry, and a new kernel needs no new
schema. The key is derived from the bundle's sha256 and the caller's spec (its names and input
order decide the operator's argument order and output layout), so loading the same kernel
again gives the same key, and torch.compile's graph (which holds the key as a constant) stays
valid. A graph run in another process needs the kernel registered there first: the error says
so.

**Fake (meta) implementation.** ``register_fake`` computes the outputs' shapes from the inputs'
sizes (:meth:`BundleKernel.output_shapes`, the spec's dims; symbolic sizes pass through, so
dynamic shapes work) and their dtypes from the bundle, and runs nothing: torch.compile traces
with it, and meta tensors dispatch to it. Calling a :class:`~service.bundle.BundleKernel` on meta
tensors directly works too.

**Outputs** are contiguous in the caller's dim order (the order of the output's dims in the
caller's spec, docs/SPEC.md), which is what the fake implementation promises; the kernel writes
them in place, no copy (:mod:`service.bundle`, "Output layout"). Strided inputs are read as
they are, no copy.

**Tracing.** Custom operators are opaque to Dynamo: the kernel's own checks and its Triton
launch run at call time, outside the graph. What Dynamo traces is :class:`FoldwiseOp`'s call,
written for it: dict and list look-ups and one operator call, no generator expressions, no I/O,
nothing read from tensors but their metadata. Outside tracing, a call on plain tensors that want
no gradient runs the kernel itself (:meth:`FoldwiseOp._eager`): the same results, without the
dispatcher's 20-60 µs (benchmarks/client_warm_call.py). So ``torch.compile(fullgraph=True)`` works over
functions calling Foldwise ops (tests/service/test_torch_ops.py, backends eager, aot_eager, inductor).

**Gradients.** :mod:`service.client.autograd` registers the operator's autograd formula: a
kernel fetched with ``KernelCache.trainable_op`` runs its derived backward's kernels; any other
raises, naming the kernel, when a backward reaches it. The APIs used are those of torch 2.4 and
later (``custom_op``, ``register_fake``, ``opcheck``), present in the 2.11 of the GPU machines
and the 2.13 here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Optional  # Optional: the op schema inference knows it, not X | None

import torch
from torch._guards import TracingContext
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack  # what torch's detect_fake_mode reads

from service.bundle import BundleError, BundleKernel, ordered_tensors
from service.bundle.leading import fold_of, folded_inputs, unfolded_shapes
from service.client.range_kernel import RangeKernel

Kernel = BundleKernel | RangeKernel  # a range's kernel picks its bucket per call, inside the operator
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # what a served forward pass hands an op
_KERNELS: dict[str, Kernel] = {}  # kernel_key -> kernel; entries are never removed (graphs hold keys)


def kernel_key(kernel: Kernel) -> str:
    """The registry key of ``kernel``: its spec's name and a digest of the bundle's sha256 (a
    range's: every bucket's), the caller's spec (input order, names and output dim order) and
    ``exact_shape``. The same kernel loaded again gets the same key, in any process."""
    if isinstance(kernel, RangeKernel):
        bundles: Any = tuple(k.sha256 for _, k in kernel.buckets)
    elif isinstance(kernel, BundleKernel):
        bundles = kernel.sha256
    else:
        raise BundleError(f"kernel: expected a BundleKernel or a RangeKernel (service.client.KernelCache.get or "
                          f"service.bundle.load_bundle), got {type(kernel).__name__}")
    digest = hashlib.sha256(repr((bundles, kernel.exact_shape, kernel.spec)).encode("utf-8")).hexdigest()
    return f"{kernel.spec.name}-{digest[:24]}"


def register_kernel(kernel: Kernel) -> str:
    """Make ``kernel`` callable through ``torch.ops.foldwise.run``; returns its key."""
    key = kernel_key(kernel)
    _KERNELS[key] = kernel
    return key


def registered_kernel(key: str) -> Kernel:
    """The kernel registered under ``key``; :class:`BundleError` naming ``kernel_key`` otherwise."""
    kernel = _KERNELS.get(key)
    if kernel is None:
        raise BundleError(f"kernel_key: no Foldwise kernel is registered under {key!r:.80} in this process; "
                          "call service.client.torch_ops.foldwise_op(kernel) (or register_kernel) first")
    return kernel


def _named_inputs(kernel: Kernel, inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    names = kernel.input_names
    if len(inputs) != len(names):
        raise BundleError(f"inputs: {len(inputs)} tensors given, the kernel takes {len(names)} ({', '.join(names)})")
    return dict(zip(names, inputs))


def _output_shapes(kernel: Kernel, inputs: Mapping[str, torch.Tensor]) -> dict[str, list[Any]]:
    """Output shapes from the inputs' sizes, as given (symbolic under torch.compile): the first
    input holding a dim gives its size; that the others agree is the kernel's check at run time."""
    fold = fold_of(kernel.input_dims, inputs)  # [b, s, c] for x[t, c] (service.bundle.leading)
    if fold is not None:
        inputs = folded_inputs(kernel.input_dims, inputs, fold)
    sizes: dict[str, Any] = {}
    for name, dims in kernel.input_dims.items():
        t = inputs[name]
        if t.dim() != len(dims):
            raise BundleError(f"inputs.{name}: has {t.dim()} dims {tuple(t.shape)}, expected "
                              f"{len(dims)} ({', '.join(dims)})")
        for d, n in zip(dims, t.shape):
            sizes.setdefault(d, n)
    shapes = kernel.output_shapes(sizes)
    return shapes if fold is None else unfolded_shapes(kernel.output_dims, shapes, fold)


# ----------------------------------------------------------------------------- the operators


def _with_scalars(named: dict[str, Any], scalar_names: Optional[str], scalars: Optional[list[float]]) -> dict[str, Any]:
    """The named inputs plus the runtime scalars given: ``scalar_names`` comma-separated (an op
    schema has no list of strings; names are identifiers) and ``scalars`` their values, in step.
    The kernel applies its defaults to the others and checks the values."""
    if scalar_names:
        named.update(zip(scalar_names.split(","), scalars or []))
    return named


@torch.library.custom_op("foldwise::run", mutates_args=())
def run(kernel_key: str, inputs: list[torch.Tensor], scalar_names: Optional[str] = None,
        scalars: Optional[list[float]] = None) -> list[torch.Tensor]:
    """Run the registered kernel ``kernel_key`` on ``inputs`` (the spec's input order), with the
    runtime scalars ``scalar_names`` = ``scalars`` (eps, a scale; the others take their defaults);
    its output parts in the spec's order, each contiguous in the caller's dim order."""
    kernel = registered_kernel(kernel_key)
    outputs = kernel(_with_scalars(_named_inputs(kernel, inputs), scalar_names, scalars))
    return [outputs[part] for part in kernel.output_parts]


@run.register_fake
def _run_fake(kernel_key: str, inputs: list[torch.Tensor], scalar_names: Optional[str] = None,
              scalars: Optional[list[float]] = None) -> list[torch.Tensor]:
    kernel = registered_kernel(kernel_key)
    named = _named_inputs(kernel, inputs)
    shapes = _output_shapes(kernel, named)
    dtypes = kernel.output_dtypes
    device = inputs[0].device
    return [torch.empty(shapes[part], dtype=getattr(torch, dtypes[part]), device=device)
            for part in kernel.output_parts]


@torch.library.custom_op("foldwise::run_out", mutates_args=("outs",))
def run_out(kernel_key: str, inputs: list[torch.Tensor], outs: list[torch.Tensor],
            scalar_names: Optional[str] = None, scalars: Optional[list[float]] = None) -> None:
    """Run the registered kernel ``kernel_key``, writing its output parts (the spec's order) into ``outs``."""
    kernel = registered_kernel(kernel_key)
    kernel(_with_scalars(_named_inputs(kernel, inputs), scalar_names, scalars), out=_named_outs(kernel, outs))


@run_out.register_fake
def _run_out_fake(kernel_key: str, inputs: list[torch.Tensor], outs: list[torch.Tensor],
                  scalar_names: Optional[str] = None, scalars: Optional[list[float]] = None) -> None:
    # the same checks as the kernel's, on the (possibly symbolic) sizes: a wrong out= tensor is
    # refused while tracing, naming the output, not only when the graph first runs
    kernel = registered_kernel(kernel_key)
    named = _named_inputs(kernel, inputs)
    kernel.check_out(_named_outs(kernel, outs), _output_shapes(kernel, named), inputs[0].device)


def _named_outs(kernel: Kernel, outs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    parts = kernel.output_parts
    if len(outs) != len(parts):
        raise BundleError(f"out: {len(outs)} tensors given, the kernel writes {len(parts)} ({', '.join(parts)})")
    return dict(zip(parts, outs))


# ----------------------------------------------------------------------------- the autograd formula
# (issue 39; the plans are built by service.client.autograd): here, with the operator, so a backward
# through any kernel behaves the same whatever the process imported

UPSTREAM, INPUT, OUTPUT, STAGED = "upstream", "input", "output", "staged"  # where a backward kernel's input comes from
_PLANS: dict[str, Any] = {}  # forward kernel key -> its backward; never removed (graphs hold keys)


def register_backward(forward_key: str, plan: Any) -> None:
    """Give the kernel registered under ``forward_key`` a backward: ``plan``, a
    :class:`service.client.autograd.BackwardPlan`."""
    _PLANS[forward_key] = plan


def _setup_context(ctx: Any, inputs: tuple, output: list[torch.Tensor]) -> None:
    kernel_key, tensors, scalar_names, scalars = (*inputs, None, None)[:4]  # the defaults are not passed on
    ctx.kernel_key, ctx.scalar_names, ctx.scalars, ctx.count = kernel_key, scalar_names, scalars, len(tensors)
    # torch matches the returned gradients' pytree with the inputs', where a None input is an empty
    # node: the gradients stop where the trailing None arguments (no runtime scalars) begin
    ctx.arguments = len(inputs) - (scalars is None) - (scalars is None and scalar_names is None)
    ctx.save_for_backward(*tensors, *output)


def _scalars_for(kernel: Any, names: Optional[str], values: Optional[list[float]]
                 ) -> tuple[Optional[str], Optional[list[float]]]:
    """The forward call's runtime scalars that ``kernel`` takes (the others it does not know)."""
    if not names:
        return None, None
    pairs = [(n, v) for n, v in zip(names.split(","), values or []) if n in kernel.scalars]
    return (",".join(n for n, _ in pairs), [v for _, v in pairs]) if pairs else (None, None)


def _backward(ctx: Any, grads: list[Optional[torch.Tensor]]) -> tuple:
    plan = _PLANS.get(ctx.kernel_key)
    if plan is None:
        raise BundleError(f"kernel_key: the Foldwise kernel {ctx.kernel_key!r:.80} has no backward registered; get it "
                          "with KernelCache.trainable_op")
    saved = ctx.saved_tensors
    ins = dict(zip(plan.inputs, saved[:ctx.count]))
    outs = dict(zip(plan.outputs, saved[ctx.count:]))
    ups = {name: (torch.zeros_like(outs[name]) if g is None else g.to(outs[name].dtype))
           for name, g in zip(plan.outputs, grads)}
    found: dict[str, torch.Tensor] = {}
    staged: dict[str, torch.Tensor] = {}
    sources = {INPUT: ins, OUTPUT: outs, UPSTREAM: ups, STAGED: staged}
    for k in plan.kernels:  # in the order they run: a stage's results feed the next
        names, values = _scalars_for(k, ctx.scalar_names, ctx.scalars)
        args = [sources[kind][n] for kind, n in k.reads]
        if all(order == tuple(range(len(order))) for _, _, order in k.writes):
            parts = torch.ops.foldwise.run(k.key, args, names, values)
        else:
            parts = _written_as_inputs(k, args, ins, names, values)
        staged |= dict(zip(k.parts, parts))
        for index, name, order in k.writes:
            found[name] = parts[index].permute(order)
    for f in plan.in_forward:
        from fuser_core import factor_value  # here: the derivation's modules load only for a backward that has one

        x = ins[f.input]
        factor = factor_value(f.factor, {name: sources[kind][source] for name, kind, source in f.reads})
        factor = factor.permute(f.order).reshape([n if keep else 1 for n, keep in zip(x.shape, f.keep)])
        found[f.input] = factor.float() * outs[f.part].float()
    grads_in = [None if n not in found else found[n].to(ins[n].dtype) for n in plan.inputs]
    return (None, grads_in, None, None)[:ctx.arguments]


def _written_as_inputs(k: Any, args: list[torch.Tensor], ins: dict[str, torch.Tensor], names: Optional[str],
                       values: Optional[list[float]]) -> list[torch.Tensor]:
    """Backward kernel ``k``'s output parts, each gradient written where it lies in its input's layout:
    a gradient whose dims come in another order (a head's d_w as [d, v] for w[v, d]) would otherwise be
    a transposed view autograd copies into the weight's layout, one weight-sized tensor more at once."""
    kernel = registered_kernel(k.key)
    shapes = _output_shapes(kernel, _named_inputs(kernel, args))
    dtypes = kernel.output_dtypes
    gradients = {index: (name, order) for index, name, order in k.writes}
    outs = []
    for index, part in enumerate(k.parts):
        if index in gradients:
            name, order = gradients[index]
            laid = torch.empty(ins[name].shape, dtype=getattr(torch, dtypes[part]), device=args[0].device)
            outs.append(laid.permute([order.index(i) for i in range(len(order))]))
        else:
            outs.append(torch.empty(shapes[part], dtype=getattr(torch, dtypes[part]), device=args[0].device))
    torch.ops.foldwise.run_out(k.key, args, outs, names, values)
    return outs


torch.library.register_autograd("foldwise::run", _backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- the friendly wrapper


class FoldwiseOp:
    """A kernel as a torch operator: ``op(x=..., w=...)`` or ``op({"x": ..., "w": ...})`` ->
    ``{output part: tensor}``, like the :class:`~service.bundle.BundleKernel` it wraps; with
    ``out={part: tensor}`` (every part) it writes into those tensors and returns them.

    The call is what Dynamo traces (module docstring, "Tracing"): keep it to dict and list
    look-ups and the operator call. An input named ``out`` is passed in the inputs dict.
    """

    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        self.key = register_kernel(kernel)
        self.input_names = kernel.input_names
        self.output_parts = kernel.output_parts
        self.scalar_names = kernel.scalar_names

    def __repr__(self) -> str:
        return f"FoldwiseOp({self.key!r})"

    @staticmethod
    def _eager(args: list[torch.Tensor]) -> bool:
        """Whether a call may run the kernel directly, not through ``torch.ops.foldwise``: what a
        served forward pass does (plain tensors, no gradient wanted). Under torch.compile, fake
        tensors (tracing, a FakeTensorMode) or autograd the operator runs, so the graph holds it,
        its fake kernel gives the shapes, and a backward through it runs the kernel's registered
        backward or fails loudly (service.client.autograd) rather than silently giving no gradient. Dynamo never traces this branch."""
        if torch.compiler.is_compiling():
            return False
        for t in args:  # a subclass (FakeTensor, a functional or traced tensor) goes through the operator
            if type(t) not in _PLAIN_TENSORS or (t.requires_grad and torch.is_grad_enabled()):
                return False
        # any torch dispatch mode (FakeTensorMode, make_fx's proxy mode) or tracing context: the operator.
        # torch's detect_fake_mode asks the same and walks the inputs' pytree too: 10 µs a call
        return not _get_current_dispatch_mode_stack() and TracingContext.try_get() is None

    def __call__(self, inputs: Mapping[str, torch.Tensor] | None = None, /, *,
                 out: Mapping[str, torch.Tensor] | None = None, **tensors: torch.Tensor) -> dict[str, torch.Tensor]:
        if inputs is not None and tensors:
            raise BundleError("pass the inputs either as one dict or as keyword arguments, not both")
        given = dict(tensors if inputs is None else inputs)
        # runtime scalars (op(x=x, w=w, eps=1e-5)) go as two lists, those given only: the kernel applies
        # its defaults (which may depend on sizes) at run time; values are checked there too
        names, values = [], []
        for name in self.scalar_names:
            if name in given:
                names.append(name)
                values.append(float(given.pop(name)))
        # the operators take lists; names are checked here, where they are known (the rest at run time)
        args = ordered_tensors(given, self.input_names, "inputs", "input")
        if self._eager(args):  # the kernel itself: the operator's dispatch would add 20-60 µs per call
            result = self.kernel({**given, **dict(zip(names, values))}, out=out)
            return {part: result[part] for part in self.output_parts}
        if out is None:
            return dict(zip(self.output_parts, torch.ops.foldwise.run(self.key, args, ",".join(names) or None, values or None)))
        if not isinstance(out, Mapping):
            raise BundleError(f"out: expected a dict of output part -> tensor, got {type(out).__name__}")
        outs = ordered_tensors(out, self.output_parts, "out", "output")
        torch.ops.foldwise.run_out(self.key, args, outs, ",".join(names) or None, values or None)
        return dict(zip(self.output_parts, outs))


def foldwise_op(kernel: Kernel) -> FoldwiseOp:
    """``kernel`` (a loaded :class:`~service.bundle.BundleKernel`, or a
    :class:`~service.client.range_kernel.RangeKernel`: each call runs the bucket its sizes fall in, picked
    inside the operator at run time, so one traced graph with dynamic sizes serves every bucket)
    registered as a torch operator,
    and a callable over it whose call torch.compile(fullgraph=True) traces."""
    return FoldwiseOp(kernel)
