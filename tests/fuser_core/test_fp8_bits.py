"""float8 e4m3fn crosses kernel boundaries as its bits, converted by our own helpers (sm_80 has
no fp8 type; Triton's interpreter converts inexactly): they must agree with ml_dtypes on every
code and on values around every rounding boundary."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import triton

from benchmarks.gpu.fp8_native import roundtrip_kernel  # the helpers generated modules copy, in one kernel


def run(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    xt = torch.from_numpy(x.astype(np.float32))
    bits = torch.empty(x.size, dtype=torch.uint8)
    back = torch.empty(x.size, dtype=torch.float32)
    # the exact path, as on sm_80, AMD and in the interpreter (the hardware's: benchmarks/gpu/fp8_native.py)
    roundtrip_kernel[(triton.cdiv(x.size, 1024),)](xt, bits, back, x.size, BLOCK=1024, NATIVE=False)
    return bits.numpy(), back.numpy()


def boundary_values() -> np.ndarray:
    codes = np.arange(0, 0x7F, dtype=np.uint8)  # every finite non-negative code
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    mids = (values[:-1] + values[1:]) / 2  # ties: round to even
    ulp = np.float32(2.0**-20)
    xs = np.concatenate([values, mids, mids * (1 + ulp), mids * (1 - ulp), [448.0, 460.0, 464.0, 1e6, 2.0**-12, 1e-30]])
    return np.concatenate([xs, -xs]).astype(np.float32)


def test_every_code_decodes_like_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    expected = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    xs = np.where(np.isnan(expected), np.float32("nan"), expected)
    bits, back = run(xs)
    np.testing.assert_array_equal(np.isnan(back), np.isnan(expected))
    finite = ~np.isnan(expected)
    np.testing.assert_array_equal(back[finite], expected[finite])


@pytest.mark.parametrize("seed", [0, 1])
def test_rounding_matches_ml_dtypes_saturating(seed):
    rng = np.random.default_rng(seed)
    xs = np.concatenate([boundary_values(), rng.standard_normal(4000).astype(np.float32) * 10.0 ** rng.integers(-4, 3, 4000)])
    bits, back = run(xs.astype(np.float32))
    expected = np.clip(xs, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(bits, expected.view(np.uint8))
    np.testing.assert_array_equal(back, expected.astype(np.float32))


def test_nan_keeps_nan():
    bits, back = run(np.array([np.nan, -np.nan], dtype=np.float32))
    assert np.isnan(back).all() and set(bits & 0x7F) == {0x7F}
