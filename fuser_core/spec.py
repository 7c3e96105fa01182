"""Cascade spec v1: load, validate and infer dims (docs/SPEC.md).

:func:`load_spec` is the only way a spec enters Foldwise. It accepts JSON text, bytes or
an already-decoded dict, checks every field, parses every expression with our own grammar
(:mod:`fuser_core.expr`), infers each step's named dims, and returns an immutable
:class:`Spec`. Anything wrong raises :class:`~fuser_core.errors.SpecError` naming the
step and field. Sizes are limited so that a request cannot make us do unbounded work.

Example:
    >>> spec = load_spec('''{"foldwise": 1, "name": "lse", "inputs": {"x": {"dims": ["m", "n"]}},
    ...   "steps": [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
    ...             {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - mx)"},
    ...             {"name": "lse", "expr": "mx + log(den)"}], "outputs": ["lse"]}''')
    >>> spec.step("den").dims
    ('m',)
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from fuser_core import expr as ex
from fuser_core.errors import SpecError, shown
from fuser_core.reduce_ops import SPEC_REDUCE_KINDS, is_selection, returns_indices
# the spec as data lives in spec_model; its names are the spec's public names, read from here too
from fuser_core.spec_paged import check_page_tables, load_paged
from fuser_core.spec_model import INPUT_KINDS, Input, Paged, Param, Spec, Step, raw_param  # noqa: F401

MAX_SPEC_BYTES = 64 * 1024
MAX_INPUTS = 16
MAX_DIMS_PER_INPUT = 8
MAX_DIMS = 16
MAX_PARAMS = 32
MAX_STEPS = 64
MAX_OUTPUTS = 16
MAX_TOPK = 1024
MAX_INLINED_NODES = 20_000  # an expression with every elementwise step substituted
MAX_DOC_CHARS = 4096
MAX_MERGED = 4  # dims one list 'over' reduces together

IDENT = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}\Z")
SPEC_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}\Z")
TOP_KEYS = {"foldwise", "name", "doc", "inputs", "params", "steps", "outputs", "output_dtypes", "constraints", "example"}
OUTPUT_DTYPES = ("float32", "float16", "bfloat16")  # what "output_dtypes" may store an output as
# a shape constraint: two dims and how their sizes compare ("m <= n"); read by this pattern, never evaluated
CONSTRAINT = re.compile(r"\s*([A-Za-z][A-Za-z0-9_]{0,63})\s*(<=|<|==|>=|>)\s*([A-Za-z][A-Za-z0-9_]{0,63})\s*\Z")
MAX_CONSTRAINTS = 16
STEP_KEYS = {"name", "expr", "reduce", "over", "k", "as", "doc"}
INPUT_KEYS = {"dims", "kind", "doc", "paged"}
RUNTIME_PARAM_KEYS = {"runtime", "default", "positive", "doc"}
RUNTIME_KINDS = ("float",)  # a runtime scalar is passed to the kernel as fp32 (never an int: see docs/SPEC.md)


def oriented(a: str, rel: str, b: str) -> tuple[str, str, str]:
    """One way to write a constraint: ``n >= m`` as ``m <= n``, ``n == m`` with its dims sorted."""
    if rel in (">", ">="):
        return b, rel.replace(">", "<"), a
    return (min(a, b), rel, max(a, b)) if rel == "==" else (a, rel, b)


def _decode(source: str | bytes | Mapping[str, Any]) -> Any:
    if isinstance(source, Mapping):
        return source
    if isinstance(source, bytes):
        if len(source) > MAX_SPEC_BYTES:
            raise SpecError(f"spec is {len(source)} bytes; the limit is {MAX_SPEC_BYTES}")
        try:
            source = source.decode("utf-8")
        except UnicodeDecodeError as err:
            raise SpecError(f"spec is not UTF-8: {err}") from None
    if not isinstance(source, str):
        raise SpecError(f"spec must be a JSON object, got {type(source).__name__}")
    if len(source) > MAX_SPEC_BYTES or len(source.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise SpecError(f"spec is larger than {MAX_SPEC_BYTES} bytes")
    try:
        return json.loads(source, parse_constant=_reject_constant)
    except json.JSONDecodeError as err:
        raise SpecError(f"not valid JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    except RecursionError:
        raise SpecError("JSON nests too deeply") from None
    except SpecError:
        raise
    except ValueError as err:  # e.g. an integer of more than 4300 digits (sys.get_int_max_str_digits)
        raise SpecError(f"not valid JSON: {err}") from None


def _reject_constant(name: str) -> Any:
    raise SpecError(f"JSON constant {name} is not allowed; write numbers, or 'inf' inside an expression")


def load_spec(source: str | bytes | Mapping[str, Any], *, printed: bool = False) -> Spec:
    """Validate a spec and return it with every expression parsed and every dim inferred.

    ``printed=True`` is for specs whose expressions we printed ourselves (a canonical form):
    their text may be longer than the user's, so the character limit is
    :data:`~fuser_core.expr.MAX_PRINTED_CHARS`; every other limit is unchanged.
    """
    return _Loader(_decode(source), ex.MAX_PRINTED_CHARS if printed else ex.MAX_EXPR_CHARS).load()


class _Loader:
    def __init__(self, raw: Any, max_expr_chars: int):
        self.raw = raw
        self.max_expr_chars = max_expr_chars
        self.by_name: dict[str, Input | Param | Step] = {}
        self.dims: list[str] = []
        self.merges: dict[str, tuple[str, ...]] = {}  # merged dim -> its parts (Spec.merges)
        self.merged_into: dict[str, str] = {}  # part -> its merged dim

    # -- small checks
    def ident(self, value: Any, loc: tuple[str | int, ...], what: str, step: str | None = None) -> str:
        if not isinstance(value, str) or not IDENT.match(value):
            raise SpecError(
                f"{what} must be an identifier (a letter, then letters, digits or _; at most 64), got {shown(value)}",
                loc=loc, step=step,
            )
        if value in ex.RESERVED:
            raise SpecError(f"{what} {value!r} is a reserved word of the expression language", loc=loc, step=step)
        return value

    def keys(self, obj: Any, allowed: set[str], loc: tuple[str | int, ...], step: str | None = None) -> None:
        if not isinstance(obj, dict):
            raise SpecError(f"expected an object, got {type(obj).__name__}", loc=loc, step=step)
        unknown = sorted(set(obj) - allowed, key=str)  # a dict given directly may have non-str keys
        if unknown:
            raise SpecError(
                f"unknown field {shown(unknown[0])} (allowed: {', '.join(sorted(allowed))})", loc=loc, step=step
            )

    def declare(self, name: str, obj: Input | Param | Step, loc: tuple[str | int, ...], step: str | None) -> None:
        if name in self.by_name:
            raise SpecError(f"name {name!r} is already used by an earlier input, param or step", loc=loc, step=step)
        if name in self.dims:
            raise SpecError(f"name {name!r} is already a dim name", loc=loc, step=step)
        self.by_name[name] = obj

    # -- the spec
    def load(self) -> Spec:
        raw = self.raw
        self.keys(raw, TOP_KEYS, ())
        for required in ("foldwise", "name", "inputs", "steps", "outputs"):
            if required not in raw:
                raise SpecError("this field is required", loc=(required,))
        if type(raw["foldwise"]) is not int or raw["foldwise"] != 1:  # not True, not 1.0
            raise SpecError(f"unsupported format version {shown(raw['foldwise'], 40)}; expected 1", loc=("foldwise",))
        name = raw["name"]
        if not isinstance(name, str) or not SPEC_NAME.match(name):
            raise SpecError(f"must match [a-z][a-z0-9_]* (at most 64 characters), got {shown(name)}", loc=("name",))
        doc = raw.get("doc", "")
        if not isinstance(doc, str) or len(doc) > MAX_DOC_CHARS:
            raise SpecError(f"must be text of at most {MAX_DOC_CHARS} characters", loc=("doc",))

        inputs = self.merge_dims(self.load_inputs(raw["inputs"]), raw["steps"])
        params = self.load_params(raw.get("params", {}))
        steps = self.load_steps(raw["steps"])
        outputs = self.load_outputs(raw["outputs"], steps)
        self.check_reachability(inputs, params, steps, outputs)
        check_page_tables(self, inputs)
        spec = Spec(
            name=name, doc=doc, inputs=inputs, params=params, steps=steps, outputs=outputs,
            dims=tuple(self.dims), merges=dict(self.merges), _by_name=dict(self.by_name),
        )
        constraints = self.load_constraints(raw.get("constraints", []), spec.sized_dims)
        spec = replace(spec, constraints=constraints) if constraints else spec
        if "output_dtypes" in raw:
            spec = replace(spec, output_dtypes=self.load_output_dtypes(raw["output_dtypes"], spec))
        return replace(spec, example=self.load_example(raw["example"])) if "example" in raw else spec

    def load_example(self, raw: Any) -> dict[str, int]:
        """``"example": {"m": 3, "n": 37}``: a shape the spec runs at, dim -> a positive size. Bound
        to the spec (its dims, limits and constraints) where a command uses it, as every shape is
        (fuser_core.problem.bind_shape; service.cli.checks names it ``example``)."""
        if not isinstance(raw, dict) or not raw or len(raw) > MAX_DIMS:
            raise SpecError(f"expected an object of at most {MAX_DIMS} dim -> size, such as {{\"m\": 4, \"n\": 300}}",
                            loc=("example",))
        for d, n in raw.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise SpecError(f"must be a positive integer, got {shown(n, 40)}", loc=("example", str(d)))
        return dict(raw)

    def load_constraints(self, raw: Any, dims: tuple[str, ...]) -> tuple[tuple[str, str, str], ...]:
        """``"constraints": ["m <= n", ...]``: each two of the spec's dims and a relation (<, <=, ==,
        >=, >), matched by a pattern (no user text is evaluated); sorted, duplicates dropped."""
        if not isinstance(raw, list):
            raise SpecError('expected a list of constraints such as "m <= n"', loc=("constraints",))
        if len(raw) > MAX_CONSTRAINTS:
            raise SpecError(f"{len(raw)} constraints; the limit is {MAX_CONSTRAINTS}", loc=("constraints",))
        out = set()
        for i, text in enumerate(raw):
            m = CONSTRAINT.match(text) if isinstance(text, str) else None
            if m is None:
                raise SpecError(f'expected "<dim> <relation> <dim>" (relation <, <=, ==, >= or >), got {shown(text)}',
                                loc=("constraints", i))
            a, rel, b = m.groups()
            for d in (a, b):
                if d not in dims:
                    raise SpecError(f"{d!r} is not a dim of this spec (its dims: {', '.join(dims)})", loc=("constraints", i))
            if a == b:
                raise SpecError(f"compares {a!r} with itself", loc=("constraints", i))
            out.add(oriented(a, rel, b))
        return tuple(sorted(out))

    def load_inputs(self, raw: Any) -> tuple[Input, ...]:
        if not isinstance(raw, dict) or not raw:
            raise SpecError("expected a non-empty object of input name -> {dims}", loc=("inputs",))
        if len(raw) > MAX_INPUTS:
            raise SpecError(f"{len(raw)} inputs; the limit is {MAX_INPUTS}", loc=("inputs",))
        out = []
        for name, decl in raw.items():
            loc: tuple[str | int, ...] = ("inputs", name)
            self.ident(name, loc, "input name")
            self.keys(decl, INPUT_KEYS, loc)
            dims = decl.get("dims")
            if not isinstance(dims, list):
                raise SpecError("expected a list of dim names", loc=(*loc, "dims"))
            if len(dims) > MAX_DIMS_PER_INPUT:
                raise SpecError(f"{len(dims)} dims; the limit is {MAX_DIMS_PER_INPUT}", loc=(*loc, "dims"))
            for i, d in enumerate(dims):
                self.ident(d, (*loc, "dims", i), "dim name")
                if d in raw:
                    raise SpecError(f"dim {d!r} clashes with the input of that name", loc=(*loc, "dims", i))
            if len(set(dims)) != len(dims):
                dup = next(d for d in dims if dims.count(d) > 1)
                raise SpecError(f"dim {dup!r} appears twice in one input", loc=(*loc, "dims"))
            kind = decl.get("kind", "float")
            if kind not in ("float", "index"):
                raise SpecError(f"must be 'index' or 'float', got {shown(kind, 40)}", loc=(*loc, "kind"))
            for d in dims:
                if d not in self.dims:
                    self.dims.append(d)
            if len(self.dims) > MAX_DIMS:
                raise SpecError(f"the spec uses more than {MAX_DIMS} dims", loc=(*loc, "dims"))
            paged = load_paged(self, decl["paged"], tuple(dims), kind, out, (*loc, "paged")) if "paged" in decl else None
            inp = Input(name, tuple(dims), kind, paged=paged)
            self.declare(name, inp, loc, None)
            out.append(inp)
        return tuple(out)

    def merge_dims(self, inputs: tuple[Input, ...], raw_steps: Any) -> tuple[Input, ...]:
        """Reductions with a list ``over`` ([c, p]) merge those dims into one, ``c_p`` (of size
        size(c) * size(p)), and inputs' dims are logical from here on: an input holding them holds
        the merged dim in their place (they must be next to each other, in that order: a view of
        the tensor), and one holding some of them (a per-channel weight [c]) holds the merged dim
        too, its values repeated along the others (:mod:`fuser_core.merged`, at the launch)."""
        if not isinstance(raw_steps, list):
            return inputs  # load_steps reports it
        for i, s in enumerate(raw_steps):
            over = s.get("over") if isinstance(s, dict) else None
            if not isinstance(over, list):
                continue
            loc: tuple[str | int, ...] = ("steps", i, "over")
            sname = s.get("name") if isinstance(s.get("name"), str) else None
            if not 2 <= len(over) <= MAX_MERGED:
                raise SpecError(f"a list 'over' names 2 to {MAX_MERGED} dims, got {len(over)}", loc=loc, step=sname)
            parts = tuple(self.ident(d, (*loc, k), "dim name", sname) for k, d in enumerate(over))
            if len(set(parts)) != len(parts):
                raise SpecError("names a dim twice", loc=loc, step=sname)
            for d in parts:
                if d not in self.dims:
                    raise SpecError(f"unknown dim {d!r}", loc=loc, step=sname)
            known = next((m for m, ps in self.merges.items() if set(ps) & set(parts)), None)
            if known is not None:
                if self.merges[known] != parts:
                    raise SpecError(f"dims {', '.join(set(self.merges[known]) & set(parts))} are already reduced "
                                    f"together as {list(self.merges[known])}; every list 'over' with them must be "
                                    "that list", loc=loc, step=sname)
                continue
            merged = "_".join(parts)
            while merged in self.dims or any(merged == inp.name for inp in inputs) or merged in self.merges:
                merged += "_"
            self.merges[merged] = parts
            self.merged_into.update({d: merged for d in parts})
        if not self.merges:
            return inputs
        out = []
        for inp in inputs:
            dims: list[str] = []
            for d in inp.dims:
                merged = self.merged_into.get(d)
                if merged is None:
                    dims.append(d)
                    continue
                parts = self.merges[merged]
                held = [p for p in inp.dims if p in parts]
                start = inp.dims.index(held[0])
                if list(inp.dims[start:start + len(held)]) != held or held != [p for p in parts if p in held]:
                    raise SpecError(f"dims {', '.join(held)} are reduced together as {list(parts)}: an input "
                                    "must hold them next to each other, in that order", loc=("inputs", inp.name, "dims"))
                if not dims or dims[-1] != merged:
                    dims.append(merged)
            if tuple(dims) == inp.dims:
                out.append(inp)
                continue
            new = replace(inp, dims=tuple(dims), storage_dims=inp.dims)
            self.by_name[inp.name] = new
            out.append(new)
        order: list[str] = []
        for inp in out:
            order.extend(d for d in inp.dims if d not in order)
        self.dims = order
        return tuple(out)

    def load_params(self, raw: Any) -> tuple[Param, ...]:
        if not isinstance(raw, dict):
            raise SpecError("expected an object of param name -> number, expression or {\"runtime\": \"float\"}",
                            loc=("params",))
        if len(raw) > MAX_PARAMS:
            raise SpecError(f"{len(raw)} params; the limit is {MAX_PARAMS}", loc=("params",))
        out = []
        for name, value in raw.items():
            loc: tuple[str | int, ...] = ("params", name)
            self.ident(name, loc, "param name")
            p = self.load_runtime_param(name, value, loc) if isinstance(value, dict) else Param(name, self.param_expr(value, loc))
            self.declare(name, p, loc, None)
            out.append(p)
        return tuple(out)

    def load_runtime_param(self, name: str, raw: dict, loc: tuple[str | int, ...]) -> Param:
        """``{"runtime": "float", "default": ..., "positive": true}``: a scalar passed at call time."""
        self.keys(raw, RUNTIME_PARAM_KEYS, loc)
        kind = raw.get("runtime")
        if kind not in RUNTIME_KINDS:
            raise SpecError(f"a param given as an object is a runtime scalar: 'runtime' must be "
                            f"{' or '.join(map(repr, RUNTIME_KINDS))}, got {shown(kind, 40)}", loc=(*loc, "runtime"))
        positive = raw.get("positive", False)
        if not isinstance(positive, bool):
            raise SpecError(f"must be true or false, got {shown(positive, 40)}", loc=(*loc, "positive"))
        doc = raw.get("doc", "")
        if not isinstance(doc, str) or len(doc) > MAX_DOC_CHARS:
            raise SpecError(f"must be text of at most {MAX_DOC_CHARS} characters", loc=(*loc, "doc"))
        default = None
        if "default" in raw:
            default = self.param_expr(raw["default"], (*loc, "default"))
            if positive and isinstance(default, ex.Num) and not default.value > 0:
                raise SpecError(f"the param is declared positive, but its default is {default.value:g}",
                                loc=(*loc, "default"))
        return Param(name, default, runtime=True, positive=positive)

    def param_expr(self, value: Any, loc: tuple[str | int, ...]) -> ex.Expr:
        """A constant param (or a runtime param's default): a finite number, or an expression of
        numbers and size(dim)."""
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise SpecError("expected a number or an expression string", loc=loc)
        if isinstance(value, str):
            e = ex.parse_expr_text(value, loc, max_chars=self.max_expr_chars)
        else:
            try:
                number = float(value)
            except OverflowError:  # an int too large for a float
                number = math.inf
            if not math.isfinite(number):
                raise SpecError("must be a finite number", loc=loc)
            e = ex.Num(number)
        for node in ex.walk(e):
            if isinstance(node, ex.Ref):
                raise SpecError(f"unknown name {node.name!r}: a param may use numbers and size(dim) only", loc=loc)
            if isinstance(node, ex.Index):
                raise SpecError("index() has no meaning in a param; use it in a step", loc=loc)
            if isinstance(node, ex.Size) and node.dim not in self.dims and node.dim not in self.merged_into:
                raise SpecError(f"size() of unknown dim {node.dim!r}", loc=loc)
            if isinstance(node, ex.Compare | ex.Logic | ex.Str):
                raise SpecError("comparisons, and/or/not and strings are not allowed in a param", loc=loc)
            if isinstance(node, ex.Call) and node.func == "where":
                raise SpecError("where() is not allowed in a param", loc=loc)
        return e

    def load_steps(self, raw: Any) -> tuple[Step, ...]:
        if not isinstance(raw, list) or not raw:
            raise SpecError("expected a non-empty list of steps", loc=("steps",))
        if len(raw) > MAX_STEPS:
            raise SpecError(f"{len(raw)} steps; the limit is {MAX_STEPS}", loc=("steps",))
        later = {s.get("name") for s in raw if isinstance(s, dict) and isinstance(s.get("name"), str)}
        steps: list[Step] = []
        inlined: dict[str, int] = {}
        for i, s in enumerate(raw):
            step = self.load_step(i, s, later)
            later.discard(step.name)
            size = sum(inlined.get(n.name, 1) if isinstance(n, ex.Ref) else 1 for n in ex.walk(step.expr))
            if size > MAX_INLINED_NODES:
                raise SpecError(
                    f"expression grows to {size} nodes once earlier steps are substituted; the limit is {MAX_INLINED_NODES}",
                    loc=("steps", i, "expr"), step=step.name,
                )
            inlined[step.name] = 1 if step.is_reduction else size
            steps.append(step)
        return tuple(steps)

    def load_step(self, i: int, raw: Any, later: set[str]) -> Step:
        loc: tuple[str | int, ...] = ("steps", i)
        self.keys(raw, STEP_KEYS, loc)
        sname = raw.get("name")
        self.ident(sname, (*loc, "name"), "step name")
        if "expr" not in raw:
            raise SpecError("this field is required", loc=(*loc, "expr"), step=sname)
        e = ex.parse_expr_text(raw["expr"], (*loc, "expr"), sname, self.max_expr_chars)
        self.check_expr(e, (*loc, "expr"), sname, later)
        edims = self.expr_dims(e)

        reduce = raw.get("reduce")
        if reduce is None:
            for key in ("over", "k", "as"):
                if key in raw:
                    raise SpecError(f"{key!r} needs 'reduce'", loc=(*loc, key), step=sname)
            step = Step(sname, e, edims)
            self.declare(sname, step, (*loc, "name"), sname)
            return step
        if reduce not in SPEC_REDUCE_KINDS:
            raise SpecError(f"unknown reduction {shown(reduce, 40)}; one of {', '.join(SPEC_REDUCE_KINDS)}", loc=(*loc, "reduce"), step=sname)
        over = raw.get("over")
        if over is None:
            raise SpecError("a reduction needs 'over' (the dim it reduces)", loc=(*loc, "over"), step=sname)
        if isinstance(over, list):  # checked by merge_dims: one loop over the merged dim
            if is_selection(reduce):
                raise SpecError(f"{reduce} over several dims is not supported (a position in one of them)",
                                loc=(*loc, "over"), step=sname)
            over = self.merged_into[over[0]]
        elif isinstance(over, str) and over in self.merged_into:
            merged = self.merged_into[over]
            raise SpecError(f"{over!r} is reduced together with the others of {list(self.merges[merged])} by another "
                            "step: reduce over that list here too", loc=(*loc, "over"), step=sname)
        self.ident(over, (*loc, "over"), "dim name", sname)
        if over not in self.dims:
            raise SpecError(f"unknown dim {over!r}", loc=(*loc, "over"), step=sname)
        if over not in edims:
            raise SpecError(
                f"reduces over {over!r}, but its expression has dims ({', '.join(edims)})", loc=(*loc, "over"), step=sname
            )
        dims = tuple(d for d in edims if d != over)
        k = as_dim = None
        if reduce == "topk":
            k = raw.get("k")
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_TOPK:
                raise SpecError(f"topk needs 'k', an integer from 1 to {MAX_TOPK}", loc=(*loc, "k"), step=sname)
            as_dim = self.ident(raw.get("as"), (*loc, "as"), "topk 'as' dim", sname)
            if as_dim in self.dims:
                raise SpecError(f"dim {as_dim!r} already exists; 'as' must name a new dim", loc=(*loc, "as"), step=sname)
            if as_dim in self.by_name or as_dim == sname:
                raise SpecError(f"dim {as_dim!r} clashes with a name of the spec", loc=(*loc, "as"), step=sname)
            self.dims.append(as_dim)
            if len(self.dims) > MAX_DIMS:
                raise SpecError(f"the spec uses more than {MAX_DIMS} dims", loc=(*loc, "as"), step=sname)
            dims = (*dims, as_dim)
        else:
            for key in ("k", "as"):
                if key in raw:
                    raise SpecError(f"{key!r} is only for topk", loc=(*loc, key), step=sname)
        step = Step(sname, e, dims, reduce, over, k, as_dim)
        self.declare(sname, step, (*loc, "name"), sname)
        return step

    def check_expr(self, e: ex.Expr, loc: tuple[str | int, ...], step: str, later: set[str]) -> None:
        def visit(node: ex.Expr, cond_ok: bool) -> None:
            if isinstance(node, ex.Ref):
                obj = self.by_name.get(node.name)
                if obj is None:
                    if node.name == step:
                        raise SpecError(f"step {step!r} uses itself (a cycle)", loc=loc, step=step)
                    if node.name in later:
                        raise SpecError(
                            f"uses step {node.name!r}, which comes later: steps run in order, so this would be a cycle",
                            loc=loc, step=step,
                        )
                    if node.name in self.dims:
                        raise SpecError(f"{node.name!r} is a dim; use size({node.name}) or index({node.name})", loc=loc, step=step)
                    raise SpecError(f"unknown name {node.name!r}", loc=loc, step=step)
                is_topk = isinstance(obj, Step) and obj.reduce == "topk"
                if node.part is not None and not is_topk:
                    raise SpecError(f".{node.part} is only for topk steps; {node.name!r} is not one", loc=loc, step=step)
                if is_topk and node.part is None:
                    raise SpecError(f"{node.name!r} is a topk step: use {node.name}.values or {node.name}.indices", loc=loc, step=step)
            elif isinstance(node, ex.Size | ex.Index):
                if isinstance(node, ex.Index) and node.dim in self.merged_into:
                    raise SpecError(f"index({node.dim}) of a dim reduced together with others "
                                    f"({list(self.merges[self.merged_into[node.dim]])}) is not supported",
                                    loc=loc, step=step)
                if node.dim not in self.dims and not (isinstance(node, ex.Size) and node.dim in self.merged_into):
                    raise SpecError(f"unknown dim {node.dim!r}", loc=loc, step=step)
            elif isinstance(node, ex.Compare) and not cond_ok:
                raise SpecError("a comparison may only be the condition of where()", loc=loc, step=step)
            elif isinstance(node, ex.Logic):
                if not cond_ok:
                    raise SpecError(f"{node.op} may only combine the conditions of where()", loc=loc, step=step)
                for arg in node.args:
                    if not isinstance(arg, ex.CONDITIONS):
                        raise SpecError(f"{node.op} combines comparisons (or and/or/not of them), got "
                                        f"{ex.to_text(arg)!r}", loc=loc, step=step)
                    visit(arg, True)
                return
            elif isinstance(node, ex.Str):
                raise SpecError("a string may only be the dtype of cast()", loc=loc, step=step)
            if isinstance(node, ex.Call) and node.func == "where":
                cond, a, b = node.args
                if not isinstance(cond, ex.CONDITIONS):
                    raise SpecError("where() needs a comparison (or and/or/not of comparisons) as its first argument",
                                    loc=loc, step=step)
                visit(cond, True)
                visit(a, False)
                visit(b, False)
                return
            for child in ex.children(node):
                visit(child, False)

        visit(e, False)

    def expr_dims(self, e: ex.Expr) -> tuple[str, ...]:
        found: set[str] = set()
        for node in ex.walk(e):
            if isinstance(node, ex.Ref):
                obj = self.by_name[node.name]
                if not isinstance(obj, Param):
                    found.update(obj.dims)
            elif isinstance(node, ex.Index):
                found.add(node.dim)
        return tuple(d for d in self.dims if d in found)

    def load_output_dtypes(self, raw: Any, spec: Spec) -> tuple[tuple[str, str], ...]:
        """``"output_dtypes": {"mx": "float32"}``: an output's storage dtype where it is not the float
        inputs' (docs/SPEC.md); a value output only (an arg-reduction's indices are int32; a top-k's
        values take it, its indices stay int32)."""
        if not isinstance(raw, dict) or len(raw) > MAX_OUTPUTS:
            raise SpecError(f"expected an object of at most {MAX_OUTPUTS} outputs -> dtype", loc=("output_dtypes",))
        for name, dtype in raw.items():
            if name not in spec.outputs:
                raise SpecError(f"{shown(name)} is not an output", loc=("output_dtypes", name))
            step = spec.step(name)
            if returns_indices(step.reduce):
                raise SpecError(f"{name!r} writes indices; only a value output takes a dtype", loc=("output_dtypes", name))
            if dtype not in OUTPUT_DTYPES:
                raise SpecError(f"{shown(dtype)}: one of {', '.join(OUTPUT_DTYPES)}", loc=("output_dtypes", name))
        return tuple(sorted(raw.items()))

    def load_outputs(self, raw: Any, steps: tuple[Step, ...]) -> tuple[str, ...]:
        if not isinstance(raw, list) or not raw:
            raise SpecError("expected a non-empty list of step names", loc=("outputs",))
        if len(raw) > MAX_OUTPUTS:
            raise SpecError(f"{len(raw)} outputs; the limit is {MAX_OUTPUTS}", loc=("outputs",))
        names = {s.name for s in steps}
        for i, name in enumerate(raw):
            if not isinstance(name, str) or name not in names:
                obj = self.by_name.get(name) if isinstance(name, str) else None
                what = "an input" if isinstance(obj, Input) else "a param" if isinstance(obj, Param) else "not a step"
                raise SpecError(f"{shown(name)} is {what}; outputs name steps", loc=("outputs", i))
            if raw.index(name) != i:
                raise SpecError(f"{name!r} is listed twice", loc=("outputs", i))
        return tuple(raw)

    def check_reachability(self, inputs, params, steps, outputs) -> None:
        used: set[str] = set(outputs)
        for step in reversed(steps):
            if step.name in used:
                used.update(n.name for n in ex.walk(step.expr) if isinstance(n, ex.Ref))
        for i, step in enumerate(steps):
            if step.name not in used:
                raise SpecError("does not reach any output (remove it or list it in outputs)", loc=("steps", i, "name"), step=step.name)
        for inp in inputs:
            if inp.name not in used:
                raise SpecError("is not used by any step that reaches an output", loc=("inputs", inp.name))
        for p in params:  # a kernel argument the kernel ignores would take a caller's value silently
            if p.runtime and p.name not in used:
                raise SpecError("a runtime param must be used by a step that reaches an output", loc=("params", p.name))
