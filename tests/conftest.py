"""Shared fixtures: the public catalog of specs (../shared/catalog from the repo root), and a
per-session kernel cache directory (generated kernels never land in ~/.cache/foldwise)."""

from __future__ import annotations

import os

# Kernels run on the CPU through Triton's interpreter: set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

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


@pytest.fixture(scope="session", autouse=True)
def kernel_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """FOLDWISE_CACHE_DIR for the whole session: a fresh temporary directory (subprocesses inherit it)."""
    path = tmp_path_factory.mktemp("foldwise-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FOLDWISE_CACHE_DIR", str(path))
        yield path
