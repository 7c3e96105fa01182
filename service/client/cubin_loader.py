"""Hand a bundle's stored binaries (cubins; hsaco, not run on AMD) straight to Triton's JIT: a
kernel ready to launch with no compile, no source hashing and no cache-directory lookup (issue 15).

Why: loading a stored cubin through Triton's own cache (:func:`service.bundle.install_variant`,
then ``triton.compile`` finding it) still pays Triton's cache front-end at start-up: the cache
manager's file writes and reads, and Triton's cache key, which hashes the kernel's AST and its
helpers (``JITFunction.cache_key``) and, once per process, every file of Triton itself and its
``libtriton.so`` plus a ``ptxas --version`` (``triton_key()``, about 0.9 s here). This is what
torch Inductor's static launcher avoids (``torch/_inductor/runtime/static_triton_launcher.py``:
a ``CompiledKernel``'s metadata and cubin are all a launch needs); this module does the same
but keeps Triton's own launcher.

How (:func:`seed_jit_caches`): the bundle's module launcher is run once on ``meta`` tensors of
the bundle's tuned shape, each ``kernel[grid](...)`` as a *warm-up* (Triton binds, specialises
and keys the launch itself, and launches nothing). Where Triton would then compile, it gets a
``CompiledKernel`` built from the bundle's stored metadata and cubin (:class:`StoredKernel`),
and keeps it in the JITFunction's device cache under its own key. The first real launch at that
specialisation finds it there; only ``cuModuleLoadData`` and the launch remain. A launch Triton
specialises differently (other sizes, an unaligned tensor) misses that key and compiles from
source as before. (Triton's check that the globals a kernel read are unchanged since it was
compiled is filled in when Triton hashes the source, so it has nothing to check for a stored
kernel: the module is generated, content-addressed and never edited.)

Checks, before anything is kept: every cubin decodes to its recorded sha256
(:func:`service.bundle.verify_variant`); the module launches exactly the stored kernels, in
order, by name; each launch's options (num_warps, num_stages, fp fusion, debug...) and target
are the ones the cubin was compiled with. On a mismatch nothing stays in any cache
(:class:`CubinLoadError`). The caller (service.client) checks device arch, Triton version and
Triton's cache-invalidating variables first (:func:`service.bundle.choose_binary`).

**AMD (not run on AMD).** An hsaco variant goes through the same steps: Triton's
``CompiledKernel`` is the same class for both backends, its binary under the backend's
``binary_ext`` ("hsaco") and loaded by the HIP driver's ``load_binary`` at the first launch, as
for a cubin. The warm-up with an hsaco is tested on a CPU host with
:class:`fuser_core.codegen.launches.TargetOnlyDriver` for gfx942 (tests/service/test_binaries_hsaco.py);
loading and launching it has not been run on an AMD GPU,
so :func:`service.bundle.choose_binary` does not pick one yet (the client compiles the source).

Imports only the standard library at import time (torch and triton when called).
"""

from __future__ import annotations

import json
import threading
from collections import namedtuple
from collections.abc import Mapping
from types import ModuleType
from typing import Any

# The Triton versions whose internals this module was checked against: CompiledKernel's
# attributes (3.9 adds ``_module_pid``, set here too: 3.6 never reads it), JITFunction.run's
# device caches ``(kernel_cache, kernel_key_cache, target, backend, binder)``, its per-instance
# ``compile`` set by ``create_binder`` and called as ``self.compile(src, target=, options=)``
# (the same code in 3.6's and 3.9's triton/runtime/jit.py and triton/compiler/compiler.py).
# Other versions go through Triton's cache instead (service.client).
SUPPORTED_TRITON = ("3.6.", "3.9.")
# Options that name a path on the machine that compiled the kernel, not what was compiled
_HOST_OPTIONS = {"extern_libs"}
_LOCK = threading.Lock()


class CubinLoadError(RuntimeError):
    """The stored kernels do not fit this module's launches; nothing was kept."""


def supports(triton_version: str) -> bool:
    """Whether this loader knows the Triton internals of ``triton_version``."""
    return triton_version.startswith(SUPPORTED_TRITON)


