"""The kernel structure (fuser_core/codegen/structure/: each kernel an ordered list of typed
operations, fuser_core/codegen/ops/) and what the printers make of it: loop-invariant loads
hoisted out of the loop, each kernel's arguments exactly what its operations read, the split
part + combine pair launched as one object, tl.dot decided once, every value's name and dims
decided before printing, the helpers a module pastes named by its operations."""

from __future__ import annotations

import re

import pytest

from fuser_core.catalog import load_catalog_spec
from fuser_core.codegen.module import module_source, output_dtypes
from fuser_core.codegen.ops import Load
from fuser_core.codegen.plan import KernelConfig, make_plan
from fuser_core.codegen.structure import SplitLaunch, build_structure, kernel_names
from fuser_core.derive import derive_cascade
from fuser_core.runner import bind_dtypes, self_check
from fuser_core.spec import load_spec

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

ATTENTION_SHAPE = {"b": 1, "h": 2, "m": 20, "n": 37, "d": 16, "e": 16}
ATTENTION_BLOCKS = {"m": 16, "n": 16, "e": 16}


def attention(strategy: str, dtype: str = "float16"):
    spec = load_catalog_spec("attention")
    d = derive_cascade(spec)
    config = KernelConfig(ATTENTION_BLOCKS, split=2 if strategy == "split_fused" else 1)
    plan = make_plan(spec, d, strategy, ATTENTION_SHAPE, config)
    dtypes = bind_dtypes(spec, dtype)
    return spec, d, plan, dtypes


def kernel_sources(source: str) -> dict[str, tuple[list[str], str]]:
    """kernel name -> (its parameters, its body) in a generated module."""
    out = {}
    for m in re.finditer(r"@triton\.jit\ndef (\w+_kernel)\(\n(.*?)\n\):\n(.*?)(?=\n\n\n|\n\ndef launch|\Z)", source, re.S):
        params = [p.strip().split(":")[0] for p in m.group(2).split(",") if p.strip()]
        out[m.group(1)] = (params, m.group(3))
    return out


def load_line(body: str, name: str) -> int:
    lines = body.splitlines()
    return next(i for i, line in enumerate(lines) if re.match(rf"\s*{name} = tl\.load\({name}_ptr", line))


@pytest.mark.parametrize("strategy", ["streaming_fused", "split_fused", "multi_pass"])
def test_q_is_loaded_once_per_program_before_the_loop_over_n(strategy: str) -> None:
    spec, d, plan, dtypes = attention(strategy)
    structure = build_structure(plan, dtypes)
    first = structure.kernels[0]
    assert [ld.name for ld in first.hoisted] == ["q"]  # q lacks n: loop-invariant; k and v are streamed
    assert {op.input for op in first.walk() if isinstance(op, Load) and not op.hoisted} == {"k", "v"}
    assert [loop.hoisted for loop in first.loops()][0] == ("q",)  # the first loop that reads q
    body = kernel_sources(module_source(plan, output_dtypes(spec, dtypes), dtypes))[first.name][1]
    lines = body.splitlines()
    loop = next(i for i, line in enumerate(lines) if line.strip().startswith("for start in range("))
    assert load_line(body, "q") < loop < load_line(body, "k")
    assert sum(1 for line in lines if re.match(r"\s*q = tl\.load", line)) == 1  # once, not per pass
    assert lines[load_line(body, "q")].startswith("    q = ")  # at the kernel's top level


