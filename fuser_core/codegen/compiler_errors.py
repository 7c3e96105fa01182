"""What Triton's compiler says when a generated kernel fails, read into one line of text.

A frontend error (a ``CompilationError``) points at a line of the function; :func:`module_line`
finds it in the generated module. A failing MLIR pass raises only "PassManager::run failed" and
prints its reason on the process's stderr (file descriptor 2, from C++): :func:`compiler_stderr`
keeps that text, :func:`pipeline_failure` reads the pass and assertion from it. Both backends
(:mod:`fuser_core.codegen.backends`) run the same frontend and pass manager, so this is shared.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

MAX_ERROR_CHARS = 2000


class CompileError(RuntimeError):
    """Triton's compiler refused a kernel; the message is :func:`error_text`'s."""


def module_line(fn, error) -> str:
    """'line N' of the generated module where a CompilationError points (found by its text)."""
    node, src = getattr(error, "node", None), getattr(error, "src", None)
    lineno = getattr(node, "lineno", None)
    if not (lineno and src):
        return ""
    wanted = src.split("\n")[lineno - 1]
    try:
        lines = Path(fn.fn.__code__.co_filename).read_text().split("\n")
    except OSError:
        return ""
    hits = [k + 1 for k, line in enumerate(lines) if line.strip() == wanted.strip()]
    return f"line {hits[0]}: {wanted.strip()}" if hits else f"line {lineno} of the function: {wanted.strip()}"


def error_text(fn, error: Exception, diagnostics: str = "") -> str:
    """The compiler's message for a kernel that failed, in one line: the kernel, the module line a
    CompilationError points at, what failed, and the pass a failed pipeline names on stderr."""
    from triton.compiler.errors import CompilationError

    name = fn.__name__
    if isinstance(error, CompilationError):
        cause = error.error_message or type(error).__name__
        where = module_line(fn, error)
        text = f"{name}: {where}: {cause}" if where else f"{name}: {cause}"
    else:
        text = f"{name}: {type(error).__name__}: {error}"
        why = pipeline_failure(diagnostics)
        if why:
            text += f" ({why})"
    return text[:MAX_ERROR_CHARS]


_FAILED_PASS = re.compile(r"Pipeline failed while executing \[`(\w+)`")
_ASSERTION = re.compile(r"Assertion `(.{1,200}?)' failed")


def pipeline_failure(diagnostics: str) -> str | None:
    """What an MLIR pass pipeline that failed wrote to stderr, in one line: the pass, and the
    assertion it hit (``pass TritonGPUOptimizeThreadLocality: assertion loopResult.hasOneUse()``).
    Triton's own exception says only "PassManager::run failed"; the reason is printed, with a
    reproducer of the whole module, on the process's stderr (:func:`compiler_stderr`)."""
    failed = _FAILED_PASS.search(diagnostics)
    if failed is None:
        return None
    assertion = _ASSERTION.search(diagnostics)
    return f"pass {failed.group(1)}" + (f": assertion {assertion.group(1)}" if assertion else "")


@contextlib.contextmanager
def compiler_stderr():
    """Within the block, what Triton's C++ compiler writes to the process's stderr (file
    descriptor 2) is kept (yields a list that receives it as one string) instead of printed:
    a failing pass prints its diagnostics and a reproducer of the whole module there, hundreds
    of lines per kernel. Compiles run in :class:`fuser_core.codegen.gpu_compile.CompilePool` workers, one at a time."""
    import sys
    import tempfile

    out: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            out.append(sink.read().decode("utf-8", "replace"))


def pass_on(printed: list[str]) -> None:
    """What a compile that succeeded printed (warnings): to stderr, as it would have gone."""
    import sys

    if any(printed):
        sys.stderr.write("".join(printed))
