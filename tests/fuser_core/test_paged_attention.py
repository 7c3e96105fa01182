"""A paged KV cache (issue 36, 3): ``attention_paged`` reads k and v where vLLM and FlashAttention
keep them, pages of 16 keys addressed through a block table, in every strategy. The reference here
is plain torch, written apart from Foldwise's own paging (fuser_core.paged): a cache with more
pages than the batch uses, pages of a sequence scattered and out of order, NaN in every page and
slot no sequence owns, a table wider than the keys need and padded with page 0 as vLLM pads it."""

from __future__ import annotations

import math

import pytest
import torch

from fuser_core.catalog import load_catalog_spec
from fuser_core.codegen.chain import run_chain
from fuser_core.codegen.module import generate
from fuser_core.codegen.plan import KernelConfig, default_config, valid_strategies
from fuser_core.derive import derive_cascade
from fuser_core.interpreter import interpreter_quiet
from fuser_core.problem import bind_shape
from fuser_core.spec import SpecError, load_spec

SPEC = load_catalog_spec("attention_paged")
PAGE = 16
FUSED = ("streaming_fused", "row_resident", "split_fused", "multi_pass")


def vllm_cache(k, v, kv_len, pages, seed):
    """k, v [b, g, n, d] -> (k_cache, v_cache [pages, 16, g, d], block_table [b, cols + 3]): each
    sequence's kv_len[b] keys on pages drawn at random among ``pages``, NaN everywhere else."""
    b, g, n, d = k.shape
    cols = math.ceil(n / PAGE)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(pages, generator=gen)
    k_cache = torch.full((pages, PAGE, g, d), float("nan"))
    v_cache = torch.full((pages, PAGE, g, v.shape[-1]), float("nan"))
    table = torch.zeros(b, cols + 3, dtype=torch.int32)  # vLLM pads a row with page 0
    table[:, cols:] = -1  # past the columns the shape reads: never read, never checked
    used = 0
    for s in range(b):
        for j in range(math.ceil(int(kv_len[s]) / PAGE)):
            page = int(order[used])
            used += 1
            table[s, j] = page
            keys = range(j * PAGE, min((j + 1) * PAGE, int(kv_len[s])))
            for i, key in enumerate(keys):
                k_cache[page, i] = k[s, :, key]
                v_cache[page, i] = v[s, :, key]
    return k_cache, v_cache, table


def paged_reference(q, k_cache, v_cache, table, kv_len, scale):
    """float64 attention of each sequence over its own keys, gathered page by page; bottom-right causal."""
    b, g, r, m, d = q.shape
    out = torch.zeros(b, g, r, m, v_cache.shape[-1], dtype=torch.float64)
    for s in range(b):
        length = int(kv_len[s])
        if length == 0:
            continue
        keys = torch.cat([k_cache[int(table[s, j])] for j in range(math.ceil(length / PAGE))])[:length]
        vals = torch.cat([v_cache[int(table[s, j])] for j in range(math.ceil(length / PAGE))])[:length]
        scores = torch.einsum("grmd,ngd->grmn", q[s].double(), keys.double()) * scale
        visible = torch.arange(length)[None, :] <= torch.arange(m)[:, None] + length - m
        scores = scores.masked_fill(~visible, float("-inf"))
        p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query that sees no key: o = 0
        out[s] = torch.einsum("grmn,nge->grme", p, vals.double())
    return out


def launch(strategy, shape, tensors, block_n=None):
    """``strategy``'s output; ``block_n``: tiles of that many keys (8: two per page; 32: across pages),
    split_fused in 3 parts, else the default config."""
    bound = bind_shape(SPEC, shape)
    scalars = {"scale": 1 / math.sqrt(shape["d"])}
    if strategy == "unfused_chain":
        return run_chain(SPEC, bound, "float32", tensors, scalars=scalars)["o"]
    derivation = derive_cascade(SPEC)
    config = default_config(SPEC, derivation, strategy, bound)
    if block_n is not None and strategy != "row_resident":
        config = KernelConfig({**config.blocks, "n": block_n}, split=3 if strategy == "split_fused" else 1)
    module = generate(SPEC, derivation, strategy, bound, config, {"q": "float32", "k": "float32", "v": "float32"})
    with interpreter_quiet():
        return module.load().launch(tensors, bound, scalars=scalars)["o"]


