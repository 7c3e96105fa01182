"""Compiled variants: one arch's binaries of a bundle's kernels, and which one a device loads.

A variant is what the server stores per (bundle, arch, Triton version) and what formats 2 and 3
carry (:mod:`service.bundle.formats`): Triton's compile of every kernel of the module for one
arch. Its arch says which binary it holds (:class:`fuser_core.Target`, the one parser of arch
names): an NVIDIA arch a *cubin* variant, an AMD one an *hsaco* variant (an AMDGPU ELF):

- cubin (the format of issue 15, unchanged, so the variants and bundles stored before AMD
  targets verify and hash as ever)::

    {"arch": "sm_90a", "capability": 90, "triton_version", "ptxas_version",
     "kernels": [{"name", "cubin" (base64), "cubin_sha256", "cubin_size", "ptx", "metadata",
                  "triton_hash", "registers", "spill_bytes", "shared_bytes"}]}

- hsaco::

    {"arch": "gfx942", "binary_kind": "hsaco", "triton_version", "compiler_version",
     "kernels": [{"name", "hsaco" (base64), "hsaco_sha256", "hsaco_size", "amdgcn", "metadata",
                  "triton_hash", "registers", "spill_bytes", "shared_bytes"}]}

``metadata`` is Triton's own metadata JSON of the kernel (shared, num_warps, target, ...),
``triton_hash`` its cache key. Every binary is covered by the bundle's sha256 like any other
field, and decodes to its recorded size and sha256 before it is used (:func:`verify_variant`).

Loading an hsaco on an AMD GPU has not been run (no ROCm machine was available): the loader
(:mod:`service.client.cubin_loader`) handles both kinds the same way, but :func:`choose_binary` does not
pick an hsaco (``BinaryKind.run_on_device``); an AMD client compiles the source, as before.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fuser_core import Target
from service.bundle.formats import bundle_variants, triton_version_key
from service.bundle.hashing import BundleError

MAX_BINARY_BYTES = 8 * 1024 * 1024  # Foldwise's cubins and hsaco are tens of KiB
MAX_ASM_CHARS = 8 * 1024 * 1024
MAX_KERNELS_PER_VARIANT = 16  # a module launches one kernel, two when split, one per chain step
# The arch names Target.parse reads (sm_90, sm_90a, gfx942), as a pattern: the API's path and
# query checks (service/api); tests/service/test_binaries.py checks that it agrees with Target.parse.
ARCH_PATTERN = r"sm_\d{2,3}a?|gfx[0-9a-f]{3,4}"


@dataclass(frozen=True)
class BinaryKind:
    """How a variant of one binary kind is laid out."""

    name: str  # "cubin", "hsaco": the kernel's base64 field, beside <name>_sha256 and <name>_size
    asm: str  # the assembly text Triton keeps beside it: "ptx", "amdgcn"
    compiler: str  # the variant's field naming the compiler that made the binary
    vendor: str  # whose GPUs run it
    run_on_device: bool  # loading a stored binary of this kind has run on a GPU of its vendor


KINDS = {
    "cubin": BinaryKind("cubin", "ptx", "ptxas_version", "NVIDIA", run_on_device=True),
    # not run on AMD: no ROCm machine was available (module docstring)
    "hsaco": BinaryKind("hsaco", "amdgcn", "compiler_version", "AMD", run_on_device=False),
}


def arch_target(arch: Any, where: str = "arch") -> Target:
    """The :class:`Target` of a variant's arch name; :class:`BundleError` naming ``where`` otherwise."""
    try:
        return Target.parse(arch)
    except ValueError:
        raise BundleError(f"{where}: {arch!r:.40} is not a GPU arch like sm_90a or gfx942") from None


def variant_kind(variant: Mapping[str, Any]) -> BinaryKind:
    """The binary kind of a (verified) variant: its arch's."""
    return KINDS[Target.parse(variant["arch"]).binary_kind]


def variant_compiler(variant: Mapping[str, Any]) -> str:
    """The compiler version a (verified) variant records: ptxas's for a cubin, the AMD backend's for an hsaco."""
    return variant[variant_kind(variant).compiler]


