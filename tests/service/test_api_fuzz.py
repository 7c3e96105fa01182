"""API fuzzing with schemathesis against our own OpenAPI document, on a live server.

``foldwise serve --workers 0`` runs as a real subprocess on loopback (an SQLite file; a fresh,
migrated PostgreSQL database too). Every operation of ``/openapi.json`` gets schema-driven
requests, valid and invalid (schemathesis' positive and negative generation), and
``POST /v1/jobs`` also gets mutations of a valid catalog submission (shape sizes, dtypes,
targets, budgets), which reach the job queue rather than stopping at validation. Every
response must:

- not be a server error (5xx);
- have a status code, content type, headers and body that the document declares (errors are
  ``application/problem+json`` ProblemView; see service/api/app.py ``_document_problems``).

Half the requests carry a valid admin token (tokens exist, so that is what reaches the
routes' logic); the others carry whatever the generator drew (missing or bad tokens: 401).
Bounded: a few dozen examples per operation and mode, no deadline, no example database.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.support.catalog import load_catalog  # noqa: E402
from tests.support.servers import LiveServer, service_env  # noqa: E402

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
CATALOG = load_catalog()


def create_admin_token(db_url: str, tmp_path: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "service.cli", "token", "create", "--db", db_url, "--name", "fuzz",
                          "--scopes", "admin"], env=service_env(), cwd=tmp_path, check=True, capture_output=True,
                         text=True, timeout=60)
    return out.stdout.split()[0]


FUZZ_SETTINGS = dict(deadline=None, database=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
                     suppress_health_check=list(HealthCheck))


def spec_dims(raw: dict) -> list[str]:
    return sorted({d for inp in raw["inputs"].values() for d in inp["dims"]})


def valid_job_bodies() -> st.SearchStrategy[dict]:
    """A catalog submission with its fields mutated: mostly valid, sometimes just out of range
    (sizes, an unknown or missing dim, dtypes, targets, budgets)."""
    sizes = st.one_of(st.integers(1, 512), st.integers(1, 512), st.integers(-3, 0), st.integers(2**31 - 2, 2**40))

    def body(name: str) -> st.SearchStrategy[dict]:
        raw = CATALOG[name]
        shape = st.fixed_dictionaries({d: sizes for d in spec_dims(raw)})
        shape = st.one_of(shape, shape, shape, shape.map(lambda s: {**s, "zz": 4}), shape.map(lambda s: dict(list(s.items())[1:])))
        return st.fixed_dictionaries({
            "spec": st.just(copy.deepcopy(raw)),
            "shape": shape,
            "dtype": st.sampled_from(["float32", "float32", "float32", "float16", "bfloat16", "float64", "", {"x": "float16"}]),
            "target": st.sampled_from(["h100", "h100", "h100", "a100", "H200", " h100 ", "tpu", "x" * 40]),
            "measurer": st.sampled_from(["model", "model", "model", "cuda"]),
            "budget": st.one_of(
                st.fixed_dictionaries({"trials": st.integers(1, 64), "seconds": st.floats(1, 3600)}),
                st.fixed_dictionaries({"trials": st.integers(1, 64), "seconds": st.floats(1, 3600)}),
                st.fixed_dictionaries({"trials": st.integers(-1, 2000), "seconds": st.one_of(st.floats(0, 1e6),
                                                                                              st.just(0))})),
        })

    def valid(name: str) -> st.SearchStrategy[dict]:
        raw = CATALOG[name]
        return st.fixed_dictionaries({
            "spec": st.just(copy.deepcopy(raw)), "shape": st.fixed_dictionaries({d: st.integers(1, 512)
                                                                                for d in spec_dims(raw)}),
            "dtype": st.just("float32"), "target": st.just("h100"), "measurer": st.just("model"),
            "budget": st.fixed_dictionaries({"trials": st.integers(1, 64), "seconds": st.floats(1, 3600)})})

    names = st.sampled_from(["safe_softmax", "layernorm", "moe_routing", "rmsnorm"])
    return st.one_of(names.flatmap(valid), names.flatmap(body))


def fuzz(base: str, token: str, examples: int) -> dict[str, int]:
    """Fuzz every operation; returns {"calls": n, "statuses": {...}} (asserting every check)."""
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    calls: dict[str, int] = {}
    failures: list[str] = []

    def send(case, authorize: bool) -> None:
        if authorize:
            case.headers = {**(case.headers or {}), "Authorization": f"Bearer {token}"}
        response = case.call(base_url=base)
        calls[str(response.status_code)] = calls.get(str(response.status_code), 0) + 1
        try:
            case.validate_response(response, checks=CHECKS)
        except AssertionError as err:  # collect, so one run shows every operation's problem
            failures.append(f"{case.method} {case.formatted_path}: {str(err)[:1500]}")

    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 12
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=examples, **FUZZ_SETTINGS)
            @given(case=op.as_strategy(generation_mode=mode), authorize=st.booleans())
            def run(case, authorize) -> None:
                send(case, authorize)

            try:
                run()
            except Unsatisfiable:  # nothing invalid to send (an operation without parameters)
                assert mode == GenerationMode.NEGATIVE, op.path
        if op.method.upper() == "POST" and op.path == "/v1/jobs":
            @settings(max_examples=2 * examples, **FUZZ_SETTINGS)
            @given(body=valid_job_bodies())
            def submit(body) -> None:
                send(op.Case(body=body, media_type="application/json"), True)

            submit()
    assert not failures, f"{len(failures)} responses broke the contract:\n" + "\n\n".join(failures[:8])
    return calls


def run_fuzz(db_url: str, tmp_path: Path, examples: int) -> None:
    server = LiveServer(db_url, tmp_path)
    try:
        token = create_admin_token(db_url, tmp_path)
        calls = fuzz(server.base, token, examples)
        assert server.proc.poll() is None, server.log()
        assert httpx.get(server.base + "/healthz", timeout=5).json()["database"] == "ok"
        total = sum(calls.values())
        print(f"\nfuzzed {total} API calls on {db_url.split(':')[0]}; statuses {dict(sorted(calls.items()))}")
        assert not any(code.startswith("5") for code in calls), calls
        assert calls.get("200", 0) > 20 and calls.get("202", 0) >= 3, calls  # the requests also reached the logic
        assert total > 300
    finally:
        server.stop()
    assert "unhandled error" not in server.log_path.read_text(errors="replace"), server.log()


def test_fuzz_the_api_against_its_own_schema_on_sqlite(tmp_path) -> None:
    run_fuzz(f"sqlite:///{tmp_path / 'fuzz.db'}", tmp_path, examples=12)


@pytest.mark.postgres
def test_fuzz_the_api_against_its_own_schema_on_postgres(fresh_postgres_url, tmp_path) -> None:
    run_fuzz(fresh_postgres_url, tmp_path, examples=8)