CASES = {  # (m, kv_len): decode, chunked prefill (a sequence with no key, one past the first page)
    "decode": (1, [37, 1, 16, 20]),
    "chunked_prefill": (3, [37, 2, 0, 17]),
}


RUNS = [(s, None) for s in (*FUSED, "unfused_chain")] + [  # tiles of 8 keys (two a page) and 32 (across pages)
    (s, b) for s in ("streaming_fused", "split_fused", "multi_pass") for b in (8, 32)]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("strategy, block_n", RUNS)
def test_paged_attention_matches_a_torch_paged_reference(strategy, block_n, case):
    m, lengths = CASES[case]
    b, g, r, n, d = len(lengths), 2, 2, 37, 16
    torch.manual_seed(3)
    q = torch.randn(b, g, r, m, d)
    k, v = torch.randn(b, g, n, d) * 3, torch.randn(b, g, n, d)
    kv_len = torch.tensor(lengths, dtype=torch.int32)
    kv_len = torch.maximum(kv_len, torch.full_like(kv_len, m)) if case == "decode" else kv_len
    k_cache, v_cache, table = vllm_cache(k, v, kv_len, pages=17, seed=5)
    shape = {"b": b, "g": g, "r": r, "m": m, "n": n, "d": d, "e": d}
    bound = bind_shape(SPEC, shape)
    if strategy in FUSED:
        why = valid_strategies(SPEC, derive_cascade(SPEC), bound)[strategy]
        assert why is None, why
    got = launch(strategy, shape, {"q": q, "k": k_cache, "v": v_cache, "kv_len": kv_len, "block_table": table}, block_n)
    want = paged_reference(q, k_cache, v_cache, table, kv_len, 1 / math.sqrt(d))
    assert torch.isfinite(got).all()  # NaN in the pages and slots no sequence owns was never read
    assert float((got.double() - want).abs().max()) < 1e-5


def test_a_page_number_outside_the_cache_is_refused_naming_the_table():
    b, g, r, m, n, d = 2, 1, 1, 1, 20, 8
    shape = {"b": b, "g": g, "r": r, "m": m, "n": n, "d": d, "e": d}
    k_cache = torch.randn(5, PAGE, g, d)
    inputs = {"q": torch.randn(b, g, r, m, d), "k": k_cache, "v": k_cache.clone(),
              "kv_len": torch.tensor([20, 3], dtype=torch.int32),
              "block_table": torch.tensor([[0, 1], [2, 5]], dtype=torch.int32)}
    with pytest.raises(ValueError, match=r"^block_table: holds 5 at position \[1, 1\]; a page number must lie in \[0, 5\)"):
        launch("streaming_fused", shape, inputs)
    with pytest.raises(ValueError, match=r"^block_table: missing"):
        launch("streaming_fused", shape, {k: t for k, t in inputs.items() if k != "block_table"})
    with pytest.raises(ValueError, match=r"^block_table: expected an int32 or int64 tensor of shape \(2, >= 2\)"):
        launch("streaming_fused", shape, {**inputs, "block_table": torch.zeros(2, 1, dtype=torch.int32)})
    with pytest.raises(ValueError, match=r"^v: expected pages of shape \(pages, 16, 1, 8\)"):
        launch("streaming_fused", shape, {**inputs, "block_table": inputs["block_table"].clamp(max=4),
                                          "v": torch.randn(5, 8, g, d)})
    with pytest.raises(ValueError, match=r"^block_table: holds 5"):  # the unfused chain checks it too
        launch("unfused_chain", shape, inputs)


