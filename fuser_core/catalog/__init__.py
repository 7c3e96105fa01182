"""The workload catalog: cascade specs addressable by name, and the benchmark suites.

The catalog ships inside the package (the ``*.json`` files beside this module, installed as
package data), so ``foldwise derive safe_softmax`` works from any clone or wheel. A user adds
their own folders with ``$FOLDWISE_CATALOG_DIR`` (several separated by ``os.pathsep``); they
are searched before the packaged catalog, so a user's spec of the same name wins.

A spec's catalog name is its file name without ``.json``. Every command and client call that
takes a spec accepts a catalog name or a path: an argument naming an existing file is that
file, anything else is looked up by name (:func:`spec_source`). ``suites.json`` in a catalog
folder is not a spec: it holds benchmark suites (suite name -> list of cases, each a catalog
spec name, a shape and a dtype); a user's suite replaces the packaged suite of the same name.

This module is the one place that knows where specs live; the CLI, ``foldwise bench``, the
dashboard's picker, the client and the tests all read it.

Example:
    >>> "safe_softmax" in catalog_names()
    True
    >>> load_catalog_spec("safe_softmax").name
    'safe_softmax'
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuser_core.spec import MAX_SPEC_BYTES, Spec, load_spec

PACKAGED_DIR = Path(__file__).resolve().parent
CATALOG_ENV = "FOLDWISE_CATALOG_DIR"
SUITES_FILE = "suites.json"
MAX_CATALOG_FILES = 200  # per folder: a user's folder is listed, never walked without bound
MAX_SUITES_BYTES = 16 * MAX_SPEC_BYTES
# a catalog name is a file stem: no path separators, so a name can never reach outside its folder
CATALOG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")


class CatalogError(ValueError):
    """A spec that cannot be found or read by name or path, or a bad suites file; the message
    says which argument and why."""


@dataclass(frozen=True)
class CatalogEntry:
    """One spec file of the catalog: its name (the file stem), path and the spec's ``doc``."""

    name: str
    path: Path
    doc: str | None
    packaged: bool

    @property
    def summary(self) -> str | None:
        """The doc's first sentence: a listing's line (a serving spec's doc runs to a paragraph)."""
        return None if self.doc is None else self.doc.split(". ", 1)[0].rstrip(".") + "."


def catalog_dirs(extra: Sequence[str | os.PathLike] = ()) -> list[Path]:
    """The folders searched for specs by name, first match wins: ``extra``, then those of
    ``$FOLDWISE_CATALOG_DIR``, then the packaged catalog. Folders that do not exist are skipped."""
    env = os.environ.get(CATALOG_ENV, "")
    user = [Path(p).expanduser() for p in [*map(os.fspath, extra), *env.split(os.pathsep)] if p]
    out: list[Path] = []
    for path in [*user, PACKAGED_DIR]:
        path = path.resolve()
        if path.is_dir() and path not in out:
            out.append(path)
    return out


def _spec_files(directory: Path) -> list[Path]:
    files = sorted(p for p in directory.glob("*.json") if p.name != SUITES_FILE and CATALOG_NAME.match(p.stem))
    return files[:MAX_CATALOG_FILES]


def catalog_entries(dirs: Sequence[Path] | None = None) -> list[CatalogEntry]:
    """Every spec file by name (sorted), the first folder of ``dirs`` (default :func:`catalog_dirs`)
    that has a name winning. ``doc`` is read from the JSON without validating the spec, so a
    listing never fails on one bad file; a file that is not a JSON object gets ``doc`` None."""
    dirs = catalog_dirs() if dirs is None else list(dirs)
    found: dict[str, CatalogEntry] = {}
    for directory in dirs:
        for path in _spec_files(directory):
            if path.stem in found:
                continue
            doc = None
            try:
                if path.stat().st_size <= MAX_SPEC_BYTES:
                    raw = json.loads(path.read_bytes())
                    doc = raw.get("doc") if isinstance(raw, dict) and isinstance(raw.get("doc"), str) else None
            except (OSError, ValueError):
                pass
            found[path.stem] = CatalogEntry(path.stem, path, doc, directory == PACKAGED_DIR)
    return [found[name] for name in sorted(found)]


