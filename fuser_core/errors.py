"""The one error type for invalid specs.

Every validation failure names where it happened: a path into the spec JSON
(``("steps", 1, "expr")``) and, for steps, the step's name. The CLI prints it and
exits 2; the HTTP API turns ``loc`` into the problem+json error location.
"""

from __future__ import annotations

from typing import Any


class SpecError(ValueError):
    """A spec that cannot be accepted.

    Example:
        >>> err = SpecError("unknown name 'y'", loc=("steps", 1, "expr"), step="den")
        >>> str(err)
        "steps[1] (den).expr: unknown name 'y'"
    """

    def __init__(self, message: str, *, loc: tuple[str | int, ...] = (), step: str | None = None):
        self.message = message
        self.loc = tuple(loc)
        self.step = step
        super().__init__(f"{self.where}: {message}" if loc else message)

    @property
    def where(self) -> str:
        """The field as a readable path, e.g. ``steps[1] (den).expr``."""
        out = ""
        for part in self.loc:
            if isinstance(part, int):
                out += f"[{part}]"
                if self.step is not None and out.startswith("steps"):
                    out += f" ({self.step})"
            else:
                out += f".{part}" if out else part
        return out


class DerivationLimitError(RuntimeError):
    """A derivation that would exceed its size or time budget (reported, never hung on)."""


def shown(value: Any, limit: int = 80) -> str:
    """A short repr for error messages that is safe on any decoded value (a deeply nested list
    or a 5000-digit int makes ``repr`` raise RecursionError / ValueError)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, str):
        text = repr(value[: limit + 1])
    elif value is None or isinstance(value, bool | int | float):
        text = repr(value)
    else:
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."
