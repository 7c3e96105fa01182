"""The one request normaliser (service/tuning_request.py) and the one reader of shape and dtype
text (service.bundle): what every way in (API, CLI, worker, dashboard, client) relies on."""

from __future__ import annotations

import json

import pytest

from fuser_core.errors import SpecError
from fuser_core.spec import load_spec
from service.bundle import parse_dtype_text, parse_shape_text, shape_text, user_names
from service.errors import InvalidRequest
from service.tuning_request import MEASURERS, Limits, known_targets, tuning_request

SOFTMAX = {"foldwise": 1, "name": "safe_softmax", "inputs": {"x": {"dims": ["m", "n"]}},
           "steps": [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
                     {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - mx)"},
                     {"name": "y", "expr": "exp(x - mx) / den"}],
           "outputs": ["y"], "params": {}}
# the same cascade with other dim and step names: the same spec_hash, so the same job
RENAMED = json.loads(json.dumps(SOFTMAX).replace('"m"', '"rows"').replace('"n"', '"cols"')
                     .replace('"mx"', '"peak"').replace("mx", "peak"))


def request(raw=SOFTMAX, shape=None, dtype="float32", target="h100", measurer="model", trials=10, seconds=60.0,
            **kwargs):
    spec = load_spec(raw)
    names = list(spec.dims)
    return tuning_request(spec, json.dumps(raw), shape or {names[0]: 4, names[1]: 300}, dtype, target, measurer,
                          trials, seconds, **kwargs)


def test_a_request_is_bound_to_canonical_names_and_keyed_like_any_other_naming():
    a = request()
    b = request(RENAMED)
    assert a.spec_hash == b.spec_hash
    assert a.shape == b.shape == {"d0": 4, "d1": 300} and a.shape_key == "d0=4,d1=300"
    assert a.dedupe_key == b.dedupe_key
    assert a.dtype == request(dtype={"x": "float32"}).dtype == "float32"  # one name for one kernel
    assert request(target=" H100 ").target == "h100"
    assert a.dedupe_key != request(measurer="cuda").dedupe_key != request(shape={"m": 4, "n": 301}).dedupe_key


def test_every_bad_field_is_named_at_once():
    with pytest.raises(InvalidRequest) as info:
        request(target="tpu", measurer="guess", trials=0, seconds=float("inf"))
    assert [e.loc for e in info.value.errors] == [("budget", "trials"), ("target",), ("measurer",)]
    assert info.value.loc == ("budget", "trials")
    assert "one of " + ", ".join(known_targets()) in info.value.errors[1].message
    assert "one of " + ", ".join(sorted(MEASURERS)) in info.value.errors[2].message


def test_the_shape_and_dtype_are_checked_against_the_spec_and_the_limits():
    with pytest.raises(InvalidRequest) as info:
        request(shape={"m": 4, "k": 3}, dtype="float128")
    assert [e.loc[0] for e in info.value.errors] == ["shape", "dtype"]
    with pytest.raises(InvalidRequest) as info:
        request(shape={"m": 4, "n": 300}, limits=Limits(max_dim=256, max_trials=5))
    assert [e.loc for e in info.value.errors] == [("budget", "trials"), ("shape", "n")]
    with pytest.raises(InvalidRequest) as info:
        request(shape={"m": 4096, "n": 4096}, limits=Limits(max_elements=1 << 20))
    assert info.value.loc == ("shape",) and "elements" in info.value.message


def test_user_names_map_canonical_names_back():
    names = user_names(load_spec(RENAMED))
    assert names["d0"] in ("rows", "cols") and {names["d0"], names["d1"]} == {"rows", "cols"}
    assert "peak" in names.values()


@pytest.mark.parametrize("text, shape", [("m=4,n=300", {"m": 4, "n": 300}), (" m = 4 , n=300, ", {"m": 4, "n": 300}),
                                         ("d1=300,d0=4", {"d1": 300, "d0": 4})])
def test_shape_text_reads_what_shape_text_writes(text, shape):
    assert parse_shape_text(text) == shape
    assert parse_shape_text(shape_text(shape)) == shape


@pytest.mark.parametrize("text, message", [("", "expected dim=size"), ("m=4,m=5", "given twice"), ("m=-1", "m=-1"),
                                           ("m=4x", "m=4x"), ("m", "'m'"), ("=4", "'=4'"), ("m=" + "9" * 20, "m=99"),
                                           ("m=1," * 600, "longer than")])
def test_bad_shape_text_names_the_shape(text, message):
    with pytest.raises(SpecError, match=message) as info:
        parse_shape_text(text)
    assert info.value.loc == ("shape",)


def test_dtype_text():
    assert parse_dtype_text(" float16 ") == "float16"
    assert parse_dtype_text('{"x": "float8_e4m3fn"}') == {"x": "float8_e4m3fn"}
    for bad in ('{"x": ', '{"x": 1}', "{[1]"):
        with pytest.raises(SpecError) as info:
            parse_dtype_text(bad)
        assert info.value.loc == ("dtype",)