def test_split_kernels_take_only_what_they_use() -> None:
    spec, d, plan, dtypes = attention("split_fused")
    structure = build_structure(plan, dtypes, output_dtypes(spec, dtypes))
    part_name, combine_name = kernel_names(plan)
    (launch,) = structure.launches
    assert isinstance(launch, SplitLaunch)
    assert (launch.part.kernel, launch.combine.kernel) == (part_name, combine_name)
    assert launch.part.grid.split and not launch.combine.grid.split  # o keeps no n: one program per lane block
    kernels = kernel_sources(module_source(plan, output_dtypes(spec, dtypes), dtypes))
    assert set(kernels) == {part_name, combine_name}
    part, combine = kernels[part_name][0], kernels[combine_name][0]
    ws = [f"ws_{w.name}_ptr" for w in structure.workspace]
    assert ws and set(ws) <= set(part) and set(ws) <= set(combine)
    # the part kernel reads the inputs and writes the workspace: no output, no SPLIT
    assert {"q_ptr", "k_ptr", "v_ptr", "chunk"} <= set(part)
    assert "o_ptr" not in part and "stride_o_m" not in part and "SPLIT" not in part
    # the combine kernel reads the workspace and writes o: no input it does not load, and no chunk
    # (one program per lane block merges every part: it reads no chunk of the axis)
    assert {"o_ptr", "stride_o_m", "SPLIT"} <= set(combine) and "chunk" not in combine
    assert not {"q_ptr", "k_ptr", "v_ptr", "stride_q_m", "stride_k_n"} & set(combine)
    # nor sizes and blocks it never reads: b is the slowest lane (its program id is what is left),
    # and the combine kernel has no d or n
    assert "size_b" not in part and "BLOCK_b" not in part
    assert not {"size_d", "size_n", "BLOCK_d", "BLOCK_n"} & set(combine)
    # the printed parameters are the structure's, and the launcher passes one value for each
    for kernel in structure.kernels:
        assert kernels[kernel.name][0] == [a.name for a in kernel.args]


def test_split_attention_runs_with_its_own_argument_lists() -> None:
    spec, d, plan, dtypes = attention("split_fused", "float32")
    report = self_check(spec, ATTENTION_SHAPE, "float32", strategy="split_fused", config=plan.config, derivation=d)
    assert report["passed"], report


def test_dots_are_decided_once_and_printed_as_decided() -> None:
    spec, d, plan, dtypes = attention("streaming_fused")
    structure = build_structure(plan, dtypes)
    dots = structure.kernels[0].dots
    # s = q.k over d, o = p.v over n, in each of the loop's two parts (whole tiles, then the partial one)
    assert [loop.unmasked for loop in structure.kernels[0].loops()] == [True, False]
    assert sorted(x.over for x in dots) == ["d", "d", "n", "n"]
    assert all(x.precision == "float16" for x in dots)
    source = module_source(plan, output_dtypes(spec, dtypes), dtypes)
    assert sum("tl.dot(" in line for line in source.splitlines()) == len(dots)
    small = make_plan(spec, d, "streaming_fused", ATTENTION_SHAPE, KernelConfig({"m": 1, "n": 16, "e": 16}))
    assert build_structure(small, dtypes).kernels[0].dots == ()  # BLOCK_m = 1 < 16: tile reductions


def test_a_combine_kernel_without_outputs_along_the_axis_loads_no_input() -> None:
    spec = load_spec({"foldwise": 1, "name": "lse", "inputs": {"x": {"dims": ["m", "n"]}},
                      "steps": [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"},
                                {"name": "den", "reduce": "sum", "over": "n", "expr": "exp(x - mx)"},
                                {"name": "y", "expr": "mx + log(den)"}],
                      "outputs": ["y"]})
    d = derive_cascade(spec)
    shape = {"m": 3, "n": 45}
    plan = make_plan(spec, d, "split_fused", shape, KernelConfig({"n": 8}, split=3))
    dtypes = bind_dtypes(spec, "float32")
    part, combine = build_structure(plan, dtypes).kernels
    assert part.inputs == ("x",) and part.outputs == ()
    assert combine.inputs == () and combine.outputs == ("y",)
    assert "x_ptr" not in [a.name for a in combine.args]
    report = self_check(spec, shape, "float32", strategy="split_fused", config=plan.config, derivation=d)
    assert report["passed"], report


