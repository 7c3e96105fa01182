"""On a GPU: the hardware's e4m3 conversions (FP8_NATIVE, sm_89+) give the bits of the exact
software path (tests/fuser_core/test_fp8_bits.py checks that path against ml_dtypes on every code
and every rounding boundary, on the CPU). Run by the GPU check's probes stage; alone:

    python benchmarks/gpu/fp8_native.py

prints one JSON object: how many values were compared, and how many differ (0 is the claim).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fuser_core.codegen.helpers import fp8e4m3_bits, fp8e4m3_to_float  # noqa: E402  (what modules copy)


@triton.jit
def roundtrip_kernel(x_ptr, bits_ptr, back_ptr, n, BLOCK: tl.constexpr, NATIVE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    bits = fp8e4m3_bits(tl.load(x_ptr + offs, mask=mask, other=0), NATIVE)
    tl.store(bits_ptr + offs, bits, mask=mask)
    tl.store(back_ptr + offs, fp8e4m3_to_float(bits, NATIVE), mask=mask)


def values(torch: Any) -> Any:
    """Every finite code's value, the midpoints between them and a float32 ulp either side,
    beyond the range, subnormals, +-inf and NaN; both signs; and random values over 7 decades."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)
    exact = codes.view(torch.float8_e4m3fn).float()
    mids = (exact[:-1] + exact[1:]) / 2
    ulp = 2.0 ** -20
    extra = torch.tensor([448.0, 460.0, 464.0, 1e6, 2.0 ** -12, 1e-30, float("inf"), float("nan")])
    gen = torch.Generator().manual_seed(0)
    rand = torch.randn(100_000, generator=gen) * 10.0 ** torch.randint(-4, 3, (100_000,), generator=gen)
    xs = torch.cat([exact, mids, mids * (1 + ulp), mids * (1 - ulp), extra, rand])
    return torch.cat([xs, -xs]).float()


def compare(device: str = "cuda") -> dict[str, Any]:
    import torch

    x = values(torch).to(device)
    out = {}
    for native in (True, False):
        bits = torch.empty(x.numel(), dtype=torch.uint8, device=device)
        back = torch.empty(x.numel(), dtype=torch.float32, device=device)
        roundtrip_kernel[(triton.cdiv(x.numel(), 1024),)](x, bits, back, x.numel(), BLOCK=1024, NATIVE=native)
        out[native] = (bits.cpu(), back.cpu())
    (hb, hv), (sb, sv) = out[True], out[False]
    nan = torch.isnan(hv) & torch.isnan(sv)  # NaN's sign bit may differ: both are NaN
    return {"values": int(x.numel()), "bits_differ": int(((hb != sb) & ~nan).sum()),
            "values_differ": int(((hv != sv) & ~nan).sum()),
            "nan_mismatch": int((torch.isnan(hv) != torch.isnan(sv)).sum())}


if __name__ == "__main__":
    print(json.dumps(compare()))
