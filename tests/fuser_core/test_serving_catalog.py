"""The serving catalog (issue 24, 1): each spec an inference server needs, run through every
strategy's kernel (Triton's interpreter) on sizes that are no multiple of the tiles, against the
torch (or FlashAttention-convention) call its doc line names, in float64.

Attention specs take the grouped layout [b, g, r, m, d] (a view of the usual [b, h, m, d], no
copy) and align the causal diagonal bottom-right: decode (m = 1) and chunked prefill (m = 3)
against a KV cache of n = 37 keys, checked against SDPA with ``causal_lower_right`` and
``enable_gqa=True``. A query that sees no key gets 0 (FlashAttention's convention).
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from fuser_core.catalog import catalog_entries, load_catalog_spec
from fuser_core.codegen.plan import BASELINE, STRATEGIES, KernelConfig
from fuser_core.derive import derive_cascade
from fuser_core.problem import ShapeError
from fuser_core.reference import evaluate
from fuser_core.runner import interpreter_quiet, run
from fuser_core.spec import load_spec

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

ALL = (*STRATEGIES, BASELINE)
B, G, R, N, D, E = 2, 2, 2, 37, 7, 6  # n = 37: four tiles of 8 and a partial one
SERVING = ("attention_gqa", "attention_padded", "attention_varlen", "attention_sliding_window",
           "attention_softcap", "attention_sink", "cross_entropy_ignore", "rmsnorm_residual", "swiglu_fp8_per_token",
           "rmsnorm_fp8_per_token", "rmsnorm_residual_fp8_per_token", "rmsnorm_fp8_per_block")


def config(strategy: str, blocks: dict[str, int], resident_tiles: bool = False) -> KernelConfig | None:
    if strategy == BASELINE or (strategy == "row_resident" and not resident_tiles):
        return None
    return KernelConfig(blocks, split=3 if strategy == "split_fused" else 1)


@pytest.fixture(scope="module")
def derived():
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            spec = load_catalog_spec(name)
            cache[name] = (spec, derive_cascade(spec))
        return cache[name]
    return get


def run_all(derived, name: str, shape: dict[str, int], inputs: dict[str, np.ndarray], blocks: dict[str, int],
            dtype: str | dict = "float32", resident_tiles: bool = False) -> dict[str, dict[str, np.ndarray]]:
    """Every strategy's outputs, as float64 arrays (fp8 outputs as their float values)."""
    spec, d = derived(name)
    out = {}
    for strategy in ALL:
        with interpreter_quiet():
            result = run(spec, shape, dtype, inputs, strategy=strategy, config=config(strategy, blocks, resident_tiles),
                         derivation=d)
        out[strategy] = {k: v.float().double().cpu().numpy() for k, v in result.outputs.items()}
    return out


def test_catalog_docs_name_the_call_they_match():
    docs = {e.name: e.doc or "" for e in catalog_entries()}
    for name in SERVING:
        assert "Matches" in docs[name] or "as torch" in docs[name], name


# ----------------------------------------------------------------------------- attention

def sdpa_mask(name: str, m: int, extra: dict) -> torch.Tensor:
    """[b, 1, m, n] bool: which keys each query sees, per the call the spec's doc names."""
    query = torch.arange(m)[:, None]
    key = torch.arange(N)[None, :]
    causal = torch.ones(m, N, dtype=torch.bool).tril(N - m)  # causal_lower_right(m, n), checked below
    mask = causal.expand(B, 1, m, N).clone()
    for b in range(B):
        if name == "attention_padded":
            mask[b, 0] &= key >= extra["kv_start"][b]
        elif name == "attention_varlen":  # the m queries are the last m of the kv_len[b] keys
            length = extra["kv_len"][b]
            mask[b, 0] = (key < length) & (key <= query + length - m)
        elif name == "attention_sliding_window":
            mask[b, 0] &= key > query + N - m - extra["window"]
    return mask


