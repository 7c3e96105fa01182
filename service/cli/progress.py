"""Progress on stderr for the long ``foldwise`` commands: a one-line bar redrawn in place on a
terminal, whole lines in a log (a pipe or a file gets no carriage returns).

- ``tune``: :class:`ProgressBar` on a terminal; elsewhere :class:`TrialLog`, a line every
  ``max(1, budget // 10)`` trials (at most ten for any budget, so a log stays readable while a
  long search still shows it is alive) and one for the last trial.
- every long command: :func:`stage`, a line when it starts each stage of its work;
- ``compile``: :class:`CompileProgress`, a bar per compiled module on a terminal; elsewhere a
  line per kernel (its target, strategy, name and what the compiler said, or that the compile
  cache answered).
"""

from __future__ import annotations

import sys
from typing import Any, TextIO


def stage(command: str, text: str, stream: TextIO | None = None) -> None:
    """One line on stderr saying what a long command is doing now, printed before the work (issue
    37, 8: ``run`` printed nothing for 32 s on a fresh clone, ``tune`` 42 s): the first comes from
    the argument checks' side of the command, before sympy, torch or Triton load."""
    print(f"{command}: {text}", file=stream or sys.stderr, flush=True)


def problem_text(name: str, shape: Any, dtype: Any = None) -> str:
    """``safe_softmax m=4,n=300 float16``, for stage lines."""
    sizes = ",".join(f"{d}={n}" for d, n in dict(shape).items())
    kind = "" if dtype is None else " " + (dtype if isinstance(dtype, str) else ",".join(f"{k}:{v}" for k, v in dtype.items()))
    return f"{name} {sizes}{kind}"


def _best(study: Any) -> str:
    try:
        return f"best {study.best_value:.4g} ms"
    except ValueError:  # no completed trial yet
        return "no time yet"


class ProgressBar:
    """A one-line progress bar on stderr (an Optuna callback): trials used of the budget, best time."""

    def __init__(self, budget: int, stream: TextIO | None = None, width: int = 30):
        self.budget, self.stream, self.width = budget, stream or sys.stderr, width

    def __call__(self, study: Any, trial: Any) -> None:
        from tuner import budget_used

        done = min(budget_used(study), self.budget)
        filled = self.width * done // max(1, self.budget)
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.budget} trials, {_best(study)}")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


class TrialLog:
    """Whole lines for a log (an Optuna callback): ``tune: 8/40 trials, best 0.0123 ms`` every
    ``every`` trials and at the last one."""

    def __init__(self, budget: int, stream: TextIO | None = None, every: int | None = None):
        self.budget, self.stream = budget, stream or sys.stderr
        self.every = every or max(1, budget // 10)
        self._last = 0

    def __call__(self, study: Any, trial: Any) -> None:
        from tuner import budget_used

        done = min(budget_used(study), self.budget)
        if done != self._last and (done % self.every == 0 or done == self.budget):
            self._last = done
            self.stream.write(f"tune: {done}/{self.budget} trials, {_best(study)}\n")
            self.stream.flush()

    def close(self) -> None:
        pass


def tune_progress(budget: int, *, as_json: bool, stream: TextIO | None = None) -> ProgressBar | TrialLog | None:
    """The bar on a terminal (not under ``--json``: a terminal reading JSON wants it clean), the
    log lines elsewhere (stderr, so ``--json``'s stdout stays one JSON object)."""
    stream = stream or sys.stderr
    if stream.isatty():
        return None if as_json else ProgressBar(budget, stream)
    return TrialLog(budget, stream)


class CompileProgress:
    """``foldwise compile``'s progress (a :meth:`fuser_core.CompilePool.compile` callback): on a
    terminal, ``[k/n] compiled <target> <strategy>`` redrawn in place; elsewhere a line per kernel."""

    def __init__(self, target_of: dict[int, str], stream: TextIO | None = None):
        self.target_of = target_of  # id(request) -> the target's name as the report gives it
        self.stream = stream or sys.stderr
        self.terminal = self.stream.isatty()
        self._shown = False

    def __call__(self, done: int, total: int, request: Any, build: Any, cached: bool) -> None:
        target = self.target_of.get(id(request), str(request.target))
        source = " (from the compile cache)" if cached else ""
        if self.terminal:
            self.stream.write(f"\r\033[K[{done}/{total}] compiled {target} {build.strategy}{source}")
            self._shown = True
        elif build.refused:
            self.stream.write(f"compile {target} {build.strategy}: refused: {build.refused}\n")
        else:
            for k in build.kernels:
                what = (f"ok, {k.registers} registers, {k.spill_bytes} spilled, {k.shared_bytes} shared bytes"
                        if k.ok else f"FAILED: {(k.error or '').splitlines()[0] if k.error else ''}")
                self.stream.write(f"compile {target} {build.strategy} {k.kernel}: {what}{source}\n")
        self.stream.flush()

    def close(self) -> None:
        if self._shown:  # the report starts on a clean line
            self.stream.write("\r\033[K")
            self.stream.flush()
