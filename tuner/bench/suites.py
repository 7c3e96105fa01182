"""Which cases a bench runs: a suite of the catalog's ``suites.json`` (:mod:`fuser_core.catalog`),
each case a catalog spec, its sizes and dtype, checked before anything runs (a
:class:`~tuner.bench.errors.BenchError` names the suite or the case), and its id in the results."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tuner.bench.errors import BenchError


def bench_catalog_dirs(catalog_dir: Path | None) -> list[Path]:
    """The catalog folders a bench reads: ``catalog_dir`` (``--catalog``) first, then
    ``$FOLDWISE_CATALOG_DIR`` and the packaged catalog (:mod:`fuser_core.catalog`)."""
    from fuser_core.catalog import catalog_dirs

    if catalog_dir is not None and not Path(catalog_dir).is_dir():
        raise BenchError(f"catalog: {catalog_dir} is not a folder")
    return catalog_dirs(extra=[catalog_dir] if catalog_dir is not None else [])


def load_suite(suite: str, catalog_dir: Path | None = None) -> list[dict[str, Any]]:
    """The cases of ``suite`` from the catalog's suites (``catalog_dir`` first, see
    :func:`bench_catalog_dirs`); BenchError naming the suite or the case."""
    from fuser_core.catalog import CatalogError, catalog_names, load_suites

    dirs = bench_catalog_dirs(catalog_dir)
    try:
        suites = load_suites(dirs)
    except CatalogError as err:
        raise BenchError(str(err)) from None
    if suite not in suites:
        raise BenchError(f"unknown suite {suite!r}; the catalog has {', '.join(sorted(suites)) or 'none'}")
    cases = suites[suite]
    names = set(catalog_names(dirs))
    for i, case in enumerate(cases):
        if (not isinstance(case, dict) or not isinstance(case.get("spec"), str)
                or not isinstance(case.get("shape"), dict)):
            raise BenchError(f"{suite}[{i}]: a case needs 'spec' (a catalog name) and 'shape' (dim -> size)")
        if case["spec"] not in names:
            raise BenchError(f"{suite}[{i}].spec: no catalog spec {case['spec']!r} in {', '.join(map(str, dirs))}")
    return cases


def case_id(case: Mapping[str, Any]) -> str:
    return f"{case['spec']}[" + ",".join(f"{k}={v}" for k, v in case["shape"].items()) + "]"


__all__ = ["bench_catalog_dirs", "case_id", "load_suite"]
