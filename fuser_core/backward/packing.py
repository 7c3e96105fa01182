"""Rules 5 to 7 of :mod:`fuser_core.backward.derive`: what the backward reads saved, and how its
steps are packed into specs.

5. The forward's outputs the backward reads are read as the forward wrote them (softmax's ``y``:
   no exp in its backward); other elementwise steps are recomputed; a forward reduction is
   *saved* when it is smaller than an input (per-row statistics), else recomputed (attention's
   ``m x n`` scores).
6. Gradients share a spec when their *outer* reductions (those whose result keeps no dim another
   reduction of the gradient runs over: the loop the kernel is built around) run along the same
   axes: a norm's ``d_x`` (over the hidden axis) and ``d_w`` (over the tokens) get one spec each,
   attention's ``d_k`` and ``d_v`` (both over the queries, FlashAttention-2's dK/dV kernel) share one.
7. A gradient with outer reductions along two axes runs the ones that read only inputs and saved
   values first, in a spec of their own (a *stage*) whose results the next spec reads:
   attention's ``d_q`` loops over the keys, and ``D = rowsum(dO o)`` (over the head dim, no key
   in it) is computed before, as FlashAttention-2's preprocessing kernel computes it.
8. At the sizes the kernels run at (``sizes``, when given), a value an outer reduction reads that
   holds a reduction over a dim the gradient keeps, too long for a tile to hold whole
   (:data:`~fuser_core.codegen.plan.MAX_INNER_BLOCK`), is staged too: an LM head's ``d_logits``
   ``[t, v]`` (its logits sum over d, and ``d_h`` and ``d_w`` keep d) at d = 4096 is written by a
   stage that loops over d, and each gradient reads it (a GEMM each), as torch's own backward does.
   Without it the gradient's kernel would hold all of d in every tile; with it the stage's
   ``[t, v]`` is materialised (Liger's fused linear cross-entropy writes it a chunk of tokens at a
   time; Cut Cross-Entropy never writes it, adding both gradients by atomics).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fuser_core import expr as ex
from fuser_core.codegen.plan import MAX_INNER_BLOCK, next_pow2
from fuser_core.errors import SpecError
from fuser_core.spec import load_spec
from fuser_core.spec_model import Spec, Step, raw_param


@dataclass
class BackStep:
    name: str
    expr: ex.Expr
    reduce: str | None = None
    over: str | None = None


@dataclass
class Closure:
    steps: set[str] = field(default_factory=set)  # backward and recomputed forward steps
    saved: set[str] = field(default_factory=set)  # forward reductions read saved
    staged: set[str] = field(default_factory=set)  # results of an earlier stage read


def refs(e: ex.Expr) -> list[str]:
    return list(dict.fromkeys(n.name for n in ex.walk(e) if isinstance(n, ex.Ref)))


def step_json(name: str, e: ex.Expr, reduce: str | None, over: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name}
    if reduce:
        out |= {"reduce": reduce, "over": over}
    return out | {"expr": ex.to_text(e)}


class Packer:
    """Packs the backward steps of ``spec`` into specs (module doc)."""

    def __init__(self, spec: Spec, steps: list[BackStep], dims: Mapping[str, tuple[str, ...]],
                 upstream: Mapping[str, str], sizes: Mapping[str, int] | None = None):
        self.spec, self.steps, self.dims, self.upstream = spec, steps, dims, upstream
        self.back = {s.name: s for s in steps}
        self.sizes = dict(sizes or {})  # the sizes the kernels run at (rule 8); none: rule 8 is off

    def saved_forward(self, step: Step) -> bool:
        """Rule 5: True when the backward reads ``step`` (a forward step it names) as the forward
        wrote it: an output, or a reduction smaller than an input."""
        return step.name in self.spec.outputs or (
            step.is_reduction and any(set(step.dims) < set(i.dims) for i in self.spec.inputs))

    def over(self, name: str) -> str | None:
        return self.back[name].over if name in self.back else self.spec.step(name).over

    def closure(self, root: str, stop: frozenset[str] = frozenset()) -> Closure:
        """What ``root`` needs; names in ``stop`` come from an earlier stage."""
        out = Closure()
        todo = [root]
        while todo:
            name = todo.pop()
            if name in out.steps or name in out.saved or name in out.staged:
                continue
            if name in stop and name != root:
                out.staged.add(name)
            elif name in self.back:
                out.steps.add(name)
                todo.extend(refs(self.back[name].expr))
            elif isinstance(obj := self.spec.lookup(name), Step):
                if self.saved_forward(obj):
                    out.saved.add(name)
                else:
                    out.steps.add(name)
                    todo.extend(refs(obj.expr))
        return out

    def outer(self, c: Closure, stop: frozenset[str] = frozenset()) -> list[str]:
        """The closure's outer reductions (rule 6): those no reduction reading them runs along a dim
        of their result (an inner one is computed inside that reduction's loop, per tile)."""
        reductions = [n for n in c.steps if self.over(n) is not None]
        reads = {r: self.closure(r, stop).steps - {r} for r in reductions}
        return [n for n in reductions if not any(n in reads[r] and self.over(r) in self.dims[n] for r in reductions)]

    def stages(self, c: Closure) -> set[str]:
        """Rule 7: the outer reductions to run in a stage before, when the outer ones span two axes."""
        outer = self.outer(c)
        if len({self.over(n) for n in outer}) < 2:
            return set()
        return {n for n in outer if all(self.over(m) is None for m in self.closure(n).steps - {n})}

    def too_long_to_hold(self, c: Closure, keeps: tuple[str, ...]) -> set[str]:
        """Rule 8: the backward values an outer reduction of ``c`` reads whose closure holds a
        reduction over a dim in ``keeps`` (the gradient's dims) longer than a tile holds whole."""
        long = {d for d in keeps if next_pow2(self.sizes.get(d, 1)) > MAX_INNER_BLOCK}
        if not long:
            return set()
        out = set()
        for n in self.outer(c):
            for r in refs(self.back[n].expr) if n in self.back else ():
                if r in self.back and any(self.over(m) in long for m in self.closure(r).steps):
                    out.add(r)
        return out

    def pack(self, gradients: Mapping[str, str]) -> list[tuple[list[str], Closure]]:
        """(output names, closure) per spec, in the order they run: stages, then gradients grouped
        by their outer axes (gradient input name -> its output step name in ``gradients``)."""
        staged: set[str] = set()
        for out in gradients.values():
            c = self.closure(out)
            staged |= self.stages(c) | self.too_long_to_hold(c, self.dims[out])
        stop = frozenset(staged)
        packs: list[tuple[list[str], Closure]] = []
        by_axis: dict[str | None, list[str]] = {}
        for name in sorted(staged, key=lambda n: [s.name for s in self.steps].index(n)):
            by_axis.setdefault(self.over(name), []).append(name)
        groups: dict[frozenset, list[str]] = {}
        for out in gradients.values():
            c = self.closure(out, stop)
            groups.setdefault(frozenset(self.over(n) for n in self.outer(c, stop)), []).append(out)
        for outs in [*by_axis.values(), *groups.values()]:
            merged = Closure()
            for out in outs:
                c = self.closure(out, stop)
                merged.steps |= c.steps
                merged.saved |= c.saved
                merged.staged |= c.staged
            packs.append((outs, merged))
        return packs

    def spec_json(self, name: str, doc: str, outputs: Iterable[str], c: Closure,
                  staged_dims: Mapping[str, tuple[str, ...]]) -> dict[str, Any]:
        """The spec of one pack; ``staged_dims``: each staged result's dims as its stage writes them."""
        spec = self.spec
        back_order = [s for s in self.steps if s.name in c.steps]
        fwd_order = [s for s in spec.steps if s.name in c.steps]
        read = {r for e in [s.expr for s in back_order] + [s.expr for s in fwd_order] for r in refs(e)}
        inputs: dict[str, Any] = {}
        for inp in spec.inputs:  # the forward's order first: the backward keeps its dim order
            if inp.name in read:
                inputs[inp.name] = {"dims": list(inp.dims), **({"kind": inp.kind} if inp.is_index else {})}
        for s in spec.steps:
            if s.name in c.saved:
                inputs[s.name] = {"dims": list(s.dims), **({"kind": "index"} if s.is_integer else {}),
                                  "doc": "saved by the forward"}
        for s in self.steps:
            if s.name in c.staged:
                inputs[s.name] = {"dims": list(staged_dims[s.name]), "doc": "computed by an earlier backward spec"}
        for out, up in self.upstream.items():
            if up in read:
                inputs[up] = {"dims": list(self.dims[up]), "doc": f"the gradient of the forward's {out}"}
        raw_steps = [step_json(s.name, s.expr, s.reduce, s.over) for s in fwd_order]
        raw_steps += [step_json(s.name, s.expr, s.reduce, s.over) for s in back_order]
        used = {d for i in inputs.values() for d in i["dims"]}
        return {
            "foldwise": 1, "name": name, "doc": doc, "inputs": inputs,
            "params": {p.name: raw_param(p) for p in spec.params if p.name in read},
            "steps": raw_steps, "outputs": list(outputs),
            **({"example": {d: n for d, n in spec.example.items() if d in used}} if spec.example else {}),
            **({"constraints": [" ".join(k) for k in spec.constraints if {k[0], k[2]} <= used]}
               if spec.constraints else {}),
        }


def load_backward(raw: dict[str, Any]) -> Spec:
    try:
        return load_spec(raw, printed=True)
    except SpecError as err:  # a bug of ours, not the user's: say which spec
        raise SpecError(f"the derived backward spec {raw['name']} does not load: {err}") from err
