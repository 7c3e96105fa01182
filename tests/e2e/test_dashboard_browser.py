"""The dashboard in a real headless Chromium (Debian's ``chromium`` + ``chromium-driver``, driven by
Selenium), against a real ``foldwise serve`` subprocess with one in-process worker using the
model measurer.

The flow of issue 6: sign in with a token, submit a catalog spec through the form (after a
rejected shape, whose error shows next to the field), watch the job reach ``succeeded`` without
a page reload, open its chart and its derivation, download the bundle (and check it is the
server's bundle, hash verified); then the kernels and workers pages, a cancel from the job
page, and the read-only views of a ``kernels:read`` token.

Every page is saved as a PNG (``$FOLDWISE_TEST_ARTIFACTS``, default ``tests/artifacts/dashboard``),
and checked not blank: its key elements are visible, math rendered without KaTeX errors, code
highlighted, and the browser console has no errors except the 422 provoked on purpose.

Needs /usr/bin/chromium, /usr/bin/chromedriver and the ``selenium`` package (``.ci/run``
installs them); skipped when they are missing unless ``FOLDWISE_REQUIRE_BROWSER=1``, which
turns the skip into a failure (CI sets it).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from tests.support.catalog import CATALOG_DIR, load_catalog
from tests.support.servers import free_port

CHROMIUM = os.environ.get("FOLDWISE_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("FOLDWISE_CHROMEDRIVER", "/usr/bin/chromedriver")
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("FOLDWISE_TEST_ARTIFACTS", ROOT / "tests" / "artifacts" / "dashboard"))
JOB_TIMEOUT_S = 120


def _missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "the selenium package is not installed (pip install -e '.[dev]')"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            return f"{path} is missing (apt-get install -y chromium chromium-driver)"
    return None


_why = _missing()
if _why and os.environ.get("FOLDWISE_REQUIRE_BROWSER") == "1":
    raise RuntimeError(f"FOLDWISE_REQUIRE_BROWSER=1 but {_why}")
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")

if _why is None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import Select, WebDriverWait


# ----------------------------------------------------------------------------- server


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``foldwise serve`` with one model-measurer worker on a fresh SQLite database, and two tokens."""
    from service.auth import create_token
    from service.store.db import make_engine, session_factory, upgrade

    work = tmp_path_factory.mktemp("dashboard-server")
    url = f"sqlite:///{work / 'dash.db'}"
    upgrade(url)
    engine = make_engine(url)
    with session_factory(engine)() as session:
        _, writer = create_token(session, "engineer", "jobs:write,kernels:read")
        _, reader = create_token(session, "viewer", "kernels:read")
    engine.dispose()
    port = free_port()
    env = {**os.environ, "TRITON_INTERPRET": "1", "FOLDWISE_MEASURER": "model", "FOLDWISE_TARGET": "h100",
           "FOLDWISE_CACHE_DIR": str(work / "cache"), "PYTHONUNBUFFERED": "1"}
    log = (work / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--db", url,
         "--workers", "1", "--measurer", "model", "--target", "h100"],
        cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"foldwise serve exited with {proc.returncode}:\n{_tail(work / 'server.log')}")
        try:
            if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"foldwise serve did not answer in 60 s:\n{_tail(work / 'server.log')}")
        time.sleep(0.3)
    yield {"base": base, "writer": writer, "reader": reader, "log": work / "server.log",
           "downloads": work / "downloads", "url": url}
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


# ----------------------------------------------------------------------------- browser


