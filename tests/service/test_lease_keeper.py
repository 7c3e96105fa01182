"""The lease's heartbeat (service.worker.recording.LeaseKeeper) when the search holds the GIL.

The keeper renews from its own thread, so a search that holds the GIL (an import's C start-up,
a long C call) delays the beat; past half a lease the keeper says so, with where the search was.
"""

from __future__ import annotations

import json
import logging
import time

from fuser_core.spec import load_spec
from service.store import job_queue
from service.tuning_request import tuning_request
from service.worker.recording import LeaseKeeper
from tests.support.catalog import load_catalog

RAW = load_catalog()["safe_softmax"]


def hold_the_gil(seconds: float) -> None:
    """A C call that never releases the GIL (builtin sum over a range), sized to ``seconds``."""
    t0 = time.perf_counter()
    sum(range(1_000_000))
    per_item = (time.perf_counter() - t0) / 1_000_000
    sum(range(int(seconds / per_item)))


def test_a_late_beat_is_logged_with_where_the_search_was(db_url, sessions, caplog) -> None:
    with sessions() as s:
        request = tuning_request(load_spec(RAW), json.dumps(RAW), {"m": 4, "n": 64}, "float32", "h100", "model", 4, 60)
        job, _ = job_queue.submit_job(s, request)
        job_queue.register_worker(s, "w-busy", hostname="h", gpu_name=None, target="h100", measurer="model",
                                  versions={})
        assert job_queue.claim_job(s, "w-busy", target="h100", measurer="model", lease_seconds=1.0).id == job.id
    keeper = LeaseKeeper(sessions, job.id, "w-busy", lease_s=1.0, every=0.05)
    with caplog.at_level(logging.WARNING, logger="foldwise.worker"):
        keeper.start()
        time.sleep(0.3)
        hold_the_gil(1.2)  # past half the lease even if the host's speed halves meanwhile
        time.sleep(0.3)
        keeper.stop()
    late = [r for r in caplog.records if r.msg == "lease renewal late"]
    assert late and all(r.job_id == job.id and r.lease_s == 1.0 and r.since_last_s > 0.5 for r in late)
    # the search's line: in the call that held the GIL, or just after it
    assert any(r.search_at.startswith(__file__) for r in late), [r.search_at for r in late]
    assert not keeper.lost and not keeper.cancel  # nobody took the job meanwhile: renewed, still held
