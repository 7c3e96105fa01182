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

from fuser_core.codegen.launches import TargetOnlyDriver
from fuser_core.catalog import spec_source
from fuser_core import Target
from fuser_core.problem import make_problem
from fuser_core.spec import load_spec
from service.binaries import compile_request_for, compile_variant, store_variant, stored_variants, variant_summaries
from service.bundle import (BUNDLE_FORMAT, BUNDLE_FORMAT_2, BUNDLE_FORMAT_3, BundleError, bundle_sha256, bundle_v1,
                            bundle_v2, bundle_v3, canonical_bytes, newest_per_arch, triton_version_key, verify_bundle,
                            verify_variant)
from service.bundle_maker import make_bundle
from service.store.kernel_cache import _store_bundle


def softmax_bundle(target: str = "h100", strategy: str = "split_fused") -> dict:
    spec = load_spec(spec_source("safe_softmax"))
    return make_bundle(make_problem(spec, {"m": 4, "n": 3000}, "float16"), target=target, strategy=strategy,
                       config={"blocks": {"n": 256}, "num_warps": 4, "num_stages": 2,
                               "split": 2 if strategy == "split_fused" else 1},
                       measured={"time_ms": 0.01, "measurer": "model"})


@pytest.fixture(scope="module")
def split_bundle():
    return softmax_bundle()


@pytest.fixture(scope="module")
def sm90(split_bundle, compile_pool):
    return compile_variant(split_bundle, pool=compile_pool)


def built_by(variant: dict, version: str) -> dict:
    """The variant as another Triton version's worker would label it (the same cubins: what is
    tested here is which one the store, the formats and the client pick, not the bytes)."""
    return {**copy.deepcopy(variant), "triton_version": version}


def test_h100_variant_is_sm_90a_with_every_kernel_of_a_split_module(split_bundle, sm90):
    assert sm90["arch"] == "sm_90a" and sm90["capability"] == 90  # Triton 3.6 to 3.9 compile capability 90 as sm_90a
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
    [again] = compile_pool.artifacts([compile_request_for(split_bundle, Target.parse("sm_90"))])
    assert [k["cubin"] for k in again["kernels"]] == [base64.b64decode(k["cubin"]) for k in sm90["kernels"]]


def test_corrupted_cubin_byte_is_refused_naming_it(sm90):
    bad = copy.deepcopy(sm90)
    cubin = bytearray(base64.b64decode(bad["kernels"][1]["cubin"]))
    cubin[100] ^= 1
    bad["kernels"][1]["cubin"] = base64.b64encode(bytes(cubin)).decode()
    with pytest.raises(BundleError, match=r"kernels\[1\]\.cubin: .* never loaded"):
        verify_variant(bad)


