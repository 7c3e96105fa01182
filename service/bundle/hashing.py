"""A bundle's bytes and hash (docs/API.md, "The kernel bundle"): what the sha256 and the ETag cover."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

HEX64 = re.compile(r"[0-9a-f]{64}\Z")


class BundleError(ValueError):
    """A bundle that cannot be made, trusted or run; the message names the field or input."""


def canonical_bytes(obj: dict) -> bytes:
    """The bytes a bundle is hashed and served as (docs/API.md): sorted keys, no spaces, UTF-8.

    NaN and infinities are refused (``allow_nan=False``): they are not JSON, and other clients
    could not parse the bundle; every finite document serialises exactly as the contract says.
    """
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as err:
        raise BundleError(f"bundle is not plain JSON: {err}") from None


def bundle_sha256(bundle: dict) -> str:
    """Hex sha256 of the bundle without its ``sha256`` field."""
    return hashlib.sha256(canonical_bytes({k: v for k, v in bundle.items() if k != "sha256"})).hexdigest()


def verify_sha256(bundle: dict[str, Any]) -> None:
    """:class:`BundleError` on ``sha256`` unless it is 64 lowercase hex digits that the bundle
    (every other field, binaries included) hashes to."""
    if not isinstance(bundle.get("sha256"), str) or not HEX64.match(bundle["sha256"]):
        raise BundleError("sha256: not 64 lowercase hex digits")
    actual = bundle_sha256(bundle)
    if actual != bundle["sha256"]:
        raise BundleError(f"sha256: the bundle hashes to {actual}, not its recorded {bundle['sha256']}: "
                          "it was changed after it was made")
