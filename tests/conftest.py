"""Shared fixtures: the public catalog of specs (../shared/catalog from the repo root)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CATALOG_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "catalog"
NOT_SPECS = {"suites.json"}


def load_catalog() -> dict[str, dict]:
    """{spec name: raw dict} for every catalog spec (suites.json is not a spec)."""
    out = {}
    for path in sorted(CATALOG_DIR.glob("*.json")):
        if path.name in NOT_SPECS:
            continue
        out[path.stem] = json.loads(path.read_text())
    return out


@pytest.fixture(scope="session")
def catalog_dir() -> Path:
    return CATALOG_DIR


@pytest.fixture()
def catalog_specs() -> dict[str, dict]:
    """A fresh copy per test, so tests may mutate it."""
    return load_catalog()
