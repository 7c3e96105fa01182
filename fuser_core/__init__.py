"""Foldwise's core: specs, derivation, certificate, reference and code generation.

The package's public API is ``__all__``: other packages (tuner, service) import these names
from ``fuser_core`` itself, never from its modules. Each name is imported from its module on
first use (PEP 562 ``__getattr__``), so ``from fuser_core import Spec`` loads the light spec
modules only, and the derivation (sympy), the reference (numpy, scipy) and the code generator
load when a name of theirs is first asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"  # the project's version (pyproject.toml reads it from here)

# public name -> (module, name there); grouped by module. Light: errors, spec, canonical,
# problem, catalog, merged, index_values. Heavy (sympy, numpy, scipy, triton): the rest.
_EXPORTS: dict[str, tuple[str, str]] = {
    **{n: ("fuser_core.errors", n) for n in ("SpecError", "DerivationLimitError")},
    **{n: ("fuser_core.targets", n) for n in ("Target",)},
    **{n: ("fuser_core.host_faults", n) for n in ("is_host_fault",)},
    **{n: ("fuser_core.dim_symbols", n) for n in ("dim_symbol", "is_dim_symbol", "symbol_kind")},
    **{n: ("fuser_core.spec", n) for n in ("load_spec", "MAX_DIMS", "MAX_SPEC_BYTES")},
    **{n: ("fuser_core.spec_model", n) for n in ("Spec",)},
    **{n: ("fuser_core.reduce_ops", n) for n in (
        "REDUCE_OPS", "SPEC_REDUCE_KINDS", "ReduceOp", "reduce_op", "is_selection", "returns_indices", "has_slots")},
    **{n: ("fuser_core.canonical", n) for n in ("spec_hash", "canonical_json", "canonical_names", "canonical_form")},
    **{n: ("fuser_core.problem", n) for n in (
        "Problem", "make_problem", "ShapeError", "bind_shape", "bind_scalars", "placeholder_scalars", "bind_dtypes", "check_sizes", "output_dtypes", "compute_dtype",
        "canonical_shape", "bound_to_canonical", "normalize_dtype", "FLOAT_DTYPES", "INDEX_DTYPES",
        "MAX_ELEMENTS", "MAX_WORK")},
    **{n: ("fuser_core.empty", n) for n in ("empty_outputs", "has_empty_dim")},
    **{n: ("fuser_core.index_values", n) for n in ("IndexRange", "index_ranges", "first_out_of_range",
                                                   "out_of_range_message")},
    **{n: ("fuser_core.merged", n) for n in ("as_logical", "to_logical", "to_storage", "input_to_storage")},
    **{n: ("fuser_core.paged", n) for n in ("to_pages", "from_pages", "gathered", "call_dims", "call_sizes")},
    **{n: ("fuser_core.catalog", n) for n in (
        "CatalogError", "PACKAGED_DIR", "catalog_dirs", "catalog_entries", "load_suites", "spec_source")},
    **{n: ("fuser_core.derive", n) for n in ("Derivation", "ReductionForm", "derive_cascade")},
    **{n: ("fuser_core.backward.derive", n) for n in ("BackwardCascade", "Gradient", "derive_backward", "spec_json")},
    **{n: ("fuser_core.backward.certify", n) for n in ("certify_backward", "backward_gradients")},
    **{n: ("fuser_core.backward.in_forward", n) for n in ("gradient_in_forward", "gradient_factor", "factor_value",
                                                          "GradientFactor")},
    **{n: ("fuser_core.backward.report", n) for n in ("backward_report", "format_backward")},
    **{n: ("fuser_core.report", n) for n in (
        "derivation_report", "report_entry", "remember_report", "SpecKey", "spec_key",
        "cached_report")},
    **{n: ("fuser_core.present", n) for n in ("REALISATIONS", "accumulator_names", "correction_text", "merge_text")},
    **{n: ("fuser_core.realisation", n) for n in ("Realisation", "Rescale", "ShiftTerm", "part_acc", "unguarded")},
    "new_anchor": ("fuser_core.realisation", "new"),  # "new" alone says too little at package level
    **{n: ("fuser_core.runner", n) for n in ("NO_LAUNCH", "run", "self_check")},
    **{n: ("fuser_core.interpreter", n) for n in ("interpreter_quiet",)},
    **{n: ("fuser_core.accuracy", n) for n in ("FAMILIES", "GATE_FAMILIES", "RUN_FAMILIES", "accuracy_check",
                                               "parse_families")},
    "accuracy_table": ("fuser_core.accuracy", "table"),
    **{n: ("fuser_core.sampled_reference", n) for n in (
        "REFERENCE_BUDGET", "SampledEvaluator", "SampledFormula", "SampledTermScales", "reference_cost", "sample_rows",
        "sliceable_dims")},
    **{n: ("fuser_core.codegen.config", n) for n in ("KernelConfig", "NotValid")},
    **{n: ("fuser_core.codegen.plan", n) for n in ("default_config", "valid_strategies")},
    **{n: ("fuser_core.codegen.strategies.registry", n) for n in (
        "BASELINE", "FALLBACK", "MULTI_PASS", "PREFERENCE", "ROW_RESIDENT", "SPLIT_FUSED", "STRATEGIES",
        "STREAMING_FUSED", "is_fused", "strategy_named")},
    **{n: ("fuser_core.codegen.module", n) for n in ("GENERATOR_VERSION", "generate")},
    **{n: ("fuser_core.codegen.gpu_compile", n) for n in ("CompilePool", "CompileRequest")},
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'fuser_core' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
