"""One reduction of the unfused chain as a spec of its own (a *sub-spec*): the original inputs it
needs and the earlier results it reads as inputs, the elementwise steps it needs and itself; and
the sub-spec's derivation, memoised in-process.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fuser_core import expr as ex
from fuser_core.codegen.config import NotValid
from fuser_core.derive import Derivation, derive_cascade
from fuser_core.reference import param_values
from fuser_core.spec import Input, Spec, Step

# ---------------------------------------------------------------- caching


_DERIVATIONS: dict[str, Derivation] = {}


def sub_derivation(sub: Spec, raw: dict[str, Any]) -> Derivation:
    """Derivations of sub-specs, memoised in-process (sympy is the slow part of a cache hit)."""
    text = json.dumps(raw, sort_keys=True)
    if text not in _DERIVATIONS:
        _DERIVATIONS[text] = derive_cascade(sub)
    return _DERIVATIONS[text]


# ---------------------------------------------------------------- sub-specs


def _refs(e: ex.Expr) -> list[ex.Ref]:
    return [n for n in ex.walk(e) if isinstance(n, ex.Ref)]


def step_reads(spec: Spec, step: Step) -> tuple[list[str], list[Step], list[str], list[str]]:
    """What ``step`` needs, through the elementwise steps it reads: (inputs, elementwise steps
    in step order, reduction parts, params)."""
    inputs: set[str] = set()
    elementwise: set[str] = set()
    parts: set[str] = set()
    params: set[str] = set()
    todo = [step.expr]
    while todo:
        for ref in _refs(todo.pop()):
            obj = spec.lookup(ref.name)
            if isinstance(obj, Step) and obj.is_reduction:
                parts.add(ref.name if ref.part is None else f"{ref.name}.{ref.part}")
            elif isinstance(obj, Step):
                if ref.name not in elementwise:
                    elementwise.add(ref.name)
                    todo.append(obj.expr)
            elif isinstance(obj, Input):
                inputs.add(ref.name)
            else:
                params.add(ref.name)
    order = [s.name for s in spec.steps]
    return (
        [i.name for i in spec.inputs if i.name in inputs],
        [s for s in spec.steps if s.name in elementwise],
        sorted(parts, key=lambda p: (order.index(p.split(".")[0]), p)),
        [p.name for p in spec.params if p.name in params],
    )


def part_dims(spec: Spec, part: str) -> tuple[str, ...]:
    return spec.step(part.split(".")[0]).dims


def part_is_index(spec: Spec, part: str) -> bool:
    return part.endswith(".indices") or spec.step(part.split(".")[0]).is_integer


def _input_names(spec: Spec) -> dict[str, str]:
    """Input name in a sub-spec for every reduction part: the step's name; ``g_values`` /
    ``g_indices`` for a topk step's parts (made unique against every name and dim)."""
    taken = {i.name for i in spec.inputs} | {p.name for p in spec.params} | {s.name for s in spec.steps} | set(spec.dims)
    out: dict[str, str] = {}
    for s in spec.steps:
        if not s.is_reduction:
            continue
        if s.reduce != "topk":
            out[s.name] = s.name
            continue
        for part in s.parts:
            name = part.replace(".", "_")
            while name in taken:
                name += "_"
            taken.add(name)
            out[part] = name
    return out


def sub_spec(spec: Spec, step: Step, shape: Mapping[str, int]) -> tuple[dict[str, Any], dict[str, tuple[str, str]]]:
    """The one-reduction spec of ``step`` (a raw dict for :func:`load_spec`) and its reads."""
    inputs, elementwise, parts, params = step_reads(spec, step)
    names = _input_names(spec)
    raw_inputs: dict[str, Any] = {}
    reads: dict[str, tuple[str, str]] = {}
    for name in inputs:
        inp = spec.input(name)
        raw_inputs[name] = {"dims": list(inp.dims), **({"kind": inp.kind} if not inp.is_float else {})}
        reads[name] = ("input", name)
    for part in parts:
        decl: dict[str, Any] = {"dims": list(part_dims(spec, part))}
        if part_is_index(spec, part):
            decl["kind"] = "index"
        raw_inputs[names[part]] = decl
        reads[names[part]] = ("step", part)
    dims = {d for decl in raw_inputs.values() for d in decl["dims"]}
    # a dim the step reads only through index() (a mask over valid tokens, index(t) < length) has no
    # input to carry it into a spec of its own: the fused strategies run such a step, the chain cannot
    indexed = {n.dim for s in [*elementwise, step] for n in ex.walk(s.expr) if isinstance(n, ex.Index)}
    carried = sorted((indexed | {step.over}) - dims - {None})
    if carried:
        raise NotValid(f"the unfused chain cannot run step {step.name!r} alone: it reads dim "
                       f"{', '.join(carried)} only through index(), and no input it reads has that dim "
                       "(the fused strategies run it)")
    values = param_values(spec, shape)

    def rewrite(node: ex.Expr) -> ex.Expr | None:
        if isinstance(node, ex.Ref) and node.part is not None:
            return ex.Ref(names[f"{node.name}.{node.part}"])
        if isinstance(node, ex.Size) and node.dim not in dims:
            return ex.Num(float(shape[node.dim]))  # a dim this kernel does not have: its size is a constant
        return None

    raw_params: dict[str, Any] = {}
    for p in spec.params:
        if p.name in params and p.runtime:  # still a kernel argument of the sub-kernel, passed at launch
            raw_params[p.name] = {"runtime": "float", **({"positive": True} if p.positive else {})}
        elif p.name in params:
            uses = {n.dim for n in ex.walk(p.expr) if isinstance(n, ex.Size)}
            raw_params[p.name] = ex.to_text(p.expr) if uses <= dims else values[p.name]
    raw_steps = []
    for s in [*elementwise, step]:
        entry: dict[str, Any] = {"name": s.name, "expr": ex.to_text(ex.map_expr(s.expr, rewrite))}
        if s.is_reduction:
            entry.update(reduce=s.reduce, over=s.over)
            if s.reduce == "topk":
                entry.update(k=s.k, **{"as": s.as_dim})
        raw_steps.append(entry)
    name = f"{spec.name}_{step.name.lower()}"[:64]
    raw = {"foldwise": 1, "name": name, "inputs": raw_inputs, "params": raw_params, "steps": raw_steps,
           "outputs": [step.name]}
    return raw, reads
