"""The ``foldwise`` command line (docs/API.md).

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

from service.cli.checks import read_spec as _read_spec
from service.cli.checks import read_spec_source as _read_spec_source
from service.cli.checks import shape_and_dtype
from service.cli.errors import EXIT_INVALID, UsageError
from service.cli.progress import problem_text, stage


def cmd_derive(args: argparse.Namespace) -> int:
    from fuser_core import derivation_report

    spec = _read_spec(args.spec)
    report = derivation_report(spec)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0 if report["certificate"]["holds"] else 1


def cmd_catalog(args: argparse.Namespace) -> int:
    """``foldwise catalog``: the specs known by name, each with its doc's first sentence (``--json``:
    the whole doc); ``foldwise catalog NAME``: one spec's JSON."""
    from fuser_core import PACKAGED_DIR, catalog_dirs, catalog_entries

    if args.name:
        sys.stdout.write(_read_spec_source(args.name).decode("utf-8", "replace"))
        return 0
    entries = catalog_entries()
    if args.json:
        print(json.dumps([{"name": e.name, "doc": e.doc, "path": str(e.path), "packaged": e.packaged}
                          for e in entries], indent=2))
        return 0
    width = max((len(e.name) for e in entries), default=4)
    for e in entries:
        print(f"{e.name:<{width}}  {e.summary or '(no doc)'}" + ("" if e.packaged else f"  [{e.path}]"))
    users = [str(d) for d in catalog_dirs() if d != PACKAGED_DIR]
    print(f"\n{len(entries)} specs; packaged catalog {PACKAGED_DIR}"
          + (f"; searched first: {', '.join(users)}" if users else "; add folders with $FOLDWISE_CATALOG_DIR"))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from service.cli.checks import checked_config, checked_families, checked_problem, checked_strategy, strategy_fits

    # every argument checked before numpy's arrays, torch or Triton load (service/cli/checks.py)
    spec, bound, dtype = checked_problem(args, allow_empty=True)
    shape, _ = shape_and_dtype(args, spec)  # as written: the run binds it itself
    strategy = checked_strategy(args.strategy)
    config = checked_config(args.config)
    if args.families is not None:  # the default list needs no check (and loads NumPy and SciPy)
        checked_families(args.families)
    if args.inputs and not Path(args.inputs).is_file():
        raise UsageError(f"--inputs: cannot read {args.inputs}: no such file")
    stage("run", f"{problem_text(spec.name, bound, dtype)}: deriving, generating and running the kernel")
    # a strategy that cannot hold this shape, with its default config (a --config given is checked
    # by the run itself, after torch loads: the plan's check is not public API)
    derivation = strategy_fits(spec, bound, strategy) if config is None else None

    import numpy as np

    from fuser_core import (
        NO_LAUNCH, NotValid, accuracy_check, accuracy_table, run, self_check, to_logical, to_storage,
    )

    families = checked_families(args.families)

    try:
        if not args.inputs:
            report = self_check(spec, shape, dtype, strategy=strategy, config=config, derivation=derivation)
            if families:  # the accuracy bar per input family (docs/API.md): its table on stderr, stdout one JSON
                stage("run", f"the accuracy bar on {len(families)} input families")
                ran = report["strategy"]  # an empty shape launched nothing: the families' shapes pick their own
                report["accuracy"] = accuracy_check(spec, shape, dtype, families=families,
                                                    strategy=strategy if ran == NO_LAUNCH else ran, config=config)
                print(accuracy_table(report["accuracy"]), file=sys.stderr)
            print(json.dumps(report, indent=2))
            return 0 if report["passed"] and report.get("accuracy", {"passed": True})["passed"] else 1
        try:
            with np.load(args.inputs) as npz:
                arrays = {name: npz[name] for name in npz.files}
        except (OSError, ValueError) as err:
            raise UsageError(f"--inputs: cannot read {args.inputs}: {err}") from None
        missing = [i.name for i in spec.inputs if i.name not in arrays]
        if missing:
            raise UsageError(f"--inputs: {args.inputs} has no array named {missing[0]!r}")
        # arrays in the spec's dims as declared (c, p)
        result = run(spec, shape, dtype, {i.name: to_logical(spec, i.name, arrays[i.name], bound) for i in spec.inputs},
                     strategy=strategy, config=config, derivation=derivation)
    except NotValid as err:
        raise UsageError(f"--strategy: {err}") from None
    outputs = {}
    for part, tensor in result.outputs.items():
        # numpy has no bfloat16/float8: 16-bit and fp8 outputs are written as float32 (exact)
        array = tensor.cpu().numpy() if not tensor.dtype.is_floating_point else tensor.float().cpu().numpy()
        outputs[part] = to_storage(spec, spec.step(part.split(".")[0]).dims, array, bound)
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