def torch_attention(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extra: dict) -> torch.Tensor:
    m = q.shape[3]
    qh = q.reshape(B, G * R, m, D)  # the usual [b, h, m, d]: query heads g * r, grouped by key-value head
    if name == "attention_gqa":
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=causal_lower_right(m, N), enable_gqa=True,
                                           scale=extra.get("scale"))
        return o.reshape(B, G, R, m, E)
    mask = sdpa_mask(name, m, extra)
    if name == "attention_softcap":  # FlashAttention's softcap: cap * tanh(q.k * scale / cap), then the mask
        kk, vv = k.repeat_interleave(R, 1), v.repeat_interleave(R, 1)
        s = qh @ kk.transpose(-1, -2) * extra.get("scale", 1 / math.sqrt(D))
        s = extra["softcap"] * torch.tanh(s / extra["softcap"])
        o = torch.softmax(s.masked_fill(~mask, -math.inf), -1) @ vv
    else:
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, enable_gqa=True)
    sees_nothing = ~mask.any(-1, keepdim=True).expand(B, G * R, m, 1)
    return torch.where(sees_nothing, 0.0, o).reshape(B, G, R, m, E)


ATTENTION_CASES = [
    ("attention_gqa", 1, {}), ("attention_gqa", 3, {"scale": 0.3}),
    ("attention_padded", 3, {"kv_start": [0, 30]}), ("attention_padded", 1, {"kv_start": [5, 37]}),
    ("attention_varlen", 3, {"kv_len": [37, 20]}), ("attention_varlen", 1, {"kv_len": [1, 0]}),
    ("attention_softcap", 3, {"softcap": 30.0}),  # a runtime scalar: not the spec's default, 50
]


def test_the_mask_is_torchs_lower_right_causal_bias():
    for m in (1, 3, N):
        got = sdpa_mask("attention_gqa", m, {})[0, 0]
        assert torch.equal(got, causal_lower_right(m, N)._materialize())


@pytest.mark.parametrize("name,m,extra", ATTENTION_CASES, ids=[f"{n}-m{m}-{i}" for i, (n, m, _) in enumerate(ATTENTION_CASES)])
def test_attention_matches_torch(derived, name, m, extra):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s) for s in ((B, G, R, m, D), (B, G, N, D), (B, G, N, E)))
    if name == "attention_softcap":  # scores large enough for the cap to bend them
        q *= 12
    inputs = {"q": q, "k": k, "v": v, **{key: np.array(val) for key, val in extra.items() if key in ("kv_start", "kv_len")},
              **{key: val for key, val in extra.items() if key in ("scale", "softcap")}}  # runtime scalars
    want = torch_attention(name, *(torch.tensor(x) for x in (q, k, v)), extra).numpy()
    shape = {"b": B, "g": G, "r": R, "m": m, "n": N, "d": D, "e": E}
    for strategy, got in run_all(derived, name, shape, inputs, {"n": 8, "e": 4}).items():
        np.testing.assert_allclose(got["o"], want, rtol=2e-5, atol=2e-6, err_msg=f"{name} {strategy}")


@pytest.mark.parametrize("m", [1, 3, N])
def test_causal_attention_is_aligned_bottom_right_in_every_strategy(derived, m):
    """attention_causal (issue 36, 2): one causal meaning across the catalog. At m = 3 over n = 37 keys
    (chunked prefill) and m = 1 (decode) it is SDPA with causal_lower_right, in every strategy; at
    m = n the usual causal mask. The top-left mask it had gave decode v[..., :1, :] instead."""
    rng = np.random.default_rng(8)
    b, h = 2, 3
    q, k, v = rng.standard_normal((b, h, m, D)), rng.standard_normal((b, h, N, D)), rng.standard_normal((b, h, N, E))
    want = F.scaled_dot_product_attention(*(torch.tensor(x) for x in (q, k, v)), attn_mask=causal_lower_right(m, N))
    shape = {"b": b, "h": h, "m": m, "n": N, "d": D, "e": E}
    for strategy, got in run_all(derived, "attention_causal", shape, {"q": q, "k": k, "v": v},
                                 {"n": 8, "m": 16, "e": 8}).items():
        np.testing.assert_allclose(got["o"], want.numpy(), rtol=2e-5, atol=2e-6, err_msg=f"m={m} {strategy}")


