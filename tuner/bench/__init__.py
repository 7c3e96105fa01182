"""``foldwise bench``: the tuned fused kernel against its baselines, on the GPU.

For every case of a suite (the catalog's ``suites.json``, :mod:`fuser_core.catalog`: a catalog spec, sizes, dtype)
the bench

1. tunes the fused kernel with the ``cuda`` measurer (:class:`tuner.device.measurer.DeviceMeasurer`,
   ``trials`` per case);
2. times, in the same worker process and with the same harness (correctness check against
   the float64 reference first, then CUDA events, L2 flushed, inputs rotated, median): the
   tuned fused kernel, the unfused kernel chain (:mod:`fuser_core.codegen.chain`), torch
   eager and ``torch.compile`` (Inductor) of the spec (:mod:`tuner.torch_ref`), and torch's
   hand-written kernel where one exists. A baseline that gives a wrong result is reported
   with its error and not timed; one that crashes or hangs is reported as failed;
3. measures the device-to-device copy bandwidth once, and reports each fused kernel's
   achieved bandwidth on the **minimum traffic** (every input read once, every output written
   once) as a fraction of it;
4. checks the targets of issue 4 (:mod:`tuner.bench.targets`) and marks each met / missed / n/a.

Results record the device name, the date, torch, Triton and Python versions, and every
setting; they are written as JSON, a Markdown table and a PNG bar chart (matplotlib, Agg).

Without a CUDA GPU the bench refuses (:class:`~tuner.bench.errors.NoGpu`), unless ``device="cpu"`` asks for the
smoke mode: kernels through Triton's interpreter at tiny shapes (each case shrunk like the
model measurer's correctness check, :func:`tuner.measure.reduced_problem`), every time
labelled "CPU interpreter, not GPU", targets not evaluated. It exists to exercise the whole
pipeline and the writers on machines without a GPU; its numbers say nothing about GPUs.

The modules, each with one job (this package re-exports nothing: import from the module, or
the public names from ``tuner``):

- :mod:`~tuner.bench.errors`: why a bench cannot run (:class:`~tuner.bench.errors.BenchError`, ``NoGpu``);
- :mod:`~tuner.bench.variants`: what is timed per case (the fused kernel, the baselines, experts) and their labels;
- :mod:`~tuner.bench.suites`: which cases a suite names (read from the catalog, checked);
- :mod:`~tuner.bench.targets`: the per-case facts (roofline, dependent long axes) and the targets' verdicts;
- :mod:`~tuner.bench.run`: :func:`~tuner.bench.run.run_bench`, which tunes and times every case in one worker;
- :mod:`~tuner.bench.report`: the results as JSON, Markdown and a PNG chart.

Example (on a GPU)::

    from tuner.bench.report import write_outputs
    from tuner.bench.run import run_bench

    results = run_bench("paper", Path("benchmarks/results/paper"), trials=40)
    write_outputs(results, Path("benchmarks/results/paper"))
"""
