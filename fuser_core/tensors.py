"""Where kernels meet torch: the device they run on and NumPy inputs as torch tensors.

Shared by :mod:`fuser_core.runner` and :mod:`fuser_core.codegen.chain` (which the runner
calls), so neither imports the other for them; :mod:`fuser_core.runner` re-exports both.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np


def device() -> str:
    import torch

    if torch.cuda.is_available():
        return "cuda"
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return "cpu"


def to_torch(arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, str], dev: str) -> dict[str, Any]:
    import torch

    out = {}
    for name, arr in arrays.items():
        t = torch.from_numpy(np.ascontiguousarray(arr).reshape(np.shape(arr)))  # ascontiguousarray makes a 0-dim array (1,)
        dt = dtypes[name]
        t = t.to(torch.int64 if dt == "int64" else getattr(torch, dt if dt != "float8_e4m3fn" else "float32"))
        if dt == "float8_e4m3fn":
            t = t.to(torch.float8_e4m3fn)
        out[name] = t.to(dev)
    return out
