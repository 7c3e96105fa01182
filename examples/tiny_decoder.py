"""A small decoder-only transformer whose norms, attention and loss run as Foldwise torch ops.

The model is Llama-shaped and written in plain torch: token embedding, pre-norm layers (RMSNorm,
rotary embeddings, grouped-query attention with 4 query heads over 2 key-value heads, SwiGLU MLP),
a final RMSNorm and an LM head, random weights from a seed. One function, :func:`forward`, runs it
with either set of ops:

- :class:`TorchOps`: plain torch (``F.rms_norm``, ``F.scaled_dot_product_attention`` with a
  bottom-right causal mask, ``F.cross_entropy(ignore_index=-100)``), the reference;
- :class:`FoldwiseOps`: the catalog kernels served by ``foldwise serve`` and fetched with
  :class:`service.client.KernelCache`, called as torch operators (``KernelCache.torch_op``):
  ``rmsnorm_residual`` (residual add + norm, both written; the final norm too),
  ``attention_padded`` (GQA, causal aligned bottom-right, a left-padded batch) and
  ``cross_entropy_ignore``.

:func:`generate` runs a prefill over a left-padded batch and then greedy decode steps against a
KV cache (the cache's slices are strided views handed to the kernel as they are; q is viewed as
[b, g, r, m, d], no copy). :func:`compare` runs both, and the Foldwise model again under
``torch.compile(fullgraph=True)``, and reports the logits' normwise error against torch and whether
the tokens agree. :func:`compare_training` (``--train``) runs one SGD step of next-token training on whole
sequences with trainable ops (:meth:`FoldwiseOps.prepare_training`: ``loss.backward()`` runs the backward
kernels Foldwise derives for the norms, attention and the loss) and reports every weight's gradient and the
loss after the step against plain torch. Run it against a server::

    foldwise serve --db sqlite:///foldwise.db &          # or any running server
    python examples/tiny_decoder.py --server http://127.0.0.1:8000 --trials 4 [--train]

Without a GPU, kernels run through Triton's interpreter (``TRITON_INTERPRET=1``): correct, slow.
On a GPU, ``--bench`` adds tokens per second of decode against plain torch and ``torch.compile``.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

EPS = 1e-5  # the model's eps (Llama's), a runtime scalar of rmsnorm_residual (its default is 1e-6)


@dataclass(frozen=True)
class Config:
    vocab: int = 97
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 96
    max_len: int = 16  # the KV cache's length


def init_weights(cfg: Config, seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float | None = None) -> torch.Tensor:
        scale = scale if scale is not None else 1 / math.sqrt(shape[-1])
        return (torch.randn(*shape, generator=g) * scale).to(device)

    w = {"embed": rand(cfg.vocab, cfg.hidden, scale=1.0), "norm": 1 + 0.1 * rand(cfg.hidden, scale=1.0),
         "head": rand(cfg.vocab, cfg.hidden)}
    for i in range(cfg.layers):
        w |= {f"{i}.attn_norm": 1 + 0.1 * rand(cfg.hidden, scale=1.0), f"{i}.mlp_norm": 1 + 0.1 * rand(cfg.hidden, scale=1.0),
              f"{i}.wq": rand(cfg.heads * cfg.head_dim, cfg.hidden), f"{i}.wk": rand(cfg.kv_heads * cfg.head_dim, cfg.hidden),
              f"{i}.wv": rand(cfg.kv_heads * cfg.head_dim, cfg.hidden), f"{i}.wo": rand(cfg.hidden, cfg.heads * cfg.head_dim),
              f"{i}.gate": rand(cfg.ffn, cfg.hidden), f"{i}.up": rand(cfg.ffn, cfg.hidden), f"{i}.down": rand(cfg.hidden, cfg.ffn)}
    return w


# ----------------------------------------------------------------------------- the two sets of ops

class TorchOps:
    """The reference: plain torch."""

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + residual
        return F.rms_norm(h, (h.shape[-1],), w, EPS), h

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_start: torch.Tensor) -> torch.Tensor:
        """q [b, h, m, d] over k, v [b, g, n, d]: the m queries are the last m of the n keys; keys before
        kv_start[b] are left padding. A query that sees no key (a pad row of the prefill) gets 0."""
        m, n = q.shape[2], k.shape[2]
        key = torch.arange(n, device=q.device)
        causal = torch.ones(m, n, dtype=torch.bool, device=q.device).tril(n - m)  # causal_lower_right(m, n)
        mask = causal[None, None] & (key[None, None, None, :] >= kv_start[:, None, None, None])
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return torch.where(mask.any(-1, keepdim=True), o, 0.0)

    def cross_entropy(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target, ignore_index=-100)



class FoldwiseOps:
    """Foldwise kernels from a server, as torch operators. :meth:`prepare` tunes (or finds) one kernel per
    spec at the largest shape the model uses; the calls then run it at every shape it admits (its
    ``size_limits``), with no request: the operators are resolved before the forward, so
    ``torch.compile(fullgraph=True)`` traces the forward with them."""


    def __init__(self, cache, target: str = "h100"):  # noqa: ANN001 (service.client.KernelCache)
        self.cache, self.target, self.ops = cache, target, {}

    @staticmethod
    def shapes(cfg: Config, batch: int, seq: int) -> dict[str, dict[str, int]]:
        """Each op's spec and shape for ``batch`` sequences of ``seq`` positions."""
        t = batch * seq
        return {
            "rmsnorm_residual": {"t": t, "c": cfg.hidden},
            "attention_padded": {"b": batch, "g": cfg.kv_heads, "r": cfg.heads // cfg.kv_heads, "m": seq, "n": seq,
                                 "d": cfg.head_dim, "e": cfg.head_dim},
            "cross_entropy_ignore": {"t": t, "v": cfg.vocab},
        }

    def prepare(self, cfg: Config, batch: int, trials: int | None = None) -> None:
        for name, shape in self.shapes(cfg, batch, cfg.max_len).items():
            try:
                self.ops[name] = self.cache.torch_op(name, shape, "float32", self.target)
            except LookupError:  # service.client.KernelNotFound: tune it now
                self.cache.tune(name, shape, "float32", self.target, trials=trials)
                self.ops[name] = self.cache.torch_op(name, shape, "float32", self.target)

    def prepare_training(self, cfg: Config, batch: int, seq: int, trials: int | None = None) -> None:
        """Trainable operators (``KernelCache.trainable_op``: each forward saves its statistics, and the
        backward specs derived from it run as kernels too) for a batch of whole sequences of ``seq``
        tokens: the norms, attention (causal, no padding: kv_start 0) and the loss with an ignore index,
        whose forward also writes its gradient (scaled after it by the mean's factor). Kernels the server
        lacks are tuned (``trials`` each; the server's default when None)."""
        for name, shape in self.shapes(cfg, batch, seq).items():
            self.ops[name] = self.cache.trainable_op(name, shape, "float32", self.target, tune_if_missing=True,
                                                     tune_budget={"trials": trials} if trials else None)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        out = self.ops["rmsnorm_residual"](x=x.reshape(-1, shape[-1]), residual=residual.reshape(-1, shape[-1]), w=w,
                                           eps=EPS)
        return out["y"].view(shape), out["h"].view(shape)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_start: torch.Tensor) -> torch.Tensor:
        b, h, m, d = q.shape
        g = k.shape[1]
        o = self.ops["attention_padded"](q=q.view(b, g, h // g, m, d), k=k, v=v, kv_start=kv_start)["o"]
        return o.view(b, h, m, v.shape[-1])

    def cross_entropy(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.ops["cross_entropy_ignore"](logits=logits, target=target)["mean"]


# ----------------------------------------------------------------------------- the model

def rotary(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [b, heads, s, d] at positions [b, s] (half-split, as Llama)."""
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = positions[:, None, :, None].float() * inv
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def forward(ops, w: dict[str, torch.Tensor], cfg: Config, tokens: torch.Tensor, start: int,  # noqa: ANN001
            k_cache: torch.Tensor | None, v_cache: torch.Tensor | None, kv_start: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, vocab] of ``tokens`` [b, s] at cache positions start..start + s - 1; writes their keys and
    values into the caches [layers, b, kv_heads, max_len, head_dim], or, with no caches (training: one pass
    over whole sequences, start 0), attends to this pass's keys. Positions count from each sequence's first
    real token (kv_start[b])."""
    b, s = tokens.shape
    n = start + s
    positions = (torch.arange(start, n, device=tokens.device)[None, :] - kv_start[:, None]).clamp(min=0)
    x = w["embed"][tokens]
    residual = torch.zeros_like(x)
    for i in range(cfg.layers):
        y, residual = ops.add_rmsnorm(x, residual, w[f"{i}.attn_norm"])
        q = (y @ w[f"{i}.wq"].T).view(b, s, cfg.heads, cfg.head_dim).transpose(1, 2)
        k = (y @ w[f"{i}.wk"].T).view(b, s, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        v = (y @ w[f"{i}.wv"].T).view(b, s, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = rotary(q, positions), rotary(k, positions)
        if k_cache is not None:
            k_cache[i, :, :, start:n] = k
            v_cache[i, :, :, start:n] = v
            k, v = k_cache[i, :, :, :n], v_cache[i, :, :, :n]  # the cache up to n: strided views, read in place
        o = ops.attention(q.contiguous(), k, v, kv_start)
        x = o.transpose(1, 2).reshape(b, s, cfg.heads * cfg.head_dim) @ w[f"{i}.wo"].T
        y, residual = ops.add_rmsnorm(x, residual, w[f"{i}.mlp_norm"])
        x = (F.silu(y @ w[f"{i}.gate"].T) * (y @ w[f"{i}.up"].T)) @ w[f"{i}.down"].T
    y, _ = ops.add_rmsnorm(x, residual, w["norm"])
    return y @ w["head"].T


def left_padded_batch(cfg: Config, lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of the given lengths, left-padded to the longest (pad token 0): (tokens, kv_start)."""
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    tokens = torch.zeros(len(lengths), s, dtype=torch.long)
    for row, length in enumerate(lengths):
        tokens[row, s - length:] = torch.randint(1, cfg.vocab, (length,), generator=g)
    return tokens, torch.tensor([s - length for length in lengths])


def generate(ops, w, cfg: Config, tokens: torch.Tensor, kv_start: torch.Tensor, steps: int,  # noqa: ANN001
             step_fn=forward) -> dict:  # noqa: ANN001
    """Prefill, its loss (next-token cross-entropy, pad positions ignored), then greedy decode steps:
    {"prefill": logits, "loss": mean loss, "decode": [logits of each step], "tokens": [b, steps]}."""
    b, s = tokens.shape
    device = tokens.device
    caches = [torch.zeros(cfg.layers, b, cfg.kv_heads, cfg.max_len, cfg.head_dim, device=device) for _ in range(2)]
    logits = step_fn(ops, w, cfg, tokens, 0, *caches, kv_start)
    target = torch.cat([tokens[:, 1:], torch.full((b, 1), -100, device=device)], dim=1)
    target = torch.where(torch.arange(s, device=device)[None, :] < kv_start[:, None], -100, target)
    loss = ops.cross_entropy(logits.reshape(b * s, -1), target.reshape(-1))
    out = {"prefill": logits, "loss": loss, "decode": [], "tokens": []}
    nxt = logits[:, -1].argmax(-1)
    for step in range(steps):
        out["tokens"].append(nxt)
        step_logits = step_fn(ops, w, cfg, nxt[:, None], s + step, *caches, kv_start)
        out["decode"].append(step_logits[:, -1])
        nxt = step_logits[:, -1].argmax(-1)
    out["tokens"] = torch.stack(out["tokens"], 1)
    return out


def training_batch(cfg: Config, batch: int, seq: int, prompt: int = 4, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [batch, seq], targets [batch, seq]) of whole sequences (no padding): each target is the
    next token, ignored (-100) over the first ``prompt`` positions (a fine-tuning batch trains on the
    answers only)."""
    ids = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    target = ids[:, 1:].clone()
    target[:, :prompt] = -100
    return ids[:, :-1], target


def train_step(ops, w: dict[str, torch.Tensor], cfg: Config, tokens: torch.Tensor, target: torch.Tensor,  # noqa: ANN001
               lr: float) -> dict:
    """One SGD step of next-token training on ``tokens`` and ``target`` [b, s] (model weights ``w``,
    copied): {"loss": the mean loss before the step, "grads": every weight's gradient, "loss_after": after it}."""
    b, s = tokens.shape
    params = {k: v.detach().clone().requires_grad_() for k, v in w.items()}
    kv_start = torch.zeros(b, dtype=torch.long, device=tokens.device)  # no padding: causal attention

    def loss_of(p: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = forward(ops, p, cfg, tokens, 0, None, None, kv_start)
        return ops.cross_entropy(logits.reshape(b * s, -1), target.reshape(-1))

    loss = loss_of(params)
    loss.backward()  # through the ops' backward (Foldwise's: the derived backward kernels)
    grads = {k: p.grad for k, p in params.items()}
    with torch.no_grad():
        stepped = {k: p - lr * p.grad for k, p in params.items()}
        after = loss_of(stepped)
    return {"loss": loss.detach(), "grads": grads, "loss_after": after}


def compare_training(ops, cfg: Config = Config(), batch: int = 2, seq: int = 12, lr: float = 0.5,  # noqa: ANN001
                     device: str = "cpu") -> list[dict]:
    """Rows of the training table: one SGD step with ``ops`` (prepared for training at ``batch`` x
    ``seq``) against plain torch: the loss before and after the step, and every weight's gradient
    (normwise error)."""
    w = init_weights(cfg, device=device)
    tokens, target = (t.to(device) for t in training_batch(cfg, batch, seq))
    want, got = train_step(TorchOps(), w, cfg, tokens, target, lr), train_step(ops, w, cfg, tokens, target, lr)
    rows = [{"quantity": "loss", "error": abs(float(got["loss"] - want["loss"])), "value": float(want["loss"])},
            {"quantity": "loss after one SGD step", "error": abs(float(got["loss_after"] - want["loss_after"])),
             "value": float(want["loss_after"])}]
    rows += [{"quantity": f"grad {k}", "error": normwise(got["grads"][k], want["grads"][k]),
              "value": float(want["grads"][k].norm())} for k in w]
    return rows


def training_table(rows: list[dict]) -> str:
    lines = ["| quantity | torch's value (norm) | error (normwise for gradients) |", "|---|---|---|"]
    lines += [f"| {r['quantity']} | {r['value']:.4g} | {r['error']:.1e} |" for r in rows]
    return "\n".join(lines)


def normwise(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def compare(cache, cfg: Config = Config(), lengths: tuple[int, ...] = (8, 5), steps: int = 4,  # noqa: ANN001
            trials: int | None = None, compile_backend: str | None = "aot_eager", target: str = "h100",
            device: str = "cpu") -> list[dict]:
    """Rows of the example's table: each phase's logits error against plain torch, and whether tokens agree."""
    w = init_weights(cfg, device=device)
    tokens, kv_start = (t.to(device) for t in left_padded_batch(cfg, list(lengths)))
    fw = FoldwiseOps(cache, target)
    fw.prepare(cfg, len(lengths), trials)
    want = generate(TorchOps(), w, cfg, tokens, kv_start, steps)
    runs = {"foldwise": generate(fw, w, cfg, tokens, kv_start, steps)}
    if compile_backend:
        torch._dynamo.reset()
        runs[f"foldwise, torch.compile(fullgraph=True, backend={compile_backend!r})"] = generate(
            fw, w, cfg, tokens, kv_start, steps,
            step_fn=torch.compile(forward, fullgraph=True, backend=compile_backend, dynamic=False))
    real = torch.arange(tokens.shape[1], device=device)[None, :] >= kv_start[:, None]  # pad rows' logits are no token's
    rows = []
    for name, got in runs.items():
        rows.append({"run": name, "phase": "prefill (left-padded batch)",
                     "logits_err": normwise(got["prefill"][real], want["prefill"][real]),
                     "loss_err": abs(float(got["loss"]) - float(want["loss"])), "tokens_equal": None})
        for step, (g, r) in enumerate(zip(got["decode"], want["decode"])):
            rows.append({"run": name, "phase": f"decode step {step + 1}", "logits_err": normwise(g, r),
                         "loss_err": None, "tokens_equal": bool(torch.equal(got["tokens"][:, step], want["tokens"][:, step]))})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| run | phase | logits error (normwise) | loss error | tokens equal |", "|---|---|---|---|---|"]
    for r in rows:
        loss = "" if r["loss_err"] is None else f"{r['loss_err']:.1e}"
        tok = "" if r["tokens_equal"] is None else ("yes" if r["tokens_equal"] else "NO")
        lines.append(f"| {r['run']} | {r['phase']} | {r['logits_err']:.1e} | {loss} | {tok} |")
    return "\n".join(lines)


def bench(cache, cfg: Config, batch: int, steps: int, target: str, trials: int | None = None,  # noqa: ANN001
          compile_backend: str = "inductor") -> list[dict]:
    """Decode tokens per second on the GPU, each run timed after a warm-up run of the same steps:
    plain torch, plain torch under ``torch.compile``, the Foldwise ops, and the Foldwise ops under
    ``torch.compile(fullgraph=True)``. Tokens are the batch's prompt and generated positions."""
    w = init_weights(cfg, device="cuda")
    tokens, kv_start = (t.cuda() for t in left_padded_batch(cfg, [cfg.max_len // 2] * batch))
    fw = FoldwiseOps(cache, target)
    fw.prepare(cfg, batch, trials)
    runs = [("torch", TorchOps(), forward),
            (f"torch.compile({compile_backend})", TorchOps(), torch.compile(forward, backend=compile_backend)),
            ("foldwise", fw, forward),
            (f"foldwise, torch.compile(fullgraph=True, {compile_backend})", fw,
             torch.compile(forward, fullgraph=True, backend=compile_backend))]
    rows = []
    for name, ops, fn in runs:
        generate(ops, w, cfg, tokens, kv_start, steps, fn)  # warm-up (compiles)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        generate(ops, w, cfg, tokens, kv_start, steps, fn)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        rows.append({"ops": name, "batch": batch, "prompt": tokens.shape[1], "steps": steps, "seconds": seconds,
                     "tokens_per_s": batch * (steps + tokens.shape[1]) / seconds})
    return rows


def bench_table(rows: list[dict]) -> str:
    lines = ["| ops | batch | prompt | decode steps | seconds | tokens/s |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['ops']} | {r['batch']} | {r['prompt']} | {r['steps']} | {r['seconds']:.3f} | "
              f"{r['tokens_per_s']:.0f} |" for r in rows]
    return "\n".join(lines)


def graph_capture(cache, cfg: Config, batch: int, target: str, trials: int | None = None) -> dict:  # noqa: ANN001
    """The Foldwise ops of one decode step (residual add + RMSNorm, then attention over the KV cache)
    captured in a CUDA graph and replayed on new data: a host synchronisation, an HTTP request or
    a disk read on the call path would fail the capture or miss the replayed data. Their outputs
    after the replay against plain torch on the same data (max absolute difference)."""
    fw = FoldwiseOps(cache, target)
    fw.prepare(cfg, batch, trials)
    g = torch.Generator(device="cuda").manual_seed(5)
    x, residual = (torch.randn(batch, 1, cfg.hidden, device="cuda", generator=g) for _ in range(2))
    norm_w = torch.randn(cfg.hidden, device="cuda", generator=g)
    n = cfg.max_len
    q = torch.randn(batch, cfg.heads, 1, cfg.head_dim, device="cuda", generator=g)
    k, v = (torch.randn(batch, cfg.kv_heads, n, cfg.head_dim, device="cuda", generator=g) for _ in range(2))
    kv_start = torch.arange(batch, device="cuda") % (n // 2)

    def step() -> tuple[torch.Tensor, ...]:
        y, h = fw.add_rmsnorm(x, residual, norm_w)
        return y, h, fw.attention(q, k, v, kv_start)

    side = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graphs asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    for t in (x, residual, q, k, v):  # new data in the captured buffers
        t.copy_(torch.randn(t.shape, device="cuda", generator=g))
    graph.replay()
    torch.cuda.synchronize()
    torch_ops = TorchOps()
    want = (*torch_ops.add_rmsnorm(x, residual, norm_w), torch_ops.attention(q, k, v, kv_start))
    return {"captured": True, "replayed": True, "batch": batch, "kv_len": n,
            "max_abs_err": max(float((a - b).abs().max()) for a, b in zip(got, want))}


def main(argv: list[str] | None = None) -> int:
    import json
    import os

    from service.client import KernelCache

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", required=True, help="the Foldwise server's URL")
    ap.add_argument("--token", default=None)
    ap.add_argument("--target", default="h100")
    ap.add_argument("--trials", type=int, default=None, help="tuning trials per missing kernel (server default)")
    ap.add_argument("--backend", default="aot_eager", help="torch.compile backend for the compiled run ('' skips it)")
    ap.add_argument("--bench", action="store_true",
                    help="on a GPU: decode tokens/s against torch and torch.compile, and a CUDA-graph capture")
    ap.add_argument("--train", action="store_true",
                    help="also one training step (gradients through the trainable ops) against torch")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    if args.bench and not gpu:
        ap.error("--bench needs a CUDA GPU (and TRITON_INTERPRET unset)")
    results: dict = {"device": torch.cuda.get_device_name(0) if gpu else "cpu (Triton's interpreter)"}
    with KernelCache(args.server, token=args.token) as cache:
        rows = compare(cache, trials=args.trials, compile_backend=args.backend or None, target=args.target,
                       device="cuda" if gpu else "cpu")
        results["compare"] = rows
        print(table(rows))
        if args.bench:
            cfg = Config(max_len=512)
            results["bench"] = bench(cache, cfg, batch=8, steps=64, target=args.target, trials=args.trials)
            results["bench_table"] = bench_table(results["bench"])
            print(results["bench_table"])
            results["graph_capture"] = graph_capture(cache, cfg, batch=8, target=args.target, trials=args.trials)
            print(f"CUDA graph capture of a decode step's Foldwise ops: {results['graph_capture']}")
        if args.train:
            fw = FoldwiseOps(cache, args.target)
            fw.prepare_training(Config(), batch=2, seq=12, trials=args.trials)
            results["training"] = compare_training(fw, device="cuda" if gpu else "cpu")
            print(training_table(results["training"]))
    ok = all(r["tokens_equal"] is not False and r["logits_err"] <= 1e-5 for r in rows)
    ok = ok and all(r["error"] <= 1e-5 for r in results.get("training", ()))
    results["passed"] = ok
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
