"""Compile generated kernels with Triton's GPU compiler, on a machine without a GPU, for any target.

Triton's interpreter runs a kernel as Python and accepts code that the compiler rejects (a
name assigned inside a loop and read after it, for one), so a kernel that only passed the
interpreter may fail on every GPU. This module runs the real compiler: the generated launcher
is called on ``meta`` tensors with every ``@triton.jit`` launch intercepted
(:mod:`fuser_core.codegen.launches`), and each launch goes through ``triton.compile`` for the
request's :class:`fuser_core.targets.Target`, by its backend
(:func:`fuser_core.codegen.backends.backend_for`): NVIDIA (``Target("cuda", 90, 32)``: TTIR,
PTX, a cubin from the wheel's ptxas) or AMD (``Target("hip", "gfx942", 64)``: AMDGCN and an
hsaco from Triton's own LLVM; no ROCm needed). Every launch is compiled with Triton's FP-fusion
knob set explicitly (:data:`fuser_core.codegen.module.FP_FUSION`), as the generated launchers
pass it. The backend reads what each kernel holds (registers, spills, shared memory or LDS)
from its binary. A pass that fails prints its reason on stderr, not in the exception: it is
read from there into the error (:mod:`fuser_core.codegen.compiler_errors`).

Kernels must be *loaded* with the interpreter off, and a test process runs with it on, so
compiles happen in worker processes (:class:`CompilePool`) started with
``TRITON_INTERPRET=0``. Results are cached in memory and on disk
(``$FOLDWISE_CACHE_DIR/compiled``), keyed by the module's text, the bound signature, the
whole target, the options and Triton's version: the facts are the installed Triton's (Triton
3.6's and 3.9's ptxas give different registers for most kernels, and 3.6 rejects some configs
that 3.9 compiles), so a :class:`ModuleBuild` names the Triton version that built it. A whole
request's outcome is cached too (``compiled/requests``, :func:`request_key`), looked up by
:meth:`CompilePool.compile` before any worker starts: a request seen before costs a file read,
not a process with torch, the derivation and the launcher.

Example:
    >>> from fuser_core.codegen.gpu_compile import CompilePool, CompileRequest
    >>> with CompilePool() as pool:  # doctest: +SKIP
    ...     [module] = pool.compile([CompileRequest(spec, {"m": 4, "n": 1000}, {"x": "float16"},
    ...                                             STREAMING_FUSED.name, None, Target.parse("gfx942"))])
    >>> module.ok, module.kernels[0].registers  # doctest: +SKIP
    (True, 24)
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import multiprocessing
import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fuser_core.codegen.backends import Backend, BoundLaunch, backend_for
from fuser_core.codegen.compiler_errors import MAX_ERROR_CHARS, CompileError, compiler_stderr, error_text, pass_on
from fuser_core.codegen.launches import KernelLaunch, request_launches
from fuser_core.host_faults import is_host_fault, write_cache_file
from fuser_core.spec import Spec
from fuser_core.targets import Target

# part of the cache key: how a KernelBuild's facts are read (3: a failed pass named; 4: SASS
# facts; 5: any backend, sgprs)
FACTS_VERSION = 5
DEFAULT_TARGET = Target("cuda", 90, 32)  # sm_90 (H100, H200)


@dataclass(frozen=True)
class KernelBuild:
    """What the GPU compiler said about one kernel launch of a generated module (the resource
    fields are :class:`fuser_core.codegen.backends.Resources`': per thread on NVIDIA, per lane
    on AMD)."""

    kernel: str
    ok: bool
    error: str | None = None  # the compiler's message: kernel, module line, what failed
    registers: int | None = None  # per thread (AMD: VGPRs per lane)
    spill_bytes: int | None = None  # per thread, what spilled out of registers (NVIDIA stack + local; AMD scratch)
    stack_bytes: int | None = None  # NVIDIA only
    local_bytes: int | None = None  # NVIDIA only
    shared_bytes: int | None = None  # per program: the launch's dynamic plus the binary's static (AMD: LDS)
    num_warps: int | None = None
    num_stages: int | None = None
    # what the cubin issues (fuser_core.codegen.sass.KernelSass.to_dict): the whole body and each
    # innermost loop's instructions, MUFU ops, load/store widths and tensor-core kinds (NVIDIA only)
    sass: dict[str, Any] | None = None
    sgprs: int | None = None  # AMD only: scalar registers per wavefront

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> KernelBuild:
        return KernelBuild(**{k: raw.get(k) for k in KernelBuild.__dataclass_fields__})


@dataclass(frozen=True)
class CompileRequest:
    """One generated module to compile: the spec, bound shape, input dtypes, strategy (or
    ``unfused_chain``), config (``KernelConfig.to_dict()`` form; None: the strategy's default)
    and the :class:`fuser_core.targets.Target` (default sm_90). ``sass``: also read what the
    cubin issues (:class:`KernelBuild` ``sass``, the static bound's input; NVIDIA only);
    disassembling costs about half a compile, so a check that only needs registers, spills and
    shared memory leaves it off. Picklable, so it crosses to a worker process."""

    spec: Spec
    shape: dict[str, int]
    dtypes: dict[str, str]
    strategy: str
    config: dict[str, Any] | None = None
    target: Target = field(default=DEFAULT_TARGET)
    sass: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.target, Target):  # a bare capability (90) was this field once
            raise TypeError(f"CompileRequest.target takes a fuser_core.Target (e.g. Target.parse('sm_90')), "
                            f"got {type(self.target).__name__} {self.target!r}")


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


# ---------------------------------------------------------------- compiling one launch


def _compiled(launch: KernelLaunch, backend: Backend, bound: BoundLaunch) -> Any:
    """``backend.compile`` of a bound launch, what the compiler prints kept (:func:`compiler_stderr`):
    CompileError with the compiler's message on failure; a success's warnings passed on."""
    with compiler_stderr() as printed:
        try:
            compiled = backend.compile(launch, bound)
            error = None
        except Exception as err:  # noqa: BLE001 - the message names the kernel and module line
            error = err
    if error is not None:
        raise CompileError(error_text(launch.fn, error, "".join(printed))) from None
    pass_on(printed)
    return compiled


def _target_of(compiled: Any) -> Target:
    """The target a ``CompiledKernel`` was built for (its metadata's Triton ``GPUTarget``)."""
    t = compiled.metadata.target
    return Target(t.backend, t.arch, t.warp_size)


def compiled_artifacts(compiled: list[Any]) -> dict[str, Any]:
    """:func:`compile_artifacts`' answer, less ``config``, for Triton ``CompiledKernel`` s built for
    one target: from ``triton.compile`` here, or from a launched kernel's JIT cache (the target is
    the one their metadata names: the measuring GPU's, :mod:`tuner.measured_binary`)."""
    targets = {_target_of(c) for c in compiled}
    if len(targets) != 1:
        raise ValueError(f"kernels compiled for {len(targets)} targets ({', '.join(sorted(map(str, targets)))}); "
                         "expected one")
    backend = backend_for(targets.pop())
    kernels = [backend.artifact(c) for c in compiled]
    return {**backend.describe([k[backend.binary_kind] for k in kernels]), "kernels": kernels}


def compile_artifacts(request: CompileRequest) -> dict[str, Any]:
    """Every kernel of one request compiled, with its artifacts, for either backend::

        {"target": {"backend": "cuda"|"hip", "arch": 90|"gfx942", "warp_size": 32|64},
         "arch": target.binary_arch,          # "sm_90a", "sm_80", "gfx942"
         "binary_kind": "cubin"|"hsaco",
         "capability": 90 | None,             # None for AMD
         "triton_version": "3.9.0",
         "compiler_version": str,             # ptxas's "release ..." line; for AMD the LLD that linked
         "ptxas_version": str,                # NVIDIA only (= compiler_version), as stored bundles have it
         "config": KernelConfig.to_dict(),
         "kernels": [{"name", "cubin"|"hsaco": bytes, "ptx"|"amdgcn": str, "metadata": Triton's JSON,
                      "triton_hash", "registers", "spill_bytes", "shared_bytes"}, ...]}

    kernels in launch order (a split kernel has two); their resource facts are
    :class:`KernelBuild`'s (AMD: VGPRs per lane, scratch bytes, LDS bytes). Raises CompileError
    (a RuntimeError) with the compiler's message when a kernel fails. Needs TRITON_INTERPRET=0
    (:meth:`CompilePool.artifacts`)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("compile_artifacts needs TRITON_INTERPRET=0 (use CompilePool.artifacts)")
    config, launches = request_launches(request)
    backend = backend_for(request.target)
    # Triton's cache key hashes the cache-invalidating TRITON_* variables that are *set*; an
    # inference server sets none, so compile with this one unset even where an operator set it
    # (the launches pass the FP-fusion knob explicitly, so it changes no code, only the key the
    # server would compute at its first launch: it would compile instead of loading the binary)
    saved = os.environ.pop("TRITON_DEFAULT_FP_FUSION", None)
    try:
        compiled = [_compiled(launch, backend, backend.bind(launch)) for launch in launches]
    finally:
        if saved is not None:
            os.environ["TRITON_DEFAULT_FP_FUSION"] = saved
    found = compiled_artifacts(compiled)
    return {**{k: v for k, v in found.items() if k != "kernels"}, "config": config, "kernels": found["kernels"]}


def compile_launch(launch: KernelLaunch, target: Target = DEFAULT_TARGET, sass: bool = True) -> KernelBuild:
    """Compile one intercepted launch for ``target`` (with its SASS facts when ``sass``, on NVIDIA);
    errors become ``ok=False``."""
    backend = backend_for(target)
    try:
        bound = backend.bind(launch)
    except Exception as error:  # noqa: BLE001 - a binding failure is the kernel's failure
        return KernelBuild(launch.fn.__name__, False, error_text(launch.fn, error))
    return _compile_bound(launch, backend, bound, sass)


def _compile_bound(launch: KernelLaunch, backend: Backend, bound: BoundLaunch, sass: bool) -> KernelBuild:
    options = bound.options
    try:
        compiled = _compiled(launch, backend, bound)
        used = backend.resources(compiled)
        facts = backend.sass_facts(compiled) if sass else None
    except Exception as error:  # noqa: BLE001 - every compiler failure is reported, not raised
        message = str(error) if isinstance(error, CompileError) else error_text(launch.fn, error)
        return KernelBuild(launch.fn.__name__, False, message, num_warps=options.num_warps,
                           num_stages=options.num_stages)
    return KernelBuild(launch.fn.__name__, True, None, registers=used.registers, spill_bytes=used.spill_bytes,
                       stack_bytes=used.stack_bytes, local_bytes=used.local_bytes, shared_bytes=used.shared_bytes,
                       num_warps=options.num_warps, num_stages=options.num_stages, sass=facts, sgprs=used.sgprs)


# ---------------------------------------------------------------- caching


def _cache_dir() -> Path:
    from fuser_core.codegen.module import cache_dir

    path = cache_dir().parent / "compiled"
    path.mkdir(parents=True, exist_ok=True)
    return path


_BUILDS: dict[str, KernelBuild] = {}


def _launch_key(launch: KernelLaunch, bound: BoundLaunch, target: Target, sass: bool) -> str:
    import triton

    module_text = Path(launch.fn.fn.__code__.co_filename).read_text()
    signature = [sorted(bound.signature.items()), sorted((str(k), repr(v)) for k, v in bound.constexprs.items()),
                 sorted((str(k), repr(v)) for k, v in bound.attrs.items()), bound.options.num_warps,
                 bound.options.num_stages]
    payload = json.dumps([module_text, launch.fn.__name__, signature, [target.backend, target.arch, target.warp_size],
                          triton.__version__, FACTS_VERSION, sass], default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def cached_compile(launch: KernelLaunch, target: Target = DEFAULT_TARGET, sass: bool = False) -> KernelBuild:
    """:func:`compile_launch`, answered from memory or the disk cache when seen before (an
    unbindable launch is compiled, and fails, uncached)."""
    backend = backend_for(target)
    try:
        bound = backend.bind(launch)
        key = _launch_key(launch, bound, target, sass)
    except Exception:  # noqa: BLE001 - compile_launch reports the binding failure as the kernel's
        return compile_launch(launch, target, sass)
    if key in _BUILDS:
        return _BUILDS[key]
    path = _cache_dir() / f"{key[:32]}.json"
    if path.exists():
        with contextlib.suppress(OSError, ValueError, TypeError):
            _BUILDS[key] = KernelBuild.from_dict(json.loads(path.read_text()))
            return _BUILDS[key]
    build = _compile_bound(launch, backend, bound, sass)
    if is_host_fault(build.error):  # the disk was full, not the kernel wrong: compiled again next time
        return build
    _BUILDS[key] = build
    write_cache_file(path, json.dumps(build.to_dict()))
    return build


@functools.cache
def _source_digest() -> str:
    """sha256 of every fuser_core source file: a module build answered from the request cache was
    made by this very code (the generator, the launcher, the facts read), or it is not reused."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _triton_version() -> str:
    """The installed Triton's version, read without importing it (the request cache is looked up
    in the caller's process, which need not load Triton when every answer is cached)."""
    from importlib import metadata

    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        import triton

        return triton.__version__


def request_key(request: CompileRequest) -> str:
    """The request cache's key: what the request says (the whole spec, its names included, as they
    name the kernels; shape, dtypes, strategy, config, target, ``sass``), the Triton that compiles
    it, the facts' version and the digest of fuser_core's sources. Each launch's compile is cached
    by its module text (:func:`cached_compile`), but reaching the launches costs a worker process,
    torch, the derivation and the launcher on meta tensors, seconds per request; this key answers
    a request seen before without any of them (``foldwise compile`` run twice)."""
    t = request.target
    payload = json.dumps([repr(request.spec), sorted(request.shape.items()), sorted(request.dtypes.items()),
                          request.strategy, request.config, [t.backend, t.arch, t.warp_size], request.sass,
                          _triton_version(), FACTS_VERSION, _source_digest()], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def _request_path(key: str) -> Path:
    folder = _cache_dir() / "requests"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{key[:32]}.json"


def cached_module(key: str) -> ModuleBuild | None:
    """The ModuleBuild stored under a :func:`request_key`, or None (absent or unreadable)."""
    path = _request_path(key)
    try:
        return ModuleBuild.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def store_module(key: str, build: ModuleBuild) -> None:
    """Keep a request's outcome, atomically; not a launcher failure (a derivation past its limit on
    a loaded host, say: another try may succeed), which names the kernel ``launch``."""
    if any((k.kernel == "launch" and not k.ok) or is_host_fault(k.error) for k in build.kernels):
        return
    try:
        path = _request_path(key)
    except OSError:  # the cache's folder cannot be made (a full disk): nothing kept
        return
    write_cache_file(path, json.dumps(build.to_dict()))


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
    builds = tuple(cached_compile(launch, request.target, request.sass) for launch in launches)
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
    # a process group of its own: a signal to the parent's group (Ctrl-C, `kill -TERM -PGID`) is the
    # parent's to handle (a job-queue worker gives its job back); dying with it would break the
    # pool under a compile the parent still needs. The parent stops it (shutdown, or its death).
    if hasattr(os, "setsid"):
        with contextlib.suppress(OSError):
            os.setsid()
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
                progress: Callable[[int, int, CompileRequest, ModuleBuild, bool], None] | None = None
                ) -> list[ModuleBuild]:
        """Each request's ModuleBuild, in order: from the request cache (:func:`request_key`) when
        seen before, else compiled in the workers (which start only then). ``progress(done, total,
        request, build, cached)`` is called as each one is answered (cached ones first)."""
        requests = list(requests)
        keys = [request_key(r) for r in requests]
        out: list[ModuleBuild | None] = [None] * len(requests)
        done = 0
        pending = {}
        for i, (request, key) in enumerate(zip(requests, keys)):
            hit = cached_module(key)
            if hit is None:
                pending[self._pool.submit(_run, request)] = i
                continue
            out[i] = hit
            done += 1
            if progress:
                progress(done, len(requests), request, hit, True)
        for future in as_completed(pending):
            i = pending[future]
            build = out[i] = ModuleBuild.from_dict(future.result())
            store_module(keys[i], build)
            done += 1
            if progress:
                progress(done, len(requests), requests[i], build, False)
        return out  # type: ignore[return-value]  (every slot is filled)

    def artifacts(self, requests: Iterable[CompileRequest]) -> list[dict[str, Any]]:
        """:func:`compile_artifacts` of each request, in order (errors are raised)."""
        return [f.result() for f in [self._pool.submit(compile_artifacts, r) for r in list(requests)]]

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
