"""Foldwise's tuner: the search space, Optuna search, cost model, measurers and benchmarks.

The package's public API is ``__all__``: service imports these names from ``tuner`` itself,
never from its modules. Each name is imported from its module on first use (PEP 562
``__getattr__``), so asking for the GPU profiles does not load Optuna, torch or the cost model.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> (module, name there); grouped by module
_EXPORTS: dict[str, tuple[str, str]] = {
    **{n: ("tuner.profiles", n) for n in ("FLEET", "GpuProfile", "PROFILES", "get_profile", "profile_for_device_name")},
    **{n: ("tuner.space", n) for n in ("Candidate", "SearchSpace")},
    **{n: ("tuner.measure", n) for n in ("Measurement", "Measurer", "ModelMeasurer", "reduced_problem")},
    **{n: ("tuner.device.measurer", n) for n in ("DeviceMeasurer",)},
    **{n: ("tuner.device.timing", n) for n in ("TimingSettings",)},
    **{n: ("tuner.device.worker", n) for n in ("WorkerProcess",)},
    **{n: ("tuner.cost_model", n) for n in ("Prediction", "predict", "exhaustive_best")},
    **{n: ("tuner.chain_cost", n) for n in ("predict_chain",)},
    **{n: ("tuner.compile_gate", n) for n in ("CompileGate", "shared_compile_pool")},
    **{n: ("tuner.search.tuner", n) for n in ("Tuner", "NoResult")},
    **{n: ("tuner.search.objective", n) for n in ("HostFault",)},
    **{n: ("tuner.search.storage", n) for n in ("fail_orphaned_trials", "make_storage", "study_name_for")},
    **{n: ("tuner.search.trials", n) for n in ("budget_used", "trial_result")},
    **{n: ("tuner.bench.variants", n) for n in ("BASELINES",)},
    **{n: ("tuner.bench.errors", n) for n in ("BenchError",)},
    **{n: ("tuner.bench.run", n) for n in ("run_bench",)},
    **{n: ("tuner.static_bound", n) for n in ("problem_bounds",)},
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'tuner' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