def _json_value(value: Any) -> Any:
    """``value`` as it reads back from Triton's metadata JSON (tuples become lists, a
    ``GPUTarget`` its fields), without a JSON round trip (this runs for every option)."""
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    return _json_value(vars(value)) if hasattr(value, "__dict__") else json.loads(json.dumps(value))


_METADATA_TYPES: dict[tuple[str, ...], type] = {}


def _stored_kernel_class():
    from triton.compiler.compiler import AsmDict, CompiledKernel, make_backend

    class StoredKernel(CompiledKernel):
        """Triton's ``CompiledKernel`` (3.6, 3.9) built from a bundle's stored metadata and binary
        (``kind``: "cubin" with its "ptx", or "hsaco" with its "amdgcn"): the attributes
        ``CompiledKernel.__init__`` sets, without reading its cache files. Loading the module
        (``cuModuleLoadData``, HIP's ``hipModuleLoadData``) stays lazy, at the first launch, as in Triton."""

        def __init__(self, src: Any, metadata: Mapping[str, Any], kind: Any, binary: bytes, asm: str, hash: str):
            from triton.backends.compiler import GPUTarget

            meta = dict(metadata)
            target = meta["target"]
            meta["target"] = GPUTarget(target["backend"], target["arch"], target["warp_size"])
            fields = tuple(sorted(meta))
            if fields not in _METADATA_TYPES:  # one class per field set, not one per kernel
                _METADATA_TYPES[fields] = namedtuple("KernelMetadata", fields)
            self.metadata = _METADATA_TYPES[fields](**meta)
            self.packed_metadata = make_backend(self.metadata.target).pack_metadata(self.metadata)
            self.src = src
            self.hash = hash
            self.name = self.metadata.name
            self.asm = AsmDict({kind.name: binary, kind.asm: asm})
            self.metadata_group = {}  # no cache files: Triton reads this group only for its hooks
            self.kernel = binary
            self.module = None
            self._module_pid = None
            self.function = None
            self._run = None

    return StoredKernel


_STORED_KERNEL: type | None = None


def stored_kernel(src: Any, kernel: Mapping[str, Any], kind: Any, binary: bytes) -> Any:
    """A ``CompiledKernel`` for one stored kernel of a variant (``kind``: the variant's
    :class:`service.bundle.BinaryKind`, ``binary``: its verified bytes) and Triton's ``ASTSource``
    of the launch it serves."""
    global _STORED_KERNEL
    if _STORED_KERNEL is None:
        _STORED_KERNEL = _stored_kernel_class()
    return _STORED_KERNEL(src, kernel["metadata"], kind, binary, kernel[kind.asm], kernel["triton_hash"])


def _mismatch(kernel: Mapping[str, Any], src: Any, target: Any, options: Mapping[str, Any]) -> str | None:
    """Why the stored ``kernel`` is not what Triton is about to compile, or None."""
    meta = kernel["metadata"]
    if src.name != kernel["name"]:
        return f"the module launches {src.name!r} where the variant stores {kernel['name']!r}"
    if _json_value(target) != meta["target"]:
        return f"{kernel['name']}: compiled for {meta['target']}, this device is {_json_value(target)}"
    for key, value in sorted(options.items()):
        if key in meta and key not in _HOST_OPTIONS and _json_value(value) != meta[key]:
            return f"{kernel['name']}: option {key} is {value!r} here, the binary was compiled with {meta[key]!r}"
    return None


def meta_inputs(bundle: Mapping[str, Any]) -> dict[str, Any]:
    """Empty ``meta`` tensors of the bundle's inputs at its tuned shape (dims and dtypes as
    the bundle records them): what the server's compile bound the launches with."""
    import torch

    shape = bundle["shape"]
    return {name: torch.empty([int(shape[d]) for d in info["dims"]], dtype=getattr(torch, info["dtype"]),
                              device="meta")
            for name, info in bundle["inputs"].items()}


def _placeholder_scalars(bundle: Mapping[str, Any]) -> dict[str, Any]:
    """The launcher's ``scalars=`` for a warm-up launch (any value: fp32 arguments are no part of the
    kernel's key), or nothing for a spec without runtime params (older launchers take none)."""
    from fuser_core import load_spec, placeholder_scalars

    scalars = placeholder_scalars(load_spec(bundle["spec"], printed=True))
    return {"scalars": scalars} if scalars else {}


