"""Hypothesis strategies that build VALID random cascade specs over docs/SPEC.md's grammar, and
targeted mutations of them that are (mostly) invalid.

:func:`cascade_specs` draws raw JSON dicts (so that :func:`fuser_core.spec.load_spec` is
exercised too): 1-3 float inputs (sometimes an index input or a scalar) over 1-3 dims,
0-2 params, and 2-5 steps where later steps read earlier results. Reductions are drawn
from templates of the cascaded-reduction shape -- a first reduction ``max``/``sum``/...
of a streamed expression G(x), then reductions that read it (``sum exp(G - mx)``,
``sum (G - mean) ** 2``, ``max G - mean``, ``topk exp(G - mx) / den`` (and a value it carries,
``sum where(index(x) == g.indices, X, 0)``), contractions
``sum over d of q * k`` ...) -- and from free random expressions over everything defined
so far, so that a good share of the specs fuse and some do not. Dependent terms are often
masked, ``where(cond(index, inputs), f(x) * g(D), fill)`` with a condition free of D (a per-row
length, a causal mask, a test of an input) and a fill of 0, +-inf or a large sentinel (-1e30). Elementwise steps use
every function of the grammar, params, masks with ``index(dim)`` and casts, and rarely a
division by an expression that is identically 0 (which derive must refuse with SpecError).

Expressions are kept *numerically tame* on standard-normal inputs (logs and roots of
positive arguments, exponentials of bounded or max-shifted arguments, divisions by values
away from zero), because the kernel check compares float32 kernels with a float64
reference: a spec that overflows float32 or divides by a near-zero cancellation would
report rounding, not bugs. For the same reason an ``exp(G - m)`` uses the G that m is the
maximum of (so it is at most 1, as in online softmax; sometimes combined with a constant of the
loop, ``exp(G - maximum(mx, c))``, an attention sink), and cubics are centred on maxima and
means; ``wild=True`` lifts both, to measure the known weaknesses these avoid. Everything else
about the draw is free.

:func:`mutated_specs` applies one semantic mutation to a valid draw (an unknown name, a
step used before it is defined, a reduction over a dim its expression lacks, a topk
without ``k``, a duplicate name...): ``load_spec`` must raise ``SpecError`` or accept it.

:func:`ragged_shape` picks a small shape whose loop axis is not a multiple of the kernel
blocks used by the tests (a masked tail in every tile loop).
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

from hypothesis import strategies as st

# Names: disjoint pools for dims, inputs and steps (the loader rejects clashes); the step
# pool includes names a code generator might itself use (tl, pid, offs, *_ptr, acc...).
DIM_POOL = ("m", "n", "d", "c", "t", "e", "j2", "seq")
INPUT_POOL = ("x", "v", "w", "q", "kk", "bias", "logits", "a")
INDEX_INPUT_POOL = ("target", "tgt", "label")
STEP_POOL = (
    "mx", "den", "mean", "var", "s", "p", "y", "o", "r", "g", "lse", "z", "h", "u", "acc", "tmp", "out",
    "mask", "offs", "pid", "count", "start", "tl", "x_ptr", "mx_old", "den_anchor", "BLOCK", "size_n",
    "stride", "acc0", "nblk", "triton", "T", "amax", "scale2", "total", "idx", "best", "vals", "sel",
)
PARAM_POOL = ("eps", "scale", "alpha", "beta0")
TOPK_AS_POOL = ("kdim", "slot", "jj")

CAST_DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn")
NUMBERS = ("0.5", "2", "3", "0.25", "1e-3", "1.5", "4")


@dataclass(frozen=True)
class Atom:
    """Something an expression may read: an input, a param or an earlier step's result."""

    text: str  # how an expression names it: "x", "g.values", "eps"
    dims: frozenset[str]
    kind: str  # "float" | "index" (index input, argmax result, topk indices)
    op: str | None = None  # the reduction that made it
    over: str | None = None
    positive: bool = False  # known > 0 (a sum of exponentials...): safe to divide by, take log of
    of: str | None = None  # the expression a reduction reduced
    mean_like: bool = False  # a sum divided by the size of its axis: of the scale of its terms

    def shifted_exp(self) -> str:
        """exp(F - max F) (or exp(min F - F)): at most 1, as in online softmax."""
        return f"exp(({self.of}) - {self.text})" if self.op == "max" else f"exp({self.text} - ({self.of}))"


