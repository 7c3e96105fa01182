"""The dashboard's server side: static assets (vendored, cached, all resolvable, nothing external),
its JSON endpoints (derivation as LaTeX, generated source, kernel cache, catalog, auth/me) and
the scopes they need, on the real app (``service.api.create_app``, which mounts the dashboard).
The browser flow is tests/e2e/test_dashboard_browser.py.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from fuser_core.canonical import spec_hash as compute_spec_hash
from fuser_core.spec import load_spec
from service.store import job_queue
from service.api import create_app
from service.auth import create_token
from service.dashboard import STATIC_DIR
from service.store.db import make_engine, session_factory, upgrade
from service.store.models import Bundle, KernelRecord
from service.settings import get_settings
from service.tuning_request import tuning_request
from tests.support.catalog import CATALOG_DIR, load_catalog


@pytest.fixture()
def db_url(tmp_path):
    url = f"sqlite:///{tmp_path / 'dash.db'}"
    upgrade(url)
    return url


@pytest.fixture()
def db(db_url):
    engine = make_engine(db_url)
    yield session_factory(engine)
    engine.dispose()


def make_client(db_url: str, host: str = "127.0.0.1") -> TestClient:
    return TestClient(create_app(get_settings(db_url=db_url, host=host)))


@pytest.fixture()
def client(db_url):
    with make_client(db_url) as c:
        yield c


def submit(sessions, name: str, shape: dict, dtype="float32", measurer="model"):
    raw = load_catalog()[name]
    spec = load_spec(raw)
    with sessions() as s:
        request = tuning_request(spec, json.dumps(raw), shape, dtype, "h100", measurer, 10, 60.0)
        job, _ = job_queue.submit_job(s, request)
        return job


def add_kernel(sessions, job, *, time_ms: float, predicted: bool, baselines=None, strategy="streaming_fused",
               config=None, created_at=None) -> str:
    content = json.dumps({"job": job.id, "t": time_ms}).encode()
    digest = hashlib.sha256(content).hexdigest()
    with sessions() as s:
        if s.get(Bundle, digest) is None:
            s.add(Bundle(sha256=digest, content=content, size=len(content)))
            s.flush()
        k = KernelRecord(spec_hash=job.spec_hash, shape=job.shape, shape_key=job.shape_key, dtype=job.dtype,
                   target=job.target, triton_version="t", generator_version=f"g{time_ms}", strategy=strategy,
                   config=config or {"blocks": {}, "num_warps": 4, "num_stages": 2, "split": 1}, time_ms=time_ms,
                   measurer="model" if predicted else "cuda", predicted=predicted, bundle_sha256=digest,
                   job_id=job.id, baselines=baselines, created_at=created_at or datetime.now(UTC))
        s.add(k)
        s.commit()
        return k.id


# ----------------------------------------------------------------------------- static assets


def test_index_is_served_with_a_strict_policy(client):
    r = client.get("/")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "<main id=\"main\">" in r.text
    csp = r.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
    assert r.headers["cache-control"] == "no-cache"
    assert r.headers["x-content-type-options"] == "nosniff"


def _referenced_assets() -> list[str]:
    html = (STATIC_DIR / "index.html").read_text()
    refs = re.findall(r'(?:src|href)="(static/[^"]+)"', html)
    js_dir = STATIC_DIR / "js"
    for path in js_dir.rglob("*.js"):  # ES module imports, resolved like the browser does
        for rel in re.findall(r'from\s+"(\.{1,2}/[^"]+)"', path.read_text()):
            target = (path.parent / rel).resolve().relative_to(STATIC_DIR)
            refs.append(f"static/{target.as_posix()}")
    return sorted(set(refs))


def test_every_referenced_asset_is_served(client):
    refs = _referenced_assets()
    assert {"static/js/app.js", "static/vendor/katex/katex.min.js", "static/vendor/uplot/uPlot.iife.min.js",
            "static/vendor/highlight/highlight.min.js", "static/js/pages/spec.js"} <= set(refs)
    types = {".js": "javascript", ".css": "text/css", ".svg": "image/svg+xml"}
    for ref in refs:
        r = client.get("/" + ref)
        assert r.status_code == 200, ref
        assert types[Path(ref).suffix] in r.headers["content-type"], (ref, r.headers["content-type"])
    css = (STATIC_DIR / "vendor/katex/katex.min.css").read_text()
    fonts = re.findall(r"url\(([^)]+)\)", css)
    assert len(fonts) >= 20
    for font in fonts:
        r = client.get(f"/static/vendor/katex/{font}")
        assert r.status_code == 200 and r.headers["content-type"] == "font/woff2", font


def test_vendored_libraries_keep_their_licences():
    for lib, licence in (("uplot", "MIT"), ("katex", "MIT"), ("highlight", "BSD")):
        text = (STATIC_DIR / "vendor" / lib / "LICENSE").read_text()
        assert licence in text or (licence == "MIT" and "Permission is hereby granted" in text), lib
    readme = (STATIC_DIR / "vendor/README.md").read_text()
    assert "1.6.32" in readme and "0.16.47" in readme and "11.11.1" in readme


def test_our_static_files_load_nothing_from_elsewhere():
    for path in [STATIC_DIR / "index.html", STATIC_DIR / "style.css", *(STATIC_DIR / "js").rglob("*.js")]:
        text = path.read_text()
        assert not re.search(r"https?://", text), f"{path.name} names an external URL"
        assert "innerHTML" not in text or path.name == "util.js", f"{path.name} writes raw HTML"


def test_static_caching(client):
    vendor = client.get("/static/vendor/katex/katex.min.js")
    assert vendor.headers["cache-control"] == "public, max-age=86400"
    app_js = client.get("/static/js/app.js")
    assert app_js.headers["cache-control"] == "no-cache"
    again = client.get("/static/js/app.js", headers={"If-None-Match": app_js.headers["etag"]})
    assert again.status_code == 304
    assert client.get("/static/../service/dashboard/api.py").status_code == 404
    assert client.get("/static/nope.js").status_code == 404


# ----------------------------------------------------------------------------- spec math and source


@pytest.mark.parametrize("name", sorted(load_catalog()))
def test_math_for_every_catalog_spec(db, client, name):
    raw = load_catalog()[name]
    spec = load_spec(raw)
    shape = {d: 8 for d in spec.dims if not any(s.as_dim == d for s in spec.steps)}
    job = submit(db, name, shape)
    r = client.get(f"/v1/specs/{job.spec_hash}/math")
    assert r.status_code == 200, r.text
    m = r.json()
    assert m["spec_hash"] == compute_spec_hash(spec) and m["name"] == spec.name
    assert m["spec"] == raw
    assert m["certificate"]["trials"] > 0
    reductions = [s.name for s in spec.steps if s.is_reduction]
    assert [r["name"] for r in m["reductions"]] == reductions
    for red in m["reductions"]:
        assert red["definition"].startswith(red["name_tex"] + " = ")
        if red["fused"]:
            assert red["terms"] and red["update"] and red["merge"] and red["finalize"]
            for text in [red["definition"], *red["update"], *red["merge"], red["finalize"], *red["correction"]]:
                assert text.count("{") == text.count("}"), text  # well-formed LaTeX groups
                assert "[old]" not in text and "[new]" not in text  # printed as subscripts
        else:
            assert red["reason"]


def test_math_shows_the_corrections(db, client):
    att = submit(db, "attention", {"b": 1, "h": 1, "m": 4, "n": 8, "d": 4, "e": 4})
    m = client.get(f"/v1/specs/{att.spec_hash}/math").json()
    den = next(r for r in m["reductions"] if r["name"] == "den")
    assert den["realisation"] == "scaled"
    assert den["correction"] == [r"T \leftarrow e^{\mathit{mx}_{\mathrm{old}} - \mathit{mx}_{\mathrm{new}}}\, T"]
    assert den["merge"] == [
        r"T = e^{\mathit{mx}_{a} - \mathit{mx}}\, T_{a} + e^{\mathit{mx}_{b} - \mathit{mx}}\, T_{b}"]
    o = next(r for r in m["reductions"] if r["name"] == "o")
    assert o["finalize"] == r"o = \frac{T}{\mathit{den}}"
    ln = submit(db, "layernorm", {"t": 2, "c": 8})
    var = next(r for r in client.get(f"/v1/specs/{ln.spec_hash}/math").json()["reductions"] if r["name"] == "var")
    assert var["realisation"] == "taylor"
    assert r"\mathrm{count}_{\mathrm{old}}" in var["correction"][0]  # the top coefficient, sum 1 / N, is the count
    assert len(var["merge"]) == 2 and r"T_{1,a}^{\text{moved}}" in var["merge"][0]


def test_math_and_source_are_computed_in_a_child_process_and_kept(db, client):
    """The LaTeX and the generated source (seconds of sympy for a large spec) are computed in the
    derivations' child processes, not in the API's (where they held the GIL against every other
    request: issue 37, 2); an answer is kept, so asking again starts no child."""
    from service.dashboard import compute

    compute.loaded.cache_clear()
    pool = client.app.state.ctx.deriver
    job = submit(db, "layernorm", {"t": 4, "c": 64})
    started = pool.started
    for path in ("math", "source"):
        first = client.get(f"/v1/specs/{job.spec_hash}/{path}")
        assert first.status_code == 200, first.text
        assert client.get(f"/v1/specs/{job.spec_hash}/{path}").json() == first.json()
    assert pool.started == started + 2  # one child each; the second asks were answered from what was kept
    assert compute.loaded.cache_info().currsize == 0  # nothing derived in this (the API's) process
    other = client.get(f"/v1/specs/{job.spec_hash}/source", params={"shape": "t=2,c=32"})
    assert other.status_code == 200 and other.json()["shape"] == {"t": 2, "c": 32} and pool.started == started + 3


def test_a_slow_math_or_source_is_stopped_at_the_derivations_deadline(db, db_url):
    """A spec whose derivation outlasts the deadline: GET /math and /source answer 503
    derivation-timeout at it, and the child is killed (nothing goes on computing)."""
    from tests.support.slow_specs import slow_spec

    raw = slow_spec(15)  # ~0.35 s of derivation on a 2-core CI machine
    with db() as s:
        job, _ = job_queue.submit_job(s, tuning_request(load_spec(raw), json.dumps(raw), {"m": 4, "n": 64},
                                                        "float32", "h100", "model", 10, 60.0))
    with TestClient(create_app(get_settings(db_url=db_url), derive_timeout_s=0.1)) as c:
        pool = c.app.state.ctx.deriver
        for path in ("math", "source"):
            r = c.get(f"/v1/specs/{job.spec_hash}/{path}")
            assert r.status_code == 503 and r.json()["type"].endswith("derivation-timeout"), r.text
        assert pool.killed == 2 and not pool.running


def test_spec_endpoints_validate_the_hash(client):
    assert client.get("/v1/specs/" + "0" * 64 + "/math").status_code == 404
    r = client.get("/v1/specs/NOTAHASH/math")
    assert r.status_code == 422
    assert r.json()["errors"][0]["field"] == "spec_hash"
    assert client.get("/v1/specs/" + "0" * 64 + "/source").status_code == 404


def test_source_defaults_to_the_newest_job_then_the_tuned_kernel(db, client):
    job = submit(db, "safe_softmax", {"m": 4, "n": 300}, dtype="float16")
    r = client.get(f"/v1/specs/{job.spec_hash}/source")
    assert r.status_code == 200, r.text
    src = r.json()
    assert src["shape"] == {"m": 4, "n": 300} and src["dtype_key"] == "float16"
    assert src["strategy"] == "streaming_fused" and src["kernel_id"] is None
    assert "@triton.jit" in src["source"] and "def launch(inputs, shape, out=None, scalars=None):" in src["source"]
    assert set(src["strategies"]) == {"row_resident", "streaming_fused", "split_fused", "multi_pass"}
    # a tuned kernel (canonical dim names in its config) becomes the default, shown in the spec's names
    canon_axis = next(d for d in job.shape if job.shape[d] == 300)
    kid = add_kernel(db, job, time_ms=0.01, predicted=True, strategy="split_fused",
                     config={"blocks": {canon_axis: 32}, "num_warps": 2, "num_stages": 1, "split": 4})
    src = client.get(f"/v1/specs/{job.spec_hash}/source").json()
    assert src["kernel_id"] == kid and src["strategy"] == "split_fused"
    assert src["config"] == {"blocks": {"n": 32}, "num_warps": 2, "num_stages": 1, "split": 4}
    assert "SPLIT = 4" in src["source"]
    other = client.get(f"/v1/specs/{job.spec_hash}/source", params={"strategy": "multi_pass", "shape": "m=2,n=64"})
    assert other.status_code == 200 and other.json()["strategy"] == "multi_pass" and other.json()["kernel_id"] is None


def test_source_errors_name_the_field(db, client):
    job = submit(db, "safe_softmax", {"m": 4, "n": 300})
    url = f"/v1/specs/{job.spec_hash}/source"
    r = client.get(url, params={"shape": "m=4,q=3"})
    assert r.status_code == 422
    assert r.json()["errors"][0]["field"] == "shape.q" and "unknown dim" in r.json()["detail"]
    r = client.get(url, params={"shape": "m=4,n=0"})
    assert r.status_code == 422 and r.json()["errors"][0]["field"].startswith("shape")
    r = client.get(url, params={"shape": "m=4,n=300000", "strategy": "row_resident"})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "strategy"
    assert "too long" in r.json()["detail"]
    r = client.get(url, params={"strategy": "warp_magic"})
    assert r.status_code == 422 and "unknown strategy" in r.json()["detail"]
    r = client.get(url, params={"strategy": "Robert'); DROP"})
    assert r.status_code == 422
    r = client.get(url, params={"dtype": "float128"})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "dtype"


# ----------------------------------------------------------------------------- kernels


def test_kernel_rows_with_speedups_and_predictions(db, client):
    a = submit(db, "safe_softmax", {"m": 4, "n": 300})
    b = submit(db, "logsumexp", {"m": 4, "n": 300})
    t0 = datetime.now(UTC)
    measured = add_kernel(db, a, time_ms=0.5, predicted=False, created_at=t0,
                          baselines={"unfused_chain": {"time_ms": 1.5}, "torch_compile": 0.75, "predicted_ms": 0.4})
    predicted = add_kernel(db, b, time_ms=0.2, predicted=True, created_at=t0 + timedelta(seconds=1),
                           baselines={"unfused_chain": {"time_ms": 0.6, "predicted": True}, "torch_compile": "failed"})
    r = client.get("/v1/dashboard/kernels")
    assert r.status_code == 200, r.text
    rows = r.json()["kernels"]
    assert [k["id"] for k in rows] == [predicted, measured]  # newest first
    p, m = rows
    assert m["spec_name"] == "safe_softmax" and m["bundle_url"] == f"/v1/kernels/{measured}/bundle"
    assert m["speedups"]["unfused_chain"] == {"baseline_ms": 1.5, "speedup": 3.0, "predicted": False}
    assert m["speedups"]["torch_compile"]["speedup"] == pytest.approx(1.5)
    assert m["prediction"] == {"predicted_ms": 0.4, "measured_ms": 0.5}
    assert p["speedups"]["unfused_chain"]["predicted"] is True and "torch_compile" not in p["speedups"]
    assert p["prediction"] == {"predicted_ms": 0.2, "measured_ms": None}
    only = client.get("/v1/dashboard/kernels", params={"spec_hash": a.spec_hash}).json()["kernels"]
    assert [k["id"] for k in only] == [measured]
    assert client.get("/v1/dashboard/kernels", params={"limit": 1, "offset": 1}).json()["kernels"][0]["id"] == measured
    assert client.get("/v1/dashboard/kernels", params={"target": "a100"}).json()["kernels"] == []
    assert client.get("/v1/dashboard/kernels", params={"spec_hash": "xyz"}).status_code == 422
    assert client.get("/v1/dashboard/kernels", params={"limit": 100000}).status_code == 422


# ----------------------------------------------------------------------------- catalog and options


def test_catalog_lists_the_specs_with_their_suite_cases(client):
    specs = client.get("/v1/catalog").json()["specs"]
    names = [s["name"] for s in specs]
    assert names == sorted(load_catalog()) and "suites" not in names
    att = next(s for s in specs if s["name"] == "attention")
    assert att["spec"] == load_catalog()["attention"]
    assert att["spec_hash"] == compute_spec_hash(load_spec(att["spec"]))
    assert {c["suite"] for c in att["cases"]} >= {"paper"}
    assert all(set(c) == {"suite", "shape", "dtype", "note"} for c in att["cases"])
    # a spec in no suite still offers the form a shape: its example (issue 36)
    quant = next(s for s in specs if s["name"] == "rmsnorm_fp8_per_block")
    assert [(c["suite"], c["shape"]) for c in quant["cases"]] == [("example", {"t": 5, "g": 3, "c": 128})]


def test_catalog_dir_adds_a_users_folder(client, tmp_path, monkeypatch):
    (tmp_path / "mine.json").write_text((CATALOG_DIR / "rmsnorm.json").read_text())
    (tmp_path / "junk.json").write_text('{"not": "a spec"}')
    (tmp_path / "broken.json").write_text("{")
    # a spec named like a packaged one shadows it
    (tmp_path / "safe_softmax.json").write_text((CATALOG_DIR / "logsumexp.json").read_text())
    (tmp_path / "suites.json").write_text('{"mine": [{"spec": "mine", "shape": {"t": 2, "c": 8}}]}')
    monkeypatch.setenv("FOLDWISE_CATALOG_DIR", str(tmp_path))
    specs = {s["name"]: s for s in client.get("/v1/catalog").json()["specs"]}
    assert sorted(specs) == sorted([*load_catalog(), "mine"])  # junk and broken are not specs
    assert specs["mine"]["file"] == "mine.json" and specs["mine"]["spec"]["name"] == "rmsnorm"
    assert specs["mine"]["cases"] == [{"suite": "mine", "shape": {"t": 2, "c": 8}, "dtype": "float32", "note": None},
                                      {"suite": "example", "shape": {"t": 5, "c": 300}, "dtype": "float32",
                                       "note": "the spec's own"}]  # rmsnorm's example shape, last
    assert specs["safe_softmax"]["spec"]["name"] == "logsumexp"
    assert {c["suite"] for c in specs["attention"]["cases"]} >= {"paper", "smoke"}  # packaged suites still there
    monkeypatch.setenv("FOLDWISE_CATALOG_DIR", str(tmp_path / "missing"))
    assert [s["name"] for s in client.get("/v1/catalog").json()["specs"]] == sorted(load_catalog())


def test_form_options(client):
    o = client.get("/v1/dashboard/options").json()
    assert {"h100", "h200", "a100"} <= set(o["targets"])
    assert o["measurers"] == ["model", "cuda"] and o["default_measurer"] == "model"
    assert o["dtypes"] == ["float32", "float16", "bfloat16"]


# ----------------------------------------------------------------------------- auth


def test_auth_me_and_scopes(db, db_url):
    with make_client(db_url) as c:
        assert c.get("/v1/auth/me").json() == {"auth_enabled": False, "name": None,
                                               "scopes": ["admin", "jobs:write", "kernels:read"]}
        assert c.get("/v1/dashboard/kernels").status_code == 200  # open mode
        with db() as s:
            _, reader = create_token(s, "reader", "kernels:read")
            _, writer = create_token(s, "writer", "jobs:write")
        # loopback with tokens: status reads open, kernels need kernels:read
        assert c.get("/v1/auth/me").json() == {"auth_enabled": True, "name": None, "scopes": []}
        assert c.get("/v1/catalog").status_code == 200
        r = c.get("/v1/dashboard/kernels")
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        me = c.get("/v1/auth/me", headers={"Authorization": f"Bearer {reader}"}).json()
        assert me == {"auth_enabled": True, "name": "reader", "scopes": ["kernels:read"]}
        assert c.get("/v1/dashboard/kernels", headers={"Authorization": f"Bearer {reader}"}).status_code == 200
        r = c.get("/v1/dashboard/kernels", headers={"Authorization": f"Bearer {writer}"})
        assert r.status_code == 403 and "kernels:read" in r.json()["detail"]
        assert c.get("/v1/auth/me", headers={"Authorization": "Bearer fw_wrong"}).status_code == 401
        assert c.get("/v1/auth/me", headers={"Authorization": "Basic abc"}).status_code == 401
        assert c.get("/").status_code == 200  # the page itself is always served
    with make_client(db_url, host="0.0.0.0") as c:
        assert c.get("/v1/auth/me").status_code == 401
        assert c.get("/v1/catalog").status_code == 401
        assert c.get("/v1/catalog", headers={"Authorization": f"Bearer {reader}"}).status_code == 200
        assert c.get("/").status_code == 200 and c.get("/static/js/app.js").status_code == 200


def test_static_files_ship_with_the_package():
    """Every file under service/dashboard/static matches the package-data globs of pyproject.toml,
    so a wheel (not only an editable install) serves the whole dashboard."""
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[2]
    config = tomllib.loads((root / "pyproject.toml").read_text())
    globs = config.get("tool", {}).get("setuptools", {}).get("package-data", {}).get("service.dashboard", [])
    assert globs, "pyproject.toml has no [tool.setuptools.package-data] entry for service.dashboard"
    package = root / "service" / "dashboard"

    def matches(path: str, pattern: str) -> bool:  # setuptools' glob: '*' stays within one directory
        parts, pats = path.split("/"), pattern.split("/")
        return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats))

    missing = [p.relative_to(package).as_posix() for p in (package / "static").rglob("*") if p.is_file()
               and not any(matches(p.relative_to(package).as_posix(), g) for g in globs)]
    assert not missing, f"not shipped in a wheel: {missing}"
