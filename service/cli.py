"""The ``foldwise`` command line (../shared/docs/INTERFACE.md).

Exit codes: 0 success (a valid spec that does not fuse is a success), 2 invalid input
(the message on stderr names the field), 1 an internal error.

Subcommands arrive with the issues that build them; each one imports only what it needs,
so that ``foldwise derive bad.json`` answers before sympy is even imported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

EXIT_INVALID = 2


class UsageError(Exception):
    """Bad input from the command line (exit 2)."""


def _read_spec(path: str):
    from fuser_core.spec import MAX_SPEC_BYTES, load_spec

    p = Path(path)
    try:
        if p.stat().st_size > MAX_SPEC_BYTES:
            raise UsageError(f"{path}: spec file is larger than {MAX_SPEC_BYTES} bytes")
        data = p.read_bytes()
    except OSError as err:
        raise UsageError(f"{path}: cannot read: {err.strerror}") from None
    return load_spec(data)


def cmd_derive(args: argparse.Namespace) -> int:
    from fuser_core.report import derivation_report

    spec = _read_spec(args.spec)
    report = derivation_report(spec)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0


def parse_shape(text: str) -> dict[str, int]:
    """``m=4,n=300`` -> {"m": 4, "n": 300}."""
    shape: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip().lstrip("-").isdigit():
            raise UsageError(f"--shape: expected dim=size pairs like m=4,n=300, got {item!r}")
        shape[name.strip()] = int(value)
    return shape


def parse_dtype(text: str) -> str | dict[str, str]:
    """``float16``, or a JSON object of input -> dtype."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise UsageError(f"--dtype: not valid JSON: {err.msg}") from None
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise UsageError("--dtype: expected a JSON object of input name -> dtype")
        return value
    return text


def cmd_run(args: argparse.Namespace) -> int:
    import numpy as np

    from fuser_core.codegen.plan import KernelConfig, NotValid
    from fuser_core.runner import run, self_check

    spec = _read_spec(args.spec)
    shape = parse_shape(args.shape)
    dtype = parse_dtype(args.dtype)
    config = None
    if args.config:
        try:
            config = KernelConfig.from_dict(json.loads(args.config))
        except (json.JSONDecodeError, ValueError, TypeError) as err:
            raise UsageError(f"--config: {err}") from None
    try:
        if not args.inputs:
            report = self_check(spec, shape, dtype, strategy=args.strategy, config=config)
            print(json.dumps(report, indent=2))
            return 0 if report["passed"] else 1
        try:
            with np.load(args.inputs) as npz:
                arrays = {name: npz[name] for name in npz.files}
        except (OSError, ValueError) as err:
            raise UsageError(f"--inputs: cannot read {args.inputs}: {err}") from None
        missing = [i.name for i in spec.inputs if i.name not in arrays]
        if missing:
            raise UsageError(f"--inputs: {args.inputs} has no array named {missing[0]!r}")
        result = run(spec, shape, dtype, {i.name: arrays[i.name] for i in spec.inputs}, strategy=args.strategy, config=config)
    except NotValid as err:
        raise UsageError(f"--strategy: {err}") from None
    outputs = {}
    for part, tensor in result.outputs.items():
        # numpy has no bfloat16/float8: 16-bit and fp8 outputs are written as float32 (exact)
        outputs[part] = tensor.cpu().numpy() if not tensor.dtype.is_floating_point else tensor.float().cpu().numpy()
    if args.out:
        np.savez(args.out, **outputs)
    summary = {
        "strategy": result.strategy,
        "config": result.config.to_dict(),
        "outputs": {p: {"shape": list(a.shape), "dtype": str(result.outputs[p].dtype).replace("torch.", "")} for p, a in outputs.items()},
        "out": args.out,
    }
    print(json.dumps(summary, indent=2))
    return 0


def format_report(r: dict[str, Any]) -> str:
    lines = [f"{r['name']}  spec_hash {r['spec_hash'][:16]}  fusible: {'yes' if r['fusible'] else 'no'}"]
    for axis in r["axes"]:
        lines.append(f"axis {axis['axis']}: " + ", ".join(axis["reductions"]))
        for red in (x for x in r["reductions"] if x["over"] == axis["axis"]):
            head = f"  {red['name']:<10} {red['op']} over {red['over']}"
            if not red["fused"]:
                lines.append(f"{head}: NOT fused: {red['reason']}")
                continue
            lines.append(f"{head}: {red['realisation']}" + (" (contraction)" if red["contraction"] else ""))
            if red["depends_on"]:
                lines.append(f"    reads {', '.join(red['depends_on'])}; correction: {red['correction']}")
                lines.append(f"    {red['finalize']}" if "finalize" in red else "")
            if not red["exact"]:
                lines.append("    inexact: a cast inside rounds with running values")
    for e in r["epilogue"]:
        where = "second pass over the axis" if e["second_pass"] else "once per row, after the loop"
        lines.append(f"epilogue {e['name']}: {where}")
    c = r["certificate"]
    lines.append(
        f"certificate: max rel err {c['max_rel_err']:.2e} over {c['trials']} trials"
        + ("" if c["exact"] else f" (algebra {c['algebra_max_rel_err']:.2e}; inexact: {c['note']})")
        + ("" if c["holds"] else "  FAILED")
    )
    return "\n".join(line for line in lines if line)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="foldwise", description="Kernel search for cascaded reductions.")
    sub = parser.add_subparsers(dest="command", required=True)
    derive = sub.add_parser("derive", help="validate a spec and derive its fused form")
    derive.add_argument("spec", help="path to a spec JSON file")
    derive.add_argument("--json", action="store_true", help="print one JSON object")
    derive.set_defaults(func=cmd_derive)
    run = sub.add_parser("run", help="generate the Triton kernel(s) and run them (interpreter without a GPU)")
    run.add_argument("spec", help="path to a spec JSON file")
    run.add_argument("--shape", required=True, help="dim sizes, e.g. m=4,n=300")
    run.add_argument("--dtype", default="float32", help="float32|float16|bfloat16, or a JSON map input -> dtype")
    run.add_argument("--inputs", help="npz with one array per input name; without it, random inputs are checked")
    run.add_argument("--out", help="npz to write the outputs to (by output name; topk: NAME.values, NAME.indices)")
    run.add_argument("--strategy", help="row_resident|streaming_fused|split_fused|multi_pass, or unfused_chain (the baseline); default: best valid")
    run.add_argument("--config", help='JSON, e.g. {"blocks": {"n": 64}, "num_warps": 4, "split": 1}')
    run.set_defaults(func=cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from fuser_core.errors import SpecError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecError as err:
        where = f"{args.spec}: " if err.loc[:1] not in (("shape",), ("dtype",), ("inputs",)) else ""
        print(f"error: {where}{err}", file=sys.stderr)
        return EXIT_INVALID
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
