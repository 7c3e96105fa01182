"""Compiled kernels in the store and in bundles (issue 15), on a machine without a GPU.

Triton's GPU compiler runs here (compile-pool workers, interpreter off); nothing is launched
on a GPU: the cubin path's launch is not measured by these tests.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json

import pytest

from fuser_core.catalog import spec_source
from fuser_core.codegen.gpu_compile import capability_of
from fuser_core.spec import load_spec
from service.binaries import compile_request_for, compile_variant, store_variant, stored_variants, variant_summaries
from service.bundle import (BUNDLE_FORMAT, BUNDLE_FORMAT_2, BundleError, bundle_sha256, bundle_v1, bundle_v2,
                            canonical_bytes, make_bundle, verify_bundle, verify_variant)
from service.jobs import _store_bundle


def softmax_bundle(target: str = "h100", strategy: str = "split_fused") -> dict:
    spec = load_spec(spec_source("safe_softmax"))
    return make_bundle(spec, shape={"m": 4, "n": 3000}, dtype="float16", target=target, strategy=strategy,
                       config={"blocks": {"n": 256}, "num_warps": 4, "num_stages": 2,
                               "split": 2 if strategy == "split_fused" else 1},
                       measured={"time_ms": 0.01, "measurer": "model"})


@pytest.fixture(scope="module")
def split_bundle():
    return softmax_bundle()


@pytest.fixture(scope="module")
def sm90(split_bundle, compile_pool):
    return compile_variant(split_bundle, pool=compile_pool)


def test_h100_variant_is_sm_90a_with_every_kernel_of_a_split_module(split_bundle, sm90):
    assert sm90["arch"] == "sm_90a" and sm90["capability"] == 90  # Triton 3.9 compiles capability 90 as sm_90a
    assert sm90["triton_version"] and sm90["ptxas_version"].startswith("release ")
    assert len(sm90["kernels"]) == 2  # the split kernel and its merge
    for k in sm90["kernels"]:
        cubin = base64.b64decode(k["cubin"])
        assert cubin[:4] == b"\x7fELF" and hashlib.sha256(cubin).hexdigest() == k["cubin_sha256"]
        assert k["metadata"]["name"] == k["name"] and k["metadata"]["target"]["arch"] == 90
        for field in ("shared", "num_warps", "global_scratch_size", "profile_scratch_size"):
            assert field in k["metadata"]
        assert ".target sm_90a" in k["ptx"]
        assert k["registers"] > 0 and k["spill_bytes"] == 0


def test_a100_variant_is_sm_80(compile_pool):
    variant = compile_variant(softmax_bundle("a100", "streaming_fused"), pool=compile_pool)
    assert variant["arch"] == "sm_80" and len(variant["kernels"]) == 1
    assert ".target sm_80" in variant["kernels"][0]["ptx"]


def test_variant_cubins_are_what_the_compile_path_produces(split_bundle, sm90, compile_pool):
    """Same module and arch through the compile pool again: the same bytes (compiles are deterministic)."""
    [again] = compile_pool.artifacts([compile_request_for(split_bundle, capability_of("sm_90"))])
    assert [k["cubin"] for k in again["kernels"]] == [base64.b64decode(k["cubin"]) for k in sm90["kernels"]]


def test_corrupted_cubin_byte_is_refused_naming_it(sm90):
    bad = copy.deepcopy(sm90)
    cubin = bytearray(base64.b64decode(bad["kernels"][1]["cubin"]))
    cubin[100] ^= 1
    bad["kernels"][1]["cubin"] = base64.b64encode(bytes(cubin)).decode()
    with pytest.raises(BundleError, match=r"kernels\[1\]\.cubin: .* never loaded"):
        verify_variant(bad)


@pytest.mark.parametrize("field,value,match", [
    ("arch", "gfx90a", "arch: 'gfx90a' is not an NVIDIA arch"),
    ("kernels", [], "kernels: expected 1 to"),
    ("capability", "90", "capability: missing or not a int"),
])
def test_bad_variant_fields_are_named(sm90, field, value, match):
    bad = {**sm90, field: value}
    with pytest.raises(BundleError, match=match):
        verify_variant(bad)


def test_format_2_bundle_hash_covers_the_binaries_and_projects_to_format_1(split_bundle, sm90):
    b2 = bundle_v2(split_bundle, {"sm_90a": sm90})
    assert b2["format"] == BUNDLE_FORMAT_2 and b2["sha256"] != split_bundle["sha256"]
    verify_bundle(json.loads(canonical_bytes(b2)))
    assert bundle_v1(b2) == split_bundle and bundle_v1(b2)["format"] == BUNDLE_FORMAT
    tampered = copy.deepcopy(b2)
    tampered["binaries"]["sm_90a"]["kernels"][0]["registers"] += 1
    with pytest.raises(BundleError, match="sha256: the bundle hashes to"):
        verify_bundle(tampered)
    tampered["sha256"] = bundle_sha256(tampered)  # re-hashed, but a cubin byte changed: still refused
    k = tampered["binaries"]["sm_90a"]["kernels"][0]
    k["cubin"] = base64.b64encode(b"\x00" + base64.b64decode(k["cubin"])[1:]).decode()
    tampered["sha256"] = bundle_sha256(tampered)
    with pytest.raises(BundleError, match=r"binaries\.sm_90a\.kernels\[0\]\.cubin"):
        verify_bundle(tampered)


def test_store_and_read_variants(sessions, split_bundle, sm90):
    with sessions() as s:
        _store_bundle(s, split_bundle["sha256"], canonical_bytes(split_bundle))
        store_variant(s, split_bundle["sha256"], sm90)
        store_variant(s, split_bundle["sha256"], sm90)  # again: replaced, not duplicated
        s.commit()
    with sessions() as s:
        assert stored_variants(s, split_bundle["sha256"]) == {"sm_90a": sm90}
        assert stored_variants(s, split_bundle["sha256"], "sm_80") == {}
        [summary] = variant_summaries(s, split_bundle["sha256"])
        assert summary["arch"] == "sm_90a" and [k["registers"] for k in summary["kernels"]] == \
            [k["registers"] for k in sm90["kernels"]]
        with pytest.raises(LookupError, match="bundle_sha256: no stored bundle"):
            store_variant(s, "f" * 64, sm90)
