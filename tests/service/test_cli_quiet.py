"""Issue 26: no NumPy RuntimeWarning from Triton's interpreter reaches the user of `run`, `tune`
or the client. The interpreter computes masked-off lanes too: attention_padded's padded keys
give ``-inf - -inf`` and ``0 * inf`` there (values that are discarded), which printed "invalid
value encountered in subtract/multiply" from `foldwise run --inputs` and the client."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from fuser_core import bind_shape, derive_cascade, load_spec, make_problem, run, spec_source
from fuser_core.reference import random_inputs, random_scalars
from service.bundle import load_bundle
from service.bundle_maker import make_bundle

SHAPE = {"b": 3, "g": 3, "r": 3, "m": 3, "d": 3, "n": 3, "e": 37}  # keys padded away in masked lanes


@pytest.fixture(autouse=True)
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def padded_problem():
    spec = load_spec(spec_source("attention_padded"))
    bound = bind_shape(spec, SHAPE)
    dtypes = {i.name: "float32" for i in spec.inputs if not i.is_index}
    inputs = random_inputs(spec, bound, np.random.default_rng(0), dtypes)
    inputs.update(random_scalars(spec, np.random.default_rng(1)))
    return spec, bound, inputs


def runtime_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]


def test_run_launches_quietly_and_leaves_numpy_as_it_was() -> None:
    spec, bound, inputs = padded_problem()
    before = np.geterr()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = run(spec, bound, "float32", inputs, strategy="streaming_fused")
        # only the launch is quiet: NumPy outside it still warns
        np.log(np.zeros(1))
    assert runtime_warnings(record) == ["divide by zero encountered in log"], runtime_warnings(record)
    assert np.geterr() == before
    assert all(torch.isfinite(t).all() for t in result.outputs.values())  # the discarded lanes stayed discarded


def test_the_client_kernel_launches_quietly() -> None:
    spec, bound, inputs = padded_problem()
    problem = make_problem(spec, bound, "float32")
    from fuser_core import default_config

    config = default_config(spec, derive_cascade(spec), "streaming_fused", problem.shape).to_dict()
    kernel = load_bundle(make_bundle(problem, target="h100", strategy="streaming_fused", config=config,
                                     measured={"time_ms": 1.0}))
    names = {i.name for i in spec.inputs}
    given = {name: torch.from_numpy(np.ascontiguousarray(a)).float() if name in names and a.dtype.kind == "f"
             else torch.from_numpy(np.ascontiguousarray(a)) if name in names else float(a)
             for name, a in inputs.items()}  # tensors, and the runtime scale as a number
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = kernel(**given)
    assert runtime_warnings(record) == [], runtime_warnings(record)
    assert all(torch.isfinite(t).all() for t in out.values())


def test_quiet_is_a_no_op_off_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from fuser_core import interpreter_quiet

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with warnings.catch_warnings(record=True) as record, interpreter_quiet():
        warnings.simplefilter("always")
        np.log(np.zeros(1))
    assert runtime_warnings(record) == ["divide by zero encountered in log"]
    assert os.environ["TRITON_INTERPRET"] == "0"