class _Cascade:
    """One draw of a valid spec; every choice goes through hypothesis' ``draw``."""

    def __init__(self, draw, *, min_steps: int, max_steps: int, casts: bool, wild: bool, merged: float = 0.0):
        self.draw = draw
        self.casts = casts
        self.wild = wild
        self.merged = merged
        self.min_steps, self.max_steps = min_steps, max_steps
        self.rnd: random.Random = draw(st.randoms(use_true_random=False))
        self.atoms: list[Atom] = []
        self.steps: list[dict] = []
        self.used: set[str] = set()  # input names an expression has read
        self.step_names = list(draw(st.permutations(STEP_POOL)))
        self.as_names = list(draw(st.permutations(TOPK_AS_POOL)))

    # ---------------------------------------------------------------- small helpers
    def pick(self, seq):
        return self.draw(st.sampled_from(list(seq)))

    def chance(self, p: float) -> bool:
        """True with probability ~p; drawn so that shrinking goes towards False (and not via
        Random.random(), which hypothesis makes 0.0 far more often than p)."""
        v = self.draw(st.integers(0, 9999))
        return 3000 <= v < 3000 + round(10000 * p)  # a band away from the bounds hypothesis favours

    def roll(self) -> float:
        """A number in [0, 1) to choose between weighted branches."""
        return self.draw(st.integers(0, 999)) / 1000

    def new_name(self) -> str:
        return self.step_names.pop()

    def floats(self, *, with_axis: bool | None = None) -> list[Atom]:
        out = [a for a in self.atoms if a.kind == "float"]
        if with_axis is True:
            out = [a for a in out if self.axis in a.dims]
        elif with_axis is False:
            out = [a for a in out if self.axis not in a.dims]
        return out

    def deps(self, *ops: str) -> list[Atom]:
        """Earlier reductions over the cascade axis (the D of docs/THEORY.md)."""
        return [a for a in self.atoms if a.over == self.axis and a.kind == "float" and a.op in ops]

    def note(self, text: str) -> None:
        for a in self.atoms:
            if a.kind in ("float", "index") and a.op is None and a.text in text:
                self.used.add(a.text)

    # ---------------------------------------------------------------- inputs and params
    def declare_inputs(self) -> dict:
        draw = self.draw
        dims = list(draw(st.permutations(DIM_POOL)))[: draw(st.integers(1, 3))]
        self.dims = dims
        self.axis = self.pick(dims)
        names = list(draw(st.permutations(INPUT_POOL)))
        n_inputs = draw(st.integers(1, 3))
        inputs: dict[str, dict] = {}
        for i in range(n_inputs):
            if i == 0:
                others = [d for d in dims if d != self.axis]
                own = [self.axis] + [d for d in others if self.chance(0.75)]
            else:
                own = [d for d in dims if self.chance(0.6)]
                if not own and not self.chance(0.15):  # mostly not a scalar
                    own = [self.pick(dims)]
            self.rnd.shuffle(own)
            inputs[names[i]] = {"dims": own}
        covered = {d for spec in inputs.values() for d in spec["dims"]}
        first = inputs[names[0]]["dims"]
        for d in dims:
            if d not in covered:
                first.insert(self.rnd.randrange(len(first) + 1), d)
        for name, decl in inputs.items():
            self.atoms.append(Atom(name, frozenset(decl["dims"]), "float"))
        if len(dims) > 1 and self.chance(0.2):  # an index input, e.g. class targets
            name = self.pick(INDEX_INPUT_POOL)
            own = [d for d in dims if d != self.axis and self.chance(0.7)]
            inputs[name] = {"dims": own, "kind": "index"}
            self.atoms.append(Atom(name, frozenset(own), "index"))
        self.inputs = inputs
        return inputs

    def declare_params(self) -> dict:
        params: dict[str, object] = {}
        for name in self.draw(st.permutations(PARAM_POOL))[: self.draw(st.integers(0, 2))]:
            d = self.pick(self.dims)
            params[name] = self.pick(
                [1e-5, 0.5, 2, -1.5, f"1 / sqrt(size({d}))", f"size({d}) * 0.5", f"log(size({d}) + 1)", "2 ** -3"]
            )
            positive = not (isinstance(params[name], float | int) and params[name] < 0)
            self.atoms.append(Atom(name, frozenset(), "float", positive=positive))
        return params

    # ---------------------------------------------------------------- expressions
    def leaf(self, pool: list[Atom]) -> str:
        unused = [a for a in pool if a.op is None and a.text in self.inputs and a.text not in self.used]
        roll = self.roll()
        if unused and roll < 0.5:
            atom = self.pick(unused)
        elif pool and roll < 0.85:
            atom = self.pick(pool)
        elif roll < 0.93:
            return self.pick(NUMBERS)
        else:
            return f"size({self.pick(self.dims)})" if self.chance(0.5) else f"index({self.pick(self.dims)}) * 0.25"
        self.note(atom.text)
        return atom.text

    def tree(self, depth: int, pool: list[Atom], must: str | None = None) -> str:
        """A tame random expression over ``pool``; ``must`` (an expression) appears in it."""
        if depth <= 0 or self.chance(0.3):
            return must if must is not None else self.leaf(pool)
        kind = self.pick(["add", "sub", "mul", "mul", "div", "neg", "bounded", "positive_fn", "pow",
                          "minmax", "clamp", "where", "where", "round", "cast"])
        if self.chance(0.005):  # a division by (or log of) an expression that is identically 0: refused
            kind = "degenerate"
        if kind == "cast" and not self.casts:
            kind = "bounded"

        def sub(m: str | None = must) -> str:
            return self.tree(depth - 1, pool, m)

        def two() -> tuple[str, str]:
            if must is None or self.chance(0.5):
                return sub(), sub(None)
            return sub(None), sub()

        if kind in ("add", "sub", "mul"):
            a, b = two()
            return f"({a} {'+' if kind == 'add' else '-' if kind == 'sub' else '*'} {b})"
        if kind == "div":  # a denominator away from zero
            den = self.pick([f"(1 + {sub(None)} * {sub(None)})", f"(2 + sin({sub(None)}))", f"size({self.pick(self.dims)})"])
            return f"({sub()} / {den})"
        if kind == "neg":
            return f"(-{sub()})"
        if kind == "bounded":
            fn = self.pick(["tanh", "sigmoid", "sin", "cos", "erf", "abs"])
            inner = sub()
            if self.chance(0.3):  # exp / exp2 of something bounded
                return f"{self.pick(['exp', 'exp2'])}({fn}({inner}))"
            return f"{fn}({inner})"
        if kind == "positive_fn":
            inner = sub()
            return self.pick([
                f"log(2 + {inner} * {inner})", f"sqrt(abs({inner}) + 1)", f"rsqrt({inner} * {inner} + 0.5)",
                f"log1p(abs({inner}))", f"log2(sigmoid({inner}) + 1)", f"(abs({inner}) + 1) ** 0.5",
            ])
        if kind == "pow":  # high powers of bounded values only (and of either sign)
            if self.chance(0.25):
                return f"{self.pick(['tanh', 'sin', 'erf'])}({sub()}) ** {self.pick([9, 10, 12])}"
            return f"({sub()}) ** {self.pick([2, 2, 3, 4])}"
        if kind == "minmax":
            a, b = two()
            return f"{self.pick(['maximum', 'minimum'])}({a}, {b})"
        if kind == "clamp":
            return f"clamp({sub()}, -1, {self.pick(['1', '0.5', '2'])})"
        if kind == "where":
            return f"where({self.combined(lambda: self.condition(pool))}, {sub()}, {self.pick([sub(None), '0', '-1'])})"
        if kind == "round":  # offset: sums of quantised values must not cancel exactly (see check_kernels)
            return f"(round({sub()} * 4) * 0.25 + 0.1)"
        if kind == "degenerate":
            zero = self.leaf(pool)
            return self.pick([f"({sub()} / ({zero} - {zero}))", f"(log({zero} - {zero}) + {sub()})"])
        assert kind == "cast"
        return f'cast({sub()}, "{self.pick(CAST_DTYPES)}")'

    def combined(self, draw) -> str:
        """A condition, or and/or/not of drawn ones, as masks compose (causal and padding)."""
        roll = self.roll()
        if roll < 0.12:
            return f"{draw()} and {draw()}"
        if roll < 0.18:
            return f"{draw()} or {draw()}"
        if roll < 0.22:
            return f"not {draw()}"
        return draw()

    def condition(self, pool: list[Atom]) -> str:
        op = self.pick(["<", "<=", ">", ">=", "==", "!="])
        index_atoms = [a for a in self.atoms if a.kind == "index"]
        roll = self.roll()
        if index_atoms and roll < 0.3:
            atom = self.pick(index_atoms)
            self.note(atom.text)
            dims = [d for d in self.dims if d not in atom.dims] or self.dims
            return f"index({self.pick(dims)}) {self.pick(['==', '!='])} {atom.text}"
        if len(self.dims) > 1 and roll < 0.6:  # a causal-style mask
            a, b = self.draw(st.permutations(self.dims))[:2]
            return f"index({a}) {self.pick(['<=', '<', '>='])} index({b})"
        return f"{self.tree(1, pool)} {op} {self.tree(1, pool)}"

    def mask_condition(self) -> str:
        """A condition free of the cascade's results, as real masks are: a per-row length
        (``index(axis) < len``), a causal mask, or a test of an input; it masks a dependent term."""
        lengths = [a for a in self.atoms if a.kind == "index" and a.op is None]
        others = [d for d in self.dims if d != self.axis]
        roll = self.roll()
        if lengths and roll < 0.5:
            atom = self.pick(lengths)
            self.note(atom.text)
            return f"index({self.axis}) {self.pick(['<', '>=', '!='])} {atom.text}"
        if others and roll < 0.75:
            return f"index({self.axis}) {self.pick(['<=', '>'])} index({self.pick(others)})"
        atom = self.pick(self.floats(with_axis=True))
        atom = atom if atom.op is None else self.pick([a for a in self.floats(with_axis=True) if a.op is None] or [atom])
        self.note(atom.text)
        return f"{atom.text} {self.pick(['>', '<'])} {self.pick(['0', '0.5', '-1'])}"

    def masked(self, expr: str, op: str) -> str:
        """``where(mask, expr, fill)`` with the fill that masks ``op``: 0 for a sum, the infinity
        that loses for an order reduction, or a large sentinel constant (-1e30, as models write)."""
        fill = {"sum": "0", "max": "-inf", "topk": "-inf", "argmax": "-inf", "min": "inf", "argmin": "inf"}[op]
        if op in ("max", "min") and self.chance(0.5):
            fill = "-1e30" if op == "max" else "1e30"
        return f"where({self.combined(self.mask_condition)}, {expr}, {fill})"

    def streamed(self, depth: int | None = None) -> str:
        """G(x): an expression that varies along the cascade axis."""
        carriers = self.floats(with_axis=True)
        must_atom = self.pick(carriers)
        self.note(must_atom.text)
        pool = [a for a in self.floats() if a.over != self.axis or a.op is None]  # no same-axis results
        return self.tree(self.draw(st.integers(0, 2)) if depth is None else depth, pool, must_atom.text)

    # ---------------------------------------------------------------- steps
    def add_step(self, expr: str, *, reduce: str | None = None, over: str | None = None, k: int | None = None,
                 positive: bool = False) -> Atom:
        if reduce == "topk" and not self.as_names:  # every `as` name taken: a max instead
            reduce, k = "max", None
        name = self.new_name()
        step: dict = {"name": name}
        if reduce is not None:
            step.update(reduce=reduce, over=over)
        step["expr"] = expr  # key order differs from the catalog's on purpose (any order is valid)
        dims = self.dims_of(expr)
        if reduce is not None:
            dims = dims - {over}
        if reduce == "topk":
            as_dim = self.as_names.pop()
            step.update(k=k, **{"as": as_dim})
            self.steps.append(step)
            values = Atom(f"{name}.values", frozenset(dims | {as_dim}), "float", "topk", over)
            self.atoms += [values, Atom(f"{name}.indices", values.dims, "index", "topk", over)]
            if self.chance(0.4):  # a router renormalising its k weights: a reduction over the slots (the epilogue)
                slot_op = self.pick(["sum", "sum", "max", "min"])
                slot_expr = values.text if slot_op != "sum" or self.chance(0.5) else f"exp({values.text})"
                self.add_step(slot_expr, reduce=slot_op, over=as_dim)
            if self.chance(0.3):
                self.carried(f"{name}.indices", over)
            return values
        self.steps.append(step)
        kind = "index" if reduce in ("argmax", "argmin") else "float"
        mean_like = reduce == "sum" and expr.endswith(f"/ size({over})")
        atom = Atom(name, frozenset(dims), kind, reduce, over, positive, of=expr if reduce else None, mean_like=mean_like)
        self.atoms.append(atom)
        if kind == "index" and over == self.axis and self.chance(0.3):
            self.carried(name, over)
        return atom

    def carried(self, at: str, over: str) -> None:
        """A value a selection carries: X (of inputs) at the positions it chose, gathered after its
        loop (fuser_core.derive.gathers; DeepSeek-V3's router weighs by scores it did not select by)."""
        inputs = [a for a in self.floats(with_axis=True) if a.op is None]
        if not inputs:
            return
        must = self.pick(inputs).text
        self.note(must)
        x = self.tree(self.draw(st.integers(0, 1)), [a for a in self.floats() if a.op is None], must)
        self.add_step(f"where(index({over}) == {at}, {x}, 0)", reduce="sum", over=over)

    def dims_of(self, expr: str) -> set[str]:
        """Dims an expression reads (names are whole tokens: ``x`` does not match ``x_ptr``)."""
        import re

        tokens = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*(?:\.(?:values|indices))?", expr))
        out: set[str] = set()
        for a in self.atoms:
            if a.text in tokens:
                out |= a.dims
        for d in re.findall(r"index\(([A-Za-z0-9_]+)\)", expr):
            out.add(d)
        return out

    def first_reduction(self) -> None:
        op = self.pick(["max", "max", "sum", "sum", "min", "argmax", "argmin", "topk"])
        G = self.streamed()
        if op == "sum" and self.chance(0.4):
            G = f"{G} / size({self.axis})"
        if op == "topk":
            self.add_step(G, reduce="topk", over=self.axis, k=self.draw(st.integers(1, 4)))
            return
        if op in ("max", "min") and self.chance(0.2):
            G = self.masked(G, op)  # exp(G - mx) of a dependent term reads the masked G whole
        self.add_step(G, reduce=op, over=self.axis)

    def exp_shift(self, G: str, m: Atom) -> str:
        """exp(G - m) for a max dependency m. Tame: G is what m is the max of, so the value is at
        most 1 (online softmax); wild: any G, which can overflow the running state (a known
        weakness of anchored realisations when the anchor does not bound the exponent)."""
        if self.wild and self.chance(0.5):
            return f"exp({G} - {m.text})"
        constants = [a for a in self.floats(with_axis=False) if a.over != self.axis]  # inputs, params, other axes
        if constants and self.chance(0.35):
            # an attention sink: the anchor combined with a constant of the loop, exp(F - maximum(max F, c))
            # (or exp(minimum(min F, c) - F)): at most 1 still, the correction exp(max(m_old, c) - max(m_new, c))
            c = self.pick(constants).text
            self.note(c)
            if m.op == "max":
                return f"exp(({m.of}) - maximum({m.text}, {c}))"
            return f"exp(minimum({m.text}, {c}) - ({m.of}))"
        return m.shifted_exp()

    def contraction(self) -> bool:
        """``sum over d of q * k * scale`` with q, k sharing d and the product keeping the axis."""
        floats = self.floats()
        for d in self.dims:
            if d == self.axis:
                continue
            pairs = [(a, b) for a in floats for b in floats if a is not b and d in a.dims and d in b.dims
                     and a.op is None and b.op is None and self.axis in (a.dims | b.dims)]
            if pairs:
                a, b = self.pick(pairs)
                self.note(a.text + " " + b.text)
                params = [p for p in floats if not p.dims]
                extra = f" * {self.pick(params).text}" if params and self.chance(0.5) else ""
                self.add_step(f"{a.text} * {b.text}{extra}", reduce="sum", over=d)
                return True
        return False

    def dependent_reduction(self) -> None:
        maxes, sums = self.deps("max", "min"), self.deps("sum")
        deps = maxes + sums
        G = self.streamed(self.draw(st.integers(0, 1)))
        op = self.pick(["sum", "sum", "sum", "max", "min", "topk", "argmax"])
        m = self.pick(maxes) if maxes else None
        s = self.pick(sums).text if sums else None
        pos = [a.text for a in deps if a.positive] + [a.text for a in self.floats() if a.positive and not a.dims]
        p = self.pick(pos) if pos else None
        d = self.pick(deps).text
        # a cubic around a running *estimate* of a raw sum loses float32 accuracy (a known weakness,
        # measured with fuzz_long.py --wild): tame specs centre cubics on maxima and means only
        centres = [a.text for a in deps if a.op != "sum" or a.mean_like] if not self.wild else [a.text for a in deps]
        if op == "sum":
            choices = [f"({G} - {d}) ** 2", f"{G} * {d}", f"sin({G} * {d})", f"{G} + {d}", f"maximum({G}, {d})"]
            if centres:
                choices.append(f"({G} - {self.pick(centres)}) ** 3 / size({self.axis})")
            if m:
                e = self.exp_shift(G, m)
                choices += [e] * 3 + [f"{e} * {G}", f"{e} + 1", f"({G} - {m.text}) ** 2"]
                if p:
                    choices += [f"{e} * {self.streamed(0)} / {p}", f"{e} / {p} * ({G} - {m.text})"]
            if s:
                choices += [f"({G} - {s}) ** 2 / size({self.axis})", f"{G} * rsqrt({s} * {s} + 1)"]
            if p:
                choices += [f"{G} / {p}", f"{G} * log({p})"]
            expr = self.pick(choices)
        else:
            choices = [f"{G} - {d}", f"{G} + {d}", f"{G} * {d}", f"sin({G} - {d})"]
            if p:
                choices += [f"{G} * {p} + {d}", f"-{G} * {p}", f"({G}) / {p}"]
            if m and p:
                choices += [f"{self.exp_shift(G, m)} / {p}"] * 2
            expr = self.pick(choices)
        masked = self.chance(0.3)
        if masked:  # where(cond(index, inputs), f(x) * g(D), fill): the mask separates into G
            expr = self.masked(expr, op)
        if op == "topk":
            self.add_step(expr, reduce="topk", over=self.axis, k=self.draw(st.integers(1, 4)))
            return
        positive = op == "sum" and expr.startswith("exp(") and "*" not in expr and not masked  # masked: may be 0
        self.add_step(expr, reduce=op, over=self.axis, positive=positive)

    def free_reduction(self) -> None:
        """A reduction of a free random expression over everything so far (often not fusible)."""
        pool = self.floats()
        carriers = self.floats(with_axis=True)
        must = self.pick(carriers).text
        self.note(must)
        expr = self.tree(self.draw(st.integers(1, 3)), pool, must)
        op = self.pick(["sum", "max", "min", "argmin"])
        self.add_step(expr, reduce=op, over=self.axis)

    def other_axis_reduction(self) -> bool:
        pool = [a for a in self.floats() if a.dims - {self.axis}]
        if not pool:
            return False
        atom = self.pick(pool)
        over = self.pick(sorted(atom.dims - {self.axis}))
        self.note(atom.text)
        self.add_step(self.tree(1, self.floats(), atom.text), reduce=self.pick(["sum", "max"]), over=over)
        return True

    def elementwise(self) -> None:
        maxes, sums = self.deps("max", "min"), self.deps("sum")
        roll = self.roll()
        if maxes and sums and roll < 0.3:
            m, s = self.pick(maxes), self.pick(sums).text
            G = self.streamed(0)
            expr = self.pick([f"{self.exp_shift(G, m)} / {s}", f"{m.text} + log(abs({s}) + 1)",
                              f"({G} - {s}) * rsqrt({s} * {s} + 1e-5)"])
        else:
            pool = self.floats() + [a for a in self.atoms if a.kind == "index" and a.op is not None]
            if self.chance(0.25) and self.casts:
                expr = f'cast({self.tree(2, self.floats())}, "{self.pick(CAST_DTYPES[:3])}")'
            else:
                expr = self.tree(self.draw(st.integers(1, 3)), pool)
        if not self.dims_of(expr) and not any(a.text in expr for a in self.atoms if a.op):
            expr = f"{expr} * {self.pick(self.floats(with_axis=True)).text}"  # not a constant step
        self.note(expr)
        self.add_step(expr)

    # ---------------------------------------------------------------- the spec
    def build(self) -> dict:
        inputs = self.declare_inputs()
        params = self.declare_params()
        n_steps = self.draw(st.integers(self.min_steps, self.max_steps))
        for i in range(n_steps):
            reductions = [a for a in self.atoms if a.op is not None]
            same_axis = self.deps("sum", "max", "min")
            last = i == n_steps - 1
            if not reductions:
                kind = self.pick(["first", "first", "first", "contraction", "elementwise"] if not last else ["first"])
            else:
                kind = self.pick(["dependent"] * 5 * bool(same_axis) + ["first", "elementwise", "elementwise", "free",
                                  "other_axis"])
            if kind == "contraction" and not self.contraction():
                kind = "first"
            if kind == "other_axis" and not self.other_axis_reduction():
                kind = "elementwise"
            if kind == "first":
                self.first_reduction()
            elif kind == "dependent":
                self.dependent_reduction()
            elif kind == "free":
                self.free_reduction()
            elif kind == "elementwise":
                self.elementwise()
        self.cover_inputs()
        raw: dict = {"foldwise": 1, "name": self.draw(st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True)),
                     "inputs": inputs, "steps": self.steps, "outputs": self.outputs()}
        if params or self.chance(0.3):
            raw["params"] = {k: v for k, v in params.items() if self.reads(k)}
        if self.chance(0.2):
            raw["doc"] = "a fuzzed cascade"
        if self.merged and self.chance(self.merged):
            raw = split_axis(raw, self.axis, partial=self.chance(0.3)) or raw
        return raw

    def reads(self, name: str) -> bool:
        import re

        return any(re.search(rf"\b{re.escape(name)}\b", s["expr"]) for s in self.steps)

    def cover_inputs(self) -> None:
        """Every declared input must be read (the loader refuses unused inputs)."""
        for name, decl in self.inputs.items():
            if self.reads(name):
                continue
            sink = self.pick([a for a in self.atoms if a.op is not None or a.text in {s["name"] for s in self.steps}])
            if decl.get("kind") == "index":
                self.add_step(f"where({name} >= 1, {sink.text}, 0)")
            else:
                self.add_step(f"{sink.text} * tanh({name})")

    def outputs(self) -> list[str]:
        import re

        names = [s["name"] for s in self.steps]
        read: set[str] = set()
        for s in self.steps:
            read |= set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", s["expr"]))
        outs = [n for n in names if n not in read or self.chance(0.15)]
        return outs


