"""What the API's event loop is spared per request (issue 26: a cheap GET stays fast while
derivations are refused; benchmarks/derivation_flood.py measures it):

- no dependency of these routes runs in the thread pool (FastAPI runs a plain ``def``
  dependency there: a thread hop, and a wait for the GIL back while another thread computes,
  on every request);
"""

from __future__ import annotations

import fastapi.dependencies.utils
from fastapi.testclient import TestClient

from service.api import create_app
from service.settings import get_settings
from tests.support.catalog import load_catalog


def test_no_dependency_runs_in_the_thread_pool(db_url, monkeypatch) -> None:
    hops: list[str] = []
    real = fastapi.dependencies.utils.run_in_threadpool

    async def counted(call, *args, **kwargs):
        hops.append(getattr(call, "__qualname__", repr(call)))
        return await real(call, *args, **kwargs)

    monkeypatch.setattr(fastapi.dependencies.utils, "run_in_threadpool", counted)
    with TestClient(create_app(get_settings(db_url=db_url))) as c:
        assert c.get("/healthz").status_code == 200
        assert c.get("/v1/jobs").status_code == 200
        assert c.get("/v1/workers").status_code == 200
        assert c.post("/v1/derivations", json={"spec": load_catalog()["safe_softmax"]}).status_code == 200
    assert hops == [], hops