def cmd_compile(args: argparse.Namespace) -> int:
    """``foldwise compile``: the GPU compiler on each generated kernel, for a target or the fleet,
    with no GPU needed (service/cli/compile.py). Exit 0 when every kernel compiles, 1 when one
    fails, 2 on bad input."""
    from fuser_core import bind_dtypes
    from service.cli.checks import checked_problem
    from service.cli.compile import compile_command

    spec, shape, raw_dtype = checked_problem(args)
    stage("compile", f"{problem_text(spec.name, shape)}: deriving and generating the kernels, then Triton's GPU "
                     f"compiler on each for {args.target}")
    return compile_command(spec, shape, bind_dtypes(spec, raw_dtype), args)


def _quiet_optuna() -> None:
    """Optuna logs every trial on stderr; the CLI prints its own progress and summary."""
    from service.worker.tuning import quiet_optuna

    quiet_optuna()


def _tuning_setup(spec, raw_spec: dict, shape: dict[str, int], dtype, target: str, measurer_name: str,
                  compile_check: bool = True):
    """(space, measurer, gate, study attrs) for one tuning job; UsageError for a bad target/measurer.

    The set-up itself lives in service/worker/tuning.py, shared with the job-queue worker."""
    from service.worker.tuning import SetupError, tuning_setup

    try:
        return tuning_setup(spec, raw_spec, shape, dtype, target, measurer_name, compile_check=compile_check)
    except SetupError as err:
        raise UsageError(err.cli_message) from None


def _open_storage(url: str, heartbeat: int = 10):
    import sqlalchemy

    from tuner import make_storage

    if heartbeat < 1:
        raise UsageError(f"--heartbeat: must be at least 1 second, got {heartbeat}")
    try:
        return make_storage(url, heartbeat_interval=heartbeat)
    except (sqlalchemy.exc.ArgumentError, sqlalchemy.exc.NoSuchModuleError, ValueError) as err:
        raise UsageError(f"--db: not a database URL this build can open ({url!r}): {err}") from None
    except sqlalchemy.exc.OperationalError as err:
        raise UsageError(f"--db: cannot connect to {url!r}: {str(err.orig).strip() or err}") from None


def _run_tuner(tuner, budget: int, *, as_json: bool, **kwargs):
    """tuner.run with its progress on stderr (service/cli/progress.py): a bar on a terminal, a
    line every tenth of the budget in a log."""
    from service.cli.progress import tune_progress

    progress = tune_progress(budget, as_json=as_json)
    try:
        return tuner.run(budget, callbacks=[progress] if progress else [], **kwargs)
    finally:
        if progress:
            progress.close()


def _tune_and_print(tuner, budget: int, args: argparse.Namespace, **kwargs) -> int:
    """Run the search (:func:`_run_tuner`) and print its result: exit 0, or 1 when no
    configuration worked."""
    from tuner import NoResult

    try:
        result = _run_tuner(tuner, budget, as_json=args.json, **kwargs)
    except NoResult as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    _print_result(result, as_json=args.json, storage_url=args.db)
    return 0


def _print_result(result, *, as_json: bool, storage_url: str | None) -> None:
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
        return
    c = result.counts
    what = "predicted by the model" if result.predicted else "measured"
    print(f"best: {result.strategy} {json.dumps(result.config, sort_keys=True)}")
    print(f"time: {result.time_ms:.4g} ms ({what}, target {result.target}, measurer {result.measurer})")
    print(f"trials: {result.trials} in the study; this process: {c.get('measured', 0)} measured, "
          f"{c.get('cached', 0)} answered from stored results, {c.get('infeasible', 0)} infeasible"
          f"{_compile_pruned_note(c)}, "
          f"{c.get('failed', 0)} failed; tuner overhead {result.overhead_ms:.1f} ms/trial")
    if storage_url:
        print(f"study: {result.study_name}")


