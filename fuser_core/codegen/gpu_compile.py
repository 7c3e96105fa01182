"""Compile generated kernels with Triton's GPU compiler, on a machine without a GPU.

Triton's interpreter runs a kernel as Python and accepts code that the compiler rejects (a
name assigned inside a loop and read after it, for one), so a kernel that only passed the
interpreter may fail on every GPU. This module runs the real compiler: the generated
launcher is called on ``meta`` tensors with every ``@triton.jit`` launch intercepted, so the
signature (pointer dtypes, int sizes and strides, their specialisation, constexpr blocks,
``num_warps``/``num_stages``) is exactly the one a GPU launch would bind, with no second
copy of the argument list; each intercepted launch then goes through ``triton.compile`` for
``GPUTarget("cuda", capability, 32)``, which gives TTIR, PTX and a cubin (ptxas ships in
the triton wheel). Every launch is compiled with Triton's FP-fusion knob set explicitly
(:data:`fuser_core.codegen.module.FP_FUSION`), as the generated launchers pass it.
``cuobjdump -res-usage`` on the cubin (also in the wheel) gives registers, stack, local and
static shared bytes; Triton's metadata the dynamic shared memory a launch needs. A pass that
fails prints its reason on stderr, not in the exception: it is read from there
(:func:`compiler_stderr`) into the error.

Kernels must be *loaded* with the interpreter off, and a test process runs with it on, so
compiles happen in worker processes (:class:`CompilePool`) started with
``TRITON_INTERPRET=0``. Results are cached in memory and on disk
(``$FOLDWISE_CACHE_DIR/compiled``), keyed by the module's text, the bound signature, the
target, the options and Triton's version: the facts are the installed Triton's (Triton 3.6's
and 3.9's ptxas give different registers for most kernels, and 3.6 rejects some configs that
3.9 compiles), so a :class:`ModuleBuild` names the Triton version that built it.

Example:
    >>> from fuser_core.codegen.gpu_compile import CompilePool, CompileRequest
    >>> with CompilePool() as pool:  # doctest: +SKIP
    ...     [module] = pool.compile([CompileRequest(spec, {"m": 4, "n": 1000}, {"x": "float16"},
    ...                                             "streaming_fused", None, 90)])
    >>> module.ok, module.kernels[0].registers  # doctest: +SKIP
    (True, 26)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import re
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fuser_core.spec import Spec

MAX_ERROR_CHARS = 2000
FACTS_VERSION = 4  # part of the cache key: how a KernelBuild's facts are read (3: a failed pass named; 4: SASS facts)


@dataclass(frozen=True)
class KernelBuild:
    """What the GPU compiler said about one kernel launch of a generated module."""

    kernel: str
    ok: bool
    error: str | None = None  # the compiler's message: kernel, module line, what failed
    registers: int | None = None  # per thread
    spill_bytes: int | None = None  # stack + local bytes per thread: what spilled out of registers
    stack_bytes: int | None = None
    local_bytes: int | None = None
    shared_bytes: int | None = None  # per program: the launch's dynamic plus the cubin's static
    num_warps: int | None = None
    num_stages: int | None = None
    # what the cubin issues (fuser_core.codegen.sass.KernelSass.to_dict): the whole body and each
    # innermost loop's instructions, MUFU ops, load/store widths and tensor-core kinds
    sass: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> KernelBuild:
        return KernelBuild(**{k: raw.get(k) for k in KernelBuild.__dataclass_fields__})


@dataclass(frozen=True)
class CompileRequest:
    """One generated module to compile: the spec, bound shape, input
    dtypes, strategy (or ``unfused_chain``), config (``KernelConfig.to_dict()`` form; None: the
    strategy's default) and the target's compute capability (90 for sm_90, 80 for sm_80).
    ``sass``: also read what the cubin issues (:class:`KernelBuild` ``sass``, the static bound's
    input); disassembling costs about half a compile, so a check that only needs registers,
    spills and shared memory leaves it off. Picklable, so it crosses to a worker process."""

    spec: Spec
    shape: dict[str, int]
    dtypes: dict[str, str]
    strategy: str
    config: dict[str, Any] | None = None
    capability: int = 90
    sass: bool = False


@dataclass(frozen=True)
class ModuleBuild:
    """A request's outcome: ``refused`` (the strategy is not valid here, and why) or one
    :class:`KernelBuild` per kernel launch (a split kernel has two, the chain one per step),
    compiled by Triton ``triton_version``."""

    strategy: str
    config: dict[str, Any] | None
    kernels: tuple[KernelBuild, ...] = ()
    refused: str | None = None
    triton_version: str | None = None

    @property
    def ok(self) -> bool:
        """Every kernel compiled (a refused strategy is not a compile failure)."""
        return all(k.ok for k in self.kernels)

    def first_error(self) -> str | None:
        return next((k.error for k in self.kernels if not k.ok), None)

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "config": self.config, "refused": self.refused,
                "kernels": [k.to_dict() for k in self.kernels], "triton_version": self.triton_version}

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> ModuleBuild:
        return ModuleBuild(raw["strategy"], raw.get("config"), tuple(KernelBuild.from_dict(k) for k in raw["kernels"]),
                           raw.get("refused"), raw.get("triton_version"))


def capability_of(arch: str) -> int:
    """``"sm_90"`` / ``"sm_90a"`` -> 90."""
    m = re.fullmatch(r"sm_(\d+)a?", arch.strip())
    if not m:
        raise ValueError(f"not an NVIDIA arch name: {arch!r} (expected sm_NN)")
    return int(m.group(1))


# ---------------------------------------------------------------- launches, intercepted


@dataclass
class KernelLaunch:
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


def meta_inputs(spec, shape: Mapping[str, int], dtypes: Mapping[str, str]) -> dict[str, Any]:
    """Empty ``meta`` tensors for every input: dtypes and strides, no storage; in the user's dims (a
    contiguous per-channel weight, as inference servers pass it: fuser_core.merged)."""
    import torch

    out = {}
    for i in spec.inputs:
        dtype = dtypes.get(i.name, "int64" if i.is_index else "float32")
        out[i.name] = torch.empty([int(shape[d]) for d in i.storage_dims or i.dims], dtype=getattr(torch, dtype),
                                  device="meta")
    return out


_DERIVATIONS: dict[Spec, Any] = {}  # by the spec itself: a derivation carries the spec's own names


def request_launches(request: CompileRequest) -> tuple[dict[str, Any], list[KernelLaunch]]:
    """Generate the request's module(s) and run the launcher on meta tensors, intercepted;
    returns the config used and the launches (NotValid when the strategy cannot run)."""
    from fuser_core.codegen.chain import run_chain_detailed
    from fuser_core.codegen.module import generate
    from fuser_core.codegen.plan import BASELINE, KernelConfig, default_config
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
        with intercepted_launches() as launches:
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
    with intercepted_launches() as launches:
        module.load().launch(inputs, shape, scalars=placeholder_scalars(spec))
    return config.to_dict(), launches


# ---------------------------------------------------------------- compiling one launch


_RESOURCE = re.compile(r"\b(REG|STACK|SHARED|LOCAL):(\d+)")


def _bound(launch: KernelLaunch, capability: int):
    """Triton's own binding of the launch's arguments for the target: (options, signature,
    constexprs, attrs), as ``JITFunction.run`` computes them on a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    from fuser_core.codegen.module import FP_FUSION

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    fn = launch.fn
    # The generated modules pass the FP-fusion knob; the unfused chain's launcher (codegen/chain.py)
    # does not yet: its launches get the same explicit value, Triton <= 3.9's default, so they are
    # compiled as they run on those versions, without Triton 3.9's warning about 3.10's default.
    kwargs = {"enable_fp_fusion": FP_FUSION, **launch.kwargs}
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    return target, fn._pack_args(backend, kwargs, bound_args, specialization, options)


