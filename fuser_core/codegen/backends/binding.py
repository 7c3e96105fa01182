"""Triton's binding of a launch's arguments: the one place Foldwise calls Triton's private API.

``JITFunction.run`` binds a launch in two steps, neither of them public: a binder made by
``triton.runtime.jit.create_function_from_signature`` specialises the arguments (pointer
dtypes, which ints are 1 or divisible by 16, the constexprs), then ``JITFunction._pack_args``
turns that into ``triton.compile``'s (options, signature, constexprs, attrs). Compiling an
intercepted launch with the same two steps gives exactly the kernel a GPU launch would compile,
and the same Triton cache key. Both exist, with these signatures, in Triton 3.6 to 3.9
(:data:`TESTED_TRITON`); a Triton without them fails here with its version named, not with an
AttributeError deep in a compile worker.
"""

from __future__ import annotations

from typing import Any

TESTED_TRITON = "3.6 to 3.9"  # the versions CI compiles with (.ci/run, .ci/triton36)


def bind_launch(fn: Any, args: tuple, kwargs: dict[str, Any], triton_backend: Any) -> tuple[Any, Any, Any, Any]:
    """(options, signature, constexprs, attrs) of ``fn(*args, **kwargs)`` for ``triton_backend``
    (``triton.compiler.compiler.make_backend(target)``), as ``JITFunction.run`` computes them.
    RuntimeError naming the installed Triton's version when its private API is not the known one."""
    import triton
    from triton.runtime import jit

    create = getattr(jit, "create_function_from_signature", None)
    pack = getattr(fn, "_pack_args", None)
    missing = [name for name, found in (("triton.runtime.jit.create_function_from_signature", create),
                                        ("JITFunction._pack_args", pack)) if found is None]
    if missing:
        raise RuntimeError(f"Triton {triton.__version__} has no {' or '.join(missing)}: Foldwise binds a launch's "
                           f"arguments with Triton's private API as JITFunction.run does, known in Triton "
                           f"{TESTED_TRITON}; install one of those")
    binder = create(fn.signature, fn.params, triton_backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    return pack(triton_backend, kwargs, bound_args, specialization, options)