def _compile_pruned_note(counts: dict[str, int]) -> str:
    if "compile_pruned" not in counts:
        return " (no compile check)"
    return f" ({counts['compile_pruned']} by the compiler)"


def cmd_tune(args: argparse.Namespace) -> int:
    from service.cli.checks import checked_problem, checked_tune_choices

    # the spec, shape, dtype, budget, measurer and target checked before Optuna, sympy or torch load
    spec, _, _ = checked_problem(args)
    checked_tune_choices(args)
    raw_spec = json.loads(_read_spec_source(args.spec))
    shape, dtype = shape_and_dtype(args, spec)
    stage("tune", f"{problem_text(spec.name, shape)}: deriving, then {args.trials} trials ({args.measurer} measurer, "
                  f"target {args.target})")

    from tuner import Tuner, study_name_for

    space, measurer, gate, attrs = _tuning_setup(spec, raw_spec, shape, dtype, args.target, args.measurer,
                                                 compile_check=args.compile_check)
    _quiet_optuna()
    storage = _open_storage(args.db, args.heartbeat) if args.db else None
    name = study_name_for(attrs["spec_hash"], attrs["shape"], attrs["dtype"], attrs["target"], attrs["measurer"])
    return _tune_and_print(Tuner(space, measurer, seed=args.seed, gate=gate), args.trials, args, storage=storage,
                           study_name=name, attrs={**attrs, "budget": args.trials, "seed": args.seed})


def cmd_worker(args: argparse.Namespace) -> int:
    if args.study is None:  # the service's job queue (service/worker/__init__.py)
        from service.cli.service import cmd_worker_queue

        if args.trials is not None:
            raise UsageError("--trials: only with --study (a queued job carries its own budget)")
        return cmd_worker_queue(args)
    import optuna

    from fuser_core import load_spec
    from tuner import Tuner

    _quiet_optuna()
    storage = _open_storage(args.db, args.heartbeat)
    try:
        study = optuna.load_study(study_name=args.study, storage=storage)
    except KeyError:
        raise UsageError(f"--study: no study named {args.study!r} in {args.db}") from None
    attrs = study.user_attrs
    missing = [k for k in ("spec", "shape", "dtype", "target", "measurer", "budget") if k not in attrs]
    if missing:
        raise UsageError(f"--study: {args.study!r} was not created by `foldwise tune` "
                         f"(its user attrs lack {missing[0]!r})")
    for flag, key in (("--measurer", "measurer"), ("--target", "target")):
        given = getattr(args, key)
        if given is not None and given != attrs[key]:
            raise UsageError(f"{flag}: study {args.study!r} tunes with {key} {attrs[key]!r}, not {given!r}")
    if args.trials is not None and args.trials < 1:
        raise UsageError(f"--trials: must be at least 1, got {args.trials}")
    spec = load_spec(attrs["spec"])
    space, measurer, gate, _ = _tuning_setup(spec, attrs["spec"], attrs["shape"], attrs["dtype"], attrs["target"],
                                             attrs["measurer"])
    return _tune_and_print(Tuner(space, measurer, seed=args.seed, gate=gate), int(attrs["budget"]), args,
                           storage=storage, study_name=args.study, max_trials=args.trials)


