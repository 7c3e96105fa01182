"""Assemble a generated module (kernels + a plain Python launcher) and load it.

Triton's ``@jit`` reads a kernel's source file, so generated modules are written to a cache
directory and imported from there. The cache key is (spec hash, the spec's own names,
strategy, config, dtypes, generator version): the same request never regenerates, and a new
generator never reuses old code.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from fuser_core.canonical import canonical_json
from fuser_core.codegen.emit import kernels_source
from fuser_core.codegen.helper_copy import helper_source
from fuser_core.codegen.names import FP8_NATIVE, TMA_LOADS, WIDE_OFFSETS, safe_name, scalar_arg
from fuser_core.codegen.ops import Descriptor, walk
from fuser_core.codegen.plan import KernelConfig, KernelPlan, make_plan
from fuser_core.codegen.structure import Grid, Launch, ModuleStructure, SplitLaunch, build_structure
from fuser_core.derive import Derivation
from fuser_core.host_faults import write_cache_file
from fuser_core.merged import launcher_lines
from fuser_core.paged import launcher_lines as paged_launcher_lines, offsets_checked
from fuser_core.problem import output_dtypes  # (also read here by codegen.chain)
from fuser_core.spec import Spec


# modules of codegen/ that compile or read generated modules and print none of their text: a change
# there must not change every generated module's version line and cache key
COMPILE_SIDE = frozenset({"backends", "gpu_compile.py", "launches.py", "compiler_errors.py", "sass.py"})


def _generator_version() -> str:
    """Hash of the code generator's own sources: a changed generator never reuses old kernels."""
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(here.rglob("*.py")):  # subpackages (codegen.structure) included
        if path.relative_to(here).parts[0] not in COMPILE_SIDE:
            digest.update(path.read_bytes())
    # the derivation, the realisations the printer prints, the sympy forms of the spec's expressions, which
    # elements a fold drops (masks) and how
    # kernels address and launchers lay out inputs of merged dims and paged inputs
    # and the reduce kinds' table (identities, helpers)
    for core in ("derive", "realisation.py", "symbolic.py", "merged.py", "paged.py", "masks.py", "reduce_ops.py"):
        path = here.parent / core
        for source in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(source.read_bytes())
    return digest.hexdigest()[:12]


GENERATOR_VERSION = _generator_version()
# Triton's FP-fusion knob (a*b+c contracted to one FMA), passed explicitly by every launch: Triton
# <= 3.9 fuses by default (3.9 warns that 3.10 turns the default off), and every kernel and the
# first GPU check were verified fused. Explicit, the same code is compiled on every Triton, and no
# TRITON_DEFAULT_FP_FUSION variable is needed (it would enter Triton's cache key and make a stored
# cubin's key differ from an inference server's, which sets none).
FP_FUSION = True
TORCH_DTYPES = {
    "float32": "torch.float32", "float16": "torch.float16", "bfloat16": "torch.bfloat16", "float64": "torch.float64",
    "float8_e4m3fn": "torch.float8_e4m3fn", "int32": "torch.int32", "int64": "torch.int64",
}


