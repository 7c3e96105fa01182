"""One meaning per name (issue 38, 4): no class name is defined twice across the three packages, so
a name read in a traceback, a docstring or a review says which class it is."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_class_name_is_defined_twice_across_the_packages():
    where = defaultdict(list)
    for package in ("fuser_core", "tuner", "service"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    where[node.name].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    twice = {name: places for name, places in where.items() if len(places) > 1}
    assert not twice, twice