def catalog_names(dirs: Sequence[Path] | None = None) -> list[str]:
    """The catalog's spec names, sorted (``safe_softmax``, ``attention``, ...)."""
    return [e.name for e in catalog_entries(dirs)]


def find_catalog_spec(name: str, dirs: Sequence[Path] | None = None) -> Path | None:
    """The file of catalog spec ``name`` (first folder that has it), or None."""
    if not CATALOG_NAME.match(name):
        return None
    for directory in catalog_dirs() if dirs is None else dirs:
        path = directory / f"{name}.json"
        if path.is_file():
            return path
    return None


def spec_path(name_or_path: str | os.PathLike, dirs: Sequence[Path] | None = None) -> Path:
    """The file a spec argument means: an existing file as given, else the catalog spec of that
    name. :class:`CatalogError` when it is neither, listing the catalog's names."""
    text = os.fspath(name_or_path)
    given = Path(text).expanduser()
    if given.is_file():
        return given
    found = find_catalog_spec(text, dirs)
    if found is not None:
        return found
    if given.exists():
        raise CatalogError(f"{text}: not a file")
    names = catalog_names(dirs)
    hint = ""
    if text.endswith(".json") and Path(text).stem in names and "/" not in text and os.sep not in text:
        hint = f" (the catalog has {Path(text).stem!r}: give the name without .json)"
    raise CatalogError(f"{text}: no such file, and no catalog spec of that name{hint}; "
                       f"catalog names: {', '.join(names) or '(none)'}")


def spec_source(name_or_path: str | os.PathLike, dirs: Sequence[Path] | None = None) -> bytes:
    """The bytes of the spec that ``name_or_path`` means (:func:`spec_path`), at most
    ``MAX_SPEC_BYTES``; :class:`CatalogError` naming the argument otherwise."""
    path = spec_path(name_or_path, dirs)
    try:
        if path.stat().st_size > MAX_SPEC_BYTES:
            raise CatalogError(f"{os.fspath(name_or_path)}: spec file is larger than {MAX_SPEC_BYTES} bytes")
        return path.read_bytes()
    except OSError as err:
        raise CatalogError(f"{os.fspath(name_or_path)}: cannot read {path}: {err.strerror}") from None


def load_catalog_spec(name_or_path: str | os.PathLike, dirs: Sequence[Path] | None = None) -> Spec:
    """The validated spec a catalog name or a path means (``SpecError`` when it is invalid)."""
    return load_spec(spec_source(name_or_path, dirs))


def load_suites(dirs: Sequence[Path] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Suite name -> cases, from the ``suites.json`` of every catalog folder (a folder listed
    earlier replaces a suite of the same name). Keys that are not lists (``doc``) are not
    suites. :class:`CatalogError` naming the file when one cannot be read."""
    suites: dict[str, list[dict[str, Any]]] = {}
    for directory in reversed(catalog_dirs() if dirs is None else list(dirs)):
        path = directory / SUITES_FILE
        if not path.is_file():
            continue
        try:
            if path.stat().st_size > MAX_SUITES_BYTES:
                raise CatalogError(f"{path}: larger than {MAX_SUITES_BYTES} bytes")
            raw = json.loads(path.read_bytes())
        except OSError as err:
            raise CatalogError(f"cannot read the suites file {path}: {err.strerror}") from None
        except ValueError as err:
            raise CatalogError(f"{path}: not valid JSON: {err}") from None
        if not isinstance(raw, dict):
            raise CatalogError(f"{path}: expected an object of suite name -> list of cases")
        suites.update({k: v for k, v in raw.items() if isinstance(v, list)})
    return suites


__all__ = [
    "CATALOG_ENV", "PACKAGED_DIR", "SUITES_FILE", "CatalogEntry", "CatalogError", "catalog_dirs",
    "catalog_entries", "catalog_names", "find_catalog_spec", "load_catalog_spec", "load_suites", "spec_path",
    "spec_source",
]
