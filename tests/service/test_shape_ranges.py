"""Kernels for shape ranges (issue 24, item 3): a range job, its buckets, the server's lookup
inside a range, the client's per-call bucket pick with no request, and nearest shapes that
honour ``size_limits``.

The end-to-end test runs the service's app in-process (TestClient) with a worker thread on the
model measurer (what CI has: no GPU), and kernels through Triton's interpreter."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from tests.support.catalog import load_catalog

from service.errors import InvalidRequest
from service.shape_ranges import MAX_BUCKETS, default_buckets, pick_bucket
from service.tuning_request import tuning_request

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

RMSNORM = load_catalog()["rmsnorm"]


def rmsnorm_spec():
    from fuser_core.spec import load_spec

    return load_spec(RMSNORM)


def request(shape, **kw):
    return tuning_request(rmsnorm_spec(), RMSNORM, shape, "float32", "h100", "model", 2, 60.0, **kw)


# ----------------------------------------------------------------------------- the rule and validation


def test_default_buckets_are_powers_of_two_plus_max() -> None:
    assert default_buckets(1, 16384) == tuple(2 ** i for i in range(15))
    assert default_buckets(3, 100) == (4, 8, 16, 32, 64, 100)
    assert default_buckets(5, 7) == (7,)  # no power of two inside: max alone


def test_a_range_request_is_canonical_with_its_buckets() -> None:
    req = request({"t": {"min": 1, "max": 16384}, "c": 64})
    assert req.is_range and len(req.buckets) == 15
    # rmsnorm's canonical dims: c -> d0, t -> d1
    assert req.shape == {"d0": 64, "d1": {"min": 1, "max": 16384, "buckets": [2 ** i for i in range(15)]}}
    assert req.buckets[0] == {"d0": 64, "d1": 1} and req.buckets[-1] == {"d0": 64, "d1": 16384}
    assert req.shape_key.startswith("d0=64,d1=1..16384[1;2;4;")
    other = request({"t": {"min": 1, "max": 16384, "buckets": [16384, 1, 64]}, "c": 64})
    assert other.shape["d1"]["buckets"] == [1, 64, 16384] and other.dedupe_key != req.dedupe_key
    assert request({"t": 8, "c": 64}).buckets == ()  # a plain shape is as before


@pytest.mark.parametrize(("shape", "loc", "message"), [
    ({"t": {"max": 8}, "c": 64}, ("shape", "t", "min"), "missing"),
    ({"t": {"min": 0, "max": 8}, "c": 64}, ("shape", "t", "min"), "integer from 1"),
    ({"t": {"min": 1, "max": True}, "c": 64}, ("shape", "t", "max"), "integer"),
    ({"t": {"min": 9, "max": 8}, "c": 64}, ("shape", "t", "max"), "at least min"),
    ({"t": {"min": 1, "max": 8, "step": 2}, "c": 64}, ("shape", "t", "step"), "unknown field"),
    ({"t": {"min": 1, "max": 8, "buckets": []}, "c": 64}, ("shape", "t", "buckets"), "non-empty"),
    ({"t": {"min": 1, "max": 8, "buckets": [2, 9]}, "c": 64}, ("shape", "t", "buckets", 1), "within min..max"),
    ({"t": {"min": 1, "max": 8, "buckets": [2, 2, 8]}, "c": 64}, ("shape", "t", "buckets", 1), "twice"),
    ({"t": {"min": 1, "max": 8, "buckets": [2, 4]}, "c": 64}, ("shape", "t", "buckets"), "must include max"),
    ({"t": {"min": 1, "max": 8, "buckets": list(range(1, 34))}, "c": 64}, ("shape", "t", "buckets"), "at most 32"),
    ({"t": {"min": 1, "max": 2 ** 40}, "c": 64}, ("shape",), f"at most {MAX_BUCKETS}"),
    ({"t": {"min": 1, "max": 64}, "c": {"min": 1, "max": 64}}, ("shape",), "49 buckets in all"),
])
def test_bad_ranges_name_the_field(shape, loc, message) -> None:
    with pytest.raises(InvalidRequest, match=message) as err:
        request(shape)
    assert err.value.loc == loc


def test_range_limits_and_bucket_sizes_are_checked() -> None:
    from service.tuning_request import Limits

    with pytest.raises(InvalidRequest, match="from 1 to 1000") as err:
        request({"t": {"min": 1, "max": 4096}, "c": 64}, limits=Limits(max_dim=1000))
    assert err.value.loc == ("shape", "t", "max")
    with pytest.raises(InvalidRequest, match="elements") as err:  # the largest bucket's tensors are checked
        request({"t": {"min": 1, "max": 2 ** 20}, "c": 64}, limits=Limits(max_elements=2 ** 24))
    assert err.value.loc[0] == "shape"


def test_the_api_answers_422_naming_the_range_field(tmp_path) -> None:
    from fastapi.testclient import TestClient

    from service.api import create_app
    from service.store.db import upgrade
    from service.settings import get_settings

    url = f"sqlite:///{tmp_path / 'foldwise.db'}"
    upgrade(url)
    with TestClient(create_app(get_settings(db_url=url))) as http:
        r = http.post("/v1/jobs", json={"spec": RMSNORM, "shape": {"t": {"min": 1, "max": 8, "buckets": [2]},
                                                                     "c": 64}})
        assert r.status_code == 422, r.text
        assert any("shape.t.buckets" in str(e.get("field", "")) or e.get("loc") == ["shape", "t", "buckets"]
                   for e in r.json()["errors"]), r.json()
        r = http.post("/v1/jobs", json={"spec": RMSNORM, "shape": {"t": 8, "c": 64}, "batch_invariant": True})
        assert r.status_code == 422 and [e["loc"] for e in r.json()["errors"]] == [["batch_invariant"]], r.text


def test_pick_bucket_rounds_up() -> None:
    shape = {"d0": 64, "d1": {"min": 1, "max": 100, "buckets": [1, 8, 64, 100]}}
    assert [pick_bucket(shape, {"d0": 64, "d1": t})["d1"] for t in (1, 2, 8, 9, 64, 65, 100)] == \
        [1, 8, 8, 64, 64, 100, 100]
    assert pick_bucket(shape, {"d0": 64, "d1": 101}) is None  # above max
    assert pick_bucket(shape, {"d0": 32, "d1": 8}) is None  # another fixed size


# ----------------------------------------------------------------------------- end to end


BUCKETS = [1, 64, 1024, 16384]
C = 64  # the fixed hidden size (small: the interpreter runs t = 16384 rows)


class Counting(httpx.BaseTransport):
    """Counts the requests a TestClient sends (wraps its transport)."""

    def __init__(self, inner: httpx.BaseTransport):
        self.inner, self.count = inner, 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.count += 1
        return self.inner.handle_request(request)


def test_a_range_job_for_rmsnorm_serves_every_size_without_a_request(tmp_path) -> None:
    """A range job for rmsnorm over t in [1, 16384] (c = 64, 1 trial per bucket, model measurer)
    run by a real worker; then one get() and calls at t = 1, 37, 1000, 16384: each runs the
    smallest bucket >= t, matches a float64 reference, and costs no request. Four given buckets,
    not the default fifteen: each bucket's trial compiles for sm_90 on the CPU (about 5 s here);
    benchmarks/range_job_rmsnorm.py runs the default buckets."""
    import torch
    from fastapi.testclient import TestClient

    from service.api import create_app
    from service.client import KernelCache, KernelNotFound
    from service.store.db import upgrade
    from service.client.range_kernel import RangeKernel
    from service.settings import get_settings
    from service.worker import run_worker

    url = f"sqlite:///{tmp_path / 'foldwise.db'}"
    upgrade(url)
    settings = get_settings(db_url=url, lease_seconds=30.0, heartbeat_seconds=0.5, compile_binaries=False)
    stop = threading.Event()
    with TestClient(create_app(settings)) as http:
        body = {"spec": RMSNORM, "shape": {"t": {"min": 1, "max": 16384, "buckets": BUCKETS}, "c": C},
                "measurer": "model",
                "budget": {"trials": 1, "seconds": 600}}
        job = http.post("/v1/jobs", json=body).json()
        assert job["status"] == "queued" and job["progress"]["trials_budget"] == 4, job
        worker = threading.Thread(target=run_worker, args=(url,), daemon=True,
                                  kwargs={"measurer": "model", "target": "h100", "stop": stop, "poll_s": 0.05,
                                          "settings": settings})
        worker.start()
        try:
            deadline = time.monotonic() + 120
            while (view := http.get(f"/v1/jobs/{job['id']}").json())["status"] in ("queued", "running"):
                assert time.monotonic() < deadline, view
                time.sleep(0.2)
        finally:
            stop.set()
            worker.join(30)
        assert view["status"] == "succeeded", view
        assert view["progress"]["trials_done"] == 4
        # the view lists the buckets (canonical names: t is d1), and each trial's number says its bucket
        assert [b["d1"] for b in view["range"]["buckets"]] == BUCKETS, view["range"]
        assert view["range"]["display_buckets"] == [{"t": b, "c": C} for b in BUCKETS]  # and in the spec's own
        stride = view["range"]["trial_number_stride"]
        trials = http.get(f"/v1/jobs/{job['id']}/trials").json()["trials"]
        assert sorted(t["number"] // stride for t in trials) == [0, 1, 2, 3]
        plain = http.post("/v1/jobs", json={**body, "shape": {"t": 37, "c": C}}).json()
        assert plain["range"] is None

        # the server's lookup inside the range: the bucket's kernel, marked, with every bucket
        found = http.get("/v1/kernels", params={"spec_hash": job["spec_hash"], "shape": f"t=37,c={C}"}).json()
        assert found["shape"] == {"d0": C, "d1": 64} and found["exact_match"] is False
        assert [b["shape"]["d1"] for b in found["range"]["buckets"]] == BUCKETS
        assert http.get("/v1/kernels", params={"spec_hash": job["spec_hash"], "shape": f"t=16384,c={C}"}
                        ).json()["exact_match"] is True
        # outside the range (c differs): no kernel holds it exactly, and nothing is invented
        outside = http.get("/v1/kernels", params={"spec_hash": job["spec_hash"], "shape": "t=37,c=4"}).json()
        assert "range" not in outside and outside["exact_match"] is False

        counting = Counting(http._transport)
        http._transport = counting
        cache = KernelCache("http://testserver", cache_dir=tmp_path / "client", http_client=http)
        kernel = cache.get(RMSNORM, {"t": 37, "c": C})  # no allow_nearest
        assert isinstance(kernel, RangeKernel)
        first = counting.count
        assert first == 1 + len(BUCKETS)  # one lookup, one download per bucket
        torch.manual_seed(0)
        w = torch.randn(C)
        for t, bucket in ((1, 1), (37, 64), (1000, 1024), (16384, 16384)):
            x = torch.randn(t, C)
            y = kernel(x=x, w=w)["y"]
            assert kernel.last_bucket == {"c": C, "t": bucket}
            ref = (x.double() * torch.rsqrt((x.double() ** 2).mean(1, keepdim=True) + 1e-6) * w.double())
            assert y.shape == (t, C) and torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)
        # a model's [b, s, c] activation: t = b * s picks the bucket (service.bundle.leading)
        y = kernel(x=torch.randn(4, 250, C), w=w)["y"]
        assert y.shape == (4, 250, C) and kernel.last_bucket == {"c": C, "t": 1024}
        assert cache.get(RMSNORM, {"t": 1000, "c": C}) is kernel  # another shape of the range: no request
        assert counting.count == first
        # the range as one torch operator: the bucket picked inside it per call, also under
        # torch.compile(fullgraph=True) with dynamic sizes (one graph for every t)
        op = cache.torch_op(RMSNORM, {"t": 37, "c": C})
        compiled = torch.compile(lambda x: op(x=x, w=w)["y"], fullgraph=True, dynamic=True, backend="aot_eager")
        for t, bucket in ((37, 64), (1000, 1024), (3, 64)):
            x = torch.randn(t, C)
            assert torch.equal(op(x=x, w=w)["y"], kernel(x=x, w=w)["y"]) and kernel.last_bucket["t"] == bucket
            assert torch.equal(compiled(x), kernel(x=x, w=w)["y"])
        assert counting.count == first
        with pytest.raises(Exception, match="above the tuned range 1..16384"):
            kernel(x=torch.randn(16385, C), w=w)
        with pytest.raises(KernelNotFound, match="nearest"):  # outside the range: as before, not exact
            cache.get(RMSNORM, {"t": 37, "c": 4})
        cache.close()

    # a restart with the server down: the range is served from the disk cache, every shape of it
    def refused(request):
        raise httpx.ConnectError("connection refused", request=request)

    offline = KernelCache("http://testserver", cache_dir=tmp_path / "client", transport=httpx.MockTransport(refused))
    again = offline.get(RMSNORM, {"t": 1000, "c": C})
    assert isinstance(again, RangeKernel) and again is not kernel
    x = torch.randn(1000, C)
    assert torch.equal(again(x=x, w=w)["y"], kernel(x=x, w=w)["y"]) and again.last_bucket == {"c": C, "t": 1024}
    with pytest.raises(KernelNotFound, match="disk cache"):  # outside every stored range
        offline.get(RMSNORM, {"t": 37, "c": 4})
    offline.close()


# ----------------------------------------------------------------------------- nearest honours size_limits


def test_nearest_prefers_a_kernel_whose_size_limits_hold_the_shape(tmp_path) -> None:
    """Stored: safe_softmax row_resident kernels for n = 256 (holds n in a block of 256) and
    n = 512. Asked for n = 300, the nearer n = 256 cannot run it: the lookup answers n = 512."""
    from fuser_core.problem import make_problem
    from fuser_core.spec import load_spec
    from service.store import job_queue, kernel_cache
    from service.bundle_maker import make_bundle
    from service.store.db import make_engine, session_factory, upgrade

    raw = load_catalog()["safe_softmax"]
    spec = load_spec(raw)
    url = f"sqlite:///{tmp_path / 'foldwise.db'}"
    upgrade(url)
    sessions = session_factory(make_engine(url))
    for n in (256, 512):
        shape = {"m": 4, "n": n}
        bundle = make_bundle(make_problem(spec, shape, "float32"), target="h100", strategy="row_resident",
                             config={"blocks": {"n": n}}, measured={"time_ms": 0.01, "measurer": "model"})
        assert bundle["size_limits"] == {"d1": n}, bundle["size_limits"]
        req = tuning_request(spec, raw, shape, "float32", "h100", "model", 1, 60.0)
        with sessions() as session:
            job, _ = job_queue.submit_job(session, req)
            claimed = job_queue.claim_job(session, "w", target="h100", measurer="model", lease_seconds=60)
            job_queue.finish_job(session, claimed.id, "w", bundle=bundle, kernel_fields={})
    with sessions() as session:
        find = kernel_cache.find_kernel
        key = {"spec_hash": req.spec_hash, "target": "h100", "dtype": "float32"}
        kernel, exact = find(session, **key, shape={"d0": 4, "d1": 300})
        assert kernel.shape == {"d0": 4, "d1": 512} and not exact
        kernel, exact = find(session, **key, shape={"d0": 4, "d1": 200})  # the nearer one holds 200
        assert kernel.shape == {"d0": 4, "d1": 256} and not exact
        assert find(session, **key, shape={"d0": 4, "d1": 600}) is None  # none can run it


# ----------------------------------------------------------------------------- batch-invariant ranges (issue 36, 5)


def test_a_batch_invariant_request_is_one_bucket_at_max() -> None:
    from service.shape_ranges import one_kernel, range_view

    req = request({"t": {"min": 1, "max": 64}, "c": 64}, batch_invariant=True)
    assert req.shape["d1"] == {"min": 1, "max": 64, "buckets": [64]} and req.buckets == ({"d0": 64, "d1": 64},)
    assert one_kernel(req.shape) and range_view(req.shape)["batch_invariant"] is True
    # the same content as buckets [max]: the same job; the default buckets are another, not invariant
    assert req.dedupe_key == request({"t": {"min": 1, "max": 64, "buckets": [64]}, "c": 64}).dedupe_key
    several = request({"t": {"min": 1, "max": 64}, "c": 64})
    assert not one_kernel(several.shape) and range_view(several.shape)["batch_invariant"] is False


@pytest.mark.parametrize(("shape", "loc", "message"), [
    ({"t": {"min": 1, "max": 64, "buckets": [8, 64]}, "c": 64}, ("shape", "t", "buckets"), "one kernel"),
    ({"t": 37, "c": 64}, ("batch_invariant",), "needs a range"),
])
def test_a_batch_invariant_request_refuses_buckets_and_plain_shapes(shape, loc, message) -> None:
    with pytest.raises(InvalidRequest, match=message) as err:
        request(shape, batch_invariant=True)
    assert err.value.loc == loc


def test_a_batch_invariant_range_gives_a_row_the_same_bits_at_every_batch_size(tmp_path) -> None:
    """A batch-invariant range job for rmsnorm over t in [1, 64] (c = 64), submitted by the client's
    tune() and run by a real worker: the row computed alone (t = 1) and inside batches of 37 and
    64 rows is bitwise the same. The lookup serves it only from a range one kernel serves whole:
    a shape held by a range of several buckets is not found for a batch-invariant get()."""
    import torch
    from fastapi.testclient import TestClient

    from service.api import create_app
    from service.client import KernelCache, KernelNotFound
    from service.store.db import upgrade
    from service.client.range_kernel import RangeKernel
    from service.settings import get_settings
    from service.worker import run_worker

    url = f"sqlite:///{tmp_path / 'foldwise.db'}"
    upgrade(url)
    settings = get_settings(db_url=url, lease_seconds=30.0, heartbeat_seconds=0.5, compile_binaries=False)
    stop = threading.Event()
    with TestClient(create_app(settings)) as http:
        worker = threading.Thread(target=run_worker, args=(url,), daemon=True,
                                  kwargs={"measurer": "model", "target": "h100", "stop": stop, "poll_s": 0.05,
                                          "settings": settings})
        worker.start()
        cache = KernelCache("http://testserver", cache_dir=tmp_path / "client", http_client=http)
        try:
            kernel = cache.tune(RMSNORM, {"t": {"min": 1, "max": 64}, "c": C}, batch_invariant=True, trials=1,
                                measurer="model", timeout=120, progress=False)
            # a range of several buckets over other sizes, for the lookup's filter below
            several = http.post("/v1/jobs", json={"spec": RMSNORM, "shape": {"t": {"min": 65, "max": 128,
                                                                                   "buckets": [100, 128]}, "c": C},
                                                 "measurer": "model", "budget": {"trials": 1, "seconds": 600}}).json()
            deadline = time.monotonic() + 120
            while (view := http.get(f"/v1/jobs/{several['id']}").json())["status"] in ("queued", "running"):
                assert time.monotonic() < deadline, view
                time.sleep(0.2)
            assert view["status"] == "succeeded" and view["range"]["batch_invariant"] is False, view
        finally:
            stop.set()
            worker.join(30)
        assert isinstance(kernel, RangeKernel)
        assert cache.get(RMSNORM, {"t": 37, "c": C}, batch_invariant=True) is kernel
        found = http.get("/v1/kernels", params={"spec_hash": several["spec_hash"], "shape": f"t=37,c={C}",
                                                "batch_invariant": "true"}).json()
        assert found["range"]["batch_invariant"] is True and found["range"]["shape"]["d1"]["buckets"] == [64]

        torch.manual_seed(0)
        w = torch.randn(C)
        x = torch.randn(64, C) * torch.logspace(-3, 3, 64).unsqueeze(1)  # rows of very different scales
        whole = kernel(x=x, w=w)["y"]
        part = kernel(x=x[:37], w=w)["y"]
        for row in (0, 5, 36):
            alone = kernel(x=x[row:row + 1], w=w)["y"]
            assert kernel.last_bucket == {"c": C, "t": 64}  # every size runs the one kernel
            assert torch.equal(alone[0], part[row]) and torch.equal(alone[0], whole[row]), row
        ref = x.double() * torch.rsqrt((x.double() ** 2).mean(1, keepdim=True) + 1e-6) * w.double()
        assert torch.allclose(whole.double(), ref, rtol=1e-5, atol=1e-6)

        # t = 100 is held only by the range of two buckets: not served to a batch-invariant get()
        assert isinstance(cache.get(RMSNORM, {"t": 100, "c": C}), RangeKernel)
        with pytest.raises(KernelNotFound, match="batch-invariant"):
            cache.get(RMSNORM, {"t": 100, "c": C}, batch_invariant=True)
        cache.close()


def test_a_range_jobs_trials_in_all_are_within_the_servers_limit() -> None:
    """Issue 37, 6: budget.trials runs per bucket, so 32 buckets x 1,000 trials was one request for
    32,000 trials; the limit is on the job's trials in all."""
    from service.tuning_request import Limits

    limits = Limits(max_trials=1000)
    spec = rmsnorm_spec()
    ok = tuning_request(spec, RMSNORM, {"t": {"min": 1, "max": 8}, "c": 64}, "float32", "h100", "model", 250, 60.0,
                        limits=limits)
    assert len(ok.buckets) == 4
    with pytest.raises(InvalidRequest, match="4 buckets x 251 trials = 1004") as err:
        tuning_request(spec, RMSNORM, {"t": {"min": 1, "max": 8}, "c": 64}, "float32", "h100", "model", 251, 60.0,
                       limits=limits)
    assert err.value.loc == ("budget", "trials")