def test_a_combine_kernel_writes_one_chunk_of_the_axis_per_program() -> None:
    """Outputs along the axis: the combine grid is lanes x SPLIT and each program's output loop
    covers its own chunk; a row output (fp8's scale) is written by chunk 0's program only."""
    spec = load_catalog_spec("fp8_quant_per_token")
    d = derive_cascade(spec)
    shape = {"t": 5, "c": 300}  # 300 = 3 chunks of 112 (the last one short) at BLOCK_c = 16
    plan = make_plan(spec, d, "split_fused", shape, KernelConfig({"t": 2, "c": 16}, split=3))
    dtypes = bind_dtypes(spec, "float32")
    structure = build_structure(plan, dtypes, output_dtypes(spec, dtypes))
    (launch,) = structure.launches
    assert launch.part.grid.split and launch.combine.grid.split
    combine = structure.kernels[1]
    assert [loop.span for loop in combine.loops()][-1] == "chunk_outputs"
    assert "chunk" in [a.name for a in combine.args]  # its programs each write one chunk: it reads chunk
    body = kernel_sources(module_source(plan, output_dtypes(spec, dtypes), dtypes))[combine.name][1]
    assert "lo = tl.program_id(1) * chunk" in body
    assert "for start in range(lo, tl.minimum(lo + chunk, size_c), BLOCK_c):" in body
    lines = body.splitlines()
    guard = lines.index("    if lo == 0:")
    assert lines[guard + 2].lstrip().startswith("tl.store(scale_ptr")
    report = self_check(spec, shape, "float32", strategy="split_fused", config=plan.config, derivation=d)
    assert report["passed"], report
    # enough lane blocks to fill the GPU: one combine program per lane block writes the whole axis
    many = make_plan(spec, d, "split_fused", {"t": 4096, "c": 300}, KernelConfig({"t": 2, "c": 16}, split=3))
    assert not many.parallel_combine and not build_structure(many, dtypes).launches[0].combine.grid.split


# ---------------------------------------------------------------- shorter kernels (issue 14, deliverable 3)

FUZZ_SEED43_HOIST = {  # benchmarks/results/fuzz_judge_seed43.md, compile failure 2
    "foldwise": 1, "name": "a",
    "inputs": {"kk": {"dims": ["n"]}, "x": {"dims": ["j2"]}, "a": {"dims": ["seq"]}},
    "steps": [{"name": "offs", "reduce": "max", "over": "n", "expr": "where(index(seq) <= index(j2), kk, a)"},
              {"name": "mx_old", "reduce": "max", "over": "n", "expr": "(kk + x) - offs"}],
    "outputs": ["mx_old"], "params": {}}


def softmax_source(strategy: str, config: KernelConfig) -> str:
    spec = load_catalog_spec("safe_softmax")
    plan = make_plan(spec, derive_cascade(spec), strategy, {"m": 5, "n": 300}, config)
    dtypes = bind_dtypes(spec, "float32")
    return module_source(plan, output_dtypes(spec, dtypes), dtypes)


def test_a_module_pastes_only_the_helpers_its_kernels_call() -> None:
    source = softmax_source("streaming_fused", KernelConfig({"n": 64}))
    defined = set(re.findall(r"^def (\w+)\(", source, re.M))
    assert {"rescale", "nonzero_correction", "safe_anchor"} <= defined  # rescale calls nonzero_correction
    assert not defined & {"topk_merge", "argmax_merge", "fp8e4m3_bits", "bf16_round", "pow_real"}
    spec = load_catalog_spec("moe_routing")
    d = derive_cascade(spec)
    plan = make_plan(spec, d, "streaming_fused", {"t": 3, "x": 40, "j": 8}, KernelConfig({"x": 16}))
    dtypes = bind_dtypes(spec, "float32")
    assert "def topk_merge(" in module_source(plan, output_dtypes(spec, dtypes), dtypes)


