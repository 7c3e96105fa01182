"""Bundle formats and the text forms of the names bundles are keyed by.

**Formats.** ``foldwise-bundle/1`` is the bundle of the generated source (the package
docstring, :mod:`service.bundle`). A format-2 bundle is the format-1 bundle (every field but
sha256 unchanged) with ``format: "foldwise-bundle/2"`` and ``binaries: {arch: variant}``, hashed
as a whole, so the sha256 and the ETag cover every binary byte. Format 3 is the same with every
Triton version's variant: ``format: "foldwise-bundle/3"`` and ``binaries: {arch: {triton_version:
variant}}`` (a binary and its launcher and cache key belong to the Triton that compiled it, and
workers on different Tritons store one each). Format 2 stays for clients written for it, with one
variant per arch: the newest Triton's (:func:`newest_per_arch`). Dropping ``binaries`` gives back
the format-1 bundle and its sha256 exactly (:func:`bundle_v1`): the kernel view's
``bundle_sha256`` names that one, and a client checks a format-2 or -3 bundle against it through
this projection. A variant (one arch's compiled kernels: cubins for NVIDIA, hsaco for AMD) is
:mod:`service.bundle.binaries`'.

**Text.** Shapes and dtypes as queries and command lines write them (``m=4,n=300``,
``float16`` or a JSON object), and the canonical-to-user name map.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from fuser_core import Spec, SpecError, canonical_json, canonical_names, load_spec
from service.bundle.hashing import BundleError, bundle_sha256

BUNDLE_FORMAT = "foldwise-bundle/1"
BUNDLE_FORMAT_2 = "foldwise-bundle/2"  # /1 plus "binaries": compiled kernels per arch
BUNDLE_FORMAT_3 = "foldwise-bundle/3"  # /1 plus "binaries": compiled kernels per arch and Triton version
MAX_SHAPE_CHARS = 2048  # shape text ("m=4,n=300") of a query or command line


# ----------------------------------------------------------------------------- names and keys

def canonical_spec(spec: Spec) -> Spec:
    """The canonical spec as a :class:`Spec` (its own canonical form is itself)."""
    return load_spec(canonical_json(spec), printed=True)


def dtype_text(dtype: str | Mapping[str, str]) -> str:
    """A normalized dtype as query text: the string, or compact sorted JSON for a map."""
    return dtype if isinstance(dtype, str) else json.dumps(dict(sorted(dtype.items())), separators=(",", ":"))


def parse_dtype_text(text: str) -> str | dict[str, str]:
    """``"float16"``, or a JSON object of input name -> dtype: the one reader of dtype text (the
    inverse of :func:`dtype_text`), for the CLI's ``--dtype`` and the ``dtype`` query of the API
    and dashboard. Names are checked against a spec later (:func:`fuser_core.normalize_dtype`); here only
    the text's form: :class:`SpecError` on ``dtype`` otherwise."""
    if not text.lstrip().startswith("{"):
        return text.strip()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise SpecError(f"not valid JSON: {err.msg}", loc=("dtype",)) from None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise SpecError("expected a JSON object of input name -> dtype", loc=("dtype",))
    return value


def shape_text(shape: Mapping[str, int]) -> str:
    """``{"d1": 300, "d0": 4}`` -> ``"d0=4,d1=300"`` (sorted by dim name, as in queries)."""
    return ",".join(f"{k}={int(v)}" for k, v in sorted(shape.items()))


def parse_shape_text(text: str) -> dict[str, int]:
    """``"m=4,n=300"`` -> ``{"m": 4, "n": 300}``: the one reader of shape text (the inverse of
    :func:`shape_text`), for the CLI's ``--shape``, the API's and dashboard's ``shape`` query and
    the client. Sizes are checked against a spec later (:func:`fuser_core.problem.bind_shape`);
    here only the text's form: :class:`SpecError` on ``shape`` otherwise."""
    if not isinstance(text, str):
        raise SpecError(f"expected dim=size pairs like m=4,n=300, got {type(text).__name__}", loc=("shape",))
    if len(text) > MAX_SHAPE_CHARS:
        raise SpecError(f"longer than {MAX_SHAPE_CHARS} characters", loc=("shape",))
    shape: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not name or not value.isdigit() or not value.isascii() or len(value) > 19:
            raise SpecError(f"expected dim=size pairs like m=4,n=300, got {item[:40]!r}", loc=("shape",))
        if name in shape:
            raise SpecError(f"dim {name[:40]!r} is given twice", loc=("shape",))
        shape[name] = int(value)
    if not shape:
        raise SpecError("expected dim=size pairs like m=4,n=300", loc=("shape",))
    return shape