def _module_line(fn, error) -> str:
    """'line N' of the generated module where a CompilationError points (found by its text)."""
    node, src = getattr(error, "node", None), getattr(error, "src", None)
    lineno = getattr(node, "lineno", None)
    if not (lineno and src):
        return ""
    wanted = src.split("\n")[lineno - 1]
    try:
        lines = Path(fn.fn.__code__.co_filename).read_text().split("\n")
    except OSError:
        return ""
    hits = [k + 1 for k, line in enumerate(lines) if line.strip() == wanted.strip()]
    return f"line {hits[0]}: {wanted.strip()}" if hits else f"line {lineno} of the function: {wanted.strip()}"


def _error_text(fn, error: Exception, diagnostics: str = "") -> str:
    from triton.compiler.errors import CompilationError

    name = fn.__name__
    if isinstance(error, CompilationError):
        cause = error.error_message or type(error).__name__
        where = _module_line(fn, error)
        text = f"{name}: {where}: {cause}" if where else f"{name}: {cause}"
    else:
        text = f"{name}: {type(error).__name__}: {error}"
        why = pipeline_failure(diagnostics)
        if why:
            text += f" ({why})"
    return text[:MAX_ERROR_CHARS]


_FAILED_PASS = re.compile(r"Pipeline failed while executing \[`(\w+)`")
_ASSERTION = re.compile(r"Assertion `(.{1,200}?)' failed")


