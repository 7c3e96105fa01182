"""What the bench times per case, and how tables name it.

Every case times the tuned ``fused`` kernel and the :data:`BASELINES` asked for; with
``experts``, also each expert baseline of :mod:`tuner.experts` that computes the case, as
variant ``EXPERT_PREFIX + name``.
"""

from __future__ import annotations

BASELINES = ("chain", "eager", "compile", "handwritten")
VARIANTS = ("fused", *BASELINES)
LABELS = {"fused": "fused (tuned)", "chain": "unfused chain", "eager": "torch eager", "compile": "torch.compile",
          "handwritten": "hand-written"}
EXPERT_PREFIX = "expert:"  # variants[EXPERT_PREFIX + name]: an expert baseline of tuner.experts


def label_of(kind: str) -> str:
    """How tables name a variant: LABELS, or an expert's own name."""
    return kind[len(EXPERT_PREFIX):] if kind.startswith(EXPERT_PREFIX) else LABELS[kind]


__all__ = ["BASELINES", "EXPERT_PREFIX", "LABELS", "VARIANTS", "label_of"]
