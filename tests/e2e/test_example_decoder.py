"""The end-to-end example (issue 24, 6): examples/tiny_decoder.py, a small Llama-shaped decoder in plain torch,
runs prefill over a left-padded batch and greedy decode with a KV cache and GQA, its norms, attention and loss
through Foldwise torch ops whose kernels a real ``foldwise serve`` tunes and serves; it matches the same model in
plain torch (float32, Triton's interpreter) and again under ``torch.compile(fullgraph=True)``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.e2e.test_serve_processes import start_serve

ROOT = Path(__file__).resolve().parents[2]


def load_example():
    spec = importlib.util.spec_from_file_location("tiny_decoder", ROOT / "examples" / "tiny_decoder.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["tiny_decoder"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_tiny_decoder_matches_torch_through_served_kernels(tmp_path: Path) -> None:
    """The example's own command line (as the GPU check runs it, there with --bench), its JSON read back."""
    example = load_example()
    server, base, _ = start_serve(tmp_path, 1)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "FOLDWISE_CACHE_DIR": str(tmp_path / "client"), "TRITON_INTERPRET": "1"}
    try:
        proc = subprocess.run([sys.executable, str(ROOT / "examples" / "tiny_decoder.py"), "--server", base,
                               "--trials", "2", "--json", str(tmp_path / "decoder.json")],
                              capture_output=True, text=True, env=env, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        results = json.loads((tmp_path / "decoder.json").read_text())
        rows = results["compare"]
        print("\n" + example.table(rows))
        assert results["passed"] is True and "| foldwise | decode step 4 |" in proc.stdout
        runs = {r["run"] for r in rows}
        assert len(runs) == 2 and any("fullgraph=True" in r for r in runs)  # eager and compiled
        assert all(r["logits_err"] <= 1e-5 for r in rows), example.table(rows)
        assert all(r["tokens_equal"] for r in rows if r["tokens_equal"] is not None), example.table(rows)
        assert all(r["loss_err"] <= 1e-5 for r in rows if r["loss_err"] is not None), example.table(rows)
        assert sum(r["phase"].startswith("decode") for r in rows) == 8
        # --bench times the GPU: refused at once, naming the need, where there is none
        proc = subprocess.run([sys.executable, str(ROOT / "examples" / "tiny_decoder.py"), "--server", base,
                               "--bench"], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 2 and "--bench needs a CUDA GPU" in proc.stderr
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_tiny_decoder_training_step_matches_torch() -> None:
    """Issue 39 item 7: one SGD step of the example's model, its norms, attention and loss through
    trainable Foldwise ops (each forward saves its statistics; the derived backward specs run as
    kernels, through Triton's interpreter), made in this process as the server would serve them:
    every weight's gradient, and the loss before and after the step, match plain torch."""
    from tests.support.local_kernels import LocalCache

    example = load_example()
    cfg, batch, seq = example.Config(), 2, 12
    ops = example.FoldwiseOps(LocalCache())
    ops.prepare_training(cfg, batch, seq)
    rows = example.compare_training(ops, cfg, batch, seq)
    print("\n" + example.training_table(rows))
    grads = [r for r in rows if r["quantity"].startswith("grad ")]
    assert len(grads) == len(example.init_weights(cfg)) and all(r["value"] > 0 for r in grads)
    assert all(r["error"] <= 1e-5 for r in grads), example.training_table(rows)
    losses = {r["quantity"]: r for r in rows if not r["quantity"].startswith("grad ")}
    assert all(r["error"] <= 1e-5 for r in losses.values()), example.training_table(rows)
    assert losses["loss after one SGD step"]["value"] < losses["loss"]["value"]  # the step trained the model
