"""Which max/min steps the outputs do not depend on: the shifts of the safe-softmax family.

``mx = max(x)`` in softmax, log-softmax, logsumexp, cross-entropy and attention only keeps
``exp`` in range: the outputs are the same for any value of it (exactly, in real arithmetic).
Its gradient is then zero, and the backward should not compute it: torch's own softmax backward
and JAX's ``logsumexp`` (``stop_gradient`` on the max) skip it. Computed anyway, it is a sum of
terms that cancel (one more reduction, and a rounding error that becomes the gradient of the
maximum's position).

The test is numeric, as the forward's certificate is: the spec evaluated in float64 with the step
moved by a random amount per element must give the same outputs (relative 1e-9) on random inputs.
The backward's own certificate (``certify``) checks the result against torch's autograd, which
does differentiate through the max: a wrong answer here would fail there.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fuser_core.reference import Evaluator, random_inputs
from fuser_core.spec_model import Spec, Step

TOLERANCE = 1e-9  # relative, in float64: a shift that changes the outputs changes them by O(1)
SEEDS = (0, 1)


class _Shifted(Evaluator):
    """The reference with one reduction's result moved by ``delta`` (aligned)."""

    def __init__(self, spec: Spec, shape: Mapping[str, int], step: str, delta: np.ndarray):
        super().__init__(spec, shape)
        self.shifted_step, self.delta = step, delta

    def reduce(self, step: Step, env: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = super().reduce(step, env)
        if step.name == self.shifted_step:
            out[step.name] = out[step.name] + self.delta
        return out


def is_shift(spec: Spec, step: Step, shape: Mapping[str, int]) -> bool:
    """True when ``spec``'s outputs do not change when ``step`` (a max or min) does (module doc)."""
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        inputs = random_inputs(spec, shape, rng, "float32")
        plain = Evaluator(spec, shape)
        delta = rng.uniform(-3.0, 3.0, plain.aligned_shape(step.dims))
        before = plain.outputs(inputs)
        after = _Shifted(spec, shape, step.name, delta).outputs(inputs)
        for part, value in before.items():
            moved = after[part]
            if value.dtype.kind != "f":
                if not np.array_equal(value, moved):
                    return False
                continue
            scale = np.maximum(np.abs(value), 1.0)
            finite = np.isfinite(value) & np.isfinite(moved)
            if not np.array_equal(np.isfinite(value), np.isfinite(moved)):
                return False
            if np.any(np.abs(value - moved)[finite] > TOLERANCE * scale[finite]):
                return False
    return True