def pipeline_failure(diagnostics: str) -> str | None:
    """What an MLIR pass pipeline that failed wrote to stderr, in one line: the pass, and the
    assertion it hit (``pass TritonGPUOptimizeThreadLocality: assertion loopResult.hasOneUse()``).
    Triton's own exception says only "PassManager::run failed"; the reason is printed, with a
    reproducer of the whole module, on the process's stderr (:func:`compiler_stderr`)."""
    failed = _FAILED_PASS.search(diagnostics)
    if failed is None:
        return None
    assertion = _ASSERTION.search(diagnostics)
    return f"pass {failed.group(1)}" + (f": assertion {assertion.group(1)}" if assertion else "")


@contextlib.contextmanager
def compiler_stderr():
    """Within the block, what Triton's C++ compiler writes to the process's stderr (file
    descriptor 2) is kept (yields a list that receives it as one string) instead of printed:
    a failing pass prints its diagnostics and a reproducer of the whole module there, hundreds
    of lines per kernel. Compiles run in :class:`CompilePool` workers, one at a time."""
    import sys
    import tempfile

    out: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            out.append(sink.read().decode("utf-8", "replace"))


def _pass_on(printed: list[str]) -> None:
    """What a compile that succeeded printed (warnings): to stderr, as it would have gone."""
    import sys

    if any(printed):
        sys.stderr.write("".join(printed))


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """``cuobjdump -res-usage`` of a cubin (the tool ships in the triton wheel): REG, STACK,
    SHARED, LOCAL of its (single) function."""
    import subprocess
    import tempfile

    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    return {key: int(value) for key, value in _RESOURCE.findall(out)}


def _triton_files(compiled) -> dict[str, Any]:
    """The files Triton's cache keeps for a compiled kernel that a launch needs: the cubin,
    the PTX and Triton's own metadata JSON (name, shared, num_warps, global scratch, target...),
    read back from the cache group so they are exactly what ``CompiledKernel`` loads."""
    name = compiled.metadata.name
    group = compiled.metadata_group
    meta_path = next(p for c, p in group.items() if c.endswith(".json") and not c.startswith("__grp__"))
    return {"name": name, "cubin": bytes(compiled.asm["cubin"]), "ptx": str(compiled.asm["ptx"]),
            "metadata": json.loads(Path(meta_path).read_text()), "triton_hash": compiled.hash}


def ptxas_version(capability: int) -> str:
    """The version line of the ptxas Triton uses for ``sm_<capability>`` (it ships in the wheel)."""
    from triton.backends.nvidia.compiler import get_ptxas_version

    text = get_ptxas_version(capability)
    found = re.findall(r"release [^\n]*", text)
    return (found[-1] if found else text.strip().splitlines()[-1])[:120]


def cubin_arch(capability: int) -> str:
    """The arch Triton's ptxas really targets for a capability (Triton 3.9: ``sm_90a`` for 90,
    the arch-specific variant with wgmma/TMA; ``sm_80`` for 80)."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    return sm_arch_from_capability(capability)


def launch_artifact(launch: KernelLaunch, capability: int) -> dict[str, Any]:
    """Compile one launch and return its artifacts (:func:`_triton_files` plus the resource
    facts of :class:`KernelBuild`); raises RuntimeError with the compiler's message on failure."""
    import triton
    from triton.compiler import ASTSource

    target, (options, signature, constexprs, attrs) = _bound(launch, capability)
    with compiler_stderr() as printed:
        try:
            compiled = triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
            error = None
        except Exception as err:  # noqa: BLE001 - the message names the kernel and module line
            error = err
    if error is not None:
        raise RuntimeError(_error_text(launch.fn, error, "".join(printed))) from None
    _pass_on(printed)
    return compiled_kernel_artifact(compiled)