MERGED_SHARE = 0.15  # fuzz_long's share of draws whose cascade axis becomes two dims reduced together ("over": [a, b])


def split_axis(raw: dict, axis: str, *, partial: bool) -> dict | None:
    """The same cascade with ``axis`` written as two dims reduced together: every input holding it
    holds ``axis_hi, axis_lo`` instead, every reduction over it is ``"over": [hi, lo]`` and
    ``size(axis)`` is ``size(hi) * size(lo)`` (docs/SPEC.md "Reducing over several dims").
    ``partial``: one of several inputs holding the axis holds only ``hi`` (a per-channel weight).
    None where the cascade cannot be written so (index(axis), or a position taken along it)."""
    import re

    text = " ".join(s["expr"] for s in raw["steps"]) + " " + " ".join(map(str, raw.get("params", {}).values()))
    if re.search(rf"index\(\s*{axis}\s*\)", text):
        return None
    if any(s.get("over") == axis and s.get("reduce") in ("argmax", "argmin", "topk") for s in raw["steps"]):
        return None
    hi, lo = f"{axis}_hi", f"{axis}_lo"
    out = copy.deepcopy(raw)
    holders = [name for name, decl in out["inputs"].items() if axis in decl["dims"]]
    for name in holders:
        dims = out["inputs"][name]["dims"]
        at = dims.index(axis)
        split = [hi] if partial and len(holders) > 1 and name == holders[-1] else [hi, lo]
        out["inputs"][name]["dims"] = dims[:at] + split + dims[at + 1:]
    size = re.compile(rf"size\(\s*{axis}\s*\)")
    for step in out["steps"]:
        step["expr"] = size.sub(f"(size({hi}) * size({lo}))", step["expr"])
        if step.get("over") == axis:
            step["over"] = [hi, lo]
    for name, value in out.get("params", {}).items():
        if isinstance(value, str):
            out["params"][name] = size.sub(f"(size({hi}) * size({lo}))", value)
    return out


