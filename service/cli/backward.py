"""``foldwise backward SPEC``: the derived backward cascades of a spec and their certificate."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from service.cli.checks import read_spec
from service.cli.errors import UsageError


def cmd_backward(args: argparse.Namespace) -> int:
    from fuser_core import backward_report, format_backward

    spec = read_spec(args.spec)
    sizes = None
    if args.shape is not None:  # validated as every command's --shape is, naming the flag or the dim
        from fuser_core import SpecError, bind_shape
        from service.bundle import parse_shape_text

        try:
            sizes = bind_shape(spec, parse_shape_text(args.shape))
        except SpecError as err:
            raise UsageError(f"--shape: {err.message}") from None
    report = backward_report(spec, derive_specs=not args.no_derive, sizes=sizes)
    if args.out:
        out = Path(args.out)
        try:
            out.mkdir(parents=True, exist_ok=True)
            written = [report["forward"], *report["specs"]]
            if report["gradient_in_forward"]:
                written.append(report["gradient_in_forward"])
            for raw in written:
                raw = {k: v for k, v in raw.items() if k != "derivation"}
                (out / f"{raw['name']}.json").write_text(json.dumps(raw, indent=2) + "\n")
        except OSError as err:
            raise UsageError(f"--out: cannot write {out}: {err}") from None
    print(json.dumps(report, indent=2) if args.json else format_backward(report))
    return 0 if report["certificate"]["holds"] else 1


def add_backward_command(sub: Any, spec_help: str) -> None:
    backward = sub.add_parser("backward", help="derive a spec's backward (its gradients) as specs of their own, with "
                                               "the statistics the forward saves and a certificate against autograd")
    backward.add_argument("spec", help=spec_help)
    backward.add_argument("--json", action="store_true", help="print one JSON object")
    backward.add_argument("--out", metavar="DIR", help="write the saving forward, each backward spec and the forward "
                                                       "with its gradient as NAME.json files (for `foldwise run`)")
    backward.add_argument("--no-derive", action="store_true", help="skip deriving each backward spec's fused form")
    backward.add_argument("--shape", help="pack it for these sizes, as the torch op does (e.g. t=4096,v=128256,d=4096: "
                                          "a dim too long for one tile to hold stages the value summed over it)")
    backward.set_defaults(func=cmd_backward)