def compiled_kernel_artifact(compiled) -> dict[str, Any]:
    """The artifacts of one Triton ``CompiledKernel`` (from ``triton.compile`` here, or from a
    launched kernel's JIT cache, :mod:`tuner.measured_binary`): :func:`_triton_files` plus the
    resource facts of :class:`KernelBuild`."""
    used = cubin_resources(compiled.asm["cubin"])
    return {**_triton_files(compiled), "registers": used.get("REG"),
            "spill_bytes": used.get("STACK", 0) + used.get("LOCAL", 0),
            "shared_bytes": int(compiled.metadata.shared) + used.get("SHARED", 0)}


def compile_artifacts(request: CompileRequest) -> dict[str, Any]:
    """Every kernel of one request compiled, with its artifacts: ``{"arch", "capability",
    "triton_version", "ptxas_version", "config", "kernels": [launch_artifact, ...]}`` in launch
    order (a split kernel has two). Needs TRITON_INTERPRET=0 (:meth:`CompilePool.artifacts`)."""
    import triton

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("compile_artifacts needs TRITON_INTERPRET=0 (use CompilePool.artifacts)")
    config, launches = request_launches(request)
    # Triton's cache key hashes the cache-invalidating TRITON_* variables that are *set*; an
    # inference server sets none, so compile with this one unset even where an operator set it
    # (the launches pass the FP-fusion knob explicitly, so it changes no code, only the key the
    # server would compute at its first launch: it would compile instead of loading the cubin)
    saved = os.environ.pop("TRITON_DEFAULT_FP_FUSION", None)
    try:
        kernels = [launch_artifact(launch, request.capability) for launch in launches]
    finally:
        if saved is not None:
            os.environ["TRITON_DEFAULT_FP_FUSION"] = saved
    return {"arch": cubin_arch(request.capability), "capability": request.capability,
            "triton_version": triton.__version__, "ptxas_version": ptxas_version(request.capability),
            "config": config, "kernels": kernels}


def compile_launch(launch: KernelLaunch, capability: int, sass: bool = True) -> KernelBuild:
    """Compile one intercepted launch for ``sm_<capability>`` (with its SASS facts when ``sass``);
    errors become ``ok=False``."""
    import triton
    from triton.compiler import ASTSource

    name = launch.fn.__name__
    try:
        target, (options, signature, constexprs, attrs) = _bound(launch, capability)
    except Exception as error:  # noqa: BLE001 - a binding failure is the kernel's failure
        return KernelBuild(name, False, _error_text(launch.fn, error))
    with compiler_stderr() as printed:
        try:
            compiled = triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
            used = cubin_resources(compiled.asm["cubin"])
            facts = _sass_facts(compiled.asm["cubin"], name) if sass else None
            error = None
        except Exception as err:  # noqa: BLE001 - every compiler failure is reported, not raised
            error = err
    if error is not None:
        return KernelBuild(name, False, _error_text(launch.fn, error, "".join(printed)), num_warps=options.num_warps,
                           num_stages=options.num_stages)
    _pass_on(printed)
    return KernelBuild(
        name, True, None,
        registers=used.get("REG"),
        # Triton inlines every call and keeps no local arrays: the stack frame holds spills
        spill_bytes=used.get("STACK", 0) + used.get("LOCAL", 0),
        stack_bytes=used.get("STACK"), local_bytes=used.get("LOCAL"),
        # the launch's dynamic shared memory plus the cubin's static allocation
        shared_bytes=int(compiled.metadata.shared) + used.get("SHARED", 0),
        num_warps=options.num_warps, num_stages=options.num_stages, sass=facts,
    )


def _sass_facts(cubin: bytes, name: str) -> dict[str, Any] | None:
    """The SASS facts of the kernel called ``name`` in ``cubin`` (None if cuobjdump names none)."""
    from fuser_core.codegen.sass import cubin_facts

    found = cubin_facts(bytes(cubin))
    kernel = found.get(name) or (next(iter(found.values())) if len(found) == 1 else None)
    return kernel.to_dict() if kernel is not None else None


# ---------------------------------------------------------------- caching


def _cache_dir() -> Path:
    from fuser_core.codegen.module import cache_dir

    path = cache_dir().parent / "compiled"
    path.mkdir(parents=True, exist_ok=True)
    return path


_BUILDS: dict[str, KernelBuild] = {}


