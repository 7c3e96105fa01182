"""The SASS parser (fuser_core.codegen.sass) on stored listings of kernels compiled for sm_90
(tests/fuser_core/data/sass, made with the triton wheel's cuobjdump, encodings stripped) and on small
hand-written listings."""

from __future__ import annotations

from pathlib import Path

import pytest

from fuser_core.codegen.sass import Instruction, access_bits, classify, facts, loops, parse, tensor_kind, tensor_shape

DATA = Path(__file__).parent / "data" / "sass"


def listing(*lines: str) -> str:
    return "\n".join(["\tcode for sm_90a", "\t\tFunction : k", *lines]) + "\n"


def test_instructions_and_modifiers() -> None:
    text = listing(
        "        /*0000*/                   LDC R1, c[0x0][0x28] ;",
        "        /*0010*/               @P4 LDG.E.U16 R24, desc[UR16][R10.64] ;",
        "        /*0020*/                   LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;",
        "        /*0030*/              @!P0 STG.E.64 desc[UR4][R2.64], R8 ;",
        "        /*0040*/                   MUFU.EX2 R5, R5 ;",
        "        /*0050*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;",
        "        /*0060*/                   HGMMA.64x64x8.F32.TF32 R88, gdesc[UR8], R88 ;",
        "        /*0070*/                   HMMA.16816.F32 R4, R8, R12, R4 ;",
        "        /*0080*/                   EXIT ;",
    )
    [(name, ins)] = parse(text).items()
    assert name == "k" and len(ins) == 9 and ins[1].predicated and not ins[0].predicated
    assert [access_bits(i) for i in ins[1:4]] == [16, 128, 64]
    assert [classify(i) for i in ins[1:5]] == ["ldg", "ldg", "stg", "mufu.ex2"]
    assert [tensor_kind(i) for i in ins[5:8]] == ["hgmma.bf16", "hgmma.tf32", "hmma.f16"]
    assert tensor_shape(ins[5]) == (64, 128, 16) and tensor_shape(ins[7]) == (16, 8, 16)
    assert tensor_shape(ins[0]) is None
    assert tensor_kind(ins[0]) is None


def test_blackwell_tensor_instructions_are_counted_without_a_shape() -> None:
    """sm_100's tcgen05.mma (UTCHMMA kind::f16, UTCQMMA kind::f8f6f4) keeps its tile in an
    instruction descriptor: it counts as a tensor instruction of its kind with no shape and no
    multiply-adds of its own (tuner.static_bound.dot_macs supplies them from the kernel's dots)."""
    from fuser_core.codegen.sass import count, warp_macs

    text = listing(
        "        /*18d0*/                   UTCHMMA gdesc[UR10], gdesc[UR32], tmem[UR7], tmem[UR46], idesc[UR47], !UPT ;",
        "        /*1840*/                   UTCQMMA gdesc[UR6], gdesc[UR8], tmem[UR15], tmem[UR12], idesc[UR13], UPT ;",
        "        /*1930*/                   UTCBAR [UR9], URZ ;",
    )
    [(_, ins)] = parse(text).items()
    assert [tensor_kind(i) for i in ins] == ["utchmma.kind_f16", "utcqmma.kind_f8f6f4", None]
    assert [classify(i) for i in ins] == ["tensor", "tensor", "other"]
    assert tensor_shape(ins[0]) is None and warp_macs(ins[0]) == 0.0
    assert count(ins).tensor == {"utchmma.kind_f16": 1, "utcqmma.kind_f8f6f4": 1}


def test_innermost_loops_are_backward_branches() -> None:
    text = listing(
        "        /*0000*/                   MOV R1, RZ ;",
        "        /*0010*/                   FADD R2, R2, R3 ;",           # outer loop from here
        "        /*0020*/                   MUFU.EX2 R4, R2 ;",           # inner loop from here
        "        /*0030*/                   FMUL R4, R4, R4 ;",
        "        /*0040*/               @P0 BRA 0x20 ;",                  # inner back edge
        "        /*0050*/               @P1 BRA 0x10 ;",                  # outer back edge
        "        /*0060*/               @P2 BRA 0x80 ;",                  # forward: not a loop
        "        /*0070*/                   EXIT ;",
        "        /*0080*/                   BRA 0x80 ;",                  # the trap at the end: not work
    )
    [ins] = parse(text).values()
    [inner] = loops(ins)
    assert (inner.start, inner.end) == (0x20, 0x40)
    assert inner.counts.instructions == 3 and inner.counts["mufu.ex2"] == 1


def test_stored_softmax_streaming_kernel() -> None:
    """safe_softmax streaming_fused, BLOCK_n 1024 on 4 warps (8 fp16 elements a thread and tile):
    one 128-bit load per thread and tile in each loop; the streamed loop issues two exps per
    element (the element's and the per-lane correction's), the output loop one."""
    f = facts((DATA / "softmax_streaming_sm90.sass").read_text())["safe_softmax_streaming_fused_kernel"]
    streamed, outputs = f.loops
    assert streamed.counts.load_bits == {128: 1} and outputs.counts.load_bits == {128: 1}
    assert streamed.counts["mufu.ex2"] == 16 and outputs.counts["mufu.ex2"] == 8
    assert outputs.counts.store_bits == {128: 1}
    assert not f.total.tensor
    assert f.hot_loop is streamed


