"""Issue 25: the target and backend seam on the compile side (fuser_core.targets,
fuser_core.codegen.backends): targets parsed from arch text, the backend each picks, an AMD
compile of a generated catalog kernel giving an hsaco whose metadata the backend reads, and
the NVIDIA facts as before. Compiles run in the session's compile pool (interpreter off), on
this machine without a GPU or ROCm.
"""

from __future__ import annotations

import re
import struct

import pytest
import triton

from fuser_core.catalog import load_catalog_spec
from fuser_core.codegen.backends import CudaBackend, HipBackend, backend_for, bind_launch
from fuser_core.codegen.backends.hsaco import EM_AMDGPU, HsacoError, elf_machine, hsaco_kernels, unpack_msgpack
from fuser_core.codegen.gpu_compile import CompileRequest
from fuser_core.targets import Target

SOFTMAX = ("safe_softmax", {"m": 64, "n": 4096}, {"x": "float16"})


def softmax_request(arch: str, strategy: str = "split_fused") -> CompileRequest:
    name, shape, dtypes = SOFTMAX
    return CompileRequest(load_catalog_spec(name), shape, dtypes, strategy, None, Target.parse(arch))


# ---------------------------------------------------------------- targets


@pytest.mark.parametrize(("text", "target"), [
    ("sm_90", Target("cuda", 90, 32)), ("SM_90a", Target("cuda", 90, 32)), (" sm_100a ", Target("cuda", 100, 32)),
    ("sm_89", Target("cuda", 89, 32)), ("gfx942", Target("hip", "gfx942", 64)), ("gfx950", Target("hip", "gfx950", 64)),
])
def test_arch_text_parses_to_its_target(text, target):
    assert Target.parse(text) == target
    assert Target.parse(target.arch_name) == target  # the text a target writes parses back to it


@pytest.mark.parametrize("text", ["v100", "sm_9", "sm_", "gfx94", "gfx94210", "h100", "", "sm_90b", "cuda:90"])
def test_arch_text_that_names_no_arch_is_refused_naming_it(text):
    with pytest.raises(ValueError, match="not a GPU arch") as err:
        Target.parse(text)
    assert repr(text.strip().lower()[:40]) in str(err.value) or repr(text[:40]) in str(err.value)