@st.composite
def cascade_specs(draw, *, min_steps: int = 2, max_steps: int = 5, casts: bool = True, wild: bool = False,
                  merged: float = 0.0) -> dict:
    """A valid raw spec dict (see the module docstring). ``wild`` also draws exponents that the
    anchor does not bound and cubics around estimates of raw sums: valid specs whose fused forms
    are known to lose range or accuracy (for the long run, to measure; not for CI). ``merged``: the
    share of draws whose cascade axis is written as two dims reduced together (:func:`split_axis`;
    the long run's default, MERGED_SHARE; the CI's bounded run keeps its draws and checks the merged
    path with tests/fuser_core/test_group_norm.py)."""
    return _Cascade(draw, min_steps=min_steps, max_steps=max_steps, casts=casts, wild=wild, merged=merged).build()


# ---------------------------------------------------------------- invalid specs

MUTATIONS = (
    "unknown_name", "use_before_define", "reduce_missing_dim", "topk_no_k", "duplicate_name", "bad_function",
    "wrong_arity", "unknown_field", "output_not_step", "drop_input", "bad_over", "self_reference", "bad_cast",
    "compare_outside_where", "attribute", "dim_as_name", "k_too_big", "string_expr", "number_expr", "drop_step",
    "empty_steps", "bad_version", "swap_steps", "as_clash",
)