@pytest.mark.parametrize("name", ["attention_causal", "attention_gqa", "attention_padded", "attention_varlen",
                                  "attention_sliding_window", "attention_softcap"])
def test_a_causal_spec_refuses_more_queries_than_keys_naming_both(name):
    """The m queries are the last m of the n keys: the docs exclude m > n, and the specs say so
    (``"constraints": ["m <= n"]``), so such a call is refused, never run."""
    spec = load_catalog_spec(name)
    shape = {d: 2 for d in spec.sized_dims} | {"m": 5, "n": 4}
    with pytest.raises(ShapeError, match=r"^shape\.m: m = 5 and n = 4: the spec takes only m <= n$"):
        run(spec, shape, "float32", {})


def gpt_oss_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """gpt-oss's reference ``sdpa`` with sinks: each head's sink logit is a column appended to the scores,
    softmax over it, the column dropped, times v."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    column = sink.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return weights @ v


def test_attention_sink_matches_gpt_oss_reference(derived):
    rng = np.random.default_rng(13)
    b, h, m, n, d, e = 2, 3, 5, N, D, E
    q, k, v = rng.standard_normal((b, h, m, d)), rng.standard_normal((b, h, n, d)), rng.standard_normal((b, h, n, e))
    k[1, 2] += 40  # one head's scores near 100 (q . k / sqrt(d) with a large shared offset)
    sink = np.array([-np.inf, 0.5, 60.0])  # no sink, a small one, one above most scores
    want = gpt_oss_sink_attention(*(torch.tensor(a) for a in (q, k, v, sink))).numpy()
    for strategy, got in run_all(derived, "attention_sink", {"b": b, "h": h, "m": m, "n": n, "d": d, "e": e},
                                 {"q": q, "k": k, "v": v, "sink": sink}, {"n": 8, "d": 8, "e": 8}).items():
        np.testing.assert_allclose(got["o"], want, rtol=2e-4, atol=2e-5, err_msg=strategy)


def test_sliding_window_matches_torchs_band():
    """The catalog's window (4096) holds a whole test cache; a window of 5 keys cuts into it."""
    raw = json.loads(next(e.path for e in catalog_entries() if e.name == "attention_sliding_window").read_text())
    raw["params"]["window"] = 5
    narrow = load_spec(raw)
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal(s) for s in ((B, G, R, 3, D), (B, G, N, D), (B, G, N, E)))
    want = torch_attention("attention_sliding_window", *(torch.tensor(x) for x in (q, k, v)), {"window": 5}).numpy()
    shape = {"b": B, "g": G, "r": R, "m": 3, "n": N, "d": D, "e": E}
    d = derive_cascade(narrow)
    for strategy in ALL:
        with interpreter_quiet():
            got = run(narrow, shape, "float32", {"q": q, "k": k, "v": v}, strategy=strategy,
                      config=config(strategy, {"n": 8, "e": 4}), derivation=d).outputs["o"].double().numpy()
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=strategy)


def test_padding_slots_never_reach_the_output(derived):
    """A left-padded cache's pad slots hold garbage (torch.empty: NaN, infinities, huge numbers); a query never
    sees them, in any strategy (fuser_core.masks: a where() on index inputs drops the elements it masks)."""
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal(s) for s in ((B, G, R, 1, D), (B, G, N, D), (B, G, N, E)))
    clean = run_all(derived, "attention_padded", {"b": B, "g": G, "r": R, "m": 1, "n": N, "d": D, "e": E},
                    {"q": q, "k": k, "v": v, "kv_start": np.array([4, 9])}, {"n": 8, "e": 4})
    k[0, :, :4], v[0, :, :4], k[1, :, :9], v[1, :, :9] = np.nan, np.inf, 1e4, -np.inf
    dirty = run_all(derived, "attention_padded", {"b": B, "g": G, "r": R, "m": 1, "n": N, "d": D, "e": E},
                    {"q": q, "k": k, "v": v, "kv_start": np.array([4, 9])}, {"n": 8, "e": 4})
    for strategy in ALL:
        np.testing.assert_array_equal(dirty[strategy]["o"], clean[strategy]["o"], err_msg=strategy)


