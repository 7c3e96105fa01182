"""Measuring on a device: a crash-isolated worker process, its jobs, timing, and the device measurer.

One job per module (this package re-exports nothing: import from the module, or the public
names from ``tuner``):

- :mod:`~tuner.device.worker`: the crash-isolated worker process (generic: any job runner;
  timeouts, crashes, fault injection for tests);
- :mod:`~tuner.device.jobs`: the measurement jobs the worker child runs (check, time, binary,
  copy bandwidth);
- :mod:`~tuner.device.inputs`: a problem's inputs on the device, its sampled float64 reference
  (:mod:`fuser_core.sampled_reference`) and the timing and family input sets;
- :mod:`~tuner.device.checks`: the variants (fused candidates and baselines) and their checks
  against the reference and the accuracy bar;
- :mod:`~tuner.device.timing`: events, L2 flush and input rotation (``torch.cuda``, which is
  HIP on ROCm), or the interpreter's wall clock, labelled;
- :mod:`~tuner.device.measurer`: :class:`~tuner.device.measurer.DeviceMeasurer`, the
  :class:`tuner.measure.Measurer` that asks the worker for a checked time per candidate.
"""