def cache_dir() -> Path:
    root = os.environ.get("FOLDWISE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "foldwise")
    path = Path(root) / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass(frozen=True)
class GeneratedModule:
    key: str
    source: str
    plan: KernelPlan
    path: Path

    def load(self) -> ModuleType:
        return _load(self.key, self.path)


_MODULES: dict[str, ModuleType] = {}


def _load(key: str, path: Path) -> ModuleType:
    if key not in _MODULES:
        spec = importlib.util.spec_from_file_location(f"foldwise_kernel_{key[:16]}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        _MODULES[key] = module
    return _MODULES[key]


def cached_source(stem: str, key_parts: list, make_source: Callable[[], str]) -> tuple[str, Path, str]:
    """(key, path, source) of a generated module: read from the cache, or made and written atomically."""
    key = hashlib.sha256(json.dumps([*key_parts, GENERATOR_VERSION], sort_keys=True).encode()).hexdigest()
    path = cache_dir() / f"{stem}_{key[:16]}.py"
    if path.exists():
        return key, path, path.read_text()
    source = make_source()
    failed = write_cache_file(path, source)  # atomic: concurrent writers produce the same text
    if failed is not None:  # (a full disk): no partial file left, and Triton reads a kernel's source from its file
        raise failed
    return key, path, source


def generate(
    spec: Spec, derivation: Derivation, strategy: str, shape: dict[str, int], config: KernelConfig,
    dtypes: dict[str, str], stores: dict[str, str] | None = None,
) -> GeneratedModule:
    """The module for (spec, strategy, config, dtypes); ``stores`` overrides the outputs' storage dtypes."""
    plan = make_plan(spec, derivation, strategy, shape, config)
    stores = stores or output_dtypes(spec, dtypes)
    key_parts = [
        canonical_json(spec), [(i.name, i.dims) for i in spec.inputs], [s.name for s in spec.steps],
        sorted(plan.blocks.items()), strategy, config.to_dict(), sorted(dtypes.items()), sorted(stores.items()),
        plan.parallel_combine,
    ]
    key, path, source = cached_source(f"{spec.name}_{strategy}", key_parts, lambda: module_source(plan, stores, dtypes))
    return GeneratedModule(key, source, plan, path)


def module_source(plan: KernelPlan, stores: dict[str, str], dtypes: dict[str, str]) -> str:
    spec = plan.spec
    structure = build_structure(plan, dtypes, stores)
    body = kernels_source(structure)
    header = module_header(
        f"{spec.name}, strategy {plan.strategy}.",
        [f"config: {json.dumps(plan.config.to_dict(), sort_keys=True)}", f"blocks: {json.dumps(plan.blocks, sort_keys=True)}"],
        structure.helpers() + (["fp8_native"] if takes_fp8_native(structure) else [])
        + (["tma_loads"] if descriptor_inputs(structure) else [])
        + (["split_tickets"] if combines_in_launch(structure) else []) + ["wide_offsets"]
        + (["page_order", "to_page_layout", "page_table_checked"] if spec.page_tables else []),
    )
    return header + "\n\n" + body + "\n\n" + launcher_source(structure, stores)


def takes_fp8_native(structure: ModuleStructure) -> bool:
    """Does a kernel of the module take the FP8_NATIVE choice (the launcher then calls fp8_native)?"""
    return any(a.name == FP8_NATIVE for k in structure.kernels for a in k.args)


def descriptor_inputs(structure: ModuleStructure) -> list[str]:
    """The launcher's variables of the inputs some kernel may load through a tensor descriptor (the
    launcher then calls tma_loads on them), in the spec's order."""
    vars_ = {op.var for k in structure.kernels for op in walk(k.ops) if isinstance(op, Descriptor)}
    return [safe_name(i.name) for i in structure.plan.spec.inputs if safe_name(i.name) in vars_]


def combines_in_launch(structure: ModuleStructure) -> bool:
    """Does a split launch merge its parts in the part kernel (the launcher then calls split_tickets)?"""
    return any(isinstance(x, SplitLaunch) and x.combine is None for x in structure.launches)


def module_header(title: str, details: list[str], helpers: Iterable[str]) -> str:
    """Docstring, imports and the @triton.jit helpers ``helpers`` (those the module's kernels call;
    with the helpers they call), copied from fuser_core/codegen/helpers.py."""
    source, modules = helper_source(helpers)
    lines = [f'"""Generated by foldwise (generator {GENERATOR_VERSION}): {title}', "", *details, '"""', ""]
    lines += [*(f"import {m}" for m in sorted(modules)), ""] if modules else []
    lines += ["import torch", "import triton", "import triton.language as tl", ""]
    return "\n".join(lines) + source


def lane_programs(grid: Grid) -> str:
    """The launcher's expression for the number of lane blocks of ``grid`` (its first grid dim)."""
    return " * ".join(f"triton.cdiv(size_{d}, {b})" for d, b in grid.lanes) or "1"


def grid_text(grid: Grid) -> str:
    lanes = lane_programs(grid)
    return f"({lanes}, SPLIT)" if grid.split else f"({lanes},)"


def output_memory_order(spec: Spec, dims: tuple[str, ...]) -> tuple[str, ...]:
    """The dim order, outer to inner, a launcher lays out an output of ``dims`` in when it allocates
    it: that of the first input (in ``spec``'s order) holding all of them, else ``dims``' own.

    Why: callers get outputs contiguous in their own dim order (service.bundle), which follows the
    inputs in the order *they* list them, while a bundle's canonical spec lists inputs sorted by
    name (rmsnorm's canonical ``y`` is ``[c, t]``, its caller's ``[t, c]``). Both orders meet at the
    input holding the output's dims (``x[t, c]``), whose order no naming changes: the layout the
    server tunes and compiles (its cubins are specialised on these strides) is then the one an
    inference server's call hands the kernel, and rows are written where the input is read, along
    its contiguous dim."""
    for inp in spec.inputs:
        if set(dims) <= set(inp.dims):
            return tuple(d for d in inp.dims if d in dims)
    return dims


def launcher_source(structure: ModuleStructure, stores: dict[str, str]) -> str:
    """The module's ``launch``: outputs (and a split kernel's workspace) allocated, kernels launched."""
    plan = structure.plan
    spec = plan.spec
    lines = [
        "def launch(inputs, shape, out=None, scalars=None):",
        f'    """Run {", ".join(k.name for k in structure.kernels)} on torch tensors; returns the outputs by name '
        '(dims in each step\'s order). ``out``: a tensor per output part to write into (any strides: a '
        'caller\'s layout), else each is allocated here. ``scalars``: runtime param -> its value, every one '
        '(defaults are applied by the caller: fuser_core.problem.bind_scalars)."""',
    ]
    for d in spec.sized_dims:
        lines.append(f'    size_{d} = int(shape["{d}"])')
    for p in spec.runtime_params:  # a Python float: an fp32 kernel argument, the same binary for every value
        lines.append(f'    {scalar_arg(p.name)} = float(scalars["{p.name}"])')
    first = safe_name(spec.inputs[0].name)
    for i in spec.inputs:
        lines.append(f'    {safe_name(i.name)} = inputs["{i.name}"]')
        lines.extend(launcher_lines(spec, i.name, safe_name(i.name)))
    outs = []
    for part in spec.output_parts:
        var = safe_name(part)
        dims = spec.step(part.split(".")[0]).dims
        memory = output_memory_order(spec, dims)
        size = "(" + "".join(f"size_{d}, " for d in memory) + ")"
        alloc = f"torch.empty({size}, device={first}.device, dtype={TORCH_DTYPES[stores[part]]})"
        if memory != dims:
            lines.append(f"    # {part} laid out as the input holding its dims: ({', '.join(memory)})")
            alloc += ".permute(" + ", ".join(str(memory.index(d)) for d in dims) + ")"
        # the caller may hand its own tensors (service.bundle: outputs laid out in the caller's dim
        # order, or out= tensors); the kernels take every output's strides, so any layout is written
        lines.append(f'    {var} = out["{part}"] if out is not None else {alloc}')
        outs.append((part, var))
    lines.extend(paged_launcher_lines(spec))
    addressed = [f"{safe_name(i.name)}={safe_name(i.name)}" for i in spec.inputs if i.paged is None]
    addressed += [*offsets_checked(spec), *(f"{v}={v}" for _, v in outs)]
    lines.append(f"    {WIDE_OFFSETS} = wide_offsets({', '.join(addressed)})  # a view past 2**31 elements: 64-bit positions")
    if takes_fp8_native(structure):
        lines.append(f"    {FP8_NATIVE} = fp8_native()  # the hardware's e4m3 conversions and fp8 dots (sm_89+)")
    if descriptor_inputs(structure):
        lines.append(f"    {TMA_LOADS} = tma_loads({', '.join(descriptor_inputs(structure))})  # tiles by TMA (sm_90+)")
    tail = [f"num_warps={plan.config.num_warps}", f"num_stages={plan.config.num_stages}",
            f"enable_fp_fusion={FP_FUSION}"]

    def call(launch: Launch) -> None:
        lines.append(f"    {launch.kernel}[{grid_text(launch.grid)}](")
        lines.extend(f"        {a.launch_arg}," for a in structure.kernel(launch.kernel).args)
        lines.extend(f"        {a}," for a in tail)
        lines.append("    )")

    for launch in structure.launches:
        if isinstance(launch, SplitLaunch):
            lines.append(f"    SPLIT = {launch.split}")
            lines.append(f"    chunk = triton.cdiv(triton.cdiv(size_{launch.axis}, SPLIT), {launch.block}) * {launch.block}")
            lines.append("    # partial states of each chunk, handed from the split kernel to the combine kernel")
            for w in launch.workspace:
                size = "(SPLIT, " + "".join(f"size_{d}, " for d in w.dims) + ")"
                held = structure.kernels[0].compute if w.dtype == "float32" else w.dtype  # a float64 kernel's states
                lines.append(f"    ws_{w.name} = torch.empty({size}, device={first}.device, dtype={TORCH_DTYPES[held]})")
            if launch.combine is None:
                lines.append(f"    tickets = split_tickets({first}.device, {lane_programs(launch.part.grid)})"
                             "  # a count per lane block, 0 between launches")
            call(launch.part)
            if launch.combine is not None:
                call(launch.combine)
        else:
            call(launch)
    lines.append("    return {" + ", ".join(f'"{p}": {v}' for p, v in outs) + "}")
    return "\n".join(lines) + "\n"
