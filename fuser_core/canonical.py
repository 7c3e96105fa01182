"""Canonical form and ``spec_hash``: one identity per computation.

Two specs that differ only in key order, whitespace, ``name``/``doc``/``example``, or a consistent
renaming of dims, steps or params get the same canonical form, hence the same hash
(docs/SPEC.md, "Canonical form and identity"). The rules, decided here:

- inputs keep their names (they are the kernel's interface) and are listed sorted by name;
  input declaration order is JSON key order, so it does not count;
- dims are renamed ``d0, d1, ...`` by first appearance in the sorted inputs, then topk
  ``as`` dims in step order;
- steps are renamed ``s0, s1, ...`` in step order; params ``p0, p1, ...`` in order of first
  use, and params no step uses are dropped;
- runtime params (scalars passed at call time) keep their names like inputs, and their
  ``default`` is dropped: the same kernel serves every value;
- a canonical name that is also an input's name is skipped (an input ``s0`` makes the steps
  ``s1, s2, ...``): otherwise ``s0`` in an expression would name two things;
- expressions are printed from the parsed AST (whitespace, redundant parentheses and number
  spelling such as ``1e-5`` vs ``0.00001`` disappear).

Because the canonical input order is sorted, the dim order of outputs (docs/API.md's rule)
is defined on each user's own spec; layers that store kernels translate between the two
with :func:`canonical_names`.

Example:
    >>> from fuser_core.spec import load_spec
    >>> a = load_spec({"foldwise": 1, "name": "a", "inputs": {"x": {"dims": ["m", "n"]}},
    ...     "steps": [{"name": "t", "reduce": "max", "over": "n", "expr": "x"}], "outputs": ["t"]})
    >>> b = load_spec({"foldwise": 1, "name": "b", "inputs": {"x": {"dims": ["r", "c"]}},
    ...     "steps": [{"name": "u", "reduce": "max", "over": "c", "expr": "(x)"}], "outputs": ["u"]})
    >>> spec_hash(a) == spec_hash(b)
    True
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from fuser_core import expr as ex
from fuser_core.spec import Spec, oriented


def canonical_names(spec: Spec) -> dict[str, str]:
    """Map each dim, step and used param name of ``spec`` to its canonical name."""
    names: dict[str, str] = {}
    # inputs and runtime params keep their names (the kernel's interface: tensors and scalars passed by
    # name at call time): never reuse one
    taken = {inp.name for inp in spec.inputs} | {p.name for p in spec.runtime_params}

    def fresh(prefix: str, count: int) -> list[str]:
        out: list[str] = []
        i = 0
        while len(out) < count:
            if f"{prefix}{i}" not in taken:
                out.append(f"{prefix}{i}")
            i += 1
        return out

    dim_order: list[str] = []
    for inp in sorted(spec.inputs, key=lambda i: i.name):  # the dims the user declared (merged ones' parts)
        dim_order.extend(d for d in inp.storage_dims or inp.dims if d not in dim_order)
    dim_order.extend(s.as_dim for s in spec.steps if s.as_dim is not None)
    # a dim named only in size()/index() of a param cannot exist (validation), so all dims are covered
    for d, new in zip(dim_order, fresh("d", len(dim_order))):
        names[d] = new
    for merged, parts in spec.merges.items():  # the name load_spec gives the canonical copy's merged dim
        names[merged] = "_".join(names[p] for p in parts)
    for step, new in zip(spec.steps, fresh("s", len(spec.steps))):
        names[step.name] = new
    param_names = {p.name for p in spec.params if not p.runtime}
    used: list[str] = []
    for step in spec.steps:
        for node in ex.walk(step.expr):
            if isinstance(node, ex.Ref) and node.name in param_names and node.name not in used:
                used.append(node.name)
    for p, new in zip(used, fresh("p", len(used))):
        names[p] = new
    return names


def canonical_form(spec: Spec) -> dict[str, Any]:
    """The spec as a JSON-able dict with canonical names and canonically printed expressions."""
    names = canonical_names(spec)
    inputs = {}
    for inp in sorted(spec.inputs, key=lambda i: i.name):
        decl: dict[str, Any] = {"dims": [names[d] for d in inp.storage_dims or inp.dims]}
        if not inp.is_float:
            decl["kind"] = inp.kind
        if inp.paged is not None:  # the layout is the kernel's interface; the table keeps its name, as inputs do
            decl["paged"] = {"dim": names[inp.paged.dim], "by": [names[d] for d in inp.paged.by],
                             "table": inp.paged.table, "page_size": inp.paged.page_size}
        inputs[inp.name] = decl
    params: dict[str, Any] = {names[p.name]: ex.to_text(p.expr, names) for p in spec.params if p.name in names}
    for p in spec.runtime_params:
        # that it is a runtime scalar and its sign assumption are the computation; its default is the
        # caller's convenience, not part of the kernel (the same kernel serves eps=1e-5 and 1e-6)
        params[p.name] = {"runtime": "float", **({"positive": True} if p.positive else {})}
    steps = []
    for step in spec.steps:
        entry: dict[str, Any] = {"name": names[step.name], "expr": ex.to_text(step.expr, names)}
        if step.reduce is not None:
            entry["reduce"] = step.reduce
            over = spec.over_text(step)
            entry["over"] = [names[d] for d in over] if isinstance(over, list) else names[over]
        if step.reduce == "topk":
            entry["k"] = step.k
            entry["as"] = names[step.as_dim]  # type: ignore[index]
        steps.append(entry)
    out = {
        "foldwise": 1,
        "name": "canonical",
        "inputs": inputs,
        "params": params,
        "steps": steps,
        "outputs": [names[o] for o in spec.outputs],
    }
    if spec.output_dtypes:  # absent when none, as constraints
        out["output_dtypes"] = {names[o]: dtype for o, dtype in spec.output_dtypes}
    if spec.constraints:  # absent when none: a spec without constraints keeps its hash
        out["constraints"] = sorted(" ".join(oriented(names[a], rel, names[b])) for a, rel, b in spec.constraints)
    return out


def canonical_json(spec: Spec) -> str:
    return json.dumps(canonical_form(spec), sort_keys=True, separators=(",", ":"))


def spec_hash(spec: Spec) -> str:
    """sha256 (hex) of the canonical form: the first part of every cache key."""
    return hash_canonical_json(canonical_json(spec))


def hash_canonical_json(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