def test_no_count_or_dead_running_value_where_nothing_reads_them() -> None:
    """softmax's moves read only the running max: no count of values seen is kept, and den's running
    value (read by nothing in the loop) is computed once, after it; layernorm's running-estimate
    anchor reads the count, so it keeps it."""
    for strategy, config in [("streaming_fused", KernelConfig({"n": 64})), ("split_fused", KernelConfig({"n": 64}, split=2))]:
        source = softmax_source(strategy, config)
        assert "count" not in source
        assert not re.search(r"^\s+den = ", source, re.M)  # den_acc is read directly where needed
    spec = load_catalog_spec("layernorm")
    d = derive_cascade(spec)
    plan = make_plan(spec, d, "streaming_fused", {"t": 3, "c": 100}, KernelConfig({"c": 32}))
    dtypes = bind_dtypes(spec, "float32")
    assert "count_old = count" in module_source(plan, output_dtypes(spec, dtypes), dtypes)


def test_the_combine_kernel_loads_a_split_invariant_input_before_the_split_loop() -> None:
    spec = load_spec(FUZZ_SEED43_HOIST)
    d = derive_cascade(spec)
    shape = {"n": 13, "j2": 2, "seq": 1}
    plan = make_plan(spec, d, "split_fused", shape, KernelConfig({"n": 4}, split=2))
    dtypes = bind_dtypes(spec, "float32")
    _, combine_name = kernel_names(plan)
    body = kernel_sources(module_source(plan, output_dtypes(spec, dtypes), dtypes))[combine_name][1]
    lines = body.splitlines()
    loop = next(i for i, line in enumerate(lines) if "for split in range" in line)
    assert load_line(body, "x") < loop
    report = self_check(spec, shape, "float32", strategy="split_fused", config=plan.config, derivation=d)
    assert report["passed"], report


def test_an_input_a_max_folds_as_it_is_is_masked_once_by_its_load() -> None:
    """x's masked lanes are loaded as -inf where the max folds x itself: no tl.where(mask, x, -inf)
    after an other=0 load. The streamed sum of exp(x - mx_anchor) needs no where either (exp of -inf
    minus a finite anchor is 0, the sum's identity: structure.needs_mask); multi_pass's sum reads
    the final mx, which may be infinite, and keeps its where. The output pass loads x with other=0."""
    # row_resident keeps its where (emit.write_row_resident); streaming folds per lane (elementwise)
    for strategy, fold_x, sum_exp in [("streaming_fused", "mx_lane = max_nan(mx_lane, x)",
                                       "den_lane = rescale(den_lane, tl.exp(mx_lane_anchor_old - mx_lane_anchor)) + "
                                       "tl.exp(x - mx_lane_anchor)\n"),
                                      ("multi_pass", "tl.reduce(x, 0, max_nan)", "tl.sum(tl.where(mask_n, tl.exp(")]:
        config = KernelConfig({"n": 64})
        body = "\n".join(b for _, b in kernel_sources(softmax_source(strategy, config)).values())
        assert 'other=float("-inf")' in body and fold_x in body, strategy
        assert 'tl.where(mask_n, x, float("-inf"))' not in body
        assert sum_exp in body, strategy
    spec = load_catalog_spec("safe_softmax")
    report = self_check(spec, {"m": 5, "n": 300}, "float16", strategy="streaming_fused",
                        config=KernelConfig({"n": 64}), derivation=derive_cascade(spec))
    assert report["passed"], report


