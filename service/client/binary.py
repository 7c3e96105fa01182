"""A loaded bundle's stored binary handed to Triton where this device can run it: straight into
Triton's JIT (:mod:`service.client.cubin_loader`), else into Triton's kernel cache, else the source
compiles as usual (:func:`service.bundle.choose_binary` decides from :func:`device_facts`)."""

from __future__ import annotations

import logging
import os
from typing import Any

from service.bundle import BundleError, BundleKernel, choose_binary, device_arch, install_variant, variant_kind
from service.client import cubin_loader
from service.client.errors import KernelIntegrityError

log = logging.getLogger("foldwise.client")


def prepare_binary(bundle: dict, kernel: BundleKernel) -> dict:
    """Hand the stored binary for this device to Triton when it can be used
    (:func:`service.bundle.choose_binary`); the kernel's ``info`` either way."""
    variant, reason = choose_binary(bundle, **device_facts())
    if variant is not None:
        try:
            if cubin_loader.supports(variant["triton_version"]):
                cubin_loader.seed_jit_caches(kernel._module, bundle, variant)
                reason += "; in Triton's JIT cache, nothing to compile"
            else:
                install_variant(variant)
                reason += "; in Triton's kernel cache (this Triton is not one service.client.cubin_loader knows)"
        except BundleError as err:  # verified on download and from disk; a change since is refused
            raise KernelIntegrityError(f"bundle {bundle['sha256']}: {err}") from None
        except cubin_loader.CubinLoadError as err:
            variant, reason = None, f"the stored binary does not fit the module's launches: {err}"
        except OSError as err:
            variant, reason = None, f"the binary could not be put in Triton's cache: {err}"
    info = {"loaded": variant_kind(variant).name if variant is not None else "source", "reason": reason}
    log.info("kernel %s loaded from %s: %s", bundle["sha256"][:12], info["loaded"], reason,
             extra={"bundle_sha256": bundle["sha256"], **info})
    return info


def device_facts() -> dict[str, Any]:
    """What :func:`service.bundle.choose_binary` decides on, from this process: the GPU's arch
    (None without one), Triton's version, the interpreter flag, and Triton's cache-invalidating
    variables."""
    import torch
    import triton

    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    arch = None
    if torch.cuda.is_available():  # a ROCm build of torch answers here too: its GPU is named by its gfx arch
        arch = device_arch(torch.cuda.get_device_properties(torch.cuda.current_device()).gcnArchName
                           if torch.version.hip else tuple(torch.cuda.get_device_capability()))
    env_vars = None
    if arch is not None:
        from triton._C.libtriton import get_cache_invalidating_env_vars

        env_vars = get_cache_invalidating_env_vars()
    return {"arch": arch, "triton_version": triton.__version__, "interpreted": interpreted, "env_vars": env_vars}


__all__ = ["device_facts", "prepare_binary"]
