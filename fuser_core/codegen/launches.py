"""A generated module's kernel launches, as a GPU would bind them, on a machine without a GPU.

The generated launcher is called on ``meta`` tensors (dtypes and strides, no storage) with every
``@triton.jit`` launch intercepted (:func:`intercepted_launches`): each :class:`KernelLaunch`
keeps the function and the arguments the launcher passed, so the signature a compile binds
(pointer dtypes, int sizes and strides, their specialisation, constexpr blocks,
``num_warps``/``num_stages``) is exactly the one a GPU launch would bind, with no second copy
of the argument list. :func:`request_launches` does this for one compile request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fuser_core.spec import Spec


@dataclass
class KernelLaunch:
    """One intercepted ``kernel[grid](...)``: the function and what the launcher passed it."""

    fn: Any  # triton.runtime.jit.JITFunction
    args: tuple
    kwargs: dict[str, Any]
    grid: Any = None  # as the launcher gave it: a tuple, or a function of the launch's meta-parameters


@contextlib.contextmanager
def intercepted_launches():
    """Within the block, ``kernel[grid](...)`` records the launch instead of running it."""
    from triton.runtime.jit import JITFunction

    launches: list[KernelLaunch] = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(KernelLaunch(self, args, dict(kwargs), grid))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original


class TargetOnlyDriver:
    """For hosts without a GPU (the compile pool, tests, benchmarks/kernel_startup.py): the calls
    Triton's ``JITFunction.run`` makes before a launch (device 0, stream 0, the target), and that a
    launcher makes to choose for its device (``fp8_native``), so a launcher binds and keys its
    launches exactly as on a device of this target (a :class:`fuser_core.Target`, or an NVIDIA
    compute capability: 90). It cannot launch."""

    def __init__(self, target: Any):
        from fuser_core.targets import Target

        self.target = (target if isinstance(target, Target) else Target.parse(f"sm_{int(target)}")).triton()

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target


@contextlib.contextmanager
def target_driver(target: Any):
    """Within the block, Triton's active driver is a :class:`TargetOnlyDriver` for ``target``; after
    it, the one before (``reset_active`` would make the default driver, which fails without a GPU)."""
    from triton.runtime.driver import driver

    before = getattr(driver, "_active", None)  # DriverConfig's field (None: its default, made when asked)
    driver.set_active(TargetOnlyDriver(target))
    try:
        yield
    finally:
        driver._active = before


def meta_inputs(spec, shape: Mapping[str, int], dtypes: Mapping[str, str]) -> dict[str, Any]:
    """Empty ``meta`` tensors for every input: dtypes and strides, no storage; in the user's dims (a
    contiguous per-channel weight, as inference servers pass it: fuser_core.merged), a paged input
    as its pages with its table (fuser_core.paged)."""
    import torch

    from fuser_core.paged import page_table, storage_shape

    out = {}
    for table, layout in spec.page_tables.items():  # a paged KV cache as servers pass it: pages and an int32 table
        out[table] = page_table(layout, shape, "meta")
    for i in spec.inputs:
        dtype = dtypes.get(i.name, "int64" if i.is_index else "float32")
        dims = [int(shape[d]) for d in i.storage_dims or i.dims]
        if i.paged is not None:
            dims = list(storage_shape(i, shape, out[i.paged.table].numel()))
        out[i.name] = torch.empty(dims, dtype=getattr(torch, dtype), device="meta")
    return out


_DERIVATIONS: dict[Spec, Any] = {}  # by the spec itself: a derivation carries the spec's own names


def request_launches(request: Any) -> tuple[dict[str, Any], list[KernelLaunch]]:
    """Generate the module(s) of a request (:class:`fuser_core.codegen.gpu_compile.CompileRequest`:
    its spec, shape, dtypes, strategy and config) and run the launcher on meta tensors,
    intercepted; returns the config used and the launches (NotValid when the strategy cannot run)."""
    from fuser_core.codegen.chain import run_chain_detailed
    from fuser_core.codegen.module import generate
    from fuser_core.codegen.plan import KernelConfig, default_config
    from fuser_core.codegen.strategies import BASELINE
    from fuser_core.derive import DERIVE_TIME_LIMIT_S, derive_cascade
    from fuser_core.problem import placeholder_scalars
    from fuser_core.reference import bind_shape
    from fuser_core.runner import bind_dtypes

    spec = request.spec
    shape = bind_shape(spec, request.shape)
    dtypes = bind_dtypes(spec, request.dtypes)
    inputs = meta_inputs(spec, shape, dtypes)
    if request.strategy == BASELINE:
        config = KernelConfig.from_dict(request.config or {})
        with target_driver(request.target), intercepted_launches() as launches:
            run_chain_detailed(spec, shape, dtypes, inputs, config_blocks=config.blocks,
                               scalars=placeholder_scalars(spec))
        return config.to_dict(), launches
    if spec not in _DERIVATIONS:
        # the spec was derived within its time limit before it was sent here; a loaded host must
        # not turn the same work into a compile failure (still bounded: 10x the limit)
        _DERIVATIONS[spec] = derive_cascade(spec, time_limit_s=10 * DERIVE_TIME_LIMIT_S)
    derivation = _DERIVATIONS[spec]
    if request.config is None:
        config = default_config(spec, derivation, request.strategy, shape)
    else:
        config = KernelConfig.from_dict(request.config)
    module = generate(spec, derivation, request.strategy, shape, config, dtypes)
    with target_driver(request.target), intercepted_launches() as launches:
        module.load().launch(inputs, shape, scalars=placeholder_scalars(spec))
    return config.to_dict(), launches
