"""`foldwise backward` (issue 39): the derived backward as text and JSON, its specs written for
`foldwise run`, exit codes."""

from __future__ import annotations

import json

from service.cli import main


def test_backward_json_and_written_specs_run(tmp_path, capsys):
    assert main(["backward", "cross_entropy", "--json", "--out", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["saved"] == ["mx", "den"] and report["shifts"] == ["mx"]
    assert report["not_differentiated"] == {"target": "an index input"}
    assert report["gradients"] == [{"input": "logits", "output": "d_logits", "spec": "cross_entropy_backward",
                                    "dims": ["t", "v"]}]
    assert report["certificate"]["holds"] and report["certificate"]["worst"]["logits"] < 1e-12
    assert report["gradient_in_forward"]["outputs"] == ["loss", "logits_grad"]
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["cross_entropy_backward.json", "cross_entropy_saving.json", "cross_entropy_with_grad.json"]
    assert "derivation" not in json.loads((tmp_path / "cross_entropy_backward.json").read_text())
    # the forward that writes the gradient runs as any spec does
    assert main(["run", str(tmp_path / "cross_entropy_with_grad.json"), "--families", "none"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"]


def test_backward_text_names_the_weight_gradient_spec(capsys):
    assert main(["backward", "rmsnorm"]) == 0
    text = capsys.readouterr().out
    assert "spec rmsnorm_backward_w: writes d_w; fused" in text and "sum over t" in text
    assert "not differentiated: eps" in text and "certificate vs torch float64 autograd: holds" in text


def test_backward_refusal_names_the_field(capsys):
    assert main(["backward", "moe_routing", "--no-derive"]) == 2
    assert "steps[2] (gate).reduce: a topk step has no backward yet" in capsys.readouterr().err


def test_backward_packed_for_a_shape_stages_what_a_tile_cannot_hold(capsys):
    """--shape packs the backward as the torch op does at those sizes: an LM head at d = 4096 stages
    d_logits (packing rule 8) and still certifies; at its example (d = 80) it does not; a dim the spec
    lacks is refused naming the flag."""
    assert main(["backward", "linear_cross_entropy", "--json", "--no-derive", "--shape", "t=4096,v=128256,d=4096"]) == 0
    staged = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in staged["specs"]] == ["linear_cross_entropy_backward_stage1", "linear_cross_entropy_backward_h",
                                                   "linear_cross_entropy_backward_w"]
    assert staged["specs"][0]["outputs"] == ["d_logits"] and staged["certificate"]["holds"]
    assert main(["backward", "linear_cross_entropy", "--json", "--no-derive"]) == 0
    assert len(json.loads(capsys.readouterr().out)["specs"]) == 2
    assert main(["backward", "linear_cross_entropy", "--no-derive", "--shape", "t=4,x=3"]) == 2
    assert "--shape: unknown dim 'x'" in capsys.readouterr().err