# ----------------------------------------------------------------------------- cross-entropy

def test_cross_entropy_ignore_index_matches_torch(derived):
    rng = np.random.default_rng(7)
    t, vocab = 11, 37
    logits = rng.standard_normal((t, vocab)) * 3
    logits[2] += 100  # logits near 100
    target = rng.integers(0, vocab, t)
    target[[1, 4, 5]] = -100
    want_loss = F.cross_entropy(torch.tensor(logits), torch.tensor(target), ignore_index=-100, reduction="none")
    want_mean = F.cross_entropy(torch.tensor(logits), torch.tensor(target), ignore_index=-100)
    for strategy, got in run_all(derived, "cross_entropy_ignore", {"t": t, "v": vocab},
                                 {"logits": logits, "target": target}, {"v": 8, "t": 4}).items():
        np.testing.assert_allclose(got["loss"], want_loss.numpy(), rtol=1e-5, atol=1e-5, err_msg=strategy)
        assert np.all(got["loss"][[1, 4, 5]] == 0), strategy
        np.testing.assert_allclose(got["mean"], want_mean.numpy(), rtol=1e-5, err_msg=strategy)


def test_cross_entropy_every_label_ignored_is_zero(derived):
    logits = np.random.default_rng(8).standard_normal((5, 9))
    for strategy, got in run_all(derived, "cross_entropy_ignore", {"t": 5, "v": 9},
                                 {"logits": logits, "target": np.full(5, -100)}, {"v": 8, "t": 4}).items():
        assert np.all(got["loss"] == 0) and got["mean"] == 0, strategy


@pytest.mark.parametrize("name,label,allowed", [("cross_entropy", -100, "[0, 9)"), ("cross_entropy", 9, "[0, 9)"),
                                                ("cross_entropy_ignore", 9, "[0, 9) or -100"),
                                                ("cross_entropy_ignore", -1, "[0, 9) or -100")])
def test_out_of_range_labels_are_refused(derived, name, label, allowed):
    spec, d = derived(name)
    target = np.array([0, 3, label, 1, 2])
    with pytest.raises(ShapeError, match=rf"inputs.target: holds {label} at position \[2\].*{re.escape(allowed)}"):
        run(spec, {"t": 5, "v": 9}, "float32", {"logits": np.zeros((5, 9)), "target": target}, derivation=d)


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_cross_entropy_bf16_logits_with_int32_or_int64_labels(derived, index_dtype):
    """One job binds a dtype per input (issue 24): bf16 logits with int32 or int64 labels, as the
    float64 formula over the bf16-rounded logits gives it, within bf16's rounding of the outputs."""
    rng = np.random.default_rng(11)
    t, vocab = 9, 37
    logits = rng.standard_normal((t, vocab)) * 3
    logits[3] += 100
    target = rng.integers(0, vocab, t)
    target[[2, 6]] = -100
    rounded = torch.tensor(logits).bfloat16().double()
    want = F.cross_entropy(rounded, torch.tensor(target), ignore_index=-100, reduction="none").numpy()
    dtype = {"logits": "bfloat16", "target": index_dtype}
    for strategy, got in run_all(derived, "cross_entropy_ignore", {"t": t, "v": vocab},
                                 {"logits": logits, "target": target}, {"v": 8, "t": 4}, dtype=dtype).items():
        np.testing.assert_allclose(got["loss"], want, rtol=2.0**-7, atol=2.0**-7, err_msg=strategy)
        assert np.all(got["loss"][[2, 6]] == 0), strategy
    spec, d = derived("cross_entropy_ignore")
    target[4] = vocab  # still refused as an int32 or int64 label
    with pytest.raises(ShapeError, match=rf"inputs.target: holds {vocab} at position \[4\]"):
        run(spec, {"t": t, "v": vocab}, dtype, {"logits": logits, "target": target}, derivation=d)


