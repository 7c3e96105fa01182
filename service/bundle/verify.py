"""Verifying a bundle: its format, fields, hash, canonical spec, binaries and generated source.

A client verifies every bundle before it keeps or loads it (:func:`service.bundle.load_bundle`,
service.client), the server before it stores one.
"""

from __future__ import annotations

import ast
import json
import threading
from typing import Any

from fuser_core import SpecError, bind_dtypes, canonical_json, canonical_shape, load_spec, spec_hash
from service.bundle.binaries import verify_variant
from service.bundle.formats import BUNDLE_FORMAT, BUNDLE_FORMAT_2, BUNDLE_FORMAT_3, bundle_v1
from service.bundle.hashing import BundleError, verify_sha256

REQUIRED_FIELDS: dict[str, type | tuple[type, ...]] = {
    "format": str, "spec": dict, "spec_hash": str, "shape": dict, "dtype": (str, dict), "target": str,
    "strategy": str, "config": dict, "triton_source": str, "measured": dict, "derivation": dict, "sha256": str,
}
ALLOWED_IMPORTS = {"os", "torch", "triton", "triton.language"}
MAX_SOURCE_CHARS = 4 * 1024 * 1024  # generated modules are tens of KiB
_AST_LOCK = threading.Lock()


def verify_bundle(bundle: Any) -> None:
    """Raise :class:`BundleError` unless ``bundle`` is a well-formed bundle whose hash holds.

    Checks the format, the required fields and their types, the sha256 (recomputed), that
    ``spec`` is a valid canonical spec with hash ``spec_hash``, that ``shape`` fits it, and that
    ``triton_source`` parses, imports only os/torch/triton and defines ``launch``.
    """
    if not isinstance(bundle, dict):
        raise BundleError(f"a bundle is a JSON object, got {type(bundle).__name__}")
    fmt = bundle.get("format")
    if fmt in (BUNDLE_FORMAT_2, BUNDLE_FORMAT_3):
        _verify_binaries(bundle)
        return
    if fmt != BUNDLE_FORMAT:
        raise BundleError(f"format: expected {BUNDLE_FORMAT!r}, {BUNDLE_FORMAT_2!r} or {BUNDLE_FORMAT_3!r}, "
                          f"got {fmt!r:.60}")
    for name, kind in REQUIRED_FIELDS.items():
        if name not in bundle:
            raise BundleError(f"{name}: missing")
        if not isinstance(bundle[name], kind):
            raise BundleError(f"{name}: wrong type {type(bundle[name]).__name__}")
    verify_sha256(bundle)
    try:
        canon = load_spec(bundle["spec"], printed=True)
    except SpecError as err:
        raise BundleError(f"spec: {err}") from None
    if canonical_json(canon) != json.dumps(bundle["spec"], sort_keys=True, separators=(",", ":")):
        raise BundleError("spec: not in canonical form")
    if spec_hash(canon) != bundle["spec_hash"]:
        raise BundleError("spec_hash: does not match spec")
    try:
        if canonical_shape(canon, bundle["shape"]) != bundle["shape"]:
            raise BundleError("shape: must name every dim of the spec")
        dtypes = bind_dtypes(canon, bundle["dtype"])
    except SpecError as err:
        raise BundleError(str(err)) from None
    expected_inputs = {i.name: {"dims": list(i.dims), "dtype": dtypes[i.name]} for i in canon.inputs}
    if bundle.get("inputs") != expected_inputs:
        raise BundleError("inputs: missing, or not the spec's inputs with their dims and dtypes")
    outputs = bundle.get("outputs")
    if not isinstance(outputs, dict) or set(outputs) != set(canon.output_parts):
        raise BundleError("outputs: missing, or not the spec's output parts")
    limits = bundle.get("size_limits")
    if not isinstance(limits, dict) or not all(
            d in canon.dims and isinstance(n, int) and not isinstance(n, bool) and n >= 1 for d, n in limits.items()):
        raise BundleError("size_limits: missing, or not a map of the spec's dims to positive integers")
    _check_source(bundle["triton_source"])


def _verify_binaries(bundle: dict) -> None:
    """A format-2 or -3 bundle: its hash, every variant under its keys, and the format-1 bundle inside."""
    verify_sha256(bundle)
    binaries = bundle.get("binaries")
    per_version = bundle["format"] == BUNDLE_FORMAT_3
    if not isinstance(binaries, dict):
        raise BundleError("binaries: missing, or not an object of arch -> "
                          + ("Triton version -> variant" if per_version else "variant"))
    for arch, entry in binaries.items():
        if not per_version:
            entry = {None: entry}
        elif not isinstance(entry, dict) or not entry:
            raise BundleError(f"binaries.{arch:.40}: expected an object of Triton version -> variant")
        for version, variant in entry.items():
            where = f"binaries.{arch}" if version is None else f"binaries.{arch}[{version!r:.64}]"
            verify_variant(variant, where)
            if variant["arch"] != arch:
                raise BundleError(f"{where}.arch: {variant['arch']!r:.40} is not its key")
            if version is not None and variant["triton_version"] != version:
                raise BundleError(f"{where}.triton_version: {variant['triton_version']!r:.64} is not its key")
    verify_bundle(bundle_v1(bundle))


def _statements(tree: ast.Module):
    """Every statement of ``tree``, nested ones included. Imports are statements, so this finds
    every one that ``ast.walk`` would, without visiting the (many more) expression nodes: the
    walk was most of a bundle's verification time, which a cubin load pays at start-up."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            todo.extend(getattr(node, field, None) or ())


def _check_source(source: str) -> None:
    """The generated module's shape: parses, imports only os/torch/triton, defines launch()."""
    if len(source) > MAX_SOURCE_CHARS:
        raise BundleError(f"triton_source: longer than {MAX_SOURCE_CHARS} characters")
    try:
        with _AST_LOCK:  # CPython < 3.11.8 can raise SystemError when threads parse at once (gh-106905)
            tree = ast.parse(source)
    except SyntaxError as err:
        raise BundleError(f"triton_source: not valid Python (line {err.lineno}: {err.msg})") from None
    for node in _statements(tree):
        if isinstance(node, ast.Import):
            bad = [a.name for a in node.names if a.name not in ALLOWED_IMPORTS]
        elif isinstance(node, ast.ImportFrom):
            bad = [] if node.module in ALLOWED_IMPORTS and node.level == 0 else [str(node.module)]
        else:
            continue
        if bad:
            raise BundleError(f"triton_source: imports {bad[0]!r}; a generated module imports only os, torch, triton")
    if not any(isinstance(n, ast.FunctionDef) and n.name == "launch" for n in tree.body):
        raise BundleError("triton_source: defines no launch() function")