def test_stored_attention_kernel_uses_fp16_wgmma() -> None:
    """attention streaming_fused fp16, 128 x 64 tiles, d = e = 128, 8 warps: q.k and p.v on
    fp16 warpgroup MMAs, each warpgroup issuing its 64 rows' share once (no product twice)."""
    f = facts((DATA / "attention_fp16_streaming_sm90.sass").read_text())["attention_streaming_fused_kernel"]
    [loop] = f.loops
    assert loop.counts.tensor == {"hgmma.f16": 12}
    # per warpgroup and iteration q.k is 64 x 64 x 128, p.v 64 x 128 x 64 multiply-adds, a quarter per warp
    assert loop.counts.tensor_macs == (64 * 64 * 128 + 64 * 128 * 64) / 4
    # 64 x 64 scores per warpgroup over 128 threads: 32 a thread, one exp each (+2 for the row corrections)
    assert loop.counts["mufu.ex2"] == 34
    assert loop.counts.load_bits == {128: 8}


def test_an_instruction_knows_its_parts() -> None:
    ins = Instruction(0x10, "LDG.E.128.CONSTANT", "R4, desc[UR4][R2.64]")
    assert ins.base == "LDG" and ins.modifiers == ("E", "128", "CONSTANT")


def test_static_bound_takes_the_largest_term() -> None:
    """tuner.static_bound on the stored softmax kernel: 4096 rows of 32768 fp16 values, 32 tiles
    of 1024 each loop: memory-bound on an H100 (its loads request what must come from HBM), with
    two exps per element in the streamed loop and one in the output loop."""
    from tuner.profiles import get_profile
    from tuner.static_bound import load_width, static_bound

    f = facts((DATA / "softmax_streaming_sm90.sass").read_text())["safe_softmax_streaming_fused_kernel"]
    sass = f.to_dict()
    h100 = get_profile("h100")
    elements = 4096 * 32768
    b = static_bound(sass, programs=4096, num_warps=4, trips=[32, 32], profile=h100, elements=elements,
                     input_bytes=2 * elements)
    assert b["per_element"]["exp"] == pytest.approx(3.0, abs=0.2)  # MUFU.EX2 only, + the lane merge's
    assert b["per_element"]["sfu"] > b["per_element"]["exp"]  # every MUFU: also a reciprocal per row
    assert b["per_element"]["input_reads"] == pytest.approx(2.0, abs=0.02)  # x twice: the stream, then y's pass
    assert b["load_bytes"] == pytest.approx(2 * 2 * elements, rel=0.01)
    assert b["bound"] == max(b["terms_s"], key=b["terms_s"].get) and b["time_s"] == max(b["terms_s"].values())
    # only what must come from HBM bounds memory: with the minimum traffic given, the re-read is L2's
    once = static_bound(sass, programs=4096, num_warps=4, trips=[32, 32], profile=h100, unique_bytes=4 * elements)
    assert once["terms_s"]["memory"] == pytest.approx(4 * elements / h100.hbm_bytes_per_s)
    assert once["terms_s"]["memory"] < b["terms_s"]["memory"]
    # more iterations, more instructions: the issue term grows with the trips
    longer = static_bound(sass, programs=4096, num_warps=4, trips=[64, 64], profile=h100)
    assert longer["terms_s"]["issue"] > b["terms_s"]["issue"]
    assert load_width(sass) == 128


def test_the_model_measurer_never_predicts_below_the_static_bound() -> None:
    """With the compile gate's facts, the model's prediction is at least the compiled code's static
    bound (tuner.static_bound): cross-entropy's per-lane kernel issues 31 instructions per element,
    an issue bound the byte-based model alone missed."""
    from fuser_core.catalog import load_catalog_spec
    from fuser_core.derive import derive_cascade
    from fuser_core.problem import make_problem
    from tuner.compile_gate import CompileGate
    from tuner.measure import ModelMeasurer
    from tuner.profiles import get_profile
    from tuner.space import SearchSpace

    spec = load_catalog_spec("cross_entropy")
    derivation = derive_cascade(spec)
    problem = make_problem(spec, {"t": 4096, "v": 128256}, "bfloat16")
    h100 = get_profile("h100")
    space = SearchSpace(problem, derivation, h100)
    gate = CompileGate.for_space(space)
    measurer = ModelMeasurer(problem, derivation, h100, verify=False, gate=gate)
    for per_lane in (1, 0):
        c = space.candidate("streaming_fused", {"block_v": 1024, "block_t": 1, "num_warps": 4, "num_stages": 3,
                                                "per_lane": per_lane})
        m = measurer.measure(c)
        floor = m.details["static_bound"]
        assert m.time_ms >= 1e3 * floor["time_s"] > 0
        assert floor["kernels"][0]["bound"] in ("memory", "issue")
