"""Kernels made in this process, as the server would serve them (a bundle at the default
configuration of the strategy the runner picks), for tests of the client's torch ops that need
no server: :func:`local_kernel`, and :class:`LocalCache`, the part of ``KernelCache``'s
interface that builds trainable ops."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fuser_core import load_spec, spec_json
from fuser_core.catalog import PACKAGED_DIR
from fuser_core.codegen.plan import default_config
from fuser_core.derive import derive_cascade
from fuser_core.problem import make_problem
from fuser_core.runner import choose_strategy
from service.bundle import load_bundle
from service.bundle_maker import make_bundle

MEASURED = {"time_ms": 0.0123, "measurer": "model", "predicted": True, "device": None,
            "triton_version": "x", "torch_version": "y", "date": "2025-01-01T00:00:00+00:00"}


def local_kernel(spec: Any, shape: Mapping[str, int], dtype: str | Mapping[str, str] = "float32"):
    """``spec``'s kernel at ``shape``: the runner's strategy at its default configuration, bundled and loaded."""
    derivation = derive_cascade(spec)
    strategy = choose_strategy(spec, derivation, shape)
    config = default_config(spec, derivation, strategy, shape).to_dict()
    bundle = make_bundle(make_problem(spec, shape, dtype), target="h100", strategy=strategy, config=config,
                         measured=MEASURED)
    return load_bundle(bundle, spec=load_spec(spec_json(spec), printed=True))


class LocalCache:
    """``KernelCache.trainable_op`` over :func:`local_kernel` (catalog specs by name)."""

    def trainable_op(self, name: str, shape: Mapping[str, int], dtype: str = "float32", target: str = "h100",
                     **options: Any):
        from service.client.autograd import fetch_trainable

        def fetch_all(requests):
            return [local_kernel(load_spec(raw, printed=True), s, d) for raw, s, d in requests]

        spec = load_spec((PACKAGED_DIR / f"{name}.json").read_text())
        return fetch_trainable(fetch_all, spec, shape, dtype)