def seed_jit_caches(module: ModuleType, bundle: Mapping[str, Any], variant: Mapping[str, Any]) -> list[str]:
    """Put the variant's kernels into the JIT device caches of ``module``'s kernels (the module
    imported from ``bundle["triton_source"]``, interpreter off), each under the key Triton
    computes for the bundle's tuned shape. Returns the kernel names, in launch order.

    Raises :class:`service.bundle.BundleError` for a binary whose hash does not verify and
    :class:`CubinLoadError` when the stored kernels do not fit the launches or the warm-up
    fails; either way nothing is kept.
    """
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from service.bundle import variant_kind, verify_variant

    binaries = verify_variant(variant)
    kind = variant_kind(variant)
    kernels = variant["kernels"]
    inputs = meta_inputs(bundle)
    seeder = threading.get_ident()
    launched: list[Any] = []  # the CompiledKernel each launch ended with
    added: list[tuple[dict, Any]] = []  # (kernel_cache, kernel) this call put in
    patched: dict[int, tuple[JITFunction, bool, Any]] = {}  # id -> (fn, had compile, its compile)

    def stored_compile(fn: JITFunction, real_compile: Any):
        def compile_(src, target=None, options=None, _env_vars=None):
            if threading.get_ident() != seeder:  # another thread's launch compiles as ever
                return real_compile(src, target=target, options=options, _env_vars=_env_vars)
            n = len(launched)
            if n >= len(kernels):
                raise CubinLoadError(f"the module launches more kernels than the {len(kernels)} stored")
            why = _mismatch(kernels[n], src, target, options or {})
            if why:
                raise CubinLoadError(why)
            kernel = stored_kernel(src, kernels[n], kind, binaries[n])
            added.append((fn.device_caches[driver.active.get_current_device()][0], kernel))
            return kernel
        return compile_

    def warm_up(fn: JITFunction):
        def run(*args, grid, warmup, **kwargs):
            if threading.get_ident() != seeder:
                return JITFunction.run(fn, *args, grid=grid, warmup=warmup, **kwargs)
            if id(fn) not in patched:
                fn.device_caches[driver.active.get_current_device()]  # Triton's binder, and fn.compile
                had = "compile" in vars(fn)
                patched[id(fn)] = (fn, had, vars(fn).get("compile"))
                fn.compile = stored_compile(fn, fn.compile)
            # warm-up: Triton binds, keys and "compiles" the launch, and launches nothing
            kernel = JITFunction.run(fn, *args, grid=grid, warmup=True, **kwargs)
            n = len(launched)
            if n >= len(kernels):
                raise CubinLoadError(f"the module launches more kernels than the {len(kernels)} stored")
            if kernel is None or kernel.hash != kernels[n]["triton_hash"]:
                raise CubinLoadError(f"launch {n} ({fn.__name__}) is keyed to another kernel than the stored "
                                     f"{kernels[n]['name']}")
            launched.append(kernel)
            return kernel
        return run

    fns = [v for v in vars(module).values() if isinstance(v, JITFunction)]
    with _LOCK:
        for fn in fns:
            fn.run = warm_up(fn)
        try:
            module.launch(inputs, dict(bundle["shape"]), **_placeholder_scalars(bundle))
            if len(launched) != len(kernels):
                raise CubinLoadError(f"the module launched {len(launched)} kernels, the variant stores {len(kernels)}")
        except BaseException as err:
            for cache, kernel in added:  # keep nothing from a refused variant
                for key in [k for k, v in cache.items() if v is kernel]:
                    del cache[key]
            if isinstance(err, Exception) and not isinstance(err, CubinLoadError):
                # Triton or torch refusing the warm-up: the client loads the source instead
                raise CubinLoadError(f"the warm-up launch failed: {type(err).__name__}: {err}"[:500]) from err
            raise
        finally:
            for fn in fns:
                vars(fn).pop("run", None)
            for fn, had, compile_ in patched.values():
                if had:
                    fn.compile = compile_
                else:
                    vars(fn).pop("compile", None)
    return [k.name for k in launched]
