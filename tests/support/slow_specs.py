"""A slow but valid spec: seconds of derivation and certificate, within every documented limit
(docs/SPEC.md: at most 64 steps, 64 KB). Used by the bounded-derivation tests
(tests/service/test_api.py, test_security.py) and benchmarks/derivation_flood.py.

``slow_spec(steps)``: a max, then a chain of ``steps`` sums over ``n``, each of a cubic in ``x``
scaled by ``exp(x - mx)`` and by the previous sum: fusible, so the deriver and the certificate
work through every step. 30 steps (4 KB) take about 5 s on a loaded 2-core machine, 45 (6 KB)
about 10 s. ``tag`` changes the constants (another spec, another cache entry).
"""

from __future__ import annotations

from typing import Any


def slow_spec(steps: int = 30, tag: int = 0) -> dict[str, Any]:
    chain: list[dict[str, Any]] = [{"name": "mx", "reduce": "max", "over": "n", "expr": "x"}]
    prev = None
    for i in range(steps):
        expr = f"exp(x - mx) * (x * x * x + {i + 1}.25 * x * x + {i + 2 + tag}.5 * x + {i}.75)"
        if prev:
            expr += f" * (1 + {prev} * x)"
        chain.append({"name": f"s{i}", "reduce": "sum", "over": "n", "expr": expr})
        prev = f"s{i}"
    return {"foldwise": 1, "name": f"slow_{tag}", "inputs": {"x": {"dims": ["m", "n"]}}, "steps": chain,
            "outputs": [prev]}
