"""The cost model of the unfused chain (fuser_core/codegen/chain.py), the baseline every fused
kernel is compared with: one kernel per reduction through memory, then one elementwise kernel,
each predicted as :mod:`tuner.cost_model` predicts a fused kernel."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from fuser_core import is_dim_symbol
from fuser_core.codegen.plan import KernelConfig
from fuser_core.codegen.strategies import BASELINE
from fuser_core.derive import Derivation
from fuser_core.problem import Problem
from tuner.analysis import ELEMENT_BYTES, Anatomy, KernelSketch, Pass, WorkCounter, input_info, sketch
from tuner.cost_model import KernelLoad, Prediction, _combine, _KernelEvaluator, _Layout, _Model, _model
from tuner.profiles import GpuProfile

if TYPE_CHECKING:  # chain imports the code generator's modules: loaded only when the chain is modelled
    from fuser_core.codegen.chain import ChainElementwise

def predict_chain(problem: Problem, derivation: Derivation, profile: GpuProfile) -> Prediction:
    """Predicted time of the unfused kernel chain (fuser_core/codegen/chain.py) with its
    default blocks: one kernel per reduction reading the inputs and the earlier results, each
    result written to memory in float32, then one elementwise kernel for the outputs. The
    kernels are the chain's own plan (:func:`fuser_core.codegen.chain.chain_plan`)."""
    from fuser_core.codegen.chain import chain_plan
    from fuser_core.codegen.structure import build_structure

    spec = problem.spec
    m = _model(problem, derivation)
    plan = chain_plan(spec, m.shape, m.dtypes)
    loads: list[KernelLoad] = []
    touched: dict[str, float] = {}  # input or result -> requested bytes before the kernel that last touched it
    done = 0.0
    for r in plan.reductions:
        kp = r.plan
        an = Anatomy(r.sub, kp.derivation, r.dtypes)
        stores = {part: ELEMENT_BYTES[dtype] for part, dtype in r.stores.items()}
        ev = _KernelEvaluator(input_info(r.sub, r.dtypes), stores, _Layout(r.shape, kp.blocks, kp.lanes, kp.axis),
                              kp.config, profile)
        structure = build_structure(kp, r.dtypes, r.stores)  # the chain's own kernel plan
        sketch_ = sketch(an, structure.kernels[0], structure)
        sketch_ = KernelSketch(f"chain:{r.step.name} ({kp.strategy})", sketch_.grid, sketch_.passes, sketch_.state)
        global_names = {name: what for name, (where, what) in r.reads.items()}
        load = ev.evaluate(sketch_, {n: done - touched[w] for n, w in global_names.items() if w in touched}, done)
        loads.append(load)
        for name in [*global_names.values(), *r.step.parts]:
            touched[name] = done
        done += load.l2_bytes

    if plan.elementwise is not None:
        earlier = {n: done - at for n, at in touched.items()}
        loads.append(_chain_elementwise(m, plan.elementwise, earlier, done, profile))
    return _combine(loads, profile, {"strategy": BASELINE})


def _chain_elementwise(m: _Model, plan: ChainElementwise, earlier: Mapping[str, float], done: float,
                       profile: GpuProfile) -> KernelLoad:
    """The chain's elementwise kernel (a :class:`fuser_core.codegen.chain.ChainElementwise`)."""
    from fuser_core.spec import Input

    spec = m.spec
    p = Pass("once")
    work = WorkCounter(m.anatomy, p)
    inputs: dict[str, tuple[tuple[str, ...], int]] = {}
    runtime = {q.name for q in spec.runtime_params}
    for o in plan.outputs:
        e = m.anatomy.conv.value(o)
        for s in sorted(e.free_symbols, key=lambda s: s.name):
            name = s.name
            if is_dim_symbol(s, "size", "index") or name in inputs or name in runtime:
                continue  # a runtime param is a scalar argument, nothing loaded
            obj = spec.lookup(name)
            if isinstance(obj, Input):
                inputs[name] = (obj.dims, m.inputs[name][1])
            else:
                inputs[name] = (spec.step(name.split(".")[0]).dims, 4)
            p.loads = (*p.loads, name)
            p.add(inputs[name][0], 4)
        work.expr(e)
        p.stores.append((o, frozenset(spec.step(o).dims)))
        p.add(spec.step(o).dims, 2)
    sketch_ = KernelSketch("chain:elementwise", "lanes", [p], [])
    stores = {o: ELEMENT_BYTES[plan.stores[o]] for o in plan.outputs}
    layout = _Layout(m.shape, plan.blocks, plan.dims, None)
    ev = _KernelEvaluator(inputs, stores, layout, KernelConfig(dict(plan.blocks)), profile)
    return ev.evaluate(sketch_, {n: earlier[n] for n in inputs if n in earlier}, done)


__all__ = ["predict_chain"]
