"""Quiet NumPy's floating-point warnings around kernels that run through Triton's interpreter.

The interpreter computes every lane in NumPy, masked-off lanes and both sides of a ``tl.where``
included, so ``log(0)``, ``0 * inf`` or ``inf - inf`` in values that are then discarded print
"divide by zero encountered in log" or "invalid value encountered in multiply" although the
outputs are right (a NaN that does reach an output is in the output, where the caller sees it,
and every check compares the outputs with the float64 reference). Light (NumPy is imported only
under the interpreter, which loads it anyway), so the kernel client can use it around its
launches as ``fuser_core.runner`` does around its own.
"""

from __future__ import annotations

import contextlib
import os
import warnings


def interpreter_quiet() -> contextlib.AbstractContextManager:
    """Around one interpreted launch: NumPy's floating-point warnings off (``np.errstate`` holds per
    thread, so a service worker's neighbour keeps its own), and the interpreter's ``tl.max``/``tl.min``
    (``np.nanmax``/``np.nanmin``) "All-NaN slice" warning on a masked-off row filtered for the
    interpreter's own module only (:mod:`warnings` filters are process-wide), so nobody else's NumPy
    warnings are hidden. A no-op off the interpreter (a GPU launch computes no discarded lanes in NumPy)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return contextlib.nullcontext()
    import numpy as np

    warnings.filterwarnings("ignore", message="All-NaN (slice|axis) encountered", category=RuntimeWarning,
                            module="triton.runtime.interpreter")  # idempotent: an equal filter is replaced
    return np.errstate(all="ignore")