def test_a_lane_with_block_1_is_a_scalar_offset_in_no_tile() -> None:
    """One row per program (BLOCK_m = 1): softmax's tiles are 1-d [BLOCK_n], as in Triton's
    fused-softmax tutorial; decode attention (one query, BLOCK_m = BLOCK_e = 1) works on
    [BLOCK_d, BLOCK_n] tiles with b, h, m, e as scalar offsets; results still match float64."""
    body = next(iter(kernel_sources(softmax_source("streaming_fused", KernelConfig({"n": 64}))).values()))[1]
    assert "offs_m = tl.program_id(0)" in body and "mask_m" not in body and "pid_m" not in body
    assert "offs_n = start + tl.arange(0, BLOCK_n)" in body
    assert re.search(r"tl\.full\(\[BLOCK_n\], ", body)
    spec = load_catalog_spec("attention")
    d = derive_cascade(spec)
    shape = {"b": 1, "h": 2, "m": 1, "n": 37, "d": 16, "e": 3}
    plan = make_plan(spec, d, "streaming_fused", shape, KernelConfig({"n": 16}))
    dtypes = bind_dtypes(spec, "float32")
    body = next(iter(kernel_sources(module_source(plan, output_dtypes(spec, dtypes), dtypes)).values()))[1]
    for dim in "bhme":  # the program id peeled into each lane's offset
        assert re.search(rf"^    offs_{dim} = pid\b", body, re.M) and f"mask_{dim}" not in body and f"pid_{dim}" not in body
    assert "offs_d = tl.arange(0, BLOCK_d)" in body and "offs_n = start + tl.arange(0, BLOCK_n)" in body
    assert "offs_n[None, :] * stride_k_n + offs_d[:, None] * stride_k_d" in body  # k as a [BLOCK_d, BLOCK_n] tile
    report = self_check(spec, shape, "float32", strategy="streaming_fused", config=plan.config, derivation=d)
    assert report["passed"], report


def test_attention_is_printed_on_the_fewest_dims_and_a_kernel_sets_up_only_the_offsets_it_reads() -> None:
    """With m and e blocks of 16 or more, q is a [BLOCK_m, BLOCK_d] tile and s = tl.dot(q, k) with no
    reshape or broadcast around it (Triton's fused-attention tutorial); the states are [BLOCK_m] and
    [BLOCK_m, BLOCK_e]. Split's combine kernel reads no d: it sets up no offs_d / mask_d."""
    spec = load_catalog_spec("attention")
    d = derive_cascade(spec)
    shape = {"b": 1, "h": 2, "m": 40, "n": 50, "d": 16, "e": 24}
    config = KernelConfig({"m": 16, "n": 16, "e": 16}, split=2)
    plan = make_plan(spec, d, "split_fused", shape, config)
    dtypes = bind_dtypes(spec, "float16")
    kernels = kernel_sources(module_source(plan, output_dtypes(spec, dtypes), dtypes))
    part, combine = (kernels[name][1] for name in kernel_names(plan))
    assert "s = tl.dot(q.to(tl.float16), k.to(tl.float16))" in part
    assert "tl.reshape" not in part and "broadcast_to" not in part and "keep_dims" not in part
    assert "mx_acc = tl.full([BLOCK_m], " in part and "o_acc = tl.full([BLOCK_m, BLOCK_e], " in part
    assert "offs_d = tl.arange(0, BLOCK_d)" in part
    assert "offs_d" not in combine and "mask_d" not in combine and "offs_e" in combine
    report = self_check(spec, shape, "float16", strategy="split_fused", config=config, derivation=d)
    assert report["passed"], report


# ---------------------------------------------------------------- one kernel walk (issue 22, deliverable 1)

def catalog_modules(dtype: str = "float16"):
    """(label, module source, structure) for every catalog spec x valid strategy at its small shape."""
    from tests.support.catalog_shapes import small_shape
    from tests.support.catalog import load_catalog

    from fuser_core.codegen.plan import default_config, valid_strategies

    for name, raw in sorted(load_catalog().items()):
        spec = load_spec(raw)
        d = derive_cascade(spec)
        shape = small_shape(spec)
        fp8 = {"w": "float8_e4m3fn", "w_scale": "float32"} if name == "fp8_quant_gemm" else {}
        dtypes = bind_dtypes(spec, {**{i.name: dtype for i in spec.inputs if i.kind == "float"}, **fp8})
        for strategy, why in valid_strategies(spec, d, shape).items():
            if why is None:
                plan = make_plan(spec, d, strategy, shape, default_config(spec, d, strategy, shape))
                stores = output_dtypes(spec, dtypes)
                yield f"{name} {strategy}", module_source(plan, stores, dtypes), build_structure(plan, dtypes, stores)