def user_names(spec: Spec) -> dict[str, str]:
    """Canonical name (``d0``, ``s0``) -> ``spec``'s own name for it: how a canonical shape,
    config or output part is shown in the names of the spec someone submitted."""
    return {canon: user for user, canon in canonical_names(spec).items()}


def display_shape(spec: Spec, shape: Mapping[str, int]) -> dict[str, int]:
    """A canonical shape in ``spec``'s own dim names."""
    back = user_names(spec)
    return {back.get(d, d): n for d, n in shape.items()}


# ----------------------------------------------------------------------------- formats 2 and 3


def _with_binaries(bundle: dict, fmt: str, binaries: dict) -> dict:
    out = {k: v for k, v in bundle_v1(bundle).items() if k != "sha256"}
    out["format"] = fmt
    out["binaries"] = binaries
    out["sha256"] = bundle_sha256(out)
    return out


def bundle_v2(bundle: dict, variants: Mapping[str, dict]) -> dict:
    """The format-2 bundle of a (verified) format-1 ``bundle`` with ``variants`` by arch."""
    return _with_binaries(bundle, BUNDLE_FORMAT_2, {arch: variants[arch] for arch in sorted(variants)})


def bundle_v3(bundle: dict, variants: Iterable[dict]) -> dict:
    """The format-3 bundle of a (verified) format-1 ``bundle`` with ``variants`` (at most one per
    arch and Triton version; BundleError names a second one)."""
    binaries: dict[str, dict[str, dict]] = {}
    for variant in sorted(variants, key=lambda v: (v["arch"], triton_version_key(v["triton_version"]))):
        per_arch = binaries.setdefault(variant["arch"], {})
        if variant["triton_version"] in per_arch:
            raise BundleError(f"binaries.{variant['arch']}: two variants for Triton {variant['triton_version']!r:.64}")
        per_arch[variant["triton_version"]] = variant
    return _with_binaries(bundle, BUNDLE_FORMAT_3, binaries)


def bundle_variants(bundle: Mapping[str, Any]) -> list[dict]:
    """Every variant a (verified) bundle carries, of any format (none for format 1)."""
    binaries = bundle.get("binaries") or {}
    if bundle.get("format") == BUNDLE_FORMAT_2:
        return list(binaries.values())
    if bundle.get("format") == BUNDLE_FORMAT_3:
        return [v for per_arch in binaries.values() for v in per_arch.values()]
    return []


def triton_version_key(version: str) -> tuple:
    """A Triton version in release order: ``"3.10.0"`` after ``"3.9.0"`` (numbers compared as
    numbers, then the text: ``"3.6.0+git1"`` after ``"3.6.0"``)."""
    numbers = []
    for part in version.split("+")[0].split("."):
        if not part.isdigit():
            break
        numbers.append(int(part))
    return tuple(numbers), version


def newest_per_arch(variants: Iterable[dict]) -> dict[str, dict]:
    """arch -> the variant of the newest Triton version among ``variants``: what format 2, one
    variant per arch, carries."""
    out: dict[str, dict] = {}
    for v in variants:
        have = out.get(v["arch"])
        if have is None or triton_version_key(v["triton_version"]) > triton_version_key(have["triton_version"]):
            out[v["arch"]] = v
    return out


def bundle_v1(bundle: dict) -> dict:
    """The format-1 bundle inside a format-2 or -3 one (itself for a format-1 bundle)."""
    if bundle.get("format") not in (BUNDLE_FORMAT_2, BUNDLE_FORMAT_3):
        return bundle
    out = {k: v for k, v in bundle.items() if k not in ("sha256", "binaries")}
    out["format"] = BUNDLE_FORMAT
    out["sha256"] = bundle_sha256(out)
    return out