def _launch_key(launch: KernelLaunch, capability: int, sass: bool) -> str:
    import triton

    try:
        module_text = Path(launch.fn.fn.__code__.co_filename).read_text()
        _, (options, signature, constexprs, attrs) = _bound(launch, capability)
        bound = [sorted(signature.items()), sorted((str(k), repr(v)) for k, v in constexprs.items()),
                 sorted((str(k), repr(v)) for k, v in attrs.items()), options.num_warps, options.num_stages]
    except Exception as error:  # noqa: BLE001 - unbindable launches are compiled (and fail) uncached
        return f"unbound-{id(launch)}-{error!r}"
    payload = json.dumps([module_text, launch.fn.__name__, bound, capability, triton.__version__, FACTS_VERSION, sass],
                         default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def cached_compile(launch: KernelLaunch, capability: int, sass: bool = False) -> KernelBuild:
    """:func:`compile_launch`, answered from memory or the disk cache when seen before."""
    key = _launch_key(launch, capability, sass)
    if key in _BUILDS:
        return _BUILDS[key]
    path = _cache_dir() / f"{key[:32]}.json"
    if not key.startswith("unbound-") and path.exists():
        with contextlib.suppress(OSError, ValueError, TypeError):
            _BUILDS[key] = KernelBuild.from_dict(json.loads(path.read_text()))
            return _BUILDS[key]
    build = compile_launch(launch, capability, sass)
    _BUILDS[key] = build
    if not key.startswith("unbound-"):
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(build.to_dict()))
        os.replace(tmp, path)
    return build


def compile_request(request: CompileRequest) -> ModuleBuild:
    """Every kernel launch of one request, compiled (in this process: the interpreter must be
    off here; :class:`CompilePool` runs this in workers where it is)."""
    import triton

    from fuser_core.codegen.plan import NotValid

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("compile_request needs TRITON_INTERPRET=0 (use CompilePool from an interpreted process)")
    version = triton.__version__
    try:
        config, launches = request_launches(request)
    except NotValid as why:
        return ModuleBuild(request.strategy, request.config, refused=str(why), triton_version=version)
    except Exception as error:  # noqa: BLE001 - a generator failure is this module's failure
        text = f"{request.strategy} launcher: {type(error).__name__}: {error}"[:MAX_ERROR_CHARS]
        return ModuleBuild(request.strategy, request.config, (KernelBuild("launch", False, text),),
                           triton_version=version)
    builds = tuple(cached_compile(launch, request.capability, request.sass) for launch in launches)
    return ModuleBuild(request.strategy, config, builds, triton_version=version)


# ---------------------------------------------------------------- worker processes


def _exit_with_parent(parent: int) -> None:
    """A worker outlives a parent that was killed (SIGKILL gives the pool no chance to stop it)
    or that exited without shutting the pool down: it then waits on its queue for ever. Poll."""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _worker_init(cache_dir: str | None) -> None:
    _exit_with_parent(os.getppid())
    os.environ["TRITON_INTERPRET"] = "0"
    if cache_dir:
        os.environ["FOLDWISE_CACHE_DIR"] = cache_dir


def _run(request: CompileRequest) -> dict[str, Any]:
    return compile_request(request).to_dict()


class CompilePool:
    """Worker processes that compile :class:`CompileRequest` s (the interpreter off in them).

    ``workers`` defaults to the machine's cores (at most 4). Use as a context manager, or call
    :meth:`close`. ``compile`` keeps the order of its requests.
    """

    def __init__(self, workers: int | None = None):
        self.workers = workers or max(1, min(4, os.cpu_count() or 1))
        ctx = multiprocessing.get_context("spawn")  # a clean interpreter: no inherited triton state
        self._pool = ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_worker_init,
                                         initargs=(os.environ.get("FOLDWISE_CACHE_DIR"),))

    def compile(self, requests: Iterable[CompileRequest],
                progress: Callable[[int, int], None] | None = None) -> list[ModuleBuild]:
        requests = list(requests)
        futures = [self._pool.submit(_run, r) for r in requests]
        out = []
        for k, f in enumerate(futures):
            out.append(ModuleBuild.from_dict(f.result()))
            if progress:
                progress(k + 1, len(requests))
        return out

    def artifacts(self, requests: Iterable[CompileRequest]) -> list[dict[str, Any]]:
        """:func:`compile_artifacts` of each request, in order (errors are raised)."""
        return [f.result() for f in [self._pool.submit(compile_artifacts, r) for r in list(requests)]]

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
