"""Compiled kernels in the store and in bundles (issue 15), on a machine without a GPU.

Triton's GPU compiler runs here (compile-pool workers, interpreter off); nothing is launched
on a GPU: the cubin path's launch is not measured by these tests.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import logging

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


# ----------------------------------------------------------------------------- serving and the client

from fastapi.testclient import TestClient  # noqa: E402

from service import jobs  # noqa: E402
from service.api import create_app  # noqa: E402
from service.bundle import choose_binary, device_arch, install_variant  # noqa: E402
from service.client import KernelCache, KernelIntegrityError  # noqa: E402
from service.settings import get_settings  # noqa: E402


def stored_kernel(sessions, bundle: dict, variant: dict | None) -> str:
    spec = load_spec(bundle["spec"], printed=True)
    with sessions() as s:
        job, _ = jobs.submit_job(s, spec, json.dumps(bundle["spec"]), bundle["shape"], bundle["dtype"], "h100",
                                 "model", 4, 600)
        jobs.claim_job(s, "w", target="h100", measurer="model", lease_seconds=600)
        kernel = jobs.finish_job(s, job.id, "w", bundle=bundle, kernel_fields={"time_ms": 0.01})
        if variant is not None:
            store_variant(s, bundle["sha256"], variant)
        s.commit()
        return kernel.id


def test_bundle_formats_served_arch_selection_and_etag(db_url, sessions, split_bundle, sm90):
    kid = stored_kernel(sessions, split_bundle, sm90)
    with TestClient(create_app(get_settings(db_url=db_url))) as http:
        v1 = http.get(f"/v1/kernels/{kid}/bundle")
        assert v1.json() == split_bundle and v1.headers["etag"] == f'"{split_bundle["sha256"]}"'
        v2 = http.get(f"/v1/kernels/{kid}/bundle", params={"format": 2})
        body = v2.json()
        assert body["format"] == BUNDLE_FORMAT_2 and list(body["binaries"]) == ["sm_90a"]
        assert v2.headers["etag"] == f'"{body["sha256"]}"' and bundle_v1(body) == split_bundle
        verify_bundle(body)
        assert http.get(f"/v1/kernels/{kid}/bundle", params={"arch": "sm_80"}).json()["binaries"] == {}
        assert http.get(f"/v1/kernels/{kid}/bundle", params={"arch": "sm_90a"}).json() == body
        again = http.get(f"/v1/kernels/{kid}/bundle", params={"format": 2}, headers={"If-None-Match": v2.headers["etag"]})
        assert again.status_code == 304
        bad = http.get(f"/v1/kernels/{kid}/bundle", params={"arch": "sm90"})
        assert bad.status_code == 422 and "arch" in bad.text
        assert http.get(f"/v1/kernels/{kid}/bundle", params={"format": 3}).status_code == 422


def test_client_round_trip_cache_on_disk_and_offline_restart(db_url, sessions, split_bundle, sm90, tmp_path, caplog):
    kid = stored_kernel(sessions, split_bundle, sm90)
    spec = load_spec(spec_source("safe_softmax"))
    with TestClient(create_app(get_settings(db_url=db_url))) as http:
        cache = KernelCache("http://testserver", cache_dir=tmp_path, http_client=http)
        # the app's logging set-up stops "foldwise" loggers propagating: listen on the client's own
        client_log = logging.getLogger("foldwise.client")
        client_log.addHandler(caplog.handler)
        try:
            with caplog.at_level("INFO", logger="foldwise.client"):
                kernel = cache.get(spec, {"m": 4, "n": 3000}, dtype="float16")
        finally:
            client_log.removeHandler(caplog.handler)
    assert kernel.bundle["format"] == BUNDLE_FORMAT_2 and kid
    # no CUDA here (and the interpreter on): the source, and why, in info and in the log
    assert kernel.info["loaded"] == "source" and "TRITON_INTERPRET=1" in kernel.info["reason"]
    assert any("loaded from source" in r.getMessage() for r in caplog.records)
    on_disk = json.loads((tmp_path / f"{kernel.sha256}.json").read_bytes())
    assert on_disk["binaries"]["sm_90a"] == sm90  # the disk cache keeps the binaries
    # restart with no server: the disk copy, binaries included, re-verified
    offline = KernelCache("http://127.0.0.1:9", cache_dir=tmp_path, timeout=0.5)
    again = offline.get(spec, {"m": 4, "n": 3000}, dtype="float16")
    assert again.bundle == kernel.bundle
    # a corrupted cubin byte on disk: the copy is refused (removed), never loaded
    k = on_disk["binaries"]["sm_90a"]["kernels"][0]
    raw = bytearray(base64.b64decode(k["cubin"]))
    raw[64] ^= 0xFF
    k["cubin"] = base64.b64encode(bytes(raw)).decode()
    on_disk["sha256"] = bundle_sha256(on_disk)
    (tmp_path / f"{kernel.sha256}.json").write_bytes(canonical_bytes(on_disk))
    assert KernelCache("http://127.0.0.1:9", cache_dir=tmp_path, timeout=0.5).cached(
        spec, {"m": 4, "n": 3000}, dtype="float16") is None


def test_client_refuses_a_served_bundle_with_a_corrupted_cubin(db_url, sessions, split_bundle, sm90, tmp_path):
    bad = copy.deepcopy(sm90)
    raw = bytearray(base64.b64decode(bad["kernels"][0]["cubin"]))
    raw[200] ^= 1
    bad["kernels"][0]["cubin"] = base64.b64encode(bytes(raw)).decode()  # cubin_sha256 still the original's
    body = bundle_v2(split_bundle, {"sm_90a": bad})
    import httpx

    def serve(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/bundle"):
            return httpx.Response(200, content=canonical_bytes(body), headers={"ETag": f'"{body["sha256"]}"'})
        return httpx.Response(200, json={"id": "a" * 32, "bundle_sha256": split_bundle["sha256"], "exact_match": True})

    cache = KernelCache("http://fake", cache_dir=tmp_path, transport=httpx.MockTransport(serve))
    with pytest.raises(KernelIntegrityError, match=r"binaries\.sm_90a\.kernels\[0\]\.cubin: .* never loaded"):
        cache.get(load_spec(spec_source("safe_softmax")), {"m": 4, "n": 3000}, dtype="float16")
    assert not list(tmp_path.glob("*.json"))


def test_the_loader_decision(split_bundle, sm90):
    b2 = bundle_v2(split_bundle, {"sm_90a": sm90})
    env = {}
    h100 = {"capability": (9, 0), "triton_version": sm90["triton_version"], "interpreted": False, "env_vars": env}
    variant, why = choose_binary(b2, **h100)
    assert variant is sm90 and "stored sm_90a cubin" in why
    cases = [
        (split_bundle, h100, "no compiled binary"),
        (b2, {**h100, "capability": None}, "no CUDA device"),
        (b2, {**h100, "interpreted": True}, "TRITON_INTERPRET=1"),
        (b2, {**h100, "capability": (8, 0)}, "no binary for this device's sm_80; stored: sm_90a"),
        (b2, {**h100, "capability": (10, 0)}, "sm_100a"),
        (b2, {**h100, "triton_version": "3.8.0"}, "built with Triton"),
        (b2, {**h100, "env_vars": {"TRITON_DEFAULT_FP_FUSION": "true"}}, "cache key would differ"),
    ]
    for bundle, facts, reason in cases:
        variant, why = choose_binary(bundle, **facts)
        assert variant is None and reason in why, (facts, why)
    assert device_arch((9, 0)) == "sm_90a" and device_arch((8, 0)) == "sm_80" and device_arch((8, 6)) == "sm_86"


def _cache_hit(request, variant: dict, cache_dir: str) -> list[bytes]:
    """In a compile worker (interpreter off, no GPU): a Triton cache holding only the installed
    variant answers triton.compile for the bundle's launches with the stored cubins, the
    compiler itself disabled (what a GPU client's first launch does)."""
    import os

    import triton
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    from fuser_core.codegen.gpu_compile import _bound, request_launches

    def refuse(*args, **kwargs):
        raise AssertionError("the compiler ran: the installed cubin was not found")

    saved_env = {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TRITON_DEFAULT_FP_FUSION")}
    saved = CUDABackend.make_cubin, CUDABackend.make_ptx
    os.environ["TRITON_CACHE_DIR"] = cache_dir  # empty but for what install_variant puts there
    os.environ.pop("TRITON_DEFAULT_FP_FUSION", None)  # as in an inference server
    CUDABackend.make_cubin = CUDABackend.make_ptx = refuse
    try:
        install_variant(variant)
        out = []
        for launch in request_launches(request)[1]:
            target, (options, signature, constexprs, attrs) = _bound(launch, request.capability)
            compiled = triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
            assert all(str(p).startswith(cache_dir) for p in compiled.metadata_group.values())
            out.append(bytes(compiled.asm["cubin"]))
        return out
    finally:  # the worker is shared by the session's other compile tests
        CUDABackend.make_cubin, CUDABackend.make_ptx = saved
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_installed_cubins_are_what_triton_finds_at_launch_without_compiling(split_bundle, sm90, compile_pool,
                                                                           tmp_path):
    request = compile_request_for(split_bundle, 90)
    cubins = compile_pool._pool.submit(_cache_hit, request, sm90, str(tmp_path / "triton")).result()
    assert cubins == [base64.b64decode(k["cubin"]) for k in sm90["kernels"]]
