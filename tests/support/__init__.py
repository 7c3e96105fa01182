"""Helpers the tests share (not tests themselves): the packaged catalog as raw dicts
(``catalog``), small shapes and the fleet's compile targets (``catalog_shapes``), and the
cascade fuzzer's hypothesis strategies and checks (``fuzz_strategies``, also used by
benchmarks/fuzz_long.py and benchmarks/kernel_walk_diff.py)."""
