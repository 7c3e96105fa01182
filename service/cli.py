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
    return parser


def main(argv: list[str] | None = None) -> int:
    from fuser_core.errors import SpecError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecError as err:
        print(f"error: {getattr(args, 'spec', '')}: {err}", file=sys.stderr)
        return EXIT_INVALID
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