@st.composite
def mutated_specs(draw) -> tuple[str, dict]:
    """(mutation, raw): a valid cascade with one targeted change; most are invalid."""
    raw = copy.deepcopy(draw(cascade_specs()))
    mutation = draw(st.sampled_from(MUTATIONS))
    steps = raw["steps"]
    i = draw(st.integers(0, len(steps) - 1))
    step = steps[i]
    dims = sorted({d for decl in raw["inputs"].values() for d in decl["dims"]})
    if mutation == "unknown_name":
        step["expr"] = f"({step['expr']}) + nosuchname"
    elif mutation == "use_before_define" and i + 1 < len(steps):
        step["expr"] = f"({step['expr']}) * {steps[-1]['name']}"
    elif mutation == "reduce_missing_dim":
        step["reduce"], step["over"] = step.get("reduce", "sum"), "zz_missing"
    elif mutation == "topk_no_k":
        step["reduce"], step["over"] = "topk", step.get("over", dims[0])
        step.pop("k", None)
    elif mutation == "duplicate_name":
        step["name"] = steps[0]["name"] if i else next(iter(raw["inputs"]))
    elif mutation == "bad_function":
        step["expr"] = f"softplus({step['expr']})"
    elif mutation == "wrong_arity":
        step["expr"] = f"maximum({step['expr']})"
    elif mutation == "unknown_field":
        step[draw(st.sampled_from(["axis", "Reduce", "keepdims", ""]))] = 1
    elif mutation == "output_not_step":
        raw["outputs"].append(draw(st.sampled_from([*raw["inputs"], "nope", 3])))
    elif mutation == "drop_input":
        raw["inputs"].pop(next(iter(raw["inputs"])))
    elif mutation == "bad_over":
        step["reduce"], step["over"] = step.get("reduce", "max"), draw(st.sampled_from([*dims, "", 1, None]))
    elif mutation == "self_reference":
        step["expr"] = f"({step['expr']}) + {step['name']}"
    elif mutation == "bad_cast":
        step["expr"] = f"cast({step['expr']}, \"float64\")"
    elif mutation == "compare_outside_where":
        step["expr"] = f"({step['expr']}) < 1"
    elif mutation == "attribute":
        step["expr"] = f"({step['expr']}) + {step['name']}.real"
    elif mutation == "dim_as_name":
        step["expr"] = f"({step['expr']}) * {dims[0]}"
    elif mutation == "k_too_big":
        step.update(reduce="topk", over=step.get("over", dims[0]), k=draw(st.sampled_from([0, -1, 1025, 10**30, 2.5, True])),
                    **{"as": "kk_new"})
    elif mutation == "string_expr":
        step["expr"] = draw(st.sampled_from(["", " ", "__import__('os')", "x.__class__", "lambda: 1", "1 if 1 else 2"]))
    elif mutation == "number_expr":
        step["expr"] = draw(st.sampled_from([1, 1.5, None, [], {}]))
    elif mutation == "drop_step":
        steps.pop(i)
    elif mutation == "empty_steps":
        raw["steps"] = []
    elif mutation == "bad_version":
        raw["foldwise"] = draw(st.sampled_from([2, "1", 1.0, True, None]))
    elif mutation == "swap_steps" and len(steps) > 1:
        j = draw(st.integers(0, len(steps) - 1))
        steps[i], steps[j] = steps[j], steps[i]
    elif mutation == "as_clash":
        step.update(reduce="topk", over=step.get("over", dims[0]), k=1, **{"as": dims[-1]})
    return mutation, raw