def test_every_kernel_takes_exactly_the_parameters_its_operations_read_and_sets_up_only_offsets_it_reads() -> None:
    import ast
    import builtins

    for label, source, structure in catalog_modules():
        tree = ast.parse(source)
        module_names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} | {"tl", "triton", "torch", "os"}
        module_names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        kernels = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.endswith("_kernel")]
        assert [k.name for k in kernels] == [k.name for k in structure.kernels], label
        for node, kernel in zip(kernels, structure.kernels):
            params = [a.arg for a in node.args.args]
            assert params == [a.name for a in kernel.args], label
            loaded = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            stored = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            assert set(params) <= loaded, f"{label} {kernel.name}: unread parameters {set(params) - loaded}"
            free = loaded - stored - module_names - set(dir(builtins))
            assert free <= set(params), f"{label} {kernel.name}: reads {free - set(params)}, not parameters"
            offsets = {n for n in stored if n.startswith(("offs_", "mask_"))}
            assert offsets <= loaded, f"{label} {kernel.name}: sets up {offsets - loaded} and never reads them"
            # the operations say they read every parameter the printed kernel reads
            said = set().union(*(op.uses() for op in kernel.walk()))
            assert set(params) <= said and free <= said and said <= loaded | set(params), label


def test_the_printer_prints_operations_only() -> None:
    """emit.py has no strategy branch and reads nothing back from its text (no regular expression);
    every operation of a kernel names its value on its tile dims, in the kernel's order."""
    import ast
    from pathlib import Path

    import fuser_core.codegen.emit as emit

    tree = ast.parse(Path(emit.__file__).read_text())
    assert not any(isinstance(n, ast.Attribute) and n.attr == "strategy" for n in ast.walk(tree))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "re" not in imported
    spec, d, plan, dtypes = attention("split_fused")
    for kernel in build_structure(plan, dtypes).kernels:
        for op in kernel.walk():
            assert kernel.layout.order(op.dims) == tuple(op.dims), (kernel.name, op)
    part = build_structure(plan, dtypes).kernels[0]
    folds = {op.name: op for op in part.walk() if type(op).__name__ in ("Fold", "Reduce")}
    assert folds["s"].dims == ("m", "n") and folds["o_acc"].dims == ("m", "e") and folds["o_acc"].dot is not None


def test_helpers_are_real_functions_copied_by_name() -> None:
    import fuser_core.codegen.helpers as helpers
    from fuser_core.codegen.helper_copy import helper_names, helper_source

    names = helper_names()
    assert {"rescale", "topk_merge", "fp8e4m3_bits", "bf16_round", "pow_real"} <= set(names)
    # @triton.jit functions (the interpreter's kind under TRITON_INTERPRET=1), but for the launchers' host functions
    assert helpers.HOST_HELPERS == {"fp8_native", "tma_loads", "split_tickets", "offset_reach", "int32_offsets",
                                    "wide_offsets", "page_order", "to_page_layout", "page_table_checked"}
    assert helpers.HOST_HELPERS <= set(names)
    kinds = {n: type(getattr(helpers, n)).__name__ for n in names if n not in helpers.HOST_HELPERS}
    assert set(kinds.values()) <= {"JITFunction", "InterpretedFunction"}, kinds
    source, modules = helper_source(["fp8e4m3_round"])  # with the helpers it calls, in helpers.py's order
    defined = re.findall(r"^def (\w+)\(", source, re.M)
    assert defined == ["fp8e4m3_bits", "fp8e4m3_to_float", "fp8e4m3_round", "round_half_even"] and not modules
    source, modules = helper_source(["bf16_round"])  # both definitions, chosen where the module loads
    assert source.count("def bf16_round(") == 2 and "INTERPRETED = os.environ" in source and modules == {"os"}
    softmax = softmax_source("streaming_fused", KernelConfig({"n": 64}))
    assert "import os" not in softmax and "bf16_round" not in softmax
