"""fuser_core.host_faults: a full disk told apart from a kernel's failure, and cache writes that
leave nothing behind when the disk cannot take them (issue 37, 5)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from fuser_core import is_host_fault
from fuser_core.host_faults import write_cache_file


def test_a_full_disk_is_read_from_an_exception_chain_or_from_text() -> None:
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    try:
        try:
            raise full
        except OSError as err:
            raise RuntimeError("compiling kernel k failed") from err
    except RuntimeError as wrapped:
        assert is_host_fault(wrapped)
    assert is_host_fault(OSError(errno.EDQUOT, "quota"))
    assert is_host_fault("k: does not compile: [Errno 28] No space left on device: '/c/k.py'")
    assert not is_host_fault("k: does not compile: out of shared memory")
    assert not is_host_fault(OSError(errno.EACCES, os.strerror(errno.EACCES)))
    assert not is_host_fault(None)


def test_a_cache_write_the_disk_refuses_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "entry.json"
    assert write_cache_file(target, "{}") is None and target.read_text() == "{}"
    real = Path.write_text

    def full(self: Path, data: str, *args, **kwargs):
        real(self, data[:1], *args, **kwargs)  # a partial write, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", full)
    err = write_cache_file(tmp_path / "other.json", "{\"a\": 1}")
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry.json"]  # no .tmp, no partial entry


def test_a_compile_that_met_a_full_disk_is_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The request cache keeps no build whose kernel failed for the disk: asked again once there
    is room, it compiles."""
    from fuser_core.codegen import gpu_compile

    monkeypatch.setattr(gpu_compile, "_cache_dir", lambda: tmp_path)
    bad = gpu_compile.ModuleBuild("streaming_fused", {}, kernels=(gpu_compile.KernelBuild(
        kernel="k", ok=False, error="k: [Errno 28] No space left on device"),))
    gpu_compile.store_module("a" * 64, bad)
    assert gpu_compile.cached_module("a" * 64) is None
    good = gpu_compile.ModuleBuild("streaming_fused", {}, kernels=(gpu_compile.KernelBuild(kernel="k", ok=True),))
    gpu_compile.store_module("b" * 64, good)
    assert gpu_compile.cached_module("b" * 64) is not None