def test_a_float_input_of_another_dtype_than_the_rest_is_bound_as_given(derived):
    """bf16 activations with an fp32 weight (one job, issue 24): the output is stored in bf16 and lies
    within one bf16 ulp of the float64 result over the bf16 x and the float32 weight (HF's RMSNorm
    computes in float32 and rounds once: half an ulp)."""
    spec, d = derived("rmsnorm")
    rng = np.random.default_rng(12)
    t, c = 5, 37
    x, w = rng.standard_normal((t, c)), rng.standard_normal(c)
    want = F.rms_norm(torch.tensor(x).bfloat16().double(), (c,), torch.tensor(w).float().double(), eps=1e-6)
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs())) - 7)  # bf16 keeps 8 significant bits
    for strategy in ALL:
        with interpreter_quiet():
            result = run(spec, {"t": t, "c": c}, {"x": "bfloat16", "w": "float32"}, {"x": x, "w": w},
                         strategy=strategy, config=config(strategy, {"c": 8}), derivation=d)
        y = result.outputs["y"]
        assert y.dtype == torch.bfloat16, strategy
        assert torch.all((y.double() - want).abs() <= ulp), strategy


# ----------------------------------------------------------------------------- norms and activations

def test_rmsnorm_residual_matches_torch(derived):
    rng = np.random.default_rng(9)
    t, c = 5, 37
    x, residual = rng.standard_normal((t, c)), rng.standard_normal((t, c)) * 50  # a residual stream grows large
    w = rng.standard_normal(c)
    x[2], residual[2] = x[2] * 1e-3, residual[2] * 2e-5  # a quiet row: mean(h^2) near eps, which then matters
    h = torch.tensor(x) + torch.tensor(residual)
    want_y = F.rms_norm(h, (c,), torch.tensor(w), eps=1e-5)  # the model's eps, a runtime scalar (default 1e-6)
    for strategy, got in run_all(derived, "rmsnorm_residual", {"t": t, "c": c},
                                 {"x": x, "residual": residual, "w": w, "eps": 1e-5}, {"c": 8}).items():
        h32 = (torch.tensor(x).float() + torch.tensor(residual).float()).double()  # the float32 sum, as torch's
        np.testing.assert_array_equal(got["h"], h32.numpy(), err_msg=strategy)
        np.testing.assert_allclose(got["y"], want_y.numpy(), rtol=2e-5, atol=2e-6, err_msg=strategy)