def make_variant(artifacts: Mapping[str, Any]) -> dict:
    """A variant from :func:`fuser_core.codegen.gpu_compile.compile_artifacts`' answer (or
    :func:`tuner.measured_binary.measured_artifacts`'): a cubin variant for an NVIDIA arch, an
    hsaco variant for an AMD one."""
    kind = KINDS[arch_target(artifacts["arch"]).binary_kind]
    kernels = []
    for k in artifacts["kernels"]:
        binary = bytes(k[kind.name])
        kernels.append({"name": k["name"], kind.name: base64.b64encode(binary).decode("ascii"),
                        f"{kind.name}_sha256": hashlib.sha256(binary).hexdigest(), f"{kind.name}_size": len(binary),
                        kind.asm: k[kind.asm], "metadata": k["metadata"], "triton_hash": k["triton_hash"],
                        "registers": k.get("registers"), "spill_bytes": k.get("spill_bytes"),
                        "shared_bytes": k.get("shared_bytes")})
    variant: dict[str, Any] = {"arch": artifacts["arch"], "triton_version": str(artifacts["triton_version"]),
                               "kernels": kernels}
    if kind.name == "cubin":  # today's fields, key for key
        variant.update(capability=int(artifacts["capability"]), ptxas_version=str(artifacts["ptxas_version"]))
    else:
        variant.update(binary_kind=kind.name, compiler_version=str(artifacts["compiler_version"]))
    verify_variant(variant)
    return variant


def verify_variant(variant: Any, where: str = "variant") -> list[bytes]:
    """Check a variant's fields and that every binary decodes to its recorded size and sha256;
    returns the binaries (cubins or hsaco, in kernel order). BundleError names the bad field,
    and a binary whose hash does not verify."""
    if not isinstance(variant, dict):
        raise BundleError(f"{where}: expected an object, got {type(variant).__name__}")
    if not isinstance(variant.get("arch"), str):
        raise BundleError(f"{where}.arch: missing or not a str")
    target = arch_target(variant["arch"], f"{where}.arch")
    kind = KINDS[target.binary_kind]
    declared = variant.get("binary_kind", "cubin")  # absent: a cubin variant, as every one before AMD
    if declared != kind.name:
        raise BundleError(f"{where}.binary_kind: {declared!r:.20}, but {variant['arch']} binaries are {kind.name}")
    fields: tuple[tuple[str, type], ...] = (("triton_version", str), (kind.compiler, str), ("kernels", list))
    if kind.name == "cubin":
        fields = (("capability", int), *fields)
    for name, type_ in fields:
        if not isinstance(variant.get(name), type_) or isinstance(variant.get(name), bool):
            raise BundleError(f"{where}.{name}: missing or not a {type_.__name__}")
    if not 1 <= len(variant["kernels"]) <= MAX_KERNELS_PER_VARIANT:
        raise BundleError(f"{where}.kernels: expected 1 to {MAX_KERNELS_PER_VARIANT} kernels")
    return [_verified_binary(k, kind, f"{where}.kernels[{n}]") for n, k in enumerate(variant["kernels"])]


def _verified_binary(k: Any, kind: BinaryKind, at: str) -> bytes:
    """One kernel entry of a variant checked; its binary's bytes."""
    if not isinstance(k, dict):
        raise BundleError(f"{at}: expected an object")
    b = kind.name
    for name, type_ in (("name", str), (b, str), (f"{b}_sha256", str), (f"{b}_size", int), (kind.asm, str),
                        ("metadata", dict), ("triton_hash", str)):
        if not isinstance(k.get(name), type_):
            raise BundleError(f"{at}.{name}: missing or not a {type_.__name__}")
    if k[f"{b}_size"] > MAX_BINARY_BYTES or len(k[b]) > MAX_BINARY_BYTES * 4 // 3 + 4:
        raise BundleError(f"{at}.{b}: larger than {MAX_BINARY_BYTES} bytes")
    if len(k[kind.asm]) > MAX_ASM_CHARS:
        raise BundleError(f"{at}.{kind.asm}: longer than {MAX_ASM_CHARS} characters")
    if k["metadata"].get("name") != k["name"]:
        raise BundleError(f"{at}.metadata: its name is not the kernel's {k['name']!r:.80}")
    try:
        binary = base64.b64decode(k[b], validate=True)
    except ValueError:
        raise BundleError(f"{at}.{b}: not base64") from None
    digest = hashlib.sha256(binary).hexdigest()
    if len(binary) != k[f"{b}_size"] or digest != k[f"{b}_sha256"]:
        raise BundleError(f"{at}.{b}: {len(binary)} bytes hashing to {digest}, not the recorded "
                          f"{k[f'{b}_size']} bytes with {b}_sha256 {k[f'{b}_sha256']:.64}: the binary "
                          "was changed; it is never loaded")
    return binary


