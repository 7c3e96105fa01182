"""Names in generated code: the identifier of a spec name and the launcher's text for a tensor
argument. One module for both the kernel structure (which decides arguments) and the printers."""

from __future__ import annotations

import keyword

FP8 = "float8_e4m3fn"  # kernels see it as uint8 bits: see fp8e4m3_bits in HELPERS
# the constexpr kernel parameter (and launcher local) that chooses the hardware's fp8 conversions
# and tensor-core operands (helpers.fp8_native); a kernel takes it when it calls one of FP8_HELPERS
FP8_NATIVE = "FP8_NATIVE"
# the constexpr kernel parameter (and launcher local) that chooses tensor-descriptor (TMA) loads for the
# inputs a tl.dot reads as loaded (helpers.tma_loads: NVIDIA sm_90+, 16-byte aligned, last dim contiguous)
TMA_LOADS = "TMA_LOADS"
# the constexpr kernel parameter (and launcher local) that widens the kernels' positions to 64 bits
# (helpers.wide_offsets: a tensor whose furthest element lies 2**31 or more elements past its first,
# a view into a larger buffer); otherwise positions times strides are 32-bit, as in Triton's tutorials
WIDE_OFFSETS = "WIDE_OFFSETS"
FP8_HELPERS = frozenset({"fp8e4m3_bits", "fp8e4m3_to_float", "fp8e4m3_round", "fp8_operand", "fp8_bits_operand"})
# output dtype -> the helper that converts a float32 value for its store (emit.store_expr): fp8 as its
# bits, bfloat16 rounded to nearest even (the interpreter's own conversion truncates)
STORE_HELPERS = {FP8: "fp8e4m3_bits", "bfloat16": "bf16_store"}
# the kernels' and the launcher's own names: a spec's step or input called "out" shadowed
# launch()'s out= argument (fuzz regressions); "chunk" and "SPLIT" are a split launch's locals
_RESERVED = {"tl", "triton", "pid", "start", "count", "count_old", "float", "range", "int", "math", "torch",
             "inputs", "shape", "out", "scalars", "chunk", "SPLIT", FP8_NATIVE, TMA_LOADS, WIDE_OFFSETS}
_SUFFIXES = ("_ptr", "_anchor", "_old", "_bits", "_desc")
_PREFIXES = ("offs_", "mask_", "size_", "scalar_", "stride_", "BLOCK_", "nblk_", "pid_", "ws_")


def safe_name(name: str) -> str:
    """A Python identifier for a spec name inside generated code."""
    name = name.replace(".", "_")
    if keyword.iskeyword(name) or name in _RESERVED or name.startswith(_PREFIXES) or name.endswith(_SUFFIXES):
        return f"v_{name}"
    return name


def scalar_arg(name: str) -> str:
    """The kernel argument (and launcher variable) of runtime param ``name``: a plain fp32 scalar,
    never ``tl.constexpr``, so every value runs the same compiled kernel."""
    return f"scalar_{name}"


def fp8_bits_var(var: str) -> str:
    """The variable holding an fp8 input's loaded bits, beside ``var``, its float32 value."""
    return f"{var}_bits"


def kernel_arg(var: str, dtype: str | None) -> str:
    """A launcher's tensor argument: an fp8 tensor is passed as its bits (uint8)."""
    return f"{var}.view(torch.uint8)" if dtype == FP8 else var

# max/min in generated code: helpers that propagate NaN as torch does (fuser_core/codegen/helpers.py);
# Triton's tl.maximum, tl.max and their min twins drop it by default