class Page:
    """The browser, with the checks every page gets: screenshots, console errors, visible elements."""

    def __init__(self, base: str, downloads: Path):
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                    "--window-size=1400,1000", "--disable-extensions", "--no-first-run"):
            options.add_argument(arg)
        downloads.mkdir(parents=True, exist_ok=True)
        options.add_experimental_option("prefs", {
            "download.default_directory": str(downloads), "download.prompt_for_download": False,
            "safebrowsing.enabled": False})
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        self.driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        self.driver.execute_cdp_cmd("Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
        self.base = base
        self.downloads = downloads
        self.expected_errors: list[str] = []
        ARTIFACTS.mkdir(parents=True, exist_ok=True)

    def open(self, fragment: str) -> None:
        self.driver.get(f"{self.base}/{fragment}")

    def go(self, fragment: str) -> None:
        """Navigate inside the app (hash change, no reload)."""
        self.driver.execute_script("location.hash = arguments[0]", fragment)

    def wait(self, condition, timeout: float = 15, message: str = ""):
        return WebDriverWait(self.driver, timeout, poll_frequency=0.1).until(condition, message)

    def visible(self, css: str, timeout: float = 15):
        return self.wait(EC.visibility_of_element_located((By.CSS_SELECTOR, css)), timeout, f"{css} not visible")

    def find(self, css: str):
        return self.driver.find_element(By.CSS_SELECTOR, css)

    def all(self, css: str):
        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def text(self, css: str) -> str:
        return self.find(css).text

    def js_attr(self, css: str, name: str) -> str | None:
        """An attribute read in one step in the page (the element may be re-rendered at any time)."""
        return self.driver.execute_script(
            "const e = document.querySelector(arguments[0]); return e ? e.getAttribute(arguments[1]) : null;",
            css, name)

    def js_text(self, css: str) -> str | None:
        return self.driver.execute_script(
            "const e = document.querySelector(arguments[0]); return e ? e.innerText : null;", css)

    def status(self) -> str | None:
        return self.js_attr(".page-head [data-status]", "data-status")

    def shot(self, name: str, *, full: bool = False) -> Path:
        """A PNG of the page (``full``: the whole document height), after checking it is not blank."""
        body_text = self.driver.execute_script("return document.getElementById('main').innerText.trim()")
        assert len(body_text) > 20, f"{name}: the page is blank"
        path = ARTIFACTS / f"{name}.png"
        if full:  # the whole document, through the DevTools protocol (a window is limited to the screen)
            size = self.driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
            shot = self.driver.execute_cdp_cmd("Page.captureScreenshot", {
                "format": "png", "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], 8000), "scale": 1}})
            path.write_bytes(base64.b64decode(shot["data"]))
        else:
            self.driver.save_screenshot(str(path))
        assert path.stat().st_size > 10_000, f"{name}: screenshot suspiciously small"
        self.check_console(name)
        return path

    def check_console(self, where: str) -> None:
        errors = [e["message"] for e in self.driver.get_log("browser") if e["level"] == "SEVERE"]
        unexpected = [m for m in errors if not any(x in m for x in self.expected_errors)]
        assert not unexpected, f"{where}: browser console errors: {unexpected}"

    def sign_in(self, token: str) -> None:
        self.find("#login-button").click()
        field = self.visible("#login-token")
        field.clear()
        field.send_keys(token)
        self.find("#login-save").click()
        self.wait(lambda d: not d.find_element(By.ID, "login-dialog").get_attribute("open"), 10,
                  "login dialog stays open")

    def quit(self) -> None:
        self.driver.quit()


@pytest.fixture()
def page(server):
    p = Page(server["base"], server["downloads"])
    yield p
    p.quit()


def _api(server, method: str, path: str, token: str, **kw) -> httpx.Response:
    return httpx.request(method, server["base"] + path, headers={"Authorization": f"Bearer {token}"}, timeout=30, **kw)


# ----------------------------------------------------------------------------- the flow


def test_submit_watch_chart_derivation_download(server, page):
    page.open("#/jobs")
    page.visible("#jobs-table")
    page.sign_in(server["writer"])
    page.wait(lambda d: "engineer" in d.find_element(By.ID, "auth-status").text, 10, "not signed in")
    page.shot("01-jobs-empty")

    # the form: pick a catalog spec, provoke a field error, then submit
    page.find("#nav a[data-route=submit]").click()
    pick = page.visible("#catalog-pick")
    Select(pick).select_by_value("safe_softmax")
    page.wait(lambda d: '"name": "safe_softmax"' in d.find_element(By.ID, "spec-text").get_attribute("value"))
    page.wait(lambda d: "fusible" in d.find_element(By.ID, "spec-preview").text, 30, "spec check did not answer")
    # a spec error is shown under the spec, naming the step and field
    good_spec = page.find("#spec-text").get_attribute("value")
    bad = json.loads(good_spec)
    bad["steps"][1]["expr"] = "exp(x - zz)"
    page.driver.execute_script("document.getElementById('spec-text').value = arguments[0]", json.dumps(bad))
    page.expected_errors = ["v1/jobs - Failed to load resource: the server responded with a status of 422"]
    page.find("#submit-button").click()
    spec_error = page.visible("#error-spec")
    assert "steps[1] (den).expr" in spec_error.text and "zz" in spec_error.text, spec_error.text
    page.shot("02-submit-spec-error")
    page.driver.execute_script("document.getElementById('spec-text').value = arguments[0]", good_spec)
    shape = page.find("#shape")
    shape.clear()
    shape.send_keys("m=4,q=64")
    trials = page.find("#budget-trials")
    trials.clear()
    trials.send_keys("6")
    page.find("#submit-button").click()
    error = page.visible("#error-shape")
    assert "unknown dim 'q'" in error.text
    assert "invalid" in page.find("#shape").find_element(By.XPATH, "..").get_attribute("class")
    assert page.text("#error-spec") == ""
    page.shot("03-submit-shape-error")

    shape.clear()
    shape.send_keys("m=4,n=64")
    page.find("#submit-button").click()
    page.wait(lambda d: "#/jobs/" in d.current_url, 30, "no navigation to the job page")
    job_id = page.driver.current_url.rsplit("/", 1)[-1]
    assert len(job_id) == 32
    page.driver.execute_script("window.__noReload = 'marker'")
    assert page.visible("#job-shape").text == "m=4,n=64"  # the spec's own dim names, not canonical ones

    # live: the status changes without a reload
    statuses = set()
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        status = page.status()
        statuses.add(status)
        if status == "running" and "04-job-running" not in statuses:
            statuses.add("04-job-running")
            page.shot("04-job-running")
        if status in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(0.2)
    assert status == "succeeded", f"job ended {status}: {page.text('#job-facts')}\n{_tail(server['log'])}"
    assert page.driver.execute_script("return window.__noReload") == "marker", "the page reloaded"

    # chart and trials
    page.wait(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#trials-body tr")) == 6, 10, "trials table incomplete")
    canvas = page.find("#job-chart canvas")
    assert canvas.size["width"] > 300 and canvas.size["height"] > 100
    assert page.text("#job-best").endswith(("ms", "µs"))
    legend = page.text("#job-chart .u-legend")
    assert "best so far" in legend and "trial time" in legend
    # a log time axis in one unit (issue 26): the best-so-far curve is not flattened by slow outliers
    assert page.js_attr("#job-chart", "data-scale") == "log"
    assert page.js_attr("#job-chart", "data-unit") in ("ms", "µs")
    api_trials = _api(server, "GET", f"/v1/jobs/{job_id}/trials", server["writer"]).json()["trials"]
    cells = page.driver.execute_script(
        "return [...document.querySelectorAll('#trials-body tr')].map(tr => [...tr.cells].map(c => c.innerText))")
    assert sorted(int(c[0]) for c in cells) == sorted(t["number"] for t in api_trials)
    assert all(c[7] and c[4] for c in cells)  # every trial names its worker and its time (or failure)
    # the compile gate compiled every candidate for the job's target: its facts per trial, as the API has them
    assert all("regs" in c[5] or "does not compile" in c[5] for c in cells), cells
    assert all(t["compile"] and t["compile"][0]["registers"] for t in api_trials if t["state"] == "complete")
    assert not page.all("#cancel-button")  # finished: nothing to cancel
    page.shot("05-job-succeeded", full=True)

    # download the bundle and check it is the server's
    page.find("#download-bundle").click()
    deadline = time.monotonic() + 20
    files: list[Path] = []
    while time.monotonic() < deadline:
        files = [p for p in server["downloads"].glob("*.json")]
        if files:
            break
        time.sleep(0.2)
    assert files, "no bundle downloaded"
    bundle_bytes = files[0].read_bytes()
    job = _api(server, "GET", f"/v1/jobs/{job_id}", server["writer"]).json()
    served = _api(server, "GET", f"/v1/kernels/{job['kernel_id']}/bundle", server["writer"])
    assert bundle_bytes == served.content
    from service.bundle import bundle_sha256

    bundle = json.loads(bundle_bytes)
    assert bundle["sha256"] == bundle_sha256(bundle) == served.headers["etag"].strip('"')
    assert bundle["spec_hash"] == job["spec_hash"] and "def launch" in bundle["triton_source"]

    # the derivation, as math, and the generated source, highlighted
    page.find("#job-spec-link").click()
    page.visible("#derivation")
    page.wait(lambda d: d.find_elements(By.CSS_SELECTOR, "#spec-source code.hljs"), 30, "no generated source")
    cards = page.all("#derivation .reduction")
    assert [c.get_attribute("data-reduction") for c in cards] == ["mx", "den"]
    assert len(page.all("#derivation .katex")) >= 10
    assert not page.all(".katex-error"), "KaTeX could not render some LaTeX"
    den = cards[1].text
    assert "scaled" in den and "correction" in den and "merge rule" in den
    assert page.text("#cert-err")
    assert page.all("#spec-source .hljs-keyword"), "source not highlighted"
    assert "streaming_fused" in page.text("#spec-source") or "row_resident" in page.text("#spec-source")
    page.shot("06-spec", full=True)

    # the jobs list, filtered; the kernel cache; the workers
    page.go("#/jobs?status=succeeded")
    page.wait(lambda d: d.find_elements(By.CSS_SELECTOR, f"#jobs-body tr[data-job='{job_id}']"), 10, "job not listed")
    row = page.find(f"#jobs-body tr[data-job='{job_id}']")
    assert "safe_softmax" in row.text and "m=4,n=64" in row.text and "6 / 6" in row.text
    page.shot("07-jobs")
    page.go("#/jobs?status=failed")
    page.wait(lambda d: "no jobs match" in d.find_element(By.ID, "jobs-info").text, 10)
    page.go("#/kernels")
    page.wait(lambda d: d.find_elements(By.CSS_SELECTOR, f"#kernels-body tr[data-kernel='{job['kernel_id']}']"), 10)
    krow = page.find(f"#kernels-body tr[data-kernel='{job['kernel_id']}']")
    assert "safe_softmax" in krow.text and "model prediction" in krow.text and "×" in krow.text
    page.shot("08-kernels")

    # the kernel page: the compiled variant the worker stored (its compile follows the job's end)
    kid = job["kernel_id"]
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:  # a 503 (SQLite busy while the worker stores the binary) is retried like an empty list
        r = _api(server, "GET", f"/v1/kernels/{kid}/binaries", server["writer"])
        if r.status_code == 200 and r.json()["variants"]:
            break
        assert time.monotonic() < deadline, f"no binary stored for the job's kernel: {r.status_code} {r.text[:500]}" \
                                            f"\n{_tail(server['log'])}"
        time.sleep(0.5)
    [variant] = r.json()["variants"]
    assert variant["arch"] == "sm_90a"  # the job's target h100
    krow.find_element(By.CSS_SELECTOR, "a.kernel-link").click()
    page.wait(lambda d: d.find_elements(By.CSS_SELECTOR, "#variants-body tr[data-arch='sm_90a']"), 10, "no variants shown")
    vrows = page.driver.execute_script(
        "return [...document.querySelectorAll('#variants-body tr')].map(tr => [...tr.cells].map(c => c.innerText))")
    assert [r[1] for r in vrows] == [k["name"] for k in variant["kernels"]]
    for cells, k in zip(vrows, variant["kernels"]):
        assert cells[4] == str(k["registers"]) and "KiB" in cells[2] and "PTX" in cells[9] and "cubin" in cells[9]
        assert variant["triton_version"] in cells[8] and variant["ptxas_version"] in cells[8]
    assert "safe_softmax" in page.text("#kernel-facts") and variant["kernels"][0]["name"]
    page.shot("08b-kernel-variants", full=True)
    first = variant["kernels"][0]
    page.find(f"#variants-body tr[data-kernel-name='{first['name']}'] button.download-binary").click()
    deadline = time.monotonic() + 20
    cubins: list[Path] = []
    while time.monotonic() < deadline and not cubins:
        cubins = [p for p in server["downloads"].glob("*.cubin")]
        time.sleep(0.2)
    assert cubins and cubins[0].name == f"sm_90a-{first['name']}.cubin", cubins
    import hashlib

    data = cubins[0].read_bytes()
    assert data[:4] == b"\x7fELF" and hashlib.sha256(data).hexdigest() == first["cubin_sha256"]
    assert len(data) == first["cubin_size"]
    page.go("#/workers")
    page.wait(lambda d: d.find_elements(By.CSS_SELECTOR, "#workers-body tr"), 10, "no worker listed")
    wtext = page.js_text("#workers-body")
    assert "h100" in wtext and "model" in wtext and "ago" in wtext and "torch" in wtext
    page.shot("09-workers")


def test_cancel_from_the_job_page(server, page):
    raw = json.loads((CATALOG_DIR / "logsumexp.json").read_text())
    r = _api(server, "POST", "/v1/jobs", server["writer"], json={
        "spec": raw, "shape": {"m": 8, "n": 128}, "dtype": "float32", "target": "h100", "measurer": "model",
        "budget": {"trials": 500, "seconds": 600}})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    # the jobs list follows the job live (no reload)
    page.open("#/jobs")
    page.sign_in(server["writer"])
    page.driver.execute_script("window.__noReload = 'marker'")
    row = f"#jobs-body tr[data-job='{job_id}']"
    page.wait(lambda d: d.find_elements(By.CSS_SELECTOR, row), 10, "job not listed")
    page.wait(lambda d: page.js_attr(row, "data-status") == "running", JOB_TIMEOUT_S, "job never ran")
    page.wait(lambda d: int((page.js_text(f"{row} .progress-text") or "0 / 0").split(" / ")[0]) >= 1,
              JOB_TIMEOUT_S, "progress did not move")
    assert page.driver.execute_script("return window.__noReload") == "marker", "the page reloaded"
    page.shot("10-jobs-live")
    page.find(f"{row} td a").click()
    page.visible("#cancel-button").click()
    page.wait(lambda d: page.status() == "cancelled", JOB_TIMEOUT_S, "job not cancelled")
    assert not page.all("#cancel-button")
    done = _api(server, "GET", f"/v1/jobs/{job_id}", server["writer"]).json()
    assert done["status"] == "cancelled" and done["progress"]["trials_done"] < 500
    page.shot("11-job-cancelled", full=True)


def _finished_job(server, name: str, shape: dict, trials: int = 4) -> dict:
    """A job submitted through the API (writer token), waited for until it finished."""
    raw = json.loads((CATALOG_DIR / f"{name}.json").read_text())
    r = _api(server, "POST", "/v1/jobs", server["writer"], json={
        "spec": raw, "shape": shape, "dtype": "float32", "target": "h100", "measurer": "model",
        "budget": {"trials": trials, "seconds": 300}})
    assert r.status_code in (200, 202), r.text
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:
        job = _api(server, "GET", f"/v1/jobs/{r.json()['id']}", server["writer"]).json()
        if job["status"] in ("succeeded", "failed", "cancelled") or time.monotonic() > deadline:
            assert job["status"] == "succeeded", job
            return job
        time.sleep(0.3)


def test_a_range_jobs_page_shows_each_bucket(server, page):
    """A range job (issue 24, item 3) runs one search per bucket: its page lists the buckets in the
    caller's dim names, smallest first, with each one's trials and best time."""
    job = _finished_job(server, "rmsnorm", {"t": {"min": 1, "max": 64, "buckets": [8, 64]}, "c": 64}, trials=2)
    assert job["range"]["trial_number_stride"] > 0 and len(job["range"]["buckets"]) == 2
    page.open(f"#/jobs/{job['id']}")
    page.sign_in(server["writer"])
    rows = "#buckets-table tbody tr"
    page.wait(lambda d: len(page.all(rows)) == 2, 15, "no bucket rows")
    cells = [[c.text for c in row.find_elements(By.CSS_SELECTOR, "td")] for row in page.all(rows)]
    assert [c[0] for c in cells] == ["c=64,t=8", "c=64,t=64"], cells
    assert all(c[1] == "2" and c[2] not in ("", "—") and c[3] for c in cells), cells
    page.shot("12-range-job-buckets", full=True)


def test_a_job_nobody_can_run_says_so_and_hash_prefixes_work(server, page):
    """Issue 26: a job for a target no live worker serves shows its warning on the job page and
    in the jobs list; a 16-character hash prefix (the CLI's) filters the list and opens the spec;
    a bad hash is an error inside the jobs page, which keeps its form."""
    spec = load_catalog()["safe_softmax"]
    r = _api(server, "POST", "/v1/jobs", server["writer"],
             json={"spec": spec, "shape": {"m": 3, "n": 40}, "target": "a100", "measurer": "model",
                   "budget": {"trials": 2, "seconds": 60}})
    assert r.status_code == 202, r.text
    job = r.json()
    assert "no live worker takes target a100" in job["warnings"][0]
    page.open(f"#/jobs/{job['id']}")
    page.sign_in(server["writer"])
    box = page.visible("#job-warnings [data-warning]")
    assert "no live worker takes target a100" in box.text
    page.shot("14-job-no-worker")
    page.go(f"#/jobs?target=a100&spec_hash={job['spec_hash'][:16]}")
    page.wait(lambda d: d.find_elements(By.CSS_SELECTOR, f"#jobs-body tr[data-job='{job['id']}'] [data-warning]"), 10,
              "the jobs list does not mark the job nobody can run")
    page.shot("15-jobs-no-worker")
    page.expected_errors = ["status of 422"]  # provoked on purpose, next
    page.go("#/jobs?spec_hash=zz-not-a-hash")
    err = page.visible("#jobs-message .error-box")
    assert "spec_hash" in err.text
    assert page.find("#filter-spec").is_displayed() and page.find("#jobs-table").is_displayed()  # the page stays
    page.shot("16-jobs-bad-hash")
    page.go(f"#/specs/{job['spec_hash'][:16]}")
    page.visible("#derivation")
    assert job["spec_hash"] in page.text("#main")
    _api(server, "POST", f"/v1/jobs/{job['id']}/cancel", server["writer"])


def test_a_failed_jobs_page_shows_the_partial_kernel_it_kept(server, page):
    """Issue 26: a job that failed after a good trial kept its best kernel, marked partial: its
    page links that kernel labelled partial (never as the job's kernel), and the kernel's page
    says partial too. Made in the server's database directly, for a target (l40s) no worker serves."""
    from fuser_core.problem import make_problem
    from fuser_core.spec import load_spec
    from service.store import job_queue
    from service.bundle import canonical_spec
    from service.bundle_maker import make_bundle
    from service.store.db import make_engine, session_factory
    from service.tuning_request import tuning_request

    raw = load_catalog()["safe_softmax"]
    spec = load_spec(raw)
    engine = make_engine(server["url"])
    try:
        with session_factory(engine)() as s:
            job, _ = job_queue.submit_job(s, tuning_request(spec, json.dumps(raw), {"m": 5, "n": 48}, "float32",
                                                            "l40s", "model", 4, 60.0))
            assert job_queue.claim_job(s, "w-gone", target="l40s", measurer="model", lease_seconds=600).id == job.id
            job_queue.record_trial(s, job.id, "w-gone", number=0, strategy="streaming_fused", config={},
                                   time_ms=0.02, error=None, state="complete", predicted=True, source="tpe")
            job_queue.fail_job(s, job.id, "w-gone", "CUDA error: illegal memory access")
            bundle = make_bundle(make_problem(canonical_spec(spec), job.shape, "float32"), target="l40s",
                                 strategy="streaming_fused", config={},
                                 measured={"time_ms": 0.02, "measurer": "model", "predicted": True, "partial": True})
            kernel = job_queue.keep_partial(s, job.id, bundle=bundle, kernel_fields={"time_ms": 0.02})
    finally:
        engine.dispose()
    page.open(f"#/jobs/{job.id}")
    page.sign_in(server["writer"])
    box = page.visible("#job-partial-kernel")
    assert "partial" in box.text and kernel.id[:12] in box.text, box.text
    page.visible("#download-partial-bundle")
    assert not page.all("#job-kernel-link") and not page.all("#download-bundle")  # not the job's (finished) kernel
    assert "illegal memory access" in page.text("#job-error")
    page.shot("17-failed-job-partial-kernel")
    page.find("#job-partial-kernel-link").click()
    assert page.visible("#kernel-partial").text == "partial"
    assert "Partial" in page.visible("#kernel-message").text
    page.shot("18-partial-kernel")


def test_read_only_views_for_a_kernels_read_token(server, page):
    job = _finished_job(server, "rmsnorm", {"t": 4, "c": 64})
    page.open("#/jobs")
    page.visible("#jobs-table")
    page.sign_in(server["reader"])
    page.wait(lambda d: "viewer" in d.find_element(By.ID, "auth-status").text, 10)
    assert not page.find("#nav a[data-route=submit]").is_displayed()
    assert not page.all(".page-head a.primary")  # no "Submit a spec"
    page.wait(lambda d: d.find_elements(By.CSS_SELECTOR, "#jobs-body tr"), 10, "jobs not listed")
    page.shot("12-readonly-jobs")
    page.go(f"#/jobs/{job['id']}")
    page.visible("#job-shape")
    page.visible("#download-bundle")  # kernels:read may download
    assert not page.all("#cancel-button")
    page.go("#/submit")
    assert "lacks the jobs:write scope" in page.visible("#read-only-note").text
    page.shot("13-readonly-submit")
    page.go("#/kernels")
    page.wait(lambda d: d.find_elements(By.CSS_SELECTOR, "#kernels-body tr button.download"), 10)
    page.shot("14-readonly-kernels")
    # signing out: the server has tokens, so the kernel cache needs one again
    page.find("#login-button").click()
    page.visible("#login-clear").click()
    page.expected_errors = ["status of 401"]
    page.go("#/jobs")
    page.go("#/kernels")
    page.wait(lambda d: "Error 401" in d.find_element(By.ID, "main").text, 10, "no 401 shown")
    assert "Sign in" in page.text("#main")


def test_page_loads_nothing_from_elsewhere(server, page):
    """Every resource the page loads comes from the server itself (an isolated network works)."""
    page.open("#/jobs")
    page.visible("#jobs-table")
    urls = page.driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert urls and all(u.startswith(server["base"]) for u in urls), urls
    assert any(u.endswith("katex.min.js") for u in urls) and any(u.endswith("uPlot.iife.min.js") for u in urls)


def test_every_catalog_derivation_renders_in_katex(server, page):
    """All LaTeX the spec page can show for the catalog specs parses in the vendored KaTeX."""
    from fuser_core.derive import derive_cascade
    from fuser_core.spec import load_spec
    from service.dashboard.mathtex import derivation_math

    formulas = []
    for raw in load_catalog().values():
        m = derivation_math(derive_cascade(load_spec(raw)))
        for r in m["reductions"]:
            items = [r["integrand"], r["definition"], r["finalize"], *r["update"], *r["correction"], *r["merge"]]
            items += [t[k] for t in r["terms"] for k in ("G", "H")]
            formulas += [(f"{m['name']}.{r['name']}", f) for f in items if f]
    assert len(formulas) > 100
    page.open("#/workers")
    page.visible("#workers-table")
    failures = page.driver.execute_script("""
        const out = [];
        for (const [where, tex] of arguments[0]) {
          try { katex.renderToString(tex, {throwOnError: true, strict: "ignore"}); }
          catch (e) { out.push(where + ": " + e.message + " in " + tex); }
        }
        return out;""", formulas)
    assert not failures, failures