def test_the_kernels_read_pages_through_the_table_in_64_bits():
    bound = bind_shape(SPEC, dict(SPEC.example))
    derivation = derive_cascade(SPEC)
    source = generate(SPEC, derivation, "streaming_fused", bound,
                      default_config(SPEC, derivation, "streaming_fused", bound),
                      {"q": "float32", "k": "float32", "v": "float32"}).source
    # the page number is widened before its stride multiplies it: a cache may hold more than 2**31 elements
    assert "stride_block_table__col, mask=offs_n" in source and ".to(tl.int64) * stride_k__page" in source
    assert "tl.minimum(offs_b, size_b - 1) * stride_block_table_b" in source  # never a row past the batch
    assert "WIDE_OFFSETS = wide_offsets(q=q, kv_len=kv_len, k=k[:1], v=v[:1], block_table=block_table, o=o)" in source


BASE = {"foldwise": 1, "name": "p", "outputs": ["o"],
        "inputs": {"x": {"dims": ["b", "n", "c"]}},
        "steps": [{"name": "o", "reduce": "sum", "over": "n", "expr": "x"}]}


@pytest.mark.parametrize("paged, loc, message", [
    ({"dim": "m", "by": ["b"], "table": "t", "page_size": 16}, "inputs.x.paged.dim", "'m' is not a dim of this input"),
    ({"dim": "n", "by": ["n"], "table": "t", "page_size": 16}, "inputs.x.paged.by.0", "not a dim of this input other than 'n'"),
    ({"dim": "n", "by": [], "table": "t", "page_size": 16}, "inputs.x.paged.by", "non-empty list"),
    ({"dim": "n", "by": ["b"], "table": "t", "page_size": 0}, "inputs.x.paged.page_size", "from 1 to 4096"),
    ({"dim": "n", "by": ["b"], "table": "x", "page_size": 16}, "inputs.x.paged.table", "already an input"),
    ({"dim": "n", "by": ["b"], "table": "c", "page_size": 16}, "inputs.x.paged.table", "already an input, param, step or dim"),
    ({"dim": "n", "by": ["b"], "page_size": 16}, "inputs.x.paged.table", "this field is required"),
    ({"dim": "n", "by": ["b"], "table": "t", "page_size": 16, "layout": "HND"}, "inputs.x.paged", "unknown field 'layout'"),
])
def test_a_bad_page_layout_is_refused_naming_the_field(paged, loc, message):
    raw = {**BASE, "inputs": {"x": {**BASE["inputs"]["x"], "paged": paged}}}
    with pytest.raises(SpecError, match=message) as err:
        load_spec(raw)
    assert ".".join(map(str, err.value.loc)) == loc


def test_inputs_paged_through_one_table_agree_on_it():
    raw = {**BASE, "inputs": {"x": {"dims": ["b", "n", "c"], "paged": {"dim": "n", "by": ["b"], "table": "t", "page_size": 16}},
                              "y": {"dims": ["b", "n", "c"], "paged": {"dim": "n", "by": ["b"], "table": "t", "page_size": 32}}},
           "steps": [{"name": "o", "reduce": "sum", "over": "n", "expr": "x * y"}]}
    with pytest.raises(SpecError, match="the inputs it pages must agree") as err:
        load_spec(raw)
    assert err.value.loc == ("inputs", "y", "paged")