def cmd_bench(args: argparse.Namespace) -> int:
    """``foldwise bench``: tuned fused kernels against their baselines (tuner/bench/). Without
    a CUDA GPU it refuses (exit 2) unless ``--device cpu`` asks for the interpreter smoke mode."""
    from tuner import BASELINES, BenchError, TimingSettings, run_bench

    if args.trials < 1:
        raise UsageError(f"--trials: must be at least 1, got {args.trials}")
    for flag, value in (("--timeout", args.timeout), ("--compile-timeout", args.compile_timeout)):
        if value <= 0:
            raise UsageError(f"{flag}: must be positive, got {value}")
    baselines = BASELINES
    if args.baselines is not None:
        baselines = tuple(b.strip() for b in args.baselines.split(",") if b.strip())
        unknown = [b for b in baselines if b not in BASELINES]
        if unknown:
            raise UsageError(f"--baselines: unknown baseline {unknown[0]!r}; choose from {', '.join(BASELINES)}")
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    device = args.device or "cuda"
    out = bench_out_dir(args.out, args.suite, device)
    print(f"bench: results go to {out.resolve()}" + ("" if args.out else " (choose with --out)"), file=sys.stderr)
    timing = TimingSettings(seed=args.seed)
    try:
        results = run_bench(args.suite, out, trials=args.trials, device=device, baselines=baselines, target=args.target,
                            catalog_dir=Path(args.catalog) if args.catalog else None, only=only,
                            timeout_s=args.timeout, compile_timeout_s=args.compile_timeout, timing=timing,
                            seed=args.seed, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    except BenchError as err:  # NoGpu included: exit 2 with the reason
        raise UsageError(str(err)) from None
    if args.json:
        print(json.dumps(results, indent=2, default=str))
        return 0
    print(Path(results["files"]["markdown"]).read_text())
    print("written: " + ", ".join(results["files"].values()))
    return 0


def bench_out_dir(out: str | None, suite: str, device: str) -> Path:
    """``--out``, else ``foldwise-bench/<suite>`` (``<suite>-cpu-interpreter`` for ``--device cpu``)
    in the working directory, one folder the command names on stderr: not a ``benchmarks/results``
    tree in whatever directory it runs in (that is the repository's own folder of results)."""
    if out:
        return Path(out)
    return Path("foldwise-bench") / (suite if device == "cuda" else f"{suite}-cpu-interpreter")


def _add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="GPU benchmark: tuned fused kernels vs the unfused chain, torch eager, "
                                         "torch.compile and hand-written kernels")
    bench.add_argument("--suite", default="paper", help="a suite of the catalog's suites.json (paper, smoke; "
                                                        "`foldwise catalog` lists the catalog)")
    bench.add_argument("--out", help="directory for bench_<suite>.json/.md/.png (default: foldwise-bench/<suite> in "
                                            "the working directory, named on stderr)")
    bench.add_argument("--trials", type=int, default=40, help="tuning trials per case (default 40)")
    bench.add_argument("--device", choices=("cuda", "cpu"), default=None,
                       help="cuda (default; refuses without a GPU) or cpu: a smoke test through the Triton "
                            "interpreter at tiny shapes, timings labelled 'CPU interpreter, not GPU'")
    bench.add_argument("--baselines", help="comma-separated subset of chain,eager,compile,handwritten (default all)")
    bench.add_argument("--only", help="comma-separated spec names: run only the suite's cases of these specs")
    bench.add_argument("--target", help="GPU profile for the search space (default: the profile of this GPU)")
    bench.add_argument("--catalog", help="an extra catalog folder (specs and suites.json), searched before "
                                         "$FOLDWISE_CATALOG_DIR and the packaged catalog")
    bench.add_argument("--timeout", type=float, default=120.0, help="seconds per trial or baseline (default 120)")
    bench.add_argument("--compile-timeout", type=float, default=600.0,
                       help="seconds for the torch.compile baseline, compilation included (default 600)")
    bench.add_argument("--seed", type=int, default=0, help="sampler and input seed (default 0)")
    bench.add_argument("--json", action="store_true", help="print the results as one JSON object")
    bench.set_defaults(func=cmd_bench)


def format_report(r: dict[str, Any]) -> str:
    lines = [f"{r['name']}  spec_hash {r['spec_hash'][:16]}  fusible: {'yes' if r['fusible'] else 'no'}"]
    for axis in r["axes"]:
        merged = f" (one loop over {' x '.join(axis['dims'])})" if len(axis["dims"]) > 1 else ""
        lines.append(f"axis {axis['axis']}{merged}: " + ", ".join(axis["reductions"]))
        for red in (x for x in r["reductions"] if x["over"] == axis["axis"]):
            head = f"  {red['name']:<10} {red['op']} over {red['over']}"
            if not red["fused"]:
                lines.append(f"{head}: NOT fused: {red['reason']}")
                continue
            lines.append(f"{head}: {red['realisation']}" + (" (contraction)" if red["contraction"] else ""))
            if red["depends_on"]:
                moved = f"correction: {red['correction']}" if red["correction"] else red["realisation_doc"]
                lines.append(f"    reads {', '.join(red['depends_on'])}; {moved}")
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
    if not c["holds"]:
        lines.append(f"certificate {c['verdict']}")
    return "\n".join(line for line in lines if line)