# ----------------------------------------------------------------------------- which binary a device loads


def device_arch(device: tuple[int, int] | str) -> str:
    """The arch a device runs binaries of, as variants name it (:attr:`Target.binary_arch`): an
    NVIDIA device by its compute capability (``(9, 0)`` -> ``sm_90a``, the arch-specific variant
    Triton compiles 9.0 for; ``(8, 0)`` -> ``sm_80``), an AMD one by torch's ``gcnArchName``
    (``"gfx942:sramecc+:xnack-"`` -> ``gfx942``: the features after the name are not part of it)."""
    if isinstance(device, str):
        return Target.parse(device.split(":")[0]).binary_arch
    major, minor = device
    return Target.parse(f"sm_{major}{minor}").binary_arch


def compile_env(variant: Mapping[str, Any]) -> dict[str, str]:
    """The cache-invalidating TRITON_* variables the variant was compiled with (Triton records
    them in each kernel's metadata; they are part of its cache key)."""
    return {k: v for kernel in variant["kernels"] for k, v in kernel["metadata"].items()
            if k.startswith("TRITON_") and k.isupper()}


def choose_binary(bundle: Mapping[str, Any], *, arch: str | None, triton_version: str | None,
                  interpreted: bool, env_vars: Mapping[str, str] | None = None) -> tuple[dict | None, str]:
    """(variant to load or None, why): the client's whole decision between a stored binary and
    compiling the source. ``arch``: the GPU's (:func:`device_arch`), None without one."""
    variants = bundle_variants(bundle)
    if not variants:
        return None, "the bundle carries no compiled binary (format 1, or none stored for it)"
    if interpreted:
        return None, "TRITON_INTERPRET=1: Triton's interpreter runs the source"
    if arch is None:
        return None, "no GPU device: the source is loaded (a GPU launch would compile it)"
    for_arch = sorted((v for v in variants if v["arch"] == arch), key=lambda v: triton_version_key(v["triton_version"]))
    if not for_arch:
        return None, f"no binary for this device's {arch}; stored: {', '.join(sorted({v['arch'] for v in variants}))}"
    variant = next((v for v in for_arch if v["triton_version"] == triton_version), None)
    if variant is None:
        built = ", ".join(v["triton_version"] for v in for_arch)
        return None, (f"the {arch} binary was built with Triton {built}, this is Triton {triton_version}: its "
                      "launcher and cache key differ, so the source is compiled")
    if env_vars is not None and dict(env_vars) != compile_env(variant):
        return None, (f"Triton's cache-invalidating variables here {dict(env_vars)} are not the ones the "
                      f"binary was compiled with {compile_env(variant)}: its cache key would differ")
    kind = variant_kind(variant)
    if not kind.run_on_device:
        return None, (f"the stored {arch} {kind.name} is not loaded: loading a stored {kind.name} has not been "
                      f"run on {kind.vendor}, so the source is compiled")
    return variant, f"stored {arch} {kind.name} (Triton {variant['triton_version']}, {variant_compiler(variant)})"


def install_variant(variant: dict) -> list[str]:
    """Put a variant's kernels into Triton's kernel cache, each under the cache key Triton
    computed when it compiled it (``triton_hash``): the module's first launch then finds the
    binary there (``triton.compile``'s cache hit, a ``CompiledKernel`` loaded from these files)
    and compiles nothing. Binaries are re-verified first (a bad hash raises, nothing is written).
    Returns the cache keys."""
    from triton.runtime.cache import get_cache_manager

    binaries = verify_variant(variant)
    kind = variant_kind(variant)
    keys = []
    for kernel, binary in zip(variant["kernels"], binaries):
        name = kernel["name"][:150]  # Triton truncates its file names the same way
        manager = get_cache_manager(kernel["triton_hash"])
        group = {f"{name}.{kind.name}": manager.put(binary, f"{name}.{kind.name}", binary=True),
                 f"{name}.{kind.asm}": manager.put(kernel[kind.asm], f"{name}.{kind.asm}", binary=False),
                 f"{name}.json": manager.put(json.dumps(kernel["metadata"]), f"{name}.json", binary=False)}
        manager.put_group(f"{name}.json", group)
        keys.append(kernel["triton_hash"])
    return keys
