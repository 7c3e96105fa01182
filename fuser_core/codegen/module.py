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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from fuser_core.canonical import canonical_json
from fuser_core.codegen.emit import HELPERS, KernelWriter, kernel_arg, safe_name
from fuser_core.codegen.plan import KernelConfig, KernelPlan, make_plan
from fuser_core.derive import Derivation
from fuser_core.spec import Spec

def _generator_version() -> str:
    """Hash of the code generator's own sources: a changed generator never reuses old kernels."""
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(here.glob("*.py")):
        digest.update(path.read_bytes())
    digest.update((here.parent / "derive.py").read_bytes())
    return digest.hexdigest()[:12]


GENERATOR_VERSION = _generator_version()
TORCH_DTYPES = {
    "float32": "torch.float32", "float16": "torch.float16", "bfloat16": "torch.bfloat16",
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


def output_dtypes(spec: Spec, dtypes: dict[str, str]) -> dict[str, str]:
    """Storage dtype of each output part (docs/SPEC.md: the floating inputs' dtype unless a cast says otherwise)."""
    from fuser_core import expr as ex

    floats = [dtypes[i.name] for i in spec.inputs if i.kind == "float"]
    default = next((d for d in floats if d != "float8_e4m3fn"), "float32") if len(set(floats)) != 1 else floats[0]
    if default == "float8_e4m3fn":
        default = "float32"
    out = {}
    for part in spec.output_parts:
        step = spec.step(part.split(".")[0])
        if part.endswith(".indices") or step.reduce in ("argmax", "argmin"):
            out[part] = "int32"
        elif isinstance(step.expr, ex.Cast) and not step.is_reduction:
            out[part] = step.expr.dtype
        else:
            out[part] = default
    return out


def cached_source(stem: str, key_parts: list, make_source: Callable[[], str]) -> tuple[str, Path, str]:
    """(key, path, source) of a generated module: read from the cache, or made and written atomically."""
    key = hashlib.sha256(json.dumps([*key_parts, GENERATOR_VERSION], sort_keys=True).encode()).hexdigest()
    path = cache_dir() / f"{stem}_{key[:16]}.py"
    if path.exists():
        return key, path, path.read_text()
    source = make_source()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(source)
    os.replace(tmp, path)  # atomic: concurrent writers produce the same text
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
    ]
    key, path, source = cached_source(f"{spec.name}_{strategy}", key_parts, lambda: module_source(plan, stores, dtypes))
    return GeneratedModule(key, source, plan, path)


def module_source(plan: KernelPlan, stores: dict[str, str], dtypes: dict[str, str]) -> str:
    spec = plan.spec
    kernel = f"{spec.name}_{plan.strategy}_kernel"
    writer = KernelWriter(plan, kernel, stores, dtypes)
    body = writer.write()
    header = module_header(
        f"{spec.name}, strategy {plan.strategy}.",
        [f"config: {json.dumps(plan.config.to_dict(), sort_keys=True)}", f"blocks: {json.dumps(plan.blocks, sort_keys=True)}"],
    )
    return header + "\n\n" + body + "\n\n" + launcher_source(plan, kernel, stores, dtypes, writer)


def module_header(title: str, details: list[str]) -> str:
    """Docstring, imports and the shared @triton.jit helpers of a generated module."""
    lines = [f'"""Generated by foldwise (generator {GENERATOR_VERSION}): {title}', "", *details, '"""', "",
             "import os", "", "import torch", "import triton", "import triton.language as tl", ""]
    return "\n".join(lines) + HELPERS


def launcher_source(plan: KernelPlan, kernel: str, stores: dict[str, str], dtypes: dict[str, str],
                    writer: KernelWriter) -> str:
    spec = plan.spec
    lines = [
        "def launch(inputs, shape):",
        f'    """Run {kernel} on torch tensors; returns the outputs by name (dims in each step\'s order)."""',
    ]
    for d in spec.dims:
        lines.append(f'    size_{d} = int(shape["{d}"])')
    first = safe_name(spec.inputs[0].name)
    for i in spec.inputs:
        lines.append(f'    {safe_name(i.name)} = inputs["{i.name}"]')
    outs = []
    for part in spec.output_parts:
        var = safe_name(part)
        dims = spec.step(part.split(".")[0]).dims
        size = "(" + "".join(f"size_{d}, " for d in dims) + ")"
        lines.append(f"    {var} = torch.empty({size}, device={first}.device, dtype={TORCH_DTYPES[stores[part]]})")
        outs.append((part, var, dims))
    lanes = " * ".join(f"triton.cdiv(size_{d}, {plan.blocks[d]})" for d in plan.lanes) or "1"
    args = [kernel_arg(safe_name(i.name), dtypes.get(i.name)) for i in spec.inputs]
    args += [kernel_arg(v, stores[p]) for p, v, _ in outs]
    args += [f"size_{d}" for d in spec.dims]
    for i in spec.inputs:
        args += [f"{safe_name(i.name)}.stride({k})" for k in range(len(i.dims))]
    for _, var, dims in outs:
        args += [f"{var}.stride({k})" for k in range(len(dims))]
    launches = [(kernel, f"({lanes},)")]
    if plan.strategy == "split_fused":
        a = plan.axis
        lines.append(f"    SPLIT = {plan.config.split}")
        lines.append(f"    chunk = triton.cdiv(triton.cdiv(size_{a}, SPLIT), {plan.blocks[a]}) * {plan.blocks[a]}")
        lines.append("    # partial states of each chunk, handed from the split kernel to the combine kernel")
        workspace = writer.workspace()
        for name, dims, dtype in workspace:
            size = "(SPLIT, " + "".join(f"size_{d}, " for d in dims) + ")"
            lines.append(f"    ws_{name} = torch.empty({size}, device={first}.device, dtype={TORCH_DTYPES[dtype]})")
        args += [f"ws_{name}" for name, _, _ in workspace]
        for name, dims, _ in workspace:
            args += [f"ws_{name}.stride({k})" for k in range(len(dims) + 1)]
        args += ["SPLIT", "chunk"]
        launches = [(kernel, f"({lanes}, SPLIT)"), (kernel.replace("_kernel", "_combine_kernel"), f"({lanes},)")]
    args += [f"BLOCK_{d}={plan.blocks[d]}" for d in spec.dims]
    args += [f"num_warps={plan.config.num_warps}", f"num_stages={plan.config.num_stages}"]
    for name, grid in launches:
        lines.append(f"    {name}[{grid}](")
        lines += [f"        {a}," for a in args]
        lines.append("    )")
    lines.append("    return {" + ", ".join(f'"{p}": {v}' for p, v, _ in outs) + "}")
    return "\n".join(lines) + "\n"