# ---------------------------------------------------------------- shapes

AXIS_SIZES = (5, 7, 11, 13, 19)


def ragged_shape(spec, seed: int = 0) -> dict[str, int]:
    """A small shape for a loaded spec: every reduction axis ragged against blocks of 4
    (and long enough for every topk's k), other dims 1-3, topk ``as`` dims left to k."""
    rng = random.Random(seed)
    axes = {s.over for s in spec.steps if s.is_reduction}
    as_dims = {s.as_dim for s in spec.steps if s.reduce == "topk"}
    shape = {}
    for d in spec.dims:
        if d in as_dims:
            continue
        shape[d] = rng.choice(AXIS_SIZES) if d in axes else rng.choice((1, 2, 3))
        if d in spec.merges:  # dims reduced together: 2-3 outer, 3-7 inner (never a multiple of 4)
            outer, inner = spec.merges[d]
            shape[outer], shape[inner] = rng.choice((2, 3)), rng.choice((3, 5, 7))
            shape[d] = shape[outer] * shape[inner]
    for s in spec.steps:
        if s.reduce == "topk" and shape[s.over] < s.k:
            shape[s.over] = max(AXIS_SIZES)
    return shape


# ---------------------------------------------------------------- checking one draw

CERT_TRIALS = 4
KERNEL_BLOCK = 4  # tiles of 4 along the loop axis: several tiles and a masked tail at AXIS_SIZES