@pytest.mark.parametrize(("args", "message"), [
    (("rocm", "gfx942", 64), "unknown backend 'rocm'"),
    (("cuda", "90", 32), "not a cuda arch: '90'"),
    (("cuda", 30, 32), "not a cuda arch: 30"),
    (("hip", 942, 64), "not a hip arch: 942"),
    (("hip", "gfx942", 32), "hip targets have warp size 64, got 32"),
    (("cuda", 90, 64), "cuda targets have warp size 32, got 64"),
])
def test_a_target_that_cannot_exist_is_refused(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Target(*args)


@pytest.mark.parametrize("capability", [80, 89, 90, 100])
def test_a_cubins_arch_is_the_one_tritons_ptxas_targets(capability):
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    assert Target("cuda", capability, 32).binary_arch == sm_arch_from_capability(capability)


def test_each_backend_is_picked_by_its_target():
    cuda, hip = backend_for(Target.parse("sm_80")), backend_for(Target.parse("gfx950"))
    assert isinstance(cuda, CudaBackend) and (cuda.binary_kind, cuda.assembly_kind) == ("cubin", "ptx")
    assert isinstance(hip, HipBackend) and (hip.binary_kind, hip.assembly_kind) == ("hsaco", "amdgcn")
    with pytest.raises(TypeError, match="takes a fuser_core.targets.Target"):
        backend_for("sm_90")


def test_a_request_with_a_bare_capability_is_refused():
    name, shape, dtypes = SOFTMAX
    with pytest.raises(TypeError, match=r"CompileRequest.target takes a fuser_core.Target .* got int 90"):
        CompileRequest(load_catalog_spec(name), shape, dtypes, "split_fused", None, 90)
    assert CompileRequest(load_catalog_spec(name), shape, dtypes, "split_fused").target == Target("cuda", 90, 32)


def test_a_triton_without_the_private_binding_api_is_named():
    """Triton's JITFunction._pack_args binds launches: one without it fails with its version."""
    class NoPack:  # a JITFunction as a later Triton might have it
        signature, params = None, []

    with pytest.raises(RuntimeError, match=rf"Triton {re.escape(triton.__version__)} has no JITFunction._pack_args"):
        bind_launch(NoPack(), (), {}, None)


# ---------------------------------------------------------------- the hsaco reader


def test_the_messagepack_reader_reads_every_type_the_metadata_uses():
    data = (b"\x86" + b"\xa1a" + b"\x93\x01\xff\xcd\x01\x00" + b"\xa1b" + b"\xc3" + b"\xa1c" + b"\xc0"
            + b"\xa1d" + b"\xd9\x03xyz" + b"\xa1e" + b"\xcb" + struct.pack(">d", 2.5) + b"\xa1f" + b"\xd2"
            + struct.pack(">i", -70000))
    value, end = unpack_msgpack(data)
    assert value == {"a": [1, -1, 256], "b": True, "c": None, "d": "xyz", "e": 2.5, "f": -70000} and end == len(data)
    with pytest.raises(HsacoError, match="0xc7"):
        unpack_msgpack(b"\xc7\x01\x00\x00")


def test_a_cubin_is_not_read_as_an_hsaco(compile_pool):
    [artifacts] = compile_pool.artifacts([softmax_request("sm_80", "streaming_fused")])
    cubin = artifacts["kernels"][0]["cubin"]
    assert elf_machine(cubin) == 190  # EM_CUDA
    with pytest.raises(HsacoError, match="not an AMDGPU ELF"):
        hsaco_kernels(cubin)
    assert elf_machine(b"not an elf") is None


# ---------------------------------------------------------------- compiling for AMD


@pytest.fixture(scope="module")
def mi300x(compile_pool):
    """safe_softmax's split kernel and its combine kernel, compiled for gfx942 (MI300X)."""
    [artifacts] = compile_pool.artifacts([softmax_request("gfx942")])
    return artifacts


def test_an_amd_compile_gives_an_hsaco_per_kernel(mi300x):
    assert mi300x["target"] == {"backend": "hip", "arch": "gfx942", "warp_size": 64}
    assert mi300x["arch"] == "gfx942" and mi300x["binary_kind"] == "hsaco" and mi300x["capability"] is None
    assert mi300x["triton_version"] == triton.__version__ and "ptxas_version" not in mi300x
    assert mi300x["compiler_version"].startswith("LLD ")  # Triton's bundled LLVM linked it
    assert [k["name"] for k in mi300x["kernels"]] == ["safe_softmax_split_fused_kernel",
                                                      "safe_softmax_split_fused_combine_kernel"]
    for k in mi300x["kernels"]:
        hsaco = k["hsaco"]
        assert hsaco[:4] == b"\x7fELF" and struct.unpack_from("<H", hsaco, 18)[0] == EM_AMDGPU == 224
        assert "cubin" not in k and "ptx" not in k
        assert re.search(r'^\s*\.amdgcn_target "[\w.-]*-gfx942"$', k["amdgcn"], re.M)  # the triple's form varies by LLVM
        assert k["metadata"]["name"] == k["name"] and k["metadata"]["target"]["arch"] == "gfx942"
        assert k["registers"] > 0 and k["spill_bytes"] == 0 and k["shared_bytes"] >= k["metadata"]["shared"]


def test_the_hsacos_metadata_is_what_the_assembly_prints(mi300x):
    """The resources read from the binary's note equal the YAML metadata printed at the end of the
    amdgcn text (two renderings of one map: checks the ELF and MessagePack reading)."""
    for k in mi300x["kernels"]:
        [note] = hsaco_kernels(k["hsaco"]).values()
        printed = dict(re.findall(r"^\s+(\.\w+):\s+(\d+)\s*$", k["amdgcn"].split("amdhsa.kernels:")[-1], re.M))
        for field in (".vgpr_count", ".sgpr_count", ".group_segment_fixed_size", ".private_segment_fixed_size",
                      ".vgpr_spill_count", ".wavefront_size"):
            assert note[field] == int(printed[field]), field
        assert k["registers"] == note[".vgpr_count"] and k["spill_bytes"] == note[".private_segment_fixed_size"]
        assert k["shared_bytes"] == k["metadata"]["shared"] + note[".group_segment_fixed_size"]
        assert note[".wavefront_size"] == 64


def test_the_compile_gate_facts_for_amd_and_nvidia_differ_by_target(compile_pool):
    """One module for sm_90 and for gfx942/gfx950 in the same pool: each answer is its own target's
    (the compile cache's key holds the whole target), AMD with SGPRs and no stack/local split."""
    requests = [softmax_request(arch, "streaming_fused") for arch in ("sm_90", "gfx942", "gfx950", "sm_90")]
    sm90, gfx942, gfx950, again = compile_pool.compile(requests)
    assert all(b.ok for b in (sm90, gfx942, gfx950))
    [n], [a], [b] = sm90.kernels, gfx942.kernels, gfx950.kernels
    assert n.sgprs is None and n.stack_bytes is not None and n.spill_bytes == n.stack_bytes + n.local_bytes
    assert a.sgprs > 0 and b.sgprs > 0 and a.stack_bytes is None and a.registers > 0 and b.registers > 0
    assert again == sm90  # answered from the cache, the same facts


def test_nvidia_artifacts_keep_their_stored_form(compile_pool):
    """The cuda answer is the format bundles store (arch, capability, ptxas_version, cubin, ptx)
    with the target, binary kind and compiler version added."""
    [artifacts] = compile_pool.artifacts([softmax_request("sm_90", "streaming_fused")])
    assert artifacts["arch"] == "sm_90a" and artifacts["capability"] == 90 and artifacts["binary_kind"] == "cubin"
    assert artifacts["target"] == {"backend": "cuda", "arch": 90, "warp_size": 32}
    assert artifacts["ptxas_version"] == artifacts["compiler_version"] and artifacts["ptxas_version"].startswith("release ")
    [kernel] = artifacts["kernels"]
    assert set(kernel) == {"name", "cubin", "ptx", "metadata", "triton_hash", "registers", "spill_bytes", "shared_bytes"}
    assert ".target sm_90a" in kernel["ptx"] and kernel["cubin"][:4] == b"\x7fELF" and kernel["registers"] > 0