@pytest.mark.parametrize("field,value,match", [
    ("arch", "sm90", "arch: 'sm90' is not a GPU arch like sm_90a or gfx942"),
    ("arch", "gfx942", "binary_kind: 'cubin', but gfx942 binaries are hsaco"),  # cubins under an AMD arch
    ("binary_kind", "hsaco", "binary_kind: 'hsaco', but sm_90a binaries are cubin"),
    ("kernels", [], "kernels: expected 1 to"),
    ("capability", "90", "capability: missing or not a int"),
    ("ptxas_version", None, "ptxas_version: missing or not a str"),
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


def test_format_3_carries_every_triton_version_s_variant_under_its_keys(split_bundle, sm90):
    other = built_by(sm90, "3.10.0")
    b3 = bundle_v3(split_bundle, [other, sm90])
    assert b3["format"] == BUNDLE_FORMAT_3 and list(b3["binaries"]) == ["sm_90a"]
    assert list(b3["binaries"]["sm_90a"]) == sorted([sm90["triton_version"], "3.10.0"], key=triton_version_key)
    verify_bundle(json.loads(canonical_bytes(b3)))
    assert bundle_v1(b3) == split_bundle and bundle_v1(bundle_v3(split_bundle, [])) == split_bundle
    assert newest_per_arch([sm90, other]) == {"sm_90a": other}  # what format 2 carries
    with pytest.raises(BundleError, match=r"binaries\.sm_90a: two variants for Triton '3\.10\.0'"):
        bundle_v3(split_bundle, [other, other])
    mislabelled = copy.deepcopy(b3)
    mislabelled["binaries"]["sm_90a"]["3.10.0"]["triton_version"] = "3.11.0"
    mislabelled["sha256"] = bundle_sha256(mislabelled)
    with pytest.raises(BundleError, match=r"binaries\.sm_90a\['3\.10\.0'\]\.triton_version: '3\.11\.0' is not its key"):
        verify_bundle(mislabelled)
    flat = copy.deepcopy(b3)
    flat["binaries"]["sm_90a"] = sm90  # format 2's layout under format 3
    flat["sha256"] = bundle_sha256(flat)
    with pytest.raises(BundleError, match=r"binaries\.sm_90a"):
        verify_bundle(flat)
    assert triton_version_key("3.10.0") > triton_version_key("3.9.0") > triton_version_key("3.6.0")


def test_store_and_read_variants(sessions, split_bundle, sm90):
    older = built_by(sm90, "3.5.0")
    with sessions() as s:
        _store_bundle(s, split_bundle["sha256"], canonical_bytes(split_bundle))
        store_variant(s, split_bundle["sha256"], sm90)
        store_variant(s, split_bundle["sha256"], sm90)  # again: replaced, not duplicated
        store_variant(s, split_bundle["sha256"], older)  # another Triton's: kept beside it
        s.commit()
    with sessions() as s:
        assert stored_variants(s, split_bundle["sha256"]) == [older, sm90]
        assert stored_variants(s, split_bundle["sha256"], "sm_80") == []
        _, summary = variant_summaries(s, split_bundle["sha256"])
        assert summary["arch"] == "sm_90a" and summary["triton_version"] == sm90["triton_version"]
        assert [k["registers"] for k in summary["kernels"]] == [k["registers"] for k in sm90["kernels"]]
        with pytest.raises(BundleError, match="triton_version: longer than 64"):
            store_variant(s, split_bundle["sha256"], built_by(sm90, "3." + "9" * 70))
        with pytest.raises(LookupError, match="bundle_sha256: no stored bundle"):
            store_variant(s, "f" * 64, sm90)


# ----------------------------------------------------------------------------- serving and the client

from fastapi.testclient import TestClient  # noqa: E402

from service.store import job_queue  # noqa: E402
from service.api import create_app  # noqa: E402
from service.bundle import choose_binary, device_arch, install_variant  # noqa: E402
from service.client import KernelCache, KernelIntegrityError  # noqa: E402
from service.settings import get_settings  # noqa: E402
from service.tuning_request import tuning_request  # noqa: E402


def stored_kernel(sessions, bundle: dict, variant: dict | None, *more: dict) -> str:
    spec = load_spec(bundle["spec"], printed=True)
    with sessions() as s:
        job, _ = job_queue.submit_job(s, tuning_request(spec, json.dumps(bundle["spec"]), bundle["shape"],
                                                        bundle["dtype"], "h100", "model", 4, 600))
        job_queue.claim_job(s, "w", target="h100", measurer="model", lease_seconds=600)
        kernel = job_queue.finish_job(s, job.id, "w", bundle=bundle, kernel_fields={"time_ms": 0.01})
        for v in [variant, *more] if variant is not None else []:
            store_variant(s, bundle["sha256"], v)
        s.commit()
        return kernel.id


@pytest.mark.parametrize("fast_path", [True, False])
def test_bundle_formats_served_arch_selection_and_etag(db_url, sessions, split_bundle, sm90, fast_path, monkeypatch):
    kid = stored_kernel(sessions, split_bundle, sm90)

    def built_per_request(*args, **kwargs):
        raise AssertionError("a format-2 bundle was built for a download: it is precomputed when stored")

    import service.bundle
    import service.store.served_bundles

    for module in (service.store.served_bundles, service.bundle):  # the stores have run
        monkeypatch.setattr(module, "bundle_v2", built_per_request)
        monkeypatch.setattr(module, "bundle_v3", built_per_request)
    with TestClient(create_app(get_settings(db_url=db_url), fast_path=fast_path)) as http:
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
        assert http.get(f"/v1/kernels/{kid}/bundle", params={"format": 4}).status_code == 422
        assert http.get(f"/v1/kernels/{kid}/bundle", params={"format": 2, "x": 1}).status_code == 200  # route: ignored
        assert http.get(f"/v1/kernels/{'f' * 32}/bundle", params={"format": 2}).status_code == 404
        none = http.get(f"/v1/kernels/{kid}/bundle", params={"arch": "sm_80"})
        assert none.headers["etag"] == f'"{none.json()["sha256"]}"' and none.json()["sha256"] != body["sha256"]
        v3 = http.get(f"/v1/kernels/{kid}/bundle", params={"format": 3}).json()
        assert v3["format"] == BUNDLE_FORMAT_3 and v3["binaries"] == {"sm_90a": {sm90["triton_version"]: sm90}}
        assert bundle_v1(v3) == split_bundle
        assert http.get(f"/v1/kernels/{kid}/bundle", params={"format": 3, "arch": "sm_90a"}).json() == v3
        none3 = http.get(f"/v1/kernels/{kid}/bundle", params={"format": 3, "arch": "sm_80"}).json()
        assert none3["format"] == BUNDLE_FORMAT_3 and none3["binaries"] == {}


@pytest.mark.parametrize("fast_path", [True, False])
def test_every_triton_version_s_binary_is_served_in_format_3_and_the_newest_in_format_2(
        db_url, sessions, split_bundle, sm90, fast_path):
    """Workers on two Tritons each stored a variant of one bundle (a GPU image's older Triton,
    this host's): format 3 serves both, format 2 (one per arch) the newest; the single-binary
    routes serve each by its version."""
    older = built_by(sm90, "3.5.0")
    kid = stored_kernel(sessions, split_bundle, sm90, older)
    with TestClient(create_app(get_settings(db_url=db_url), fast_path=fast_path)) as http:
        v3 = http.get(f"/v1/kernels/{kid}/bundle", params={"format": 3}).json()
        verify_bundle(v3)
        assert v3["binaries"] == {"sm_90a": {"3.5.0": older, sm90["triton_version"]: sm90}}
        assert http.get(f"/v1/kernels/{kid}/bundle", params={"format": 2}).json()["binaries"] == {"sm_90a": sm90}
        listing = http.get(f"/v1/kernels/{kid}/binaries").json()
        assert [v["triton_version"] for v in listing["variants"]] == ["3.5.0", sm90["triton_version"]]
        path = listing["variants"][0]["kernels"][0]["cubin_path"]
        assert path.endswith(".cubin?triton_version=3.5.0") and http.get(path).status_code == 200
        plain = path.split("?")[0]  # no version: the newest's, as format 2
        assert http.get(plain).headers["etag"] == f'"{sm90["kernels"][0]["cubin_sha256"]}"'
        missing = http.get(plain, params={"triton_version": "3.4.0"})
        assert missing.status_code == 404 and "no sm_90a binary built by Triton '3.4.0'" in missing.json()["detail"]
        assert http.get(plain, params={"triton_version": "3.4 0"}).status_code == 422


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
    assert kernel.bundle["format"] == BUNDLE_FORMAT_3 and kid
    # no CUDA here (and the interpreter on): the source, and why, in info and in the log
    assert kernel.info["loaded"] == "source" and "TRITON_INTERPRET=1" in kernel.info["reason"]
    assert any("loaded from source" in r.getMessage() for r in caplog.records)
    on_disk = json.loads((tmp_path / f"{kernel.sha256}.json").read_bytes())
    assert on_disk["binaries"]["sm_90a"] == {sm90["triton_version"]: sm90}  # the disk cache keeps the binaries
    # restart with no server: the disk copy, binaries included, re-verified
    offline = KernelCache("http://127.0.0.1:9", cache_dir=tmp_path, timeout=0.5)
    again = offline.get(spec, {"m": 4, "n": 3000}, dtype="float16")
    assert again.bundle == kernel.bundle
    # a corrupted cubin byte on disk: the copy is refused (removed), never loaded
    k = on_disk["binaries"]["sm_90a"][sm90["triton_version"]]["kernels"][0]
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


def test_a_client_asks_a_server_from_before_format_3_for_format_2(split_bundle, sm90, tmp_path):
    import httpx

    body = bundle_v2(split_bundle, {"sm_90a": sm90})
    asked = []

    def serve(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/bundle"):
            asked.append(request.url.params.get("format"))
            if request.url.params.get("format") not in ("1", "2"):  # its route: format 1 or 2
                return httpx.Response(422, json={"detail": "format: less than or equal to 2"})
            return httpx.Response(200, content=canonical_bytes(body), headers={"ETag": f'"{body["sha256"]}"'})
        return httpx.Response(200, json={"id": "a" * 32, "bundle_sha256": split_bundle["sha256"], "exact_match": True})

    # revalidate_after=0: no in-process memo, so the second get asks the server again
    cache = KernelCache("http://fake", cache_dir=tmp_path, transport=httpx.MockTransport(serve), revalidate_after=0)
    spec = load_spec(spec_source("safe_softmax"))
    assert cache.get(spec, {"m": 4, "n": 3000}, dtype="float16").bundle == body
    cache._kernels.clear()
    cache.get(spec, {"m": 4, "n": 3000}, dtype="float16")
    assert asked == ["3", "2", "2"]  # asked once, then remembered


def test_the_loader_decision(split_bundle, sm90):
    b2 = bundle_v2(split_bundle, {"sm_90a": sm90})
    env = {}
    h100 = {"arch": "sm_90a", "triton_version": sm90["triton_version"], "interpreted": False, "env_vars": env}
    variant, why = choose_binary(b2, **h100)
    assert variant is sm90 and "stored sm_90a cubin" in why
    cases = [
        (split_bundle, h100, "no compiled binary"),
        (b2, {**h100, "arch": None}, "no GPU device"),
        (b2, {**h100, "interpreted": True}, "TRITON_INTERPRET=1"),
        (b2, {**h100, "arch": "sm_80"}, "no binary for this device's sm_80; stored: sm_90a"),
        (b2, {**h100, "arch": "gfx942"}, "no binary for this device's gfx942; stored: sm_90a"),
        (b2, {**h100, "triton_version": "3.8.0"}, "built with Triton"),
        (b2, {**h100, "env_vars": {"TRITON_DEFAULT_FP_FUSION": "true"}}, "cache key would differ"),
    ]
    for bundle, facts, reason in cases:
        variant, why = choose_binary(bundle, **facts)
        assert variant is None and reason in why, (facts, why)
    assert device_arch((9, 0)) == "sm_90a" and device_arch((8, 0)) == "sm_80" and device_arch((8, 6)) == "sm_86"
    assert device_arch((10, 0)) == "sm_100a" and device_arch((8, 9)) == "sm_89"
    # a ROCm device: torch's gcnArchName, its features after the name
    assert device_arch("gfx942:sramecc+:xnack-") == "gfx942" and device_arch("gfx950") == "gfx950"
    with pytest.raises(ValueError, match="not a GPU arch"):
        device_arch("navi:xnack-")
    # format 3: this Triton's variant among the others; a Triton none was built by says which were
    older, newer = built_by(sm90, "3.5.0"), built_by(sm90, "3.10.0")
    b3 = bundle_v3(split_bundle, [older, sm90, newer])
    assert choose_binary(b3, **h100)[0] is sm90 and choose_binary(b3, **{**h100, "triton_version": "3.5.0"})[0] is older
    variant, why = choose_binary(b3, **{**h100, "triton_version": "3.8.0"})
    assert variant is None and why == (f"the sm_90a binary was built with Triton 3.5.0, {sm90['triton_version']}, "
                                       "3.10.0, this is Triton 3.8.0: its launcher and cache key differ, so the "
                                       "source is compiled")


def _cache_hit(request, variant: dict, cache_dir: str) -> list[bytes]:
    """In a compile worker (interpreter off, no GPU): a Triton cache holding only the installed
    variant answers triton.compile for the bundle's launches with the stored cubins, the
    compiler itself disabled (what a GPU client's first launch does)."""
    import os

    from triton.backends.nvidia.compiler import CUDABackend

    from fuser_core.codegen.backends import backend_for
    from fuser_core.codegen.launches import request_launches

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
        backend = backend_for(request.target)
        for launch in request_launches(request)[1]:
            compiled = backend.compile(launch, backend.bind(launch))  # triton.compile, as a launch would
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
    request = compile_request_for(split_bundle, Target.parse("sm_90"))
    cubins = compile_pool._pool.submit(_cache_hit, request, sm90, str(tmp_path / "triton")).result()
    assert cubins == [base64.b64decode(k["cubin"]) for k in sm90["kernels"]]


def _fast_path(b2: dict, v1_sha: str, cache_dir: str) -> dict:
    """In a compile worker (interpreter off, no GPU; a stand-in driver answers the device,
    stream and sm_90 target Triton's JITFunction.run asks for): the client's cubin path with
    Triton's compiler and triton.compile made to fail. ``b2``: a bundle with binaries (format 2
    or 3). Returns what it saw."""
    import os

    import httpx
    import triton
    import triton.compiler
    import triton.compiler.compiler
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    import service.client.binary as binary
    from service.client import cubin_loader
    from service.bundle import bundle_variants

    def refuse(*args, **kwargs):
        raise AssertionError("triton.compile ran on the cubin path")

    variant = next(v for v in bundle_variants(b2) if v["triton_version"] == triton.__version__)
    seen: dict = {}
    saved = (triton.compile, triton.compiler.compile, triton.compiler.compiler.compile, CUDABackend.make_cubin,
             CUDABackend.make_ptx, binary.device_facts, os.environ.get("TRITON_DEFAULT_FP_FUSION"))
    os.environ.pop("TRITON_DEFAULT_FP_FUSION", None)  # as in an inference server
    triton.compile = triton.compiler.compile = triton.compiler.compiler.compile = refuse
    CUDABackend.make_cubin = CUDABackend.make_ptx = refuse
    binary.device_facts = lambda: {"arch": "sm_90a", "triton_version": triton.__version__,
                                    "interpreted": False, "env_vars": {}}
    driver.set_active(TargetOnlyDriver(90))
    try:
        def serve(request: httpx.Request) -> httpx.Response:
            if request.url.path.endswith("/bundle"):
                return httpx.Response(200, content=canonical_bytes(b2), headers={"ETag": f'"{b2["sha256"]}"'})
            return httpx.Response(200, json={"id": "k1", "bundle_sha256": v1_sha, "exact_match": True})

        cache = KernelCache("http://fake", cache_dir=cache_dir, transport=httpx.MockTransport(serve))
        spec = load_spec(spec_source("safe_softmax"))
        kernel = cache.get(spec, {"m": 4, "n": 3000}, dtype="float16")
        seen["info"] = kernel.info
        module = kernel._module
        fns = [v for v in vars(module).values() if isinstance(v, JITFunction)]
        seen["cached"] = sorted((fn.__name__, len(fn.device_caches[0][0])) for fn in fns if 0 in fn.device_caches)

        # the first launch at the tuned shape (as a warm-up: nothing can launch here) finds them
        ready, original = [], JITFunction.run
        JITFunction.run = lambda self, *a, grid, warmup, **kw: ready.append(original(self, *a, grid=grid,
                                                                                     warmup=True, **kw))
        try:
            module.launch(cubin_loader.meta_inputs(kernel.bundle), dict(kernel.bundle["shape"]))
        finally:
            JITFunction.run = original
        seen["launched"] = [(type(k).__name__, k.name, bytes(k.asm["cubin"]), k.hash, k.metadata.num_warps)
                            for k in ready]

        # a corrupted cubin byte, or a variant compiled with other options, is refused: nothing kept
        for fn in fns:
            fn.device_caches.clear()
        bad = copy.deepcopy(variant)
        raw = bytearray(base64.b64decode(bad["kernels"][1]["cubin"]))
        raw[100] ^= 1
        bad["kernels"][1]["cubin"] = base64.b64encode(bytes(raw)).decode()
        other = copy.deepcopy(variant)
        other["kernels"][1]["metadata"]["num_warps"] *= 2
        seen["refused"] = []
        for wrong in (bad, other):
            try:
                cubin_loader.seed_jit_caches(module, kernel.bundle, wrong)
                seen["refused"].append(None)
            except (BundleError, cubin_loader.CubinLoadError) as err:
                seen["refused"].append(str(err))
            seen.setdefault("left", []).append(sum(len(c[0]) for fn in fns for c in fn.device_caches.values()))

        # the client, given a bundle whose variant does not fit the launches, loads the source and says why
        mismatched = bundle_v2(bundle_v1(b2), {"sm_90a": other})
        b2 = mismatched
        fallback = KernelCache("http://fake", cache_dir=os.path.join(cache_dir, "other"),
                               transport=httpx.MockTransport(serve)).get(spec, {"m": 4, "n": 3000}, dtype="float16")
        seen["fallback"] = fallback.info
        seen["left"].append(sum(len(c[0]) for fn in fns for c in fn.device_caches.values()))
        return seen
    finally:  # the worker is shared by the session's other compile tests
        (triton.compile, triton.compiler.compile, triton.compiler.compiler.compile, CUDABackend.make_cubin,
         CUDABackend.make_ptx, binary.device_facts, fp_fusion) = saved
        if fp_fusion is not None:
            os.environ["TRITON_DEFAULT_FP_FUSION"] = fp_fusion
        driver.set_active(None)


@pytest.mark.parametrize("fmt", [2, 3])
def test_the_client_hands_the_cubins_to_triton_s_jit_and_never_compiles(split_bundle, sm90, compile_pool, tmp_path,
                                                                          fmt):
    """The cubin fast path (service.client.cubin_loader) on a matching device, under each Triton it
    knows (CI runs this file under 3.6 and 3.9): the stored kernels are in the JIT caches before
    any launch, the first launch at the tuned shape finds them, and triton.compile never runs;
    from format 3, this Triton's variant among another Triton's. A corrupted cubin, or one
    compiled with other options, is refused and leaves nothing in any cache. (No GPU here:
    module load and launch not run.)"""
    import triton

    from service.client import cubin_loader

    if not cubin_loader.supports(triton.__version__):
        pytest.skip(f"service.client.cubin_loader does not know Triton {triton.__version__}'s internals "
                    f"(it knows {', '.join(cubin_loader.SUPPORTED_TRITON)}); such a client loads through Triton's cache")
    b2 = (bundle_v2(split_bundle, {"sm_90a": sm90}) if fmt == 2
          else bundle_v3(split_bundle, [built_by(sm90, "3.5.0"), sm90]))
    seen = compile_pool._pool.submit(_fast_path, b2, split_bundle["sha256"], str(tmp_path)).result()
    assert seen["info"]["loaded"] == "cubin" and "nothing to compile" in seen["info"]["reason"]
    assert f"Triton {sm90['triton_version']}" in seen["info"]["reason"]
    assert [n for n, count in seen["cached"] if count] == sorted(k["name"] for k in sm90["kernels"])
    assert all(count == 1 for _, count in seen["cached"])
    assert seen["launched"] == [("StoredKernel", k["name"], base64.b64decode(k["cubin"]), k["triton_hash"],
                                 k["metadata"]["num_warps"]) for k in sm90["kernels"]]
    corrupted, other_options = seen["refused"]
    assert corrupted and "kernels[1].cubin" in corrupted and "never loaded" in corrupted
    assert other_options and "option num_warps" in other_options
    assert seen["left"] == [0, 0, 0]
    assert seen["fallback"]["loaded"] == "source" and "does not fit" in seen["fallback"]["reason"]
    assert "option num_warps" in seen["fallback"]["reason"]


# ----------------------------------------------------------------------------- single binaries, backfill

from service.binaries import backfill, bundles_without_binaries  # noqa: E402


def test_binaries_listing_and_single_downloads_with_their_sha256(db_url, sessions, split_bundle, sm90):
    kid = stored_kernel(sessions, split_bundle, sm90)
    with TestClient(create_app(get_settings(db_url=db_url))) as http:
        listing = http.get(f"/v1/kernels/{kid}/binaries").json()
        [variant] = listing["variants"]
        assert listing["bundle_sha256"] == split_bundle["sha256"] and variant["arch"] == "sm_90a"
        assert variant["triton_version"] == sm90["triton_version"] and variant["ptxas_version"] == sm90["ptxas_version"]
        assert [k["name"] for k in variant["kernels"]] == [k["name"] for k in sm90["kernels"]]
        for entry, stored in zip(variant["kernels"], sm90["kernels"]):
            assert entry["registers"] == stored["registers"] and entry["shared_bytes"] == stored["shared_bytes"]
            cubin = http.get(entry["cubin_path"])
            assert cubin.status_code == 200 and cubin.headers["content-type"] == "application/octet-stream"
            assert cubin.content == base64.b64decode(stored["cubin"]) and cubin.content[:4] == b"\x7fELF"
            assert cubin.headers["etag"] == f'"{stored["cubin_sha256"]}"' == f'"{entry["cubin_sha256"]}"'
            assert hashlib.sha256(cubin.content).hexdigest() == cubin.headers["x-content-sha256"]
            assert len(cubin.content) == entry["cubin_size"]
            assert "sm_90a-" in cubin.headers["content-disposition"]
            assert http.get(entry["cubin_path"], headers={"If-None-Match": cubin.headers["etag"]}).status_code == 304
            ptx = http.get(entry["ptx_path"])
            assert ptx.text == stored["ptx"] and ".target sm_90a" in ptx.text
            assert ptx.headers["etag"] == f'"{entry["ptx_sha256"]}"' == f'"{hashlib.sha256(ptx.content).hexdigest()}"'
        base = f"/v1/kernels/{kid}/binaries"
        missing = http.get(f"{base}/sm_80/{sm90['kernels'][0]['name']}.cubin")
        assert missing.status_code == 404 and "no stored sm_80 binary" in missing.json()["detail"]
        unknown = http.get(f"{base}/sm_90a/no_such_kernel.cubin")
        assert unknown.status_code == 404 and "no kernel 'no_such_kernel'" in unknown.json()["detail"]
        assert http.get(f"{base}/sm_90a/x.so").status_code == 422
        assert http.get(f"{base}/sm90/x.cubin").status_code == 422
        assert http.get(f"/v1/kernels/{'0' * 32}/binaries").status_code == 404


def test_backfill_compiles_kernels_stored_without_binaries(db_url, sessions, split_bundle, sm90, compile_pool):
    kid = stored_kernel(sessions, split_bundle, None)  # as a kernel stored before migration 0003
    with sessions() as s:
        assert bundles_without_binaries(s) == [split_bundle["sha256"]]
    seen = []
    counts = backfill(sessions, pool=compile_pool, progress=lambda *a: seen.append(a))
    assert counts == {"stored": 1, "failed": 0}
    assert seen == [(split_bundle["sha256"], "stored", f"sm_90a (Triton {sm90['triton_version']})")]
    with sessions() as s:
        [stored] = stored_variants(s, split_bundle["sha256"])
        assert [k["cubin_sha256"] for k in stored["kernels"]] == [k["cubin_sha256"] for k in sm90["kernels"]]
        assert bundles_without_binaries(s) == []
    assert backfill(sessions, pool=compile_pool) == {"stored": 0, "failed": 0}  # nothing left to do
    with TestClient(create_app(get_settings(db_url=db_url))) as http:
        assert list(http.get(f"/v1/kernels/{kid}/bundle", params={"format": 2}).json()["binaries"]) == ["sm_90a"]


def test_backfill_adds_this_triton_s_binary_beside_another_triton_s(sessions, split_bundle, sm90, compile_pool):
    stored_kernel(sessions, split_bundle, built_by(sm90, "3.5.0"))  # a GPU worker on another Triton stored its own
    with sessions() as s:
        assert bundles_without_binaries(s) == []
        assert bundles_without_binaries(s, triton_version=sm90["triton_version"]) == [split_bundle["sha256"]]
    assert backfill(sessions, pool=compile_pool) == {"stored": 1, "failed": 0}
    with sessions() as s:
        assert [v["triton_version"] for v in stored_variants(s, split_bundle["sha256"])] == \
            ["3.5.0", sm90["triton_version"]]


def test_backfill_skips_a_bundle_that_does_not_compile_and_says_so(sessions, split_bundle, monkeypatch, compile_pool):
    stored_kernel(sessions, split_bundle, None)
    import service.binaries as binaries

    def broken(bundle, arch=None, *, pool=None):
        raise RuntimeError("ptxas: out of registers")

    monkeypatch.setattr(binaries, "compile_variant", broken)
    seen = []
    assert backfill(sessions, progress=lambda *a: seen.append(a)) == {"stored": 0, "failed": 1}
    assert seen == [(split_bundle["sha256"], "failed", "RuntimeError: ptxas: out of registers")]
    with sessions() as s:
        assert bundles_without_binaries(s) == [split_bundle["sha256"]]  # still to do, still served as source


def test_backfill_command(db_url, capsys):
    from service.cli import main

    assert main(["binaries", "backfill", "--db", db_url]) == 0
    assert "0 bundle(s) compiled and stored, 0 failed" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the cuda measurer's binary

from service.binaries import job_variant, measured_binary_of  # noqa: E402
from tuner.measured_binary import compiled_kernels, measured_artifacts  # noqa: E402


def _jit_stand_in(compiled: list) -> object:
    """An object laid out as Triton 3.6's and 3.9's JITFunction keeps what it compiled at launches:
    ``device_caches[device] = (kernel_cache, kernel_key_cache, target, backend, binder)``,
    ``kernel_cache`` a map of specialization key -> CompiledKernel."""
    import types

    return types.SimpleNamespace(device_caches={0: ({f"key{n}": c for n, c in enumerate(compiled)}, {}, None, None, None)})


def _compiled_kernels_from_cache(variant: dict, cache_dir, monkeypatch) -> list:
    """Real ``triton.compiler.CompiledKernel`` objects, loaded as Triton loads a cache hit
    (``CompiledKernel(src, metadata_group, hash)``) from a cache holding the variant's files."""
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.cache import get_cache_manager

    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache_dir))
    install_variant(variant)
    out = []
    for k in variant["kernels"]:
        group = get_cache_manager(k["triton_hash"]).get_group(f"{k['name']}.json")
        out.append(CompiledKernel(None, group, k["triton_hash"]))
    return out


def test_the_measured_binary_is_read_from_the_jit_cache_of_the_launched_module(sm90, tmp_path, monkeypatch):
    """tuner.measured_binary on what a cuda measurement leaves in the child: the launched module's
    JIT caches (stand-ins laid out as Triton 3.6's and 3.9's) holding real CompiledKernel objects. The
    variant it makes is the stored one, byte for byte. (The GPU launch itself is not run here.)"""
    import types

    compiled = _compiled_kernels_from_cache(sm90, tmp_path / "triton", monkeypatch)
    assert isinstance(compiled[0].asm["cubin"], bytes) and compiled[0].metadata.target.arch == 90
    module = types.ModuleType("foldwise_kernel_standin")
    module.first_kernel = _jit_stand_in([compiled[0]])
    module.not_a_kernel = 3
    module.second_kernel = _jit_stand_in([compiled[1]])
    module.never_launched = _jit_stand_in([])
    assert compiled_kernels(module) == compiled
    variant = job_variant({}, measured_artifacts(compiled_kernels(module)))
    assert variant == sm90

    module.second_kernel = _jit_stand_in(compiled)  # two specializations: which one ran?
    with pytest.raises(ValueError, match="second_kernel: 2 compiled specializations"):
        compiled_kernels(module)
    with pytest.raises(ValueError, match="no compiled kernel in the module's JIT cache"):
        measured_artifacts([])


def test_a_cuda_measurer_s_binary_is_stored_else_the_host_compile(split_bundle, sm90, tmp_path, monkeypatch):
    compiled = _compiled_kernels_from_cache(sm90, tmp_path / "triton", monkeypatch)
    artifacts = measured_artifacts(compiled)
    asked = []

    class Cuda:
        name = "cuda"

        def measured_binary(self, strategy, config):
            asked.append((strategy, config))
            return artifacts

    assert measured_binary_of(Cuda(), "split_fused", {"split": 2}) is artifacts and asked == [("split_fused", {"split": 2})]

    class Broken(Cuda):
        def measured_binary(self, strategy, config):
            raise RuntimeError("the child crashed")

    assert measured_binary_of(Broken(), "split_fused", {}) is None  # logged; the worker compiles on the host

    class Model:  # a prediction ran no binary (tuner.Measurer's contract), nor does the interpreter
        name = "model"

        def measured_binary(self, strategy, config):
            return None

    assert measured_binary_of(Model(), "split_fused", {}) is None
    import service.binaries as binaries

    monkeypatch.setattr(binaries, "compile_variant", lambda bundle, arch=None, *, pool=None: {"compiled": bundle["sha256"]})
    assert job_variant(split_bundle, None) == {"compiled": split_bundle["sha256"]}
    assert job_variant(split_bundle, artifacts) == sm90



def test_served_cubins_equal_what_foldwise_compile_writes_for_the_same_module(split_bundle, sm90, tmp_path, capsys):
    """The bundle's module (its canonical spec, shape, dtype, strategy and config) through the
    command line, ``foldwise compile --out``: the same cubin bytes as the stored variant."""
    from service.cli import main

    spec_file = tmp_path / "canonical.json"
    spec_file.write_text(json.dumps(split_bundle["spec"]))
    shape = ",".join(f"{d}={n}" for d, n in split_bundle["shape"].items())
    out = tmp_path / "out"
    assert main(["compile", str(spec_file), "--shape", shape, "--dtype", split_bundle["dtype"] if isinstance(split_bundle["dtype"], str) else json.dumps(split_bundle["dtype"]),
                 "--target", "h100", "--strategy", split_bundle["strategy"],
                 "--config", json.dumps(split_bundle["config"]), "--out", str(out)]) == 0
    assert "2 of 2 kernels compile" in capsys.readouterr().out
    for k in sm90["kernels"]:
        assert (out / split_bundle["strategy"] / f"{k['name']}.cubin").read_bytes() == base64.b64decode(k["cubin"])
        assert (out / split_bundle["strategy"] / f"{k['name']}.ptx").read_text() == k["ptx"]


def test_a_damaged_precomputed_format_2_bundle_is_never_served(db_url, sessions, split_bundle, sm90):
    """A served format-2 row is re-checked against its hash before its bytes are first served."""
    import sqlalchemy as sa

    from service.store.models import ServedBundle

    kid = stored_kernel(sessions, split_bundle, sm90)
    with sessions() as s:
        row = s.get(ServedBundle, (split_bundle["sha256"], "2"))
        good = row.content
        s.execute(sa.update(ServedBundle).where(ServedBundle.bundle_sha256 == split_bundle["sha256"],
                                                ServedBundle.view == "2")
                  .values(content=good.replace(b'"sm_90a"', b'"sm_91a"', 1)))
        s.commit()
    with TestClient(create_app(get_settings(db_url=db_url))) as http:
        r = http.get(f"/v1/kernels/{kid}/bundle", params={"format": 2})
        assert r.status_code == 500 and r.headers["content-type"].startswith("application/problem+json")
        assert "hash mismatch" in r.text and b"sm_91a" not in r.content
        assert http.get(f"/v1/kernels/{kid}/bundle", params={"arch": "sm_90a"}).status_code == 200  # another view