def test_a_bundle_takes_the_cache_as_vllm_passes_it():
    """The client's call: q, the caches, kv_len and the block table; n is the table's width in keys
    (FlashAttention's rule), the pages' slots must be the spec's page_size."""
    from fuser_core.problem import make_problem
    from service.bundle import BundleError, load_bundle
    from service.bundle_maker import make_bundle

    b, g, r, m, d = 3, 2, 2, 1, 16
    shape = {"b": b, "g": g, "r": r, "m": m, "n": 3 * PAGE, "d": d, "e": d}
    derivation = derive_cascade(SPEC)
    measured = {"time_ms": 0.01, "measurer": "model", "predicted": True, "device": None,
                "triton_version": "x", "torch_version": "y", "date": "2026-12-06T00:00:00+00:00"}
    dtypes = {"q": "float32", "k": "float32", "v": "float32", "kv_len": "int32"}
    bundle = make_bundle(make_problem(SPEC, shape, dtypes), target="h100", strategy="split_fused",
                         config=default_config(SPEC, derivation, "split_fused", bind_shape(SPEC, shape)).to_dict(),
                         measured=measured)
    kernel = load_bundle(bundle, spec=SPEC)
    assert kernel.input_dims["k"] == ("block_table.pages", "block_table.slot", "g", "d")
    assert kernel.input_dims["block_table"] == ("b", "block_table.cols")
    torch.manual_seed(7)
    kv_len = torch.tensor([40, 3, 17], dtype=torch.int32)
    q, k, v = torch.randn(b, g, r, m, d), torch.randn(b, g, 3 * PAGE, d), torch.randn(b, g, 3 * PAGE, d)
    k_cache, v_cache, table = vllm_cache(k, v, kv_len, pages=11, seed=2)
    table = table[:, :3].contiguous()
    got = kernel(q=q, k=k_cache, v=v_cache, kv_len=kv_len, block_table=table)["o"]
    want = paged_reference(q, k_cache, v_cache, table, kv_len, 1 / math.sqrt(d))
    assert float((got.double() - want).abs().max()) < 1e-5
    with pytest.raises(BundleError, match=r"^inputs\.block_table: its pages hold 8 slots, but the spec's page_size is 16"):
        kernel(q=q, k=k_cache[:, :8], v=v_cache[:, :8], kv_len=kv_len, block_table=table)
    with pytest.raises(BundleError, match=r"^inputs: missing input 'block_table'"):
        kernel(q=q, k=k_cache, v=v_cache, kv_len=kv_len)


def test_the_tuner_times_kernels_reading_pages_made_once():
    """The device measurer's timing sets hold the pages and a table (tuner.device.inputs.as_called),
    so a timed launch never pages a logical tensor; its checked output passes."""
    from tuner.device.inputs import DeviceProblem, problem_payload
    from tuner.device.measurer import DeviceMeasurer
    from tuner.device.timing import TimingSettings
    from tuner.profiles import get_profile
    from tuner.space import SearchSpace
    from fuser_core.problem import make_problem

    shape = dict(SPEC.example)
    derivation = derive_cascade(SPEC)
    problem = make_problem(SPEC, shape, "float32")
    sets = DeviceProblem(problem_payload(problem, derivation), "cpu", {"seed": 1}).timing_sets({}, 0)
    assert tuple(sets[0]["k"].shape) == (2 * 3, PAGE, 2, 16) and tuple(sets[0]["block_table"].shape) == (2, 3)
    space = SearchSpace(problem, derivation, get_profile("h100"))
    measurer = DeviceMeasurer(problem, derivation, get_profile("h100"), device="cpu", timeout_s=120,
                              timing=TimingSettings(cpu_warmup=0, cpu_reps=1))
    try:
        candidate = space.candidate("streaming_fused", {"block_n": 16})
        assert space.check(candidate) is None
        result = measurer.measure(candidate)
    finally:
        measurer.close()
    assert result.error is None and result.details["check"]["passed"], result.error