@dataclass
class Outcome:
    """What happened to one fuzzed spec. ``failure`` is None unless something is wrong."""

    status: str  # fusible | not_fusible | limit_stopped | invalid (refused by load_spec) | undefined (by derive)
    failure: str | None = None
    kernels_checked: int = 0
    kernels_not_valid: int = 0  # (strategy, shape) pairs the planner refused with NotValid
    kernels_compiled: int = 0  # modules that passed the interpreter and went through the GPU compiler
    families_checked: int = 0  # (kernel, input family) pairs judged by the accuracy bar
    detail: dict | None = None


# the input families every checked kernel also runs on, judged by the accuracy bar (fuser_core.accuracy):
# the tuner's gate families (offsets, peaked rows) and the special ones (masked rows, NaN, axis of 1, empty dims)
FUZZ_FAMILIES = ("offset100", "offset1000", "peaked", "masked", "nan", "axis1", "empty")
# the CI's bounded run: all of them (masked rows and NaN too, since Taylor forms settle at the final values:
# x all -inf, sum((x - max)^2) was +inf fused where the reference has NaN)
CI_FAMILIES = FUZZ_FAMILIES


def kernel_configs(spec, derivation, shape):
    """(strategy, config) pairs to check: the default choice (None, None), then every valid
    strategy with tiles of KERNEL_BLOCK along the loop axis (split over 2 for split_fused)."""
    from fuser_core.codegen.plan import KernelConfig, default_config, loop_axis, valid_strategies

    out: list[tuple[str | None, KernelConfig | None]] = [(None, None)]
    valid = valid_strategies(spec, derivation, shape)
    for strategy, why in valid.items():
        if why is not None:
            continue
        config = default_config(spec, derivation, strategy, shape)
        if strategy != "row_resident":
            axis, _ = loop_axis(spec)
            config = KernelConfig({**config.blocks, axis: KERNEL_BLOCK}, split=2 if strategy == "split_fused" else 1)
        out.append((strategy, config))
    return out, valid


