"""Loading and running a bundle's kernel: the generated module imported from a
content-addressed file, and :class:`BundleKernel`, the callable that checks a call's tensors
and speaks the caller's own names (the package docstring, :mod:`service.bundle`: names, output
layout, meta tensors, other sizes, trust).
"""

from __future__ import annotations


import hashlib
import importlib.util
import inspect
import json
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from fuser_core import (
    Spec, SpecError, as_logical, bind_scalars, bind_shape, call_dims, call_sizes, canonical_names, empty_outputs,
    first_out_of_range, gathered, has_empty_dim, index_ranges, interpreter_quiet, load_spec, out_of_range_message,
    spec_hash, to_storage,
)
from service.bundle.formats import shape_text, user_names
from service.bundle.hashing import BundleError
from service.bundle.leading import call_folded
from service.bundle.verify import verify_bundle

_LOCK = threading.Lock()
CHECKED_SIZES_KEPT = 1024  # distinct input sizes a kernel remembers as checked (BundleKernel._checked)
_MODULES: dict[str, tuple[ModuleType, bool]] = {}  # source sha256 -> (module, interpreted)


def module_dir() -> Path:
    """Where bundle sources are written for import (Triton's @jit reads its source file)."""
    root = os.environ.get("FOLDWISE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "foldwise")
    path = Path(root) / "bundle_modules"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _load_module(source: str, directory: Path | None) -> tuple[ModuleType, bool]:
    """Import ``source`` as a fresh module from a content-addressed file (written atomically)."""
    digest = hashlib.sha256(source.encode("utf-8")).hexdigest()
    with _LOCK:
        if digest in _MODULES:
            return _MODULES[digest]
        folder = directory or module_dir()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"bundle_{digest[:32]}.py"
        if not path.exists() or path.read_bytes() != source.encode("utf-8"):
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                tmp.write_bytes(source.encode("utf-8"))
                os.replace(tmp, path)
            except OSError as err:  # Triton's @jit reads the source from its file: without one, no kernel
                tmp.unlink(missing_ok=True)
                raise BundleError(f"triton_source: cannot be written to {folder} to be imported ({err.strerror or err}); "
                                  "free space there or set FOLDWISE_CACHE_DIR") from None
        name = f"foldwise_bundle_{digest[:16]}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as err:
            sys.modules.pop(name, None)
            raise BundleError(f"triton_source: cannot be loaded with this Triton: {type(err).__name__}: {err}") from err
        interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
        _MODULES[digest] = (module, interpreted)
        return _MODULES[digest]


def load_bundle(bundle: dict, *, spec: Spec | None = None, exact_shape: bool = False,
                directory: Path | None = None, info: dict | None = None) -> BundleKernel:
    """Verify ``bundle`` and load its kernel; a callable over torch tensors.

    With ``spec`` (same ``spec_hash``, any naming) the callable speaks that spec's names;
    else the canonical ones. ``exact_shape=True`` refuses sizes other than the tuned shape.
    CPU tensors need ``TRITON_INTERPRET=1`` set before the first load (Triton's interpreter).
    """
    verify_bundle(bundle)
    module, interpreted = _load_module(bundle["triton_source"], directory)
    kernel = BundleKernel(bundle, module, interpreted, exact_shape=exact_shape, info=info)
    return kernel.for_spec(spec) if spec is not None else kernel


def ordered_tensors(given: Mapping[str, Any], names: tuple[str, ...], field: str, noun: str) -> list[Any]:
    """``given``'s tensors in the order of ``names``, each name given once: :class:`BundleError`
    naming ``field`` and an unknown or missing ``noun``, or ``field.<name>`` not a tensor.

    Shared by :class:`BundleKernel` (inputs and ``out=``) and :class:`service.client.torch_ops.FoldwiseOp`,
    whose call torch.compile's Dynamo traces: loops and look-ups only (no generator expressions)."""
    import torch

    verb = "takes" if noun == "input" else "writes"
    for name in given:
        if name not in names:
            raise BundleError(f"{field}: unknown {noun} {name!r}; the kernel {verb} {', '.join(names)}")
    out = []
    for name in names:
        if name not in given:
            raise BundleError(f"{field}: missing {noun} {name!r}; the kernel {verb} {', '.join(names)}")
        t = given[name]
        if not isinstance(t, torch.Tensor):
            raise BundleError(f"{field}.{name}: expected a torch.Tensor, got {type(t).__name__}")
        out.append(t)
    return out


@dataclass(frozen=True)
class _OutputPart:
    """One output part as the caller sees it, and how the kernel's (canonical) tensor maps to it."""

    name: str  # the caller's part name (``y``, ``g.values``)
    canonical: str  # the bundle's part name (``s1``, ``s2.values``)
    dims: tuple[str, ...]  # the caller's logical dims, in the caller's order (a merged dim as one)
    storage: tuple[str, ...]  # the tensor's dims: ``dims`` with a merged dim written as its parts
    order: tuple[int, ...]  # the caller's dim i is the kernel's dim order[i]
    inverse: tuple[int, ...]  # the kernel's dim j is the caller's dim inverse[j]
    dtype: str

    @property
    def same_order(self) -> bool:
        return self.order == tuple(range(len(self.order)))


class BundleKernel:
    """A loaded bundle: ``kernel(inputs)`` or ``kernel(x=..., w=...)`` -> {output part: tensor}.

    Inputs are checked before launching: names, number of dims, dtypes (exactly the
    bundle's), one device, consistent sizes per dim, and ``size_limits`` (module docstring).
    ``out={part: tensor}`` writes into given tensors (every part; shape, dtype and device
    checked). Outputs are contiguous in the caller's dim order; meta tensors launch nothing.
    A model's ``[b, s, c]`` runs where the spec says ``[t, c]`` (service.bundle.leading).
    """

    def __init__(self, bundle: dict, module: ModuleType, interpreted: bool, *, exact_shape: bool = False,
                 user: Spec | None = None, info: dict | None = None):
        self.bundle = bundle
        # how the kernel was loaded: {"loaded": "cubin"|"source", "reason": ...} (service.client)
        self.info = dict(info) if info else {"loaded": "source", "reason": "loaded with load_bundle (source)"}
        self._module = module
        self._interpreted = interpreted
        self.exact_shape = exact_shape
        self._canon = load_spec(bundle["spec"], printed=True)
        self._user = user or self._canon
        # caller's dim/step name -> canonical name (identity for the canonical spec itself)
        self._names = canonical_names(user) if user is not None else {n: n for n in self._all_names(self._canon)}
        self._back = user_names(user) if user is not None else {n: n for n in self._names}
        # a bundle made before launchers took out= (generator of issue 24) is run, then copied into place
        self._takes_out = "out" in inspect.signature(module.launch).parameters
        # the tensors a call passes (a paged input's pages and its table among them: fuser_core.paged)
        self._input_dims = {name: call_dims(self._user, name)
                            for name in (*(i.name for i in self._user.inputs), *self._user.page_tables)}
        # runtime params (eps, a scale): passed at call time by keyword, their names kept by the canonical form
        self.scalar_names = tuple(p.name for p in self._user.runtime_params)
        self._parts = tuple(self._output_part(part) for part in self._user.output_parts)
        # index inputs that select a position (a label): read from the spec once, checked per call
        self._index_rules = index_ranges(self._user)
        # sizes already checked -> (bound, shape): a forward pass calls with few distinct sizes, and the
        # checks (bind_shape: the spec's rules, size_limits) were half a warm call's host time
        self._checked_sizes: dict[tuple, tuple[dict[str, int], dict[str, int]]] = {}
        # what a call traced by torch.compile runs: this call, left out of the graph (torch is loaded:
        # the module's launcher imported it)
        self._outside_the_graph = _outside_the_graph(self._call)

    def _output_part(self, part: str) -> _OutputPart:
        step, _, suffix = part.partition(".")
        cstep = self._names[step]
        canonical = cstep + ("." + suffix if suffix else "")
        dims = self._user.step(step).dims
        cdims = self._canon.step(cstep).dims
        order = tuple(cdims.index(self._names[d]) for d in dims)
        inverse = tuple(order.index(j) for j in range(len(order)))
        return _OutputPart(part, canonical, dims, self._user.storage_dims(dims), order, inverse,
                           self.bundle["outputs"][canonical]["dtype"])

    @staticmethod
    def _all_names(spec: Spec) -> list[str]:
        return [*spec.dims, *(s.name for s in spec.steps)]

    # -- what the bundle is
    @property
    def sha256(self) -> str:
        return self.bundle["sha256"]

    @property
    def spec_hash(self) -> str:
        return self.bundle["spec_hash"]

    @property
    def strategy(self) -> str:
        return self.bundle["strategy"]

    @property
    def target(self) -> str:
        return self.bundle["target"]

    @property
    def measured(self) -> dict:
        return self.bundle["measured"]

    @property
    def shape(self) -> dict[str, int]:
        """The shape the kernel was tuned for, in the caller's dim names."""
        return {self._back[d]: n for d, n in self.bundle["shape"].items()}

    @property
    def size_limits(self) -> dict[str, int]:
        """Dims held whole in one block -> the largest size the kernel can take, caller's names."""
        return {self._back[d]: n for d, n in self.bundle.get("size_limits", {}).items()}

    @property
    def input_dtypes(self) -> dict[str, str]:
        return {name: info["dtype"] for name, info in self.bundle["inputs"].items()}

    @property
    def output_parts(self) -> tuple[str, ...]:
        return self._user.output_parts

    @property
    def spec(self) -> Spec:
        """The spec whose names this kernel speaks (the caller's, or the canonical one)."""
        return self._user

    @property
    def input_names(self) -> tuple[str, ...]:
        """The inputs in the order the caller's spec lists them."""
        return tuple(self._input_dims)

    @property
    def input_dims(self) -> dict[str, tuple[str, ...]]:
        """Input -> its tensor's dims, caller's names (a merged dim's parts, as the tensor has them)."""
        return dict(self._input_dims)

    @property
    def output_dims(self) -> dict[str, tuple[str, ...]]:
        """Output part -> its tensor's dims in the caller's order (the order it is contiguous in)."""
        return {p.name: p.storage for p in self._parts}

    @property
    def output_dtypes(self) -> dict[str, str]:
        """Output part -> its dtype (``float32``, ``int32``...), caller's names."""
        return {p.name: p.dtype for p in self._parts}

    def output_shapes(self, sizes: Mapping[str, Any]) -> dict[str, list[Any]]:
        """Output part -> its shape, from ``sizes`` (the caller's dim -> size, as the inputs give
        them; a topk ``as`` dim may be left out: it is ``k``). Sizes are used as given, never
        converted, so torch's symbolic sizes work (a fake kernel's shapes under torch.compile)."""
        full = dict(sizes)
        for s in self._user.steps:
            if s.as_dim is not None:
                full.setdefault(s.as_dim, int(s.k))  # type: ignore[arg-type]
        return {p.name: [full[d] for d in p.storage] for p in self._parts}

    def check_out(self, out: Any, shapes: Mapping[str, list[Any]], device: Any) -> dict[str, Any]:
        """``out`` (output part -> tensor, every part) checked against ``shapes``
        (:meth:`output_shapes`), the output dtypes and ``device``; returns it as a dict.
        :class:`BundleError` naming ``out.<part>`` otherwise."""
        if not isinstance(out, Mapping):
            hint = (" (an input named 'out' is passed in the inputs dict: kernel({'out': ...}))"
                    if "out" in self._input_dims else "")
            raise BundleError(f"out: expected a dict of output part -> tensor, got {type(out).__name__}{hint}")
        ordered_tensors(out, self.output_parts, "out", "output")
        for p in self._parts:
            t = out[p.name]
            want = shapes[p.name]
            if t.dim() != len(want) or list(t.shape) != list(want):
                raise BundleError(f"out.{p.name}: has shape {tuple(t.shape)}, but the output is "
                                  f"({', '.join(p.storage)}) = {tuple(want)}")
            got = str(t.dtype).removeprefix("torch.")
            if got != p.dtype:
                raise BundleError(f"out.{p.name}: dtype {got}, but the kernel writes {p.dtype}")
            if t.device != device:
                raise BundleError(f"out.{p.name}: on {t.device}, but the inputs are on {device}")
        return {p.name: out[p.name] for p in self._parts}

    def for_spec(self, spec: Spec) -> BundleKernel:
        """This kernel speaking ``spec``'s names (``spec`` must have the bundle's spec_hash)."""
        if not isinstance(spec, Spec):
            raise BundleError(f"spec: expected a loaded Spec, got {type(spec).__name__}")
        if spec_hash(spec) != self.spec_hash:
            raise BundleError(f"spec: its spec_hash {spec_hash(spec)[:16]}... is not the bundle's "
                              f"{self.spec_hash[:16]}...")
        return BundleKernel(self.bundle, self._module, self._interpreted, exact_shape=self.exact_shape, user=spec,
                            info=self.info)

    def __repr__(self) -> str:
        return (f"BundleKernel({self._user.name}, {self.strategy}, shape={shape_text(self.shape)}, "
                f"target={self.target}, sha256={self.sha256[:12]})")

    # -- running
    def __call__(self, inputs: Mapping[str, Any] | None = None, /, *, out: Mapping[str, Any] | None = None,
                 **tensors: Any) -> dict[str, Any]:
        import torch

        if torch.compiler.is_compiling():  # traced by Dynamo, which cannot trace a launcher: run it eagerly
            return self._outside_the_graph(inputs, out=out, **tensors)
        return self._call(inputs, out=out, **tensors)

    def _call(self, inputs: Mapping[str, Any] | None = None, /, *, out: Mapping[str, Any] | None = None,
              **tensors: Any) -> dict[str, Any]:
        if not (inputs is not None and tensors):  # model-shaped tensors ([b, s, c] for x[t, c]: service.bundle.leading)
            given = inputs if inputs is not None else tensors
            if isinstance(given, Mapping):
                folded = call_folded(self._run, self._input_dims, self.output_dims, given, out)
                if folded is not None:
                    return folded
        return self._run(inputs, out=out, **tensors)

    def _run(self, inputs: Mapping[str, Any] | None = None, /, *, out: Mapping[str, Any] | None = None,
             **tensors: Any) -> dict[str, Any]:
        import torch

        if inputs is not None and tensors:
            raise BundleError("pass the inputs either as one dict or as keyword arguments, not both")
        given = dict(inputs if inputs is not None else tensors)
        given_scalars = {}
        for name in self.scalar_names:  # kernel(x=x, w=w, eps=1e-5): scalars ride with the tensors
            if name in given:
                given_scalars[name] = given.pop(name)
        expected = self.input_names
        ordered_tensors(given, expected, "inputs", "input")
        sizes: dict[str, int] = {}
        devices = set()
        for name, dims in self._input_dims.items():  # the user's dims (a merged dim's parts: c, p; pages)
            t = given[name]
            if t.dim() != len(dims):
                raise BundleError(f"inputs.{name}: has {t.dim()} dims {tuple(t.shape)}, expected "
                                  f"{len(dims)} ({', '.join(dims)})")
            if name in self.bundle["inputs"]:  # a page table is int32 or int64 (the launcher checks it)
                want = self.bundle["inputs"][name]["dtype"]
                got = str(t.dtype).removeprefix("torch.")
                if got != want:
                    raise BundleError(f"inputs.{name}: dtype {got}, but this kernel was generated for {want}"
                                      + self._dtype_hint(given))
            for d, n in zip(dims, t.shape):
                if sizes.setdefault(d, int(n)) != int(n):
                    raise BundleError(f"inputs.{name}: dim {d} has size {int(n)}, but another input "
                                      f"gives {d} = {sizes[d]}")
            devices.add(t.device)
        if self._user.page_tables:
            try:
                sizes = call_sizes(self._user, sizes)
            except ValueError as err:
                raise BundleError(f"inputs.{err}") from None
        if len(devices) > 1:
            raise BundleError(f"inputs: on several devices ({', '.join(sorted(map(str, devices)))}); put them on one")
        device = next(iter(devices))
        if device.type == "cpu" and not self._interpreted:
            raise BundleError("inputs: CPU tensors, but the kernel was loaded for the GPU; set TRITON_INTERPRET=1 "
                              "before the first load to run it through Triton's interpreter (slow; for testing)")
        for s in self._user.steps:
            if s.as_dim is not None:
                sizes[s.as_dim] = int(s.k)  # type: ignore[arg-type]
        bound, shape = self._checked(sizes)
        scalars = self._bind_scalars(given_scalars, bound)
        if out is None:  # contiguous in the caller's dim order (module docstring, "Output layout")
            dst = {p.name: torch.empty([bound[d] for d in p.storage], dtype=getattr(torch, p.dtype), device=device)
                   for p in self._parts}
        else:
            dst = self.check_out(out, self.output_shapes(sizes), device)
        if device.type == "meta":  # shapes and dtypes only: nothing to compute
            return dst
        self._check_index_values(given, bound)
        # the user's tensors: the launcher views a merged dim's parts as one (fuser_core.merged)
        canonical_inputs = {name: given[name] for name in expected}
        if has_empty_dim(shape):  # an empty batch (or axis): no launch (fuser_core/empty.py)
            stores = {part: o["dtype"] for part, o in self.bundle["outputs"].items()}
            logical = {name: as_logical(self._user, name, t, bound)
                       for name, t in gathered(self._user, canonical_inputs, bound).items()}
            return self._copy_into(dst, self._to_user(empty_outputs(self._canon, shape, logical, stores), bound))
        if not self._takes_out:
            with interpreter_quiet():
                launched = self._module.launch(canonical_inputs, shape, **scalars)
            return self._copy_into(dst, self._to_user(launched, bound))
        views, copied = {}, []
        for p in self._parts:
            view = self._kernel_view(p, dst[p.name], bound)
            if view is None:  # an out= tensor whose strides cannot merge a dim's parts: written after the launch
                tmp = torch.empty([bound[d] for d in p.dims], dtype=getattr(torch, p.dtype), device=device)
                view = tmp if p.same_order else tmp.permute(p.inverse)
                copied.append(p.name)
            views[p.canonical] = view
        with interpreter_quiet():  # under the interpreter, NumPy's warnings about discarded lanes off
            outputs = self._module.launch(canonical_inputs, shape, out=views, **scalars)
        if copied:
            back = self._to_user(outputs, bound)
            for name in copied:
                dst[name].copy_(back[name])
        return dst

    def _dtype_hint(self, given: Mapping[str, Any]) -> str:
        """What to ask the server for to run these tensors: their dtype map (issue 37, 12: a bf16
        activation with an fp32 weight is a kernel of its own, found only by asking for its map)."""
        dtypes = {}
        for inp in self._user.inputs:
            t = given.get(inp.name)
            got = str(getattr(t, "dtype", "")).removeprefix("torch.")
            if inp.is_float or got == "int32":  # index inputs are int64 unless the map says int32
                dtypes[inp.name] = got
        if len(set(dtypes.values())) == 1 and all(i.is_float for i in self._user.inputs):
            return f"; for these tensors ask for dtype {next(iter(dtypes.values()))!r}"
        return f"; for these tensors ask for the dtype map {json.dumps(dtypes)}"

    def _bind_scalars(self, given: Mapping[str, Any], bound: Mapping[str, int]) -> dict[str, Any]:
        """The launcher's keyword for the runtime params: ``{"scalars": {name: value}}`` with the
        caller's spec's defaults for those not given (the bundle's canonical spec has none: a default
        is no part of the kernel); ``{}`` for a spec without (launchers before runtime params take none)."""
        if not self.scalar_names:
            return {}
        try:
            return {"scalars": bind_scalars(self._user, bound, given)}
        except SpecError as err:  # names scalars.<name>
            raise BundleError(str(err)) from None

    def _check_index_values(self, given: Mapping[str, Any], bound: Mapping[str, int]) -> None:
        """A label outside its axis is refused, never turned into a number (fuser_core.index_values); on a
        GPU this costs one reduction and one synchronisation per index input that selects a position.

        Not while a CUDA graph is being captured: a synchronisation is illegal there, and a graph
        replays later data that no host code sees; a server that captures checks its labels (or
        runs the spec that ignores them, cross_entropy_ignore) outside the graph."""
        if not self._index_rules:
            return
        import torch

        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        for rule in self._index_rules:
            bad = first_out_of_range(rule, given[rule.name], bound[rule.dim])
            if bad is not None:
                raise BundleError(f"inputs.{rule.name}: {out_of_range_message(rule, bound[rule.dim], *bad)}")

    def _kernel_view(self, p: _OutputPart, tensor: Any, bound: Mapping[str, int]) -> Any:
        """The caller's output tensor as the kernel writes it (canonical dim order, a merged dim as
        one): a view, or None where the caller's strides do not merge a dim's parts into one."""
        if p.storage != p.dims:
            try:
                tensor = tensor.view([bound[d] for d in p.dims])
            except RuntimeError:
                return None
        return tensor if p.same_order else tensor.permute(p.inverse)

    @staticmethod
    def _copy_into(dst: dict[str, Any], results: Mapping[str, Any]) -> dict[str, Any]:
        """Results computed elsewhere (no launch, or a launcher without out=) written into ``dst``."""
        for name, tensor in dst.items():
            tensor.copy_(results[name])
        return dst

    def _checked(self, sizes: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
        """:meth:`_check_sizes`, remembered per distinct sizes (read-only results; a refusal is not
        remembered). Cleared when full: a decode loop's growing KV length brings a new size per step."""
        key = tuple(sizes.items())  # the inputs' order fixes the items' order
        checked = self._checked_sizes.get(key)
        if checked is None:
            checked = self._check_sizes(sizes)
            if len(self._checked_sizes) >= CHECKED_SIZES_KEPT:
                self._checked_sizes.clear()
            self._checked_sizes[key] = checked
        return checked

    def _check_sizes(self, sizes: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
        """The sizes bound to the caller's spec, and in canonical names."""
        try:
            bound = bind_shape(self._user, sizes, allow_empty=True)
        except SpecError as err:
            raise BundleError(f"inputs: {err}") from None
        shape = {self._names[d]: n for d, n in bound.items()}
        if self.exact_shape and shape != self.bundle["shape"]:
            raise BundleError(f"inputs: sizes {shape_text(sizes)} are not the tuned shape {shape_text(self.shape)} "
                              "(the kernel was loaded with exact_shape=True)")
        for d, limit in self.bundle.get("size_limits", {}).items():
            if shape[d] > limit:
                raise BundleError(
                    f"inputs: dim {self._back[d]} = {shape[d]} is larger than {limit}, the block this "
                    f"{self.strategy} kernel holds it in (it was generated for {self._back[d]} = "
                    f"{self.bundle['shape'][d]}); fetch or tune a kernel for this shape")
        return bound, shape

    def _to_user(self, outputs: Mapping[str, Any], bound: Mapping[str, int]) -> dict[str, Any]:
        """Canonical output parts -> the caller's names, dims permuted to the caller's order (a
        merged dim split into its parts): views of the kernel's tensors."""
        out = {}
        for p in self._parts:
            tensor = outputs[p.canonical]
            tensor = tensor if p.same_order else tensor.permute(p.order)
            out[p.name] = to_storage(self._user, p.dims, tensor, bound)
        return out


TRACE_ADVICE = ("a Foldwise kernel called inside torch.compile runs outside the graph (its launcher is not "
                "traceable); for one that compiles, fullgraph included, call KernelCache.torch_op(...) instead")


def _outside_the_graph(call: Any) -> Any:
    """``call`` marked for Dynamo to leave out of the graph, with the reason (issue 37, 11: under
    torch.compile(fullgraph=True) a raw kernel failed with "Attempted to call function marked as
    skipped", and without fullgraph the interpreter's launch crashed inside the trace)."""
    import torch

    try:
        return torch.compiler.disable(call, reason=TRACE_ADVICE)
    except TypeError:  # a torch without disable(reason=)
        return torch.compiler.disable(call)