def vllm_swiglu_fp8(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's silu_and_mul then scaled_fp8_quant(use_per_token_if_dynamic=True), in float32."""
    a = F.silu(gate) * up
    scale = torch.clamp(a.abs().amax(-1, keepdim=True) / 448, min=1 / (448 * 512))
    return (a / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def test_swiglu_fp8_matches_vllms_formula(derived):
    rng = np.random.default_rng(10)
    t, f = 5, 37
    both = rng.standard_normal((t, 2 * f)).astype(np.float32)  # vLLM's [t, 2f]: gate first, then up
    both[3] *= 1e-4  # a quiet row: the scale floor decides
    gate, up = both[:, :f], both[:, f:]
    want_q, want_scale = vllm_swiglu_fp8(torch.tensor(gate), torch.tensor(up))
    for strategy, got in run_all(derived, "swiglu_fp8_per_token", {"t": t, "f": f},
                                 {"gate": gate, "up": up}, {"f": 8}).items():
        np.testing.assert_allclose(got["scale"], want_scale[:, 0].double().numpy(), rtol=1e-6, err_msg=strategy)
        # one fp8 step of rounding apart at most (a / scale in float32 may land either side of a tie)
        q, ref = got["q"], want_q.double().numpy()
        assert np.all(np.abs(q - ref) <= np.abs(ref) * 2 ** -3 + 2 ** -9), strategy
        assert np.mean(q == ref) > 0.95, strategy


def vllm_rms_norm_fp8(x: torch.Tensor, w: torch.Tensor, eps: float, group: int | None = None,
                      rounded_to: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's rms_norm_dynamic_per_token_quant (group None) and rms_norm_per_block_quant (scales [t, c / group],
    row-major) on x [t, c]: rms = rsqrt(mean(x^2) + eps); y = x * rms * w; scale = max(amax / 448, 1 / (448 * 512))
    over the token or the group; q = fp8(y / scale). ``rounded_to``: vLLM's own rounding of x * rms and of y to
    the activation dtype (None: float32 throughout, the catalog specs' formula)."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    y = y.to(rounded_to).float() * w.float() if rounded_to is not None else y * w.float()
    if rounded_to is not None:
        y = y.to(rounded_to).float()
    blocks = y.unflatten(-1, (-1, group)) if group else y.unsqueeze(-2)
    scale = torch.clamp(blocks.abs().amax(-1, keepdim=True) / 448, min=1 / (448 * 512))
    q = (blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn).flatten(-2)
    return q, scale.squeeze(-1) if group else scale[..., 0, 0]


def assert_fp8_close(got: np.ndarray, want: torch.Tensor, what: str, tied: float = 0.95) -> None:
    """fp8 values one e4m3 step apart at most (y / scale in float32 may land either side of a tie)."""
    ref = want.double().numpy().reshape(got.shape)
    assert np.all(np.abs(got - ref) <= np.abs(ref) * 2 ** -3 + 2 ** -9), what
    assert np.mean(got == ref) > tied, what


NORM_FP8 = {  # catalog spec -> (its shape at t tokens of hidden size c, vLLM's block, the inputs' dims)
    "rmsnorm_fp8_per_token": (lambda t, c: {"t": t, "c": c}, None),
    "rmsnorm_residual_fp8_per_token": (lambda t, c: {"t": t, "c": c}, None),
    "rmsnorm_fp8_per_block": (lambda t, c: {"t": t, "g": c // 16, "c": 16}, 16),
}


@pytest.mark.parametrize("name", sorted(NORM_FP8))
def test_norm_fp8_quantisation_matches_vllms_formula(derived, name):
    """Issue 36: RMSNorm + fp8 e4m3 quantisation per token and per block (and after a residual add),
    in every strategy, against vLLM's formulas in float32: the scales to float32 rounding, q to one
    fp8 step; a quiet row and a quiet block take the scale floor; h (the residual) is x + residual."""
    shape_of, group = NORM_FP8[name]
    rng = np.random.default_rng(12)
    t, c, eps = 5, 48, 1e-6
    x = rng.standard_normal((t, c)).astype(np.float32) * 3
    residual = rng.standard_normal((t, c)).astype(np.float32)
    x[2] *= 1e-9  # a quiet token (mean(x^2) far below eps): the floor 1 / (448 * 512) decides its scale
    residual[2] *= 1e-9
    x[4, :16] *= 1e-9  # a quiet first block in a loud token
    residual[4, :16] *= 1e-9
    w = (rng.standard_normal(c) * 0.5 + 1).astype(np.float32)
    h = x + residual if "residual" in name else x
    want_q, want_scale = vllm_rms_norm_fp8(torch.tensor(h), torch.tensor(w), eps, group)
    shape = shape_of(t, c)
    inputs = {"x": x.reshape([shape[d] for d in ("t", "g", "c") if d in shape]),
              "w": w.reshape([shape[d] for d in ("g", "c") if d in shape])}
    if "residual" in name:
        inputs["residual"] = residual
    results = run_all(derived, name, shape, inputs, {"c": 8})
    assert len(results) == len(ALL)
    for strategy, got in results.items():
        np.testing.assert_allclose(got["scale"], want_scale.double().numpy().reshape(got["scale"].shape),
                                   rtol=2e-6, err_msg=f"{name} {strategy}")
        assert_fp8_close(got["q"], want_q, f"{name} {strategy}")
        if "residual" in name:
            np.testing.assert_array_equal(got["h"], h, err_msg=strategy)
    floor = np.float32(1 / (448 * 512))
    assert np.all(results["unfused_chain"]["scale"].reshape(t, -1)[2] == floor)
    assert (results["unfused_chain"]["scale"].reshape(t, -1)[4, 0] == floor) == (group is not None)


@pytest.mark.parametrize("name", sorted(NORM_FP8))
def test_norm_fp8_quantisation_in_bf16_is_vllms_up_to_its_rounding_of_y(derived, name):
    """In bf16 the catalog keeps y in float32 where vLLM rounds x * rsqrt(...) and y to bf16: the scales
    differ by at most two bf16 roundings, and q by one fp8 step where the rounding crosses a tie."""
    shape_of, group = NORM_FP8[name]
    rng = np.random.default_rng(13)
    t, c = 4, 64
    x = torch.tensor(rng.standard_normal((t, c)) * 2, dtype=torch.bfloat16)
    w = torch.tensor(rng.standard_normal(c) * 0.5 + 1, dtype=torch.bfloat16)
    residual = torch.tensor(rng.standard_normal((t, c)), dtype=torch.bfloat16)
    h = (x.float() + residual.float()).to(torch.bfloat16) if "residual" in name else x  # vLLM's rounded h
    want_q, want_scale = vllm_rms_norm_fp8(h, w, 1e-6, group, rounded_to=torch.bfloat16)
    spec, d = derived(name)
    shape = shape_of(t, c)
    inputs = {"x": x.float().numpy().reshape([shape[k] for k in ("t", "g", "c") if k in shape]),
              "w": w.float().numpy().reshape([shape[k] for k in ("g", "c") if k in shape])}
    if "residual" in name:
        inputs["residual"] = residual.float().numpy()
    with interpreter_quiet():
        result = run(spec, shape, "bfloat16", inputs, derivation=d)
    assert result.outputs["scale"].dtype == torch.float32 and result.outputs["q"].dtype == torch.float8_e4m3fn
    got_scale = result.outputs["scale"].double().numpy().reshape(want_scale.shape)
    np.testing.assert_allclose(got_scale, want_scale.double().numpy(), rtol=2 * 2 ** -8)
    assert_fp8_close(result.outputs["q"].double().numpy(), want_q, name, tied=0.8)


@pytest.mark.parametrize("name,extra", [("attention_padded", {"kv_start": np.array([0, 3])}),
                                        ("attention_varlen", {"kv_len": np.array([8, 0])})])
def test_queries_that_see_no_key_under_tensor_core_tiles(derived, name, extra):
    """A left-padded prefill's pad queries see no key; with tiles large enough for tl.dot (m, n, e = 16) the
    fallback pass's product exp(where(C, s, -inf) - mx) * v is masked too: 0, never 0 / 0 (the example model's
    prefill, examples/tiny_decoder.py)."""
    rng = np.random.default_rng(11)
    m = n = 8
    q, k, v = (rng.standard_normal(s) for s in ((B, G, R, m, 16), (B, G, n, 16), (B, G, n, 16)))
    shape = {"b": B, "g": G, "r": R, "m": m, "n": n, "d": 16, "e": 16}
    want = evaluate(derived(name)[0], shape, {"q": q, "k": k, "v": v, **extra})["o"]
    assert np.any(np.all(want == 0, axis=-1))  # some query sees nothing
    for strategy, got in run_all(derived, name, shape, {"q": q, "k": k, "v": v, **extra},
                                 {"n": 16, "m": 16, "e": 16}, resident_tiles=True).items():
        np.testing.assert_allclose(got["o"], want, rtol=2e-5, atol=2e-6, err_msg=strategy)