def check_cascade(raw: dict, *, kernels: bool = False, time_limit_s: float | None = None,
                  cert_trials: int = CERT_TRIALS, compile_pool=None, capabilities: tuple[int, ...] = (90,),
                  families: tuple[str, ...] = FUZZ_FAMILIES) -> Outcome:
    """Load, derive, certify and (optionally) run every valid kernel strategy of ``raw``; with a
    ``compile_pool`` (fuser_core.codegen.gpu_compile.CompilePool), every kernel that ran is also
    compiled for each of ``capabilities`` (90: sm_90) by Triton's GPU compiler.

    Never raises for a finding: a wrong result or an unexpected exception is returned as
    ``Outcome.failure`` (with the traceback's last line), so a long run can count them.
    """
    import traceback

    from fuser_core.certificate import certify
    from fuser_core.derive import derive_cascade
    from fuser_core.errors import DerivationLimitError, SpecError
    from fuser_core.spec import load_spec

    def crash(stage: str, err: BaseException) -> str:
        tb = traceback.extract_tb(err.__traceback__)[-1]
        return f"{stage}: {type(err).__name__}: {str(err)[:300]} ({tb.filename.rsplit('/', 2)[-1]}:{tb.lineno})"

    try:
        spec = load_spec(raw)
    except SpecError as err:
        return Outcome("invalid", detail={"error": str(err)})
    except Exception as err:  # noqa: BLE001 - a finding, not an error of the harness
        return Outcome("invalid", failure=crash("load_spec", err))
    try:
        kwargs = {} if time_limit_s is None else {"time_limit_s": time_limit_s}
        derivation = derive_cascade(spec, **kwargs)
    except DerivationLimitError as err:
        return Outcome("limit_stopped", detail={"error": str(err)})
    except SpecError as err:  # x / (x - x): undefined everywhere, found once steps are substituted
        assert err.loc, err
        return Outcome("undefined", detail={"error": str(err)})
    except Exception as err:  # noqa: BLE001
        return Outcome("not_fusible", failure=crash("derive_cascade", err))
    status = "fusible" if derivation.fusible else "not_fusible"
    reasons = {f.name: f.reason for f in derivation.forms.values() if not f.fused}
    try:
        cert = certify(derivation, trials=cert_trials)
    except DerivationLimitError as err:
        return Outcome("limit_stopped", detail={"error": str(err)})
    except Exception as err:  # noqa: BLE001
        return Outcome(status, failure=crash("certify", err))
    if not cert.holds:
        return Outcome(status, failure=f"certificate fails: algebra error {cert.algebra_max_rel_err:.3g} "
                                       f"per reduction {cert.per_reduction}")
    if cert.exact and cert.max_rel_err > 1e-9:
        return Outcome(status, failure=f"exact certificate with max_rel_err {cert.max_rel_err:.3g}")
    outcome = Outcome(status, detail={"reasons": reasons, "forms": {f.name: f.kind for f in derivation.forms.values()}})
    if not kernels:
        return outcome
    outcome = check_kernels(spec, derivation, outcome, crash, families)
    if compile_pool is None or outcome.failure:
        return outcome
    return check_compiles(spec, outcome, compile_pool, capabilities)


def check_compiles(spec, outcome: Outcome, pool, capabilities: tuple[int, ...]) -> Outcome:
    """The GPU compiler on every module the interpreter ran (the interpreter accepts code the
    compiler rejects)."""
    from fuser_core.codegen.gpu_compile import CompileRequest
    from fuser_core.runner import bind_dtypes
    from fuser_core.targets import Target

    shape = outcome.detail["shape"]
    dtypes = bind_dtypes(spec, "float32")
    requests = [CompileRequest(spec, shape, dtypes, strategy, config, Target("cuda", cap, 32))
                for strategy, config in outcome.detail.get("ran", []) for cap in capabilities]
    for request, build in zip(requests, pool.compile(requests)):
        if build.refused or not build.ok:
            outcome.failure = (f"compile {request.strategy} {request.config} for {request.target}: "
                               f"{build.refused or build.first_error()}")
            return outcome
        outcome.kernels_compiled += 1
    return outcome


def check_kernels(spec, derivation, outcome: Outcome, crash, families: tuple[str, ...] = FUZZ_FAMILIES) -> Outcome:
    import warnings

    from fuser_core.codegen.plan import NotValid
    from fuser_core.reference import bind_shape
    from fuser_core.runner import self_check

    shape = bind_shape(spec, ragged_shape(spec))  # with each topk's `as` dim set to its k
    try:
        configs, valid = kernel_configs(spec, derivation, shape)
    except Exception as err:  # noqa: BLE001
        outcome.failure = crash("valid_strategies", err)
        return outcome
    outcome.detail = {**(outcome.detail or {}), "shape": shape, "valid": valid}
    for strategy, config in configs:
        label = strategy or "default"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # masked lanes compute on fill values
                report = self_check(spec, shape, "float32", strategy=strategy, config=config, derivation=derivation)
        except NotValid as err:
            outcome.kernels_not_valid += 1
            outcome.detail.setdefault("not_valid", {})[label] = str(err)
            continue
        except Exception as err:  # noqa: BLE001
            outcome.failure = crash(f"kernel {label}", err)
            return outcome
        outcome.kernels_checked += 1
        ran = (report["strategy"], report["config"])
        if ran not in outcome.detail.setdefault("ran", []):
            outcome.detail["ran"].append(ran)
        if not report["passed"]:
            bad = {p: e for p, e in report["errors"].items() if e > report["tolerances"][p]}
            outcome.failure = (f"kernel {label} ({report['strategy']}, {report['config']}) does not match the "
                               f"reference at {shape}: {bad}")
            return outcome
        # the accuracy bar on the input families (fuser_core.accuracy): a loss of digits is a wrong result
        from fuser_core.accuracy import accuracy_check, refusal
        from fuser_core.codegen.plan import KernelConfig

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                bar = accuracy_check(spec, shape, "float32", families=families, strategy=report["strategy"],
                                     config=KernelConfig.from_dict(report["config"]), derivation=derivation,
                                     reduce_shape=False)
        except Exception as err:  # noqa: BLE001
            outcome.failure = crash(f"accuracy {label}", err)
            return outcome
        outcome.families_checked += len(bar["families"])
        if not bar["passed"]:
            outcome.failure = f"wrong result: kernel {label} ({report['config']}) at {shape}: {refusal(report['strategy'], bar)}"
            return outcome
    return outcome
