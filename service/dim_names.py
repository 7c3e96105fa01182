"""Canonical versus user names: the one object that maps a spec's names both ways.

Everything stored and served speaks the *canonical* spec's names (dims ``d0, d1, ...``, steps
``s0, ...``; inputs and runtime params keep theirs: :func:`fuser_core.canonical_names`), since
two specs with one ``spec_hash`` may name their dims differently. People see their own names:
a job's ``display_shape``, the dashboard's pages, a loaded kernel's shapes. :class:`DimNames`
is that mapping, built once per spec (``DimNames.of``) or per stored source text
(``DimNames.of_source``, cached). Light: no sympy, NumPy or database imports (the client uses it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from fuser_core import Spec, canonical_names, load_spec


@dataclass(frozen=True)
class DimNames:
    """A spec's names: its own (the user's) and the canonical ones, both ways."""

    to_canonical: Mapping[str, str]  # the spec's own name -> canonical (m -> d0)
    to_user: Mapping[str, str]  # canonical -> the spec's own name (d0 -> m)

    @classmethod
    def of(cls, spec: Spec) -> DimNames:
        names = canonical_names(spec)
        return cls(names, {canon: user for user, canon in names.items()})

    @staticmethod
    def of_source(source: str) -> DimNames:
        """The names of a spec given as its JSON text (a stored ``SpecRecord.source``), cached by text."""
        return _of_source(source)

    def user(self, name: str) -> str:
        """A canonical name in the spec's own names (a name it does not know, as is)."""
        return self.to_user.get(name, name)

    def user_shape(self, shape: Mapping[str, Any]) -> dict[str, Any]:
        """A canonical shape (or any map keyed by canonical dims) in the spec's own dim names."""
        return {self.to_user.get(d, d): v for d, v in shape.items()}

    def user_dims(self) -> dict[str, str]:
        """canonical dim (``d0``) -> the spec's own dim name; steps and params left out."""
        return {canon: user for canon, user in self.to_user.items() if canon[:1] == "d" and canon[1:].isdigit()}


@lru_cache(maxsize=256)
def _of_source(source: str) -> DimNames:
    return DimNames.of(load_spec(source))
