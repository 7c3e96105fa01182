"""The dashboard's LaTeX and generated source through a real ``foldwise serve`` (uvicorn with
httptools and uvloop), computed in the derivations' child processes (service/dashboard/compute.py):
answers of tens of kilobytes come back whole through the child's pipe under uvloop, and a second
ask is answered from what was kept."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support.servers import LiveServer


@pytest.fixture()
def server(tmp_path: Path):
    live = LiveServer(f"sqlite:///{tmp_path / 'foldwise.db'}", tmp_path)
    yield live
    live.stop()


def test_math_and_source_through_a_real_server(server: LiveServer) -> None:
    with httpx.Client(base_url=server.base, timeout=120) as http:
        job = http.post("/v1/jobs", json={"spec": "attention_causal", "shape": {"b": 1, "h": 2, "m": 40, "n": 40,
                                                                               "d": 16, "e": 16},
                                          "dtype": "float16", "target": "h100", "measurer": "model",
                                          "budget": {"trials": 1}})
        assert job.status_code in (200, 201, 202), job.text
        spec_hash = job.json()["spec_hash"]
        math = http.get(f"/v1/specs/{spec_hash}/math")
        assert math.status_code == 200, server.log()
        assert [r["name"] for r in math.json()["reductions"]] and math.json()["certificate"]["trials"] > 0
        source = http.get(f"/v1/specs/{spec_hash}/source", params={"strategy": "split_fused"})
        assert source.status_code == 200, server.log()
        assert source.json()["strategy"] == "split_fused" and "@triton.jit" in source.json()["source"]
        assert len(source.content) > 16_000  # past the size uvloop's non-blocking pipe read broke at (issue 37, 1)
        assert http.get(f"/v1/specs/{spec_hash}/source", params={"strategy": "split_fused"}).json() == source.json()
        bad = http.get(f"/v1/specs/{spec_hash}/source", params={"strategy": "warp_magic"})
        assert bad.status_code == 422 and "unknown strategy" in bad.json()["detail"]