def test_pages_past_2_31_elements_are_read_where_they_lie():
    """Offsets past 2**31 elements, run (issue 36, 1): a cache of 2**31 + 128 float16 elements per
    tensor whose sequence lives on its last pages and one near its start. torch.empty reserves the
    4 GiB without touching it (only the pages written use memory), so CI runs it: a page offset
    computed in 32 bits would wrap (the interpreter then reads outside the buffer)."""
    g, d, n = 1, 8, 40
    pages = 2**31 // (PAGE * g * d) + 1
    k_cache = torch.empty(pages, PAGE, g, d, dtype=torch.float16)
    v_cache = torch.empty(pages, PAGE, g, d, dtype=torch.float16)
    table = torch.tensor([[pages - 1, pages - 2, 3]], dtype=torch.int32)
    assert (pages - 1) * PAGE * g * d >= 2**31
    torch.manual_seed(11)
    keys, vals = torch.randn(n, g, d).half(), torch.randn(n, g, d).half()
    for j, page in enumerate(table[0].tolist()):
        count = min(PAGE, n - PAGE * j)
        k_cache[page, :count], v_cache[page, :count] = keys[PAGE * j:PAGE * j + count], vals[PAGE * j:PAGE * j + count]
    q = torch.randn(1, g, 1, 1, d).half()
    shape = {"b": 1, "g": g, "r": 1, "m": 1, "n": n, "d": d, "e": d}
    bound = bind_shape(SPEC, shape)
    derivation = derive_cascade(SPEC)
    module = generate(SPEC, derivation, "streaming_fused", bound, default_config(SPEC, derivation, "streaming_fused", bound),
                      {"q": "float16", "k": "float16", "v": "float16", "kv_len": "int32"})
    with interpreter_quiet():
        o = module.load().launch({"q": q, "k": k_cache, "v": v_cache, "block_table": table,
                                  "kv_len": torch.tensor([n], dtype=torch.int32)}, bound, scalars={"scale": d**-0.5})["o"]
    scores = keys[:, 0].double() @ q[0, 0, 0, 0].double() * d**-0.5
    want = torch.softmax(scores, 0) @ vals[:, 0].double()
    assert float((o[0, 0, 0, 0].double() - want).abs().max()) < 2e-3  # float16 output: a few ulps


def test_a_range_over_the_paged_dim_picks_its_bucket_from_the_table():
    """A decode server's range over the context length: the bucket of n is the table's width in
    keys (slice the table to the batch's longest sequence to run a smaller bucket)."""
    from fuser_core.canonical import canonical_names
    from fuser_core.problem import make_problem
    from service.bundle import load_bundle
    from service.bundle_maker import make_bundle
    from service.client.range_kernel import RangeKernel

    base = {"b": 2, "g": 1, "r": 1, "m": 1, "d": 8, "e": 8}
    names = canonical_names(SPEC)
    derivation = derive_cascade(SPEC)
    dtypes = {"q": "float32", "k": "float32", "v": "float32", "kv_len": "int32"}
    measured = {"time_ms": 0.01, "measurer": "model", "predicted": True, "date": "2026-12-06T00:00:00+00:00"}
    buckets = []
    for n in (32, 64):
        shape = {**base, "n": n}
        config = default_config(SPEC, derivation, "streaming_fused", bind_shape(SPEC, shape)).to_dict()
        bundle = make_bundle(make_problem(SPEC, shape, dtypes), target="h100", strategy="streaming_fused",
                             config=config, measured=measured)
        buckets.append(({names[d]: s for d, s in shape.items()}, load_bundle(bundle, spec=SPEC)))
    ranged = {**{names[d]: s for d, s in base.items()}, names["n"]: {"min": 1, "max": 64, "buckets": [32, 64]}}
    kernel = RangeKernel(ranged, buckets)
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 1, 1, 1, 8), torch.randn(2, 1, 64, 8), torch.randn(2, 1, 64, 8)
    kv_len = torch.tensor([30, 7], dtype=torch.int32)
    k_cache, v_cache, table = vllm_cache(k, v, kv_len, pages=9, seed=4)
    want = paged_reference(q, k_cache, v_cache, table, kv_len, 8**-0.5)
    for cols, bucket in ((2, 32), (4, 64)):
        got = kernel(q=q, k=k_cache, v=v_cache, kv_len=kv_len, block_table=table[:, :cols].contiguous())["o"]
        assert kernel.last_bucket["n"] == bucket
        assert float((got.double() - want).abs().max()) < 1e-5
