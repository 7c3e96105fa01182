"""Does Triton warp-specialise Foldwise's attention loop? A static probe (issue 35, 1).

FlashAttention-3's structure (producer warps issuing TMA, consumer warpgroups on the tensor
cores) is what Triton's ``tl.range(..., warp_specialize=True)`` asks its compiler for. This script
generates the attention kernel the tuner serves (streaming_fused at tutorial 06's tile: BLOCK_m =
BLOCK_n = 128, 8 warps, 3 stages, K and V by TMA), writes a copy whose main loop is that
``tl.range``, and compiles both for Hopper (sm_90) and Blackwell (sm_100) with Triton's compiler on
this machine, no GPU: whether it compiles, whether the TTGIR holds warp-specialised partitions, and
the main loop's issued instructions (SASS, NVIDIA's disassembler). Prints a table; times need a GPU.

    python benchmarks/warp_specialize_probe.py [--dtype float16] [--targets sm_90,sm_100]
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import tempfile
from pathlib import Path

from fuser_core.catalog import load_catalog_spec
from fuser_core.codegen.backends import backend_for
from fuser_core.codegen.gpu_compile import CompileError, _compiled
from fuser_core.codegen.launches import intercepted_launches, meta_inputs, target_driver
from fuser_core.codegen.module import generate
from fuser_core.codegen.plan import KernelConfig
from fuser_core.derive import derive_cascade
from fuser_core.problem import bind_shape, placeholder_scalars
from fuser_core.runner import bind_dtypes
from fuser_core.targets import Target

SHAPE = {"b": 4, "h": 32, "m": 4096, "n": 4096, "d": 128, "e": 128}
CONFIG = KernelConfig({"m": 128, "n": 128, "d": 128, "e": 128}, num_warps=8, num_stages=3, per_lane=False)
MAIN_LOOP = "    for start in range(0, size_n // BLOCK_n * BLOCK_n, BLOCK_n):"
WS_LOOP = "    for start in tl.range(0, size_n // BLOCK_n * BLOCK_n, BLOCK_n, warp_specialize=True):"


def load_module(text: str, folder: Path, stem: str):
    path = folder / f"{stem}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def probe(module, spec, shape, dtypes, target: Target) -> dict:
    with target_driver(target), intercepted_launches() as launches:
        module.launch(meta_inputs(spec, shape, dtypes), shape, scalars=placeholder_scalars(spec))
    backend = backend_for(target)
    try:
        compiled = _compiled(launches[0], backend, backend.bind(launches[0]))
    except CompileError as err:
        return {"compiles": "no", "why": str(err).split(": ", 1)[-1][:70]}
    partitions = len(re.findall(r"ttg\.warp_specialize", compiled.asm["ttgir"]))
    facts = backend.sass_facts(compiled) or {}
    hot = max((lp["instructions"] for lp in facts.get("loops", ())), default="-")  # the main loop's body
    return {"compiles": "yes", "partitions": partitions, "loop": hot, "registers": backend.resources(compiled).registers}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--targets", default="sm_90,sm_100")
    args = parser.parse_args(argv)
    spec = load_catalog_spec("attention")
    shape = bind_shape(spec, SHAPE)
    dtypes = bind_dtypes(spec, args.dtype)
    source = generate(spec, derive_cascade(spec), "streaming_fused", shape, CONFIG, dtypes).source
    if MAIN_LOOP not in source:
        print("the generated attention loop changed: update MAIN_LOOP", file=sys.stderr)
        return 1
    print(f"attention {SHAPE} {args.dtype}, streaming_fused {CONFIG.to_dict()}")
    print(f"{'target':8} {'loop':18} {'compiles':9} {'ws partitions':14} {'hot loop':12} {'regs':5} why")
    with tempfile.TemporaryDirectory() as folder:
        variants = {"range": load_module(source, Path(folder), "attention_plain"),
                    "warp_specialize": load_module(source.replace(MAIN_LOOP, WS_LOOP), Path(folder), "attention_ws")}
        for name in args.targets.split(","):
            for label, module in variants.items():
                r = probe(module, spec, shape, dtypes, Target.parse(name))
                print(f"{name:8} {label:18} {r['compiles']:9} {str(r.get('partitions', '-')):14} "
                      f"{str(r.get('loop', '-')):12} {str(r.get('registers', '-')):5} {r.get('why', '')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
