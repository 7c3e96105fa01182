"""``foldwise compile``: Triton's GPU compiler on each generated kernel, for one target or the whole
fleet, with no GPU needed (service/cli/__init__.py reads the spec, shape and dtypes, then calls
:func:`compile_command`).

``--target`` is a GPU profile (h100), an arch (sm_90, gfx942) or ``all``: every profile of the
fleet (``tuner.FLEET``: a100, l40s, h100, h200, b200, mi300x, mi355x), one row each. For one
profile the report lists every kernel with its registers, spills, shared memory and, on NVIDIA,
its static bound at the profile's rates (read from the SASS); for ``all`` each row sums a
target up (kernels compiled, the most registers, spilled bytes and shared memory of a kernel),
with no SASS read (half a compile per kernel saved). Registers are per thread on NVIDIA and
VGPRs per lane on AMD; shared memory is LDS there. Exit 0 when every kernel compiles, 1 when
one fails, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from service.cli.errors import UsageError


def compile_targets(text: str) -> list[tuple[str, Any, Any]]:
    """``--target``: ``all`` (the fleet), a profile name (h100) or an arch (sm_90, gfx942) ->
    [(name, Target, profile or None)]; an arch has no profile (no static bound). UsageError else."""
    from fuser_core import Target
    from tuner import FLEET, get_profile

    if text.strip().lower() == "all":
        return [(name, get_profile(name).target, get_profile(name)) for name in FLEET]
    try:
        profile = get_profile(text)
    except ValueError as unknown:
        try:
            target = Target.parse(text)
        except ValueError:
            raise UsageError(f"--target: {unknown}; or an arch (sm_90, gfx942), or all") from None
        return [(target.arch_name, target, None)]
    return [(profile.name, profile.target, profile)]


def compile_command(spec, shape: dict[str, int], dtypes: dict[str, str], args: argparse.Namespace) -> int:
    """Compile the strategies asked for, for every target ``--target`` names, and print the report."""
    from service.cli.checks import checked_config, checked_strategy, strategy_fits

    # flags first, with the light modules only (service/cli/checks.py); then the derivation
    targets = compile_targets(args.target)
    strategy = checked_strategy(args.strategy, extra=("all",))
    config = checked_config(args.config)
    config = config.to_dict() if config is not None else None
    if strategy == "all" or config is not None:  # refusals are listed in the report (a config's by the compile)
        from fuser_core import derive_cascade

        derivation = derive_cascade(spec)
    else:  # one strategy named: one that cannot hold this shape is bad input, as for `foldwise run`
        derivation = strategy_fits(spec, shape, strategy)

    from fuser_core import BASELINE, STRATEGIES, CompilePool, CompileRequest, valid_strategies
    from service.cli.progress import CompileProgress

    refused: dict[str, str] = {}
    if strategy == "all":
        valid = valid_strategies(spec, derivation, shape)
        refused = {s: why for s, why in valid.items() if why}
        strategies = [s for s in STRATEGIES if s in valid and not valid[s]] + [BASELINE]
    else:
        strategies = [strategy]
    fleet = len(targets) > 1
    requests = {name: [CompileRequest(spec, shape, dtypes, s, config, target, sass=not fleet and profile is not None)
                       for s in strategies] for name, target, profile in targets}
    flat = [r for rs in requests.values() for r in rs]
    progress = CompileProgress({id(r): name for name, rs in requests.items() for r in rs})
    # the pool starts its processes only for requests its on-disk cache cannot answer
    with CompilePool(min(len(flat), 4)) as pool:
        try:
            built = iter(pool.compile(flat, progress=progress))
        finally:
            progress.close()
        reports = []
        for name, target, profile in targets:
            modules = [next(built) for _ in requests[name]]
            reports.append(_target_report(spec, shape, dtypes, name, target, profile, modules, refused, derivation))
            if args.out and not any(not k["ok"] for k in reports[-1]["kernels"]):
                folder = Path(args.out) / name if fleet else Path(args.out)
                _write_binaries(pool, [r for r, m in zip(requests[name], modules) if not m.refused], folder)
    failed = sum(not k["ok"] for report in reports for k in report["kernels"])
    if args.json:
        common = {"spec": spec.name, "shape": shape, "dtypes": dtypes}
        print(json.dumps({**common, "triton_version": reports[0]["triton_version"], "targets": reports} if fleet
                         else {**common, **reports[0]}, indent=2))
    elif fleet:
        _print_fleet(spec, shape, reports)
    else:
        _print_target(spec, reports[0])
    return 1 if failed else 0


def _target_report(spec, shape, dtypes, name: str, target, profile, modules, refused: dict[str, str],
                   derivation) -> dict:
    """One target's report: its arch and binary, each kernel's facts (and static bound), refusals."""
    kernels = [{"strategy": m.strategy, **k.to_dict()} for m in modules for k in m.kernels]
    if profile is not None:
        bounds = _static_bounds(spec, shape, dtypes, modules, profile, derivation)
        for k in kernels:
            b = bounds.get((k["strategy"], k["kernel"]))
            if b is not None:
                k["static_bound"] = b
    refused = {**refused, **{m.strategy: m.refused for m in modules if m.refused}}
    # the facts are this Triton's (its ptxas allocates registers differently from another's)
    triton_version = next((m.triton_version for m in modules if m.triton_version), None)
    return {"target": name, "arch": target.arch_name, "binary_arch": target.binary_arch,
            "binary_kind": target.binary_kind, "triton_version": triton_version, "kernels": kernels,
            "refused": refused, "configs": {m.strategy: m.config for m in modules if not m.refused}}


def _cell(value: Any) -> Any:
    return "" if value is None else value


def _print_target(spec, report: dict) -> None:
    kernels = report["kernels"]
    failed = sum(not k["ok"] for k in kernels)
    print(f"{spec.name} for {report['target']} ({report['arch']}, {report['binary_kind']}), Triton "
          f"{report['triton_version']}: {len(kernels) - failed} of {len(kernels)} kernels compile")
    print(f"{'strategy':<16} {'kernel':<44} {'ok':<4} {'regs':>5} {'spill':>6} {'shared':>7}  static bound")
    for k in kernels:
        b = k.get("static_bound")
        bound = f"  {1e3 * b['time_s']:.4g} ms ({b['bound']})" if b else ""
        print(f"{k['strategy']:<16} {k['kernel']:<44} {'yes' if k['ok'] else 'NO':<4} {_cell(k['registers']):>5} "
              f"{_cell(k['spill_bytes']):>6} {_cell(k['shared_bytes']):>7}{bound}")
        if not k["ok"]:
            print(f"    {k['error']}")
    for s, why in report["refused"].items():
        print(f"{s:<16} refused: {why}")


def _print_fleet(spec, shape: dict[str, int], reports: list[dict]) -> None:
    """One row per target: kernels compiled, and the most any kernel holds (registers per thread,
    VGPRs per lane on AMD; spilled bytes; shared memory or LDS per program)."""
    whole = sum(all(k["ok"] for k in r["kernels"]) for r in reports)
    size = ",".join(f"{d}={n}" for d, n in shape.items())
    print(f"{spec.name} {size}, Triton {reports[0]['triton_version']}: {whole} of {len(reports)} targets compile "
          "every kernel")
    print(f"{'target':<8} {'arch':<8} {'binary':<6} {'kernels':>8} {'regs':>5} {'spill':>6} {'shared':>7}")
    for r in reports:
        ok = [k for k in r["kernels"] if k["ok"]]
        most = {f: max((k[f] for k in ok if k[f] is not None), default=None)
                for f in ("registers", "spill_bytes", "shared_bytes")}
        compiled = f"{len(ok)}/{len(r['kernels'])}"
        print(f"{r['target']:<8} {r['binary_arch']:<8} {r['binary_kind']:<6} {compiled:>8} "
              f"{_cell(most['registers']):>5} {_cell(most['spill_bytes']):>6} {_cell(most['shared_bytes']):>7}")
        for k in r["kernels"]:
            if not k["ok"]:
                print(f"    {k['strategy']} {k['kernel']}: {k['error']}")
    print("regs: the most of a kernel, per thread (VGPRs per lane on AMD); spill: bytes per thread (scratch "
          "per lane); shared: bytes per program (LDS on AMD)")
    for s, why in reports[0]["refused"].items():
        print(f"{s:<16} refused: {why}")


def _static_bounds(spec, shape, dtypes, modules, profile, derivation) -> dict[tuple[str, str], dict]:
    """(strategy, kernel) -> its static bound at the target's rates (tuner.static_bound: HBM bytes,
    issue, SFU and tensor work read from the compiled SASS) for every fused module that compiled."""
    from fuser_core import STRATEGIES, KernelConfig, make_problem
    from tuner import problem_bounds

    problem = make_problem(spec, shape, dtypes)
    out: dict[tuple[str, str], dict] = {}
    for m in modules:
        if m.refused or not m.ok or m.strategy not in STRATEGIES:
            continue
        found = problem_bounds(problem, derivation, m.strategy, KernelConfig.from_dict(dict(m.config)), m.kernels,
                               profile)
        for k in found or []:
            out[(m.strategy, k["kernel"])] = {"time_s": k["time_s"], "bound": k["bound"], "terms_s": k["terms_s"],
                                              "programs": k["programs"], "trips": k["trips"]}
    return out


def _write_binaries(pool, requests: list, out: Path) -> None:
    """``compile --out DIR``: each module's binary and assembly per kernel, as the kernel store
    keeps them (``CompilePool.artifacts``), in ``DIR/<strategy>/<kernel name>.cubin|.ptx`` (AMD:
    ``.hsaco|.amdgcn``)."""
    from fuser_core import Target

    for request, artifacts in zip(requests, pool.artifacts(requests)):
        folder = out / request.strategy
        folder.mkdir(parents=True, exist_ok=True)
        target = artifacts["target"]
        kind, assembly_kind = artifacts["binary_kind"], Target(target["backend"], target["arch"],
                                                           target["warp_size"]).assembly_kind
        for kernel in artifacts["kernels"]:
            (folder / f"{kernel['name']}.{kind}").write_bytes(kernel[kind])
            (folder / f"{kernel['name']}.{assembly_kind}").write_text(kernel[assembly_kind])
