"""The end-to-end example (issue 24, 6): examples/tiny_decoder.py, a small Llama-shaped decoder in plain torch,
runs prefill over a left-padded batch and greedy decode with a KV cache and GQA, its norms, attention and loss
through Foldwise torch ops whose kernels a real ``foldwise serve`` tunes and serves; it matches the same model in
plain torch (float32, Triton's interpreter) and again under ``torch.compile(fullgraph=True)``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from service.client import KernelCache
from tests.e2e.test_serve_processes import start_serve

ROOT = Path(__file__).resolve().parents[2]


def load_example():
    spec = importlib.util.spec_from_file_location("tiny_decoder", ROOT / "examples" / "tiny_decoder.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["tiny_decoder"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_tiny_decoder_matches_torch_through_served_kernels(tmp_path: Path) -> None:
    example = load_example()
    server, base, _ = start_serve(tmp_path, 1)
    try:
        with KernelCache(base, cache_dir=tmp_path / "client") as cache:
            rows = example.compare(cache, trials=2)
        print("\n" + example.table(rows))
        runs = {r["run"] for r in rows}
        assert len(runs) == 2 and any("fullgraph=True" in r for r in runs)  # eager and compiled
        assert all(r["logits_err"] <= 1e-5 for r in rows), example.table(rows)
        assert all(r["tokens_equal"] for r in rows if r["tokens_equal"] is not None), example.table(rows)
        assert all(r["loss_err"] <= 1e-5 for r in rows if r["loss_err"] is not None), example.table(rows)
        assert sum(r["phase"].startswith("decode") for r in rows) == 8
    finally:
        server.terminate()
        server.wait(timeout=60)