def _add_problem_arguments(parser: argparse.ArgumentParser) -> None:
    """The spec, ``--shape`` and ``--dtype`` of the commands that generate kernels."""
    parser.add_argument("spec", help=SPEC_HELP)
    parser.add_argument("--shape", help="dim sizes, e.g. m=4,n=300; default: the spec's example shape")
    parser.add_argument("--dtype", default="float32", help="float32|float16|bfloat16|float64, or a JSON map input -> dtype")


def build_parser() -> argparse.ArgumentParser:
    from fuser_core import __version__

    parser = Parser(prog="foldwise", description="Kernel search for cascaded reductions: derive fused forms, generate "
                                                 "Triton kernels, tune them, serve the best from a cache.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    catalog = sub.add_parser("catalog", help="list the specs known by name (packaged catalog and "
                                             "$FOLDWISE_CATALOG_DIR), or print one spec's JSON")
    catalog.add_argument("name", nargs="?", help="a catalog name (or path): print that spec's JSON")
    catalog.add_argument("--json", action="store_true", help="list as JSON (name, doc, path, packaged)")
    catalog.set_defaults(func=cmd_catalog)
    derive = sub.add_parser("derive", help="validate a spec and derive its fused form, with its certificate")
    derive.add_argument("spec", help=SPEC_HELP)
    derive.add_argument("--json", action="store_true", help="print one JSON object")
    derive.set_defaults(func=cmd_derive)
    from service.cli.backward import add_backward_command

    add_backward_command(sub, SPEC_HELP)
    run = sub.add_parser("run", help="generate the Triton kernel(s) and run them (interpreter without a GPU)")
    _add_problem_arguments(run)
    run.add_argument("--inputs", help="npz with one array per input name; without it, random inputs are checked")
    run.add_argument("--out", help="npz to write the outputs to (by output name; topk: NAME.values, NAME.indices)")
    run.add_argument("--strategy", help="row_resident|streaming_fused|split_fused|multi_pass, or unfused_chain (the baseline); default: best valid")
    run.add_argument("--config", help='JSON, e.g. {"blocks": {"n": 64}, "num_warps": 4, "split": 1}')
    run.add_argument("--families", help="input families the accuracy bar checks (random self-check only), comma-separated: "
                     "normal, offset100, offset1000, scale30, peaked, near_ties, masked, nan, axis1, empty, or all, "
                     "values, specials, none; default all")
    run.set_defaults(func=cmd_run)
    compile_ = sub.add_parser(
        "compile", help="compile the generated kernels with Triton's GPU compiler for a target (no GPU needed)",
        description="Compile every kernel of the generated module(s) for the target's arch (h100/h200: sm_90a "
                    "cubins, a100: sm_80, mi300x: gfx942 hsaco...) or for every target of the fleet (--target all), "
                    "and report registers, spills and shared memory. Exit 0 when all compile, 1 when one fails, "
                    "2 on bad input.")
    _add_problem_arguments(compile_)
    compile_.add_argument("--target", default="h100",
                          help="GPU profile whose arch to compile for (a100, l40s, h100, h200, b200, mi300x, mi355x), "
                               "an arch (sm_90, gfx942), or all: every profile, one row each")
    compile_.add_argument("--strategy", default="all",
                          help="one strategy, unfused_chain, or all (every valid strategy plus the chain)")
    compile_.add_argument("--config", help='JSON, e.g. {"blocks": {"n": 64}, "num_warps": 4}; default: each '
                                           "strategy's default configuration")
    compile_.add_argument("--json", action="store_true", help="print one JSON object (one entry per kernel)")
    compile_.add_argument("--out", metavar="DIR", help="also write each kernel's binary and assembly to "
                                                      "DIR/<strategy>/<kernel>.cubin|.ptx (AMD: .hsaco|.amdgcn; "
                                                      "--target all: DIR/<target>/...) for targets whose kernels "
                                                      "all compile")
    compile_.set_defaults(func=cmd_compile)
    tune = sub.add_parser("tune", help="search kernel configurations with Optuna")
    _add_problem_arguments(tune)
    tune.add_argument("--target", default="h100", help="GPU profile to tune for (h100, h200, a100, ...)")
    tune.add_argument("--measurer", default="model",
                      help="cuda (time on this GPU) or model (predict from the target's profile)")
    tune.add_argument("--trials", type=int, default=40,
                      help="trial budget, shared with workers on the same study (default 40)")
    tune.add_argument("--db", help="SQLAlchemy URL of the study storage (sqlite:///tune.db, postgresql+psycopg://...)")
    tune.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
    tune.add_argument("--heartbeat", type=int, default=10, metavar="SECONDS",
                        help="with --db: a running trial records a heartbeat this often; one silent for twice as long "
                             "(its worker died) is failed and retried (default 10)")
    tune.add_argument("--json", action="store_true", help="print one JSON object")
    tune.add_argument("--no-compile-check", dest="compile_check", action="store_false",
                      help="do not compile candidates for the target before measuring them (by default each is "
                           "compiled with Triton's compiler, no GPU needed; failures and kernels beyond the target's "
                           "shared memory or registers are pruned with the compiler's reason)")
    tune.set_defaults(func=cmd_tune)
    worker = sub.add_parser("worker", help="take tuning jobs from the service database; with --study, join a "
                                           "stored study and run trials until its shared budget is used")
    worker.add_argument("--db", required=True, help="SQLAlchemy URL of the service database (or the study storage)")
    worker.add_argument("--study", help="study name (as `foldwise tune --db` printed it); without it, take jobs "
                                        "from the job queue")
    worker.add_argument("--measurer", help="must match the study's measurer (default: the study's); job queue: "
                                           "cuda|model (default: cuda when a GPU is visible, else model)")
    worker.add_argument("--target", help="must match the study's target (default: the study's); job queue: "
                                         "the target whose jobs to take (default h100)")
    worker.add_argument("--trials", type=int, help="run at most this many trials (default: until the budget is used)")
    worker.add_argument("--seed", type=int, default=None, help="sampler seed (default: random, so workers differ)")
    worker.add_argument("--heartbeat", type=int, default=10, metavar="SECONDS",
                        help="with --db: a running trial records a heartbeat this often; one silent for twice as long "
                             "(its worker died) is failed and retried (default 10)")
    worker.add_argument("--json", action="store_true", help="print one JSON object")
    worker.set_defaults(func=cmd_worker)
    from service.cli.service import add_queue_worker_arguments, add_service_commands

    add_queue_worker_arguments(worker)
    add_service_commands(sub)
    _add_bench_parser(sub)
    _describe_commands(parser)
    return parser


SPEC_HELP = "a catalog name (see `foldwise catalog`) or a path to a spec JSON file"


class HelpFormatter(argparse.HelpFormatter):
    """Adds an option's default to its help, unless the help already states it or there is
    none to state (no value, a flag that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.default in (None, False)
                or action.default is argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class Parser(argparse.ArgumentParser):
    """The CLI's parsers (subcommands' too: argparse makes them of the parent's class) show defaults."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def _describe_commands(parser: argparse.ArgumentParser) -> None:
    """Give each subcommand's --help its one-line help from the command list as description
    (argparse keeps the two apart, so `foldwise derive --help` said nothing of what it does)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                command = action.choices[choice.dest]
                command.description = command.description or choice.help
                _describe_commands(command)


# a reader that left (``foldwise ... | head``): exit as a process killed by SIGPIPE reports itself
# to a shell (128 + 13), as coreutils do, so a pipeline with ``pipefail`` can tell a truncated
# output from a finished one; quietly, with no traceback
EXIT_CLOSED_PIPE = 141


def main(argv: list[str] | None = None) -> int:
    try:
        code = _dispatch(argv)
        sys.stdout.flush()  # here, not at interpreter exit, so a closed pipe is caught below
        return code
    except BrokenPipeError:
        _silence_closed_streams()
        return EXIT_CLOSED_PIPE


def _silence_closed_streams() -> None:
    """Point stdout and stderr at /dev/null: Python flushes them again at exit, and a flush into
    the closed pipe would print "Exception ignored ... BrokenPipeError"."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):  # a replaced stream (pytest's capture) has no file descriptor
            pass
    os.close(devnull)


def _dispatch(argv: list[str] | None) -> int:
    from fuser_core import DerivationLimitError, SpecError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecError as err:
        spec_path = getattr(args, "spec", None) or getattr(args, "study", "")
        where = f"{spec_path}: " if err.loc[:1] not in (("shape",), ("dtype",), ("inputs",)) else ""
        print(f"error: {where}{err}", file=sys.stderr)
        return EXIT_INVALID
    except DerivationLimitError as err:
        print(f"error: {getattr(args, 'spec', '')}: the derivation exceeds its limits: {err}", file=sys.stderr)
        return EXIT_INVALID
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INVALID
