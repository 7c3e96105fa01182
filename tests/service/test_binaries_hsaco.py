"""AMD binaries in the store and in bundles (issue 25): hsaco variants beside cubin ones.

Triton's compiler builds an hsaco (an AMDGPU ELF) for gfx942 and gfx950 here without ROCm, in
compile-pool workers; nothing runs on an AMD GPU: loading a stored hsaco has not been run on AMD,
so the client compiles the source there (service.bundle.binaries, ``BinaryKind.run_on_device``).
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
import struct

import pytest
from tests.support.catalog import load_catalog
from fastapi.testclient import TestClient

from fuser_core.codegen.launches import TargetOnlyDriver
from fuser_core.catalog import spec_source
from fuser_core.problem import make_problem
from fuser_core.spec import load_spec
from service.binaries import compile_variant, store_variant, stored_variants, variant_summaries
from service.bundle import (ARCH_PATTERN, BundleError, bundle_sha256, bundle_v1, bundle_v3, canonical_bytes,
                            choose_binary, make_variant, verify_bundle, verify_variant)
from service.bundle_maker import make_bundle

EM_AMDGPU = 224  # the ELF e_machine of an AMDGPU code object


def elf_machine(binary: bytes) -> int:
    assert binary[:4] == b"\x7fELF", binary[:4]
    return struct.unpack_from("<H", binary, 18)[0]


def softmax_bundle(target: str) -> dict:
    spec = load_spec(spec_source("safe_softmax"))
    return make_bundle(make_problem(spec, {"m": 4, "n": 3000}, "float16"), target=target, strategy="split_fused",
                       config={"blocks": {"n": 256}, "num_warps": 4, "num_stages": 2, "split": 2},
                       measured={"time_ms": 0.01, "measurer": "model"})


@pytest.fixture(scope="module")
def mi300x_bundle():
    return softmax_bundle("mi300x")


@pytest.fixture(scope="module")
def gfx942(mi300x_bundle, compile_pool):
    return compile_variant(mi300x_bundle, pool=compile_pool)  # the bundle's target's arch: gfx942


def test_an_mi300x_bundle_compiles_to_an_hsaco_variant(gfx942):
    assert gfx942["arch"] == "gfx942" and gfx942["binary_kind"] == "hsaco"
    assert gfx942["triton_version"] and gfx942["compiler_version"]
    assert "capability" not in gfx942 and "ptxas_version" not in gfx942
    assert len(gfx942["kernels"]) == 2  # the split kernel and its merge
    for k in gfx942["kernels"]:
        hsaco = base64.b64decode(k["hsaco"])
        assert elf_machine(hsaco) == EM_AMDGPU
        assert hashlib.sha256(hsaco).hexdigest() == k["hsaco_sha256"] and len(hsaco) == k["hsaco_size"]
        assert "gfx942" in k["amdgcn"] and "cubin" not in k and "ptx" not in k
        assert k["metadata"]["name"] == k["name"] and k["metadata"]["target"]["backend"] == "hip"
        assert k["metadata"]["target"]["arch"] == "gfx942" and k["metadata"]["target"]["warp_size"] == 64
        assert k["registers"] > 0 and k["spill_bytes"] == 0


def test_gfx950_and_an_nvidia_arch_from_one_bundle(mi300x_bundle, compile_pool):
    """Any fleet arch from any bundle: the binary kind follows the arch asked for."""
    gfx950 = compile_variant(mi300x_bundle, "gfx950", pool=compile_pool)
    assert gfx950["arch"] == "gfx950" and gfx950["binary_kind"] == "hsaco"
    assert all(elf_machine(base64.b64decode(k["hsaco"])) == EM_AMDGPU for k in gfx950["kernels"])
    sm89 = compile_variant(mi300x_bundle, "sm_89", pool=compile_pool)
    assert sm89["arch"] == "sm_89" and "binary_kind" not in sm89 and sm89["capability"] == 89
    assert all(base64.b64decode(k["cubin"])[:4] == b"\x7fELF" for k in sm89["kernels"])


def test_hsaco_bytes_are_covered_by_the_bundle_sha256(mi300x_bundle, gfx942):
    b3 = bundle_v3(mi300x_bundle, [gfx942])
    verify_bundle(json.loads(canonical_bytes(b3)))
    assert bundle_v1(b3) == mi300x_bundle
    where = f"binaries.gfx942[{gfx942['triton_version']!r}]"
    # one byte of the hsaco changed: the bundle no longer hashes to its sha256
    tampered = copy.deepcopy(b3)
    k = tampered["binaries"]["gfx942"][gfx942["triton_version"]]["kernels"][0]
    raw = bytearray(base64.b64decode(k["hsaco"]))
    raw[len(raw) // 2] ^= 1
    k["hsaco"] = base64.b64encode(bytes(raw)).decode()
    with pytest.raises(BundleError, match="sha256: the bundle hashes to"):
        verify_bundle(tampered)
    # re-hashed by whoever changed it: the hsaco still does not decode to its recorded sha256
    tampered["sha256"] = bundle_sha256(tampered)
    with pytest.raises(BundleError, match=rf"{re.escape(where)}\.kernels\[0\]\.hsaco: .* never loaded"):
        verify_bundle(tampered)


@pytest.mark.parametrize("field,value,match", [
    ("binary_kind", None, "binary_kind: None, but gfx942 binaries are hsaco"),
    ("binary_kind", "cubin", "binary_kind: 'cubin', but gfx942 binaries are hsaco"),
    ("compiler_version", 3, "compiler_version: missing or not a str"),
    ("arch", "gfx9", "arch: 'gfx9' is not a GPU arch"),
])
def test_bad_hsaco_variant_fields_are_named(gfx942, field, value, match):
    with pytest.raises(BundleError, match=match):
        verify_variant({**gfx942, field: value})
    no_asm = copy.deepcopy(gfx942)
    del no_asm["kernels"][1]["amdgcn"]
    with pytest.raises(BundleError, match=r"kernels\[1\]\.amdgcn: missing"):
        verify_variant(no_asm)


def test_a_bundle_carries_a_binary_per_arch_and_each_device_picks_its_own(mi300x_bundle, gfx942, compile_pool):
    sm90 = compile_variant(mi300x_bundle, "sm_90", pool=compile_pool)
    b3 = bundle_v3(mi300x_bundle, [gfx942, sm90])
    verify_bundle(b3)
    assert sorted(b3["binaries"]) == ["gfx942", "sm_90a"]
    facts = {"triton_version": gfx942["triton_version"], "interpreted": False, "env_vars": {}}
    variant, why = choose_binary(b3, arch="sm_90a", **facts)
    assert variant is sm90 and "stored sm_90a cubin" in why
    # an MI300X finds its hsaco, but loading one has not been run on AMD: the source is compiled
    variant, why = choose_binary(b3, arch="gfx942", **facts)
    assert variant is None and "stored gfx942 hsaco is not loaded" in why and "not been run on AMD" in why
    variant, why = choose_binary(b3, arch="gfx950", **facts)
    assert variant is None and "no binary for this device's gfx950; stored: gfx942, sm_90a" in why


def test_the_api_arch_pattern_reads_what_target_parse_reads():
    from fuser_core import Target

    for arch in ("sm_80", "sm_90a", "sm_100a", "gfx942", "gfx950", "gfx90a", "gfx1100"):
        assert re.fullmatch(ARCH_PATTERN, arch) and Target.parse(arch)
    for bad in ("sm90", "sm_9", "gfx9", "GFX942", "gfx942:xnack-", "cuda"):
        assert not re.fullmatch(ARCH_PATTERN, bad)


def test_an_hsaco_variant_is_stored_listed_and_downloaded(db_url, sessions, mi300x_bundle, gfx942):
    from service.store import job_queue
    from service.api import create_app
    from service.store.models import KernelBinary
    from service.settings import get_settings
    from service.tuning_request import tuning_request

    spec = load_spec(mi300x_bundle["spec"], printed=True)
    with sessions() as s:
        job, _ = job_queue.submit_job(s, tuning_request(spec, json.dumps(mi300x_bundle["spec"]), mi300x_bundle["shape"],
                                                        mi300x_bundle["dtype"], "mi300x", "model", 4, 600))
        job_queue.claim_job(s, "w", target="mi300x", measurer="model", lease_seconds=600)
        kid = job_queue.finish_job(s, job.id, "w", bundle=mi300x_bundle, kernel_fields={"time_ms": 0.01}).id
        row = store_variant(s, mi300x_bundle["sha256"], gfx942)
        assert isinstance(row, KernelBinary) and row.arch == "gfx942"
        assert row.ptxas_version == gfx942["compiler_version"]  # the column holds the variant's compiler version
        s.commit()
    with sessions() as s:
        assert stored_variants(s, mi300x_bundle["sha256"]) == [gfx942]
        [summary] = variant_summaries(s, mi300x_bundle["sha256"])
    assert summary["binary_kind"] == "hsaco" and summary["asm_kind"] == "amdgcn"
    assert summary["compiler_version"] == gfx942["compiler_version"]
    assert [k["hsaco_sha256"] for k in summary["kernels"]] == [k["hsaco_sha256"] for k in gfx942["kernels"]]
    with TestClient(create_app(get_settings(db_url=db_url))) as http:
        v3 = http.get(f"/v1/kernels/{kid}/bundle", params={"format": 3, "arch": "gfx942"})
        assert v3.status_code == 200 and v3.json()["binaries"] == {"gfx942": {gfx942["triton_version"]: gfx942}}
        verify_bundle(v3.json())
        assert http.get(f"/v1/kernels/{kid}/bundle", params={"arch": "gfx942"}).json()["binaries"] == {"gfx942": gfx942}
        [listed] = http.get(f"/v1/kernels/{kid}/binaries").json()["variants"]
        assert listed["arch"] == "gfx942" and listed["binary_kind"] == "hsaco"
        for entry, stored in zip(listed["kernels"], gfx942["kernels"]):
            hsaco = http.get(entry["hsaco_path"])
            assert hsaco.status_code == 200 and hsaco.headers["content-type"] == "application/octet-stream"
            assert hsaco.content == base64.b64decode(stored["hsaco"]) and elf_machine(hsaco.content) == EM_AMDGPU
            assert hsaco.headers["etag"] == f'"{stored["hsaco_sha256"]}"'
            amdgcn = http.get(entry["amdgcn_path"])
            assert amdgcn.status_code == 200 and amdgcn.text == stored["amdgcn"]
            assert "cubin_path" not in entry and "ptx_path" not in entry
        name = gfx942["kernels"][0]["name"]
        wrong = http.get(f"/v1/kernels/{kid}/binaries/gfx942/{name}.cubin")
        assert wrong.status_code == 404 and "holds hsaco and amdgcn, not cubin" in wrong.json()["detail"]


def _seed_hsaco(bundle: dict, variant: dict) -> dict:
    """In a compile worker (interpreter off, no GPU): the stored hsaco kernels through the JIT
    warm-up of service.client.cubin_loader with a stand-in driver for gfx942, as an MI300X client would
    seed them; nothing is loaded or launched (not run on AMD)."""
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    import os

    from fuser_core import Target
    from service.client import cubin_loader
    from service.bundle import load_bundle

    saved = os.environ.get("TRITON_DEFAULT_FP_FUSION")
    os.environ.pop("TRITON_DEFAULT_FP_FUSION", None)  # as in an inference server
    driver.set_active(TargetOnlyDriver(Target.parse("gfx942")))
    # the module is shared by every bundle of this source in the worker (an h100 bundle's too), and a
    # device cache keeps the target it was made for: start and leave with none (a process has one GPU)
    module = load_bundle(bundle)._module
    fns = [v for v in vars(module).values() if isinstance(v, JITFunction)]
    for fn in fns:
        fn.device_caches.clear()
    try:
        names = cubin_loader.seed_jit_caches(module, bundle, variant)
        kept = [k for fn in fns for k in fn.device_caches[0][0].values()]
        return {"names": names, "kept": [(type(k).__name__, bytes(k.kernel), k.metadata.target.backend) for k in kept]}
    finally:
        for fn in fns:
            fn.device_caches.clear()
        driver.set_active(None)
        if saved is not None:
            os.environ["TRITON_DEFAULT_FP_FUSION"] = saved


def test_the_loader_seeds_stored_hsaco_kernels_behind_the_same_interface(mi300x_bundle, gfx942, compile_pool):
    """Not run on AMD: the JIT warm-up binds and keys the module's launches for gfx942 and keeps
    a CompiledKernel holding each stored hsaco; loading and launching it needs a ROCm GPU."""
    import triton

    from service.client import cubin_loader

    if not cubin_loader.supports(triton.__version__):
        pytest.skip(f"service.client.cubin_loader does not know Triton {triton.__version__}'s internals")
    seen = compile_pool._pool.submit(_seed_hsaco, mi300x_bundle, gfx942).result()
    assert seen["names"] == [k["name"] for k in gfx942["kernels"]]
    assert sorted(seen["kept"]) == sorted(("StoredKernel", base64.b64decode(k["hsaco"]), "hip")
                                          for k in gfx942["kernels"])


def test_make_variant_names_the_arch_of_artifacts_it_cannot_place(gfx942):
    with pytest.raises(BundleError, match="arch: 'rdna3' is not a GPU arch"):
        make_variant({"arch": "rdna3", "kernels": []})


def test_a_model_tuned_mi300x_job_yields_a_bundle_carrying_an_amdgpu_elf_covered_by_its_sha256(db_url, sessions):
    """Issue 25, must show: a job with "target": "mi300x", tuned with the model measurer by the
    worker, stores its kernel's hsaco (compiled on this host for gfx942) beside the bundle; the
    bundle served with binaries carries the AMDGPU ELF, and one byte changed fails verification."""
    from service.store import job_queue, kernel_cache
    from service.api import create_app
    from service.settings import get_settings
    from service.tuning_request import tuning_request
    from service.worker import run_worker

    raw = load_catalog()["safe_softmax"]
    spec = load_spec(raw)
    with sessions() as s:
        job, created = job_queue.submit_job(s, tuning_request(spec, json.dumps(raw), {"m": 4, "n": 64}, "float32",
                                                              "mi300x", "model", 4, 600))
        assert created
    settings = get_settings(db_url=db_url, lease_seconds=10.0, heartbeat_seconds=0.2)
    assert run_worker(db_url, measurer="model", target="mi300x", once=True, worker_id="w-amd", settings=settings) == 1
    with sessions() as s:
        job = job_queue.get_job(s, job.id)
        assert job.status == "succeeded", job.error
        kernel = kernel_cache.get_kernel(s, job.kernel_id)
        assert kernel.target == "mi300x"
    with TestClient(create_app(get_settings(db_url=db_url))) as http:
        body = http.get(f"/v1/kernels/{kernel.id}/bundle", params={"format": 3})
    bundle = body.json()
    verify_bundle(bundle)
    assert body.headers["etag"] == f'"{bundle["sha256"]}"' and bundle_v1(bundle)["sha256"] == kernel.bundle_sha256
    [(version, variant)] = bundle["binaries"]["gfx942"].items()
    assert list(bundle["binaries"]) == ["gfx942"] and variant["binary_kind"] == "hsaco"
    hsaco = base64.b64decode(variant["kernels"][0]["hsaco"])
    assert elf_machine(hsaco) == EM_AMDGPU
    assert all(f"def {k['name']}(" in bundle["triton_source"] for k in variant["kernels"])
    tampered = copy.deepcopy(bundle)
    entry = tampered["binaries"]["gfx942"][version]["kernels"][0]
    changed = bytearray(hsaco)
    changed[len(changed) // 3] ^= 0x40
    entry["hsaco"] = base64.b64encode(bytes(changed)).decode()
    with pytest.raises(BundleError, match="sha256: the bundle hashes to"):
        verify_bundle(tampered)
    tampered["sha256"] = bundle_sha256(tampered)
    with pytest.raises(BundleError, match=r"kernels\[0\]\.hsaco: .* never loaded"):
        verify_bundle(tampered)
