"""A stage over a kernel's operations: the loads a ``tl.dot`` reads as loaded, through tensor descriptors.

On Hopper and newer, Triton's tutorial 06 brings K and V in by the tensor memory accelerator: one
thread issues a copy of a whole tile (``UTMALDG``) into shared memory, where the matrix product reads
it, instead of every thread computing addresses and issuing ``cp.async`` (16 LDGSTS per thread per
tile at attention's BLOCK_n 128, d 128, with their address arithmetic and barriers). This stage marks
every load in a loop that qualifies (:func:`qualifies`) and adds, before the loop, the
:class:`~fuser_core.codegen.ops.Descriptor` it loads through. The printed kernel keeps both forms
under the TMA_LOADS constexpr, which the launcher sets per call (``tma_loads``: an NVIDIA device of
sm_90 or newer, the tensors 16-byte aligned with their last dim contiguous), so sm_80, AMD, the
interpreter and any other layout keep pointer loads, and a stored binary is keyed on the choice.

A load qualifies when: a tl.dot reads its input as loaded (:attr:`~fuser_core.codegen.ops.Dot.direct`);
it is 16-bit (the dot's own precision: the tile goes to the tensor cores as it is); its tile is 2-d,
the input's contiguous (last stored) dim and one other, every other dim at the program's offset; no
dim is merged (``merged.address``: an offset that divides); its masked lanes are 0 (no fold's identity
filled in: TMA fills zeros outside the tensor); and each tile dim's block is between 16 bytes and 256
elements (a TMA box).
"""

from __future__ import annotations

from dataclasses import replace

from fuser_core.codegen.ops import Descriptor, Fold, Load, Loop, Op, Reduce, walk
from fuser_core.codegen.plan import KernelPlan

TMA_DTYPES = {"float16": 2, "bfloat16": 2}  # bytes per element of the dtypes loaded through descriptors
TMA_BOX = 256  # the most elements a TMA box has along one dim


def qualifies(load: Load, plan: KernelPlan, direct: set[str]) -> tuple[str, ...]:
    """The (outer, contiguous) dims of ``load``'s tile when it can come through a descriptor, else ()."""
    if load.hoisted or load.fill is not None or load.input not in direct or load.dtype not in TMA_DTYPES:
        return ()
    spec_input = plan.spec.input(load.input)
    contiguous = (spec_input.storage_dims or spec_input.dims)[-1]
    if len(load.dims) != 2 or contiguous not in load.dims:
        return ()
    if any(fmt != "{}" or sizes for _, fmt, _, sizes in load.address):
        return ()
    outer = next(d for d in load.dims if d != contiguous)
    blocks = (plan.blocks[outer], plan.blocks[contiguous])
    if max(blocks) > TMA_BOX or blocks[1] * TMA_DTYPES[load.dtype] < 16:
        return ()
    return (outer, contiguous)


def _mark(ops: tuple[Op, ...], plan: KernelPlan, direct: set[str], in_loop: bool) -> tuple[Op, ...]:
    out = []
    for op in ops:
        if isinstance(op, Loop):
            op = replace(op, body=_mark(op.body, plan, direct, True))
        elif isinstance(op, Load) and in_loop:
            dims = qualifies(op, plan, direct)
            if dims:
                op = replace(op, descriptor=dims)
        out.append(op)
    return tuple(out)


def descriptor_loads(ops: tuple[Op, ...], plan: KernelPlan) -> tuple[Op, ...]:
    """``ops`` with the qualifying loads marked, each input's descriptor made before the first loop
    that loads through it."""
    direct = {name for op in walk(ops) if isinstance(op, (Reduce, Fold)) and op.dot is not None
              for name in op.dot.direct}
    if not direct:
        return ops
    ops = _mark(ops, plan, direct, False)
    out: list[Op] = []
    made: set[str] = set()
    for op in ops:
        for load in (x for x in walk((op,)) if isinstance(x, Load) and x.descriptor and x.name not in made):
            out.append(Descriptor(var=load.name, memory=load.descriptor, address=load.address))
            made.add(load.name)
        out.append(op)
    return tuple(out)
