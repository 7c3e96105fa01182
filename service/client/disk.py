"""The kernel client's disk cache: verified bundles by sha256, an index entry per exact request,
and the tuned ranges, so a restart without the server still serves what it had
(:mod:`service.client`, module docstring: "Offline").

Layout under the cache folder: ``<sha256>.json`` (a bundle, canonical bytes), ``<sha256>.sig``
(the signature its server sent, where the client trusts keys: service.bundle.signing),
``v2/<format-1 sha256>`` (the sha256 of the same bundle with binaries), ``index/<key>.json``
(one per request: :attr:`service.client.request.KernelRequest.key`) and
``ranges/<spec, dtype, target digest>-<range digest>.json`` (a range's shape and each bucket's
shape and bundle sha256). Every bundle read is verified again; a corrupt file is removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from service.bundle import BundleError, bundle_v1, canonical_bytes, dtype_text, verify_bundle
from service.bundle.signing import TrustedKeys
from service.client.errors import KernelServiceError
from service.client.request import KernelRequest
from service.shape_ranges import pick_bucket

log = logging.getLogger("foldwise.client")
MAX_BUNDLE_BYTES = 32 * 1024 * 1024  # a bundle is tens of KiB; refuse anything absurd (on disk or downloaded)


def default_cache_dir() -> Path:
    root = os.environ.get("FOLDWISE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "foldwise")
    return Path(root) / "client"


class DiskCache:
    """The bundles, index and ranges under ``root`` (see the module docstring)."""

    def __init__(self, root: Path, trust: TrustedKeys | None = None):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "index").mkdir(exist_ok=True)
        # with trusted keys, a bundle is read only beside its server's signature (``<sha256>.sig``), checked
        self.trust = trust

    def bundle_path(self, sha: str) -> Path:
        if not (len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
            raise KernelServiceError(f"not a sha256: {sha!r:.80}")
        return self.root / f"{sha}.json"

    def read(self, sha: str) -> dict | None:
        """The verified bundle stored under ``sha``, or None (a corrupt file is removed)."""
        try:
            path = self.bundle_path(sha)
        except KernelServiceError:
            return None
        try:
            if path.stat().st_size > MAX_BUNDLE_BYTES:
                raise BundleError("too large")
            bundle = json.loads(path.read_bytes())
            verify_bundle(bundle)
            if bundle["sha256"] != sha:
                raise BundleError("stored under another hash")
            if self.trust is not None:  # no signature kept, or not a trusted one: downloaded again
                self.trust.verify(sha, self._signature(path))
            return bundle
        except FileNotFoundError:
            return None
        except (OSError, ValueError, UnicodeDecodeError):  # BundleError is a ValueError
            path.unlink(missing_ok=True)
            return None

    @staticmethod
    def _signature(bundle_path: Path) -> str | None:
        try:
            return bundle_path.with_suffix(".sig").read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None

    def store_signature(self, sha: str, signature: str | None) -> None:
        """The server's signature of bundle ``sha`` (its ``Foldwise-Signature``), kept beside it."""
        if signature:
            self._write_atomic(self.bundle_path(sha).with_suffix(".sig"), signature.encode("ascii", "replace"))

    def v2_of(self, v1_sha: str) -> str | None:
        """The sha256 of the bundle with binaries (format 2 or 3) stored for a format-1 one, when
        it is on disk (linked from ``v2/<format-1 sha256>``, the folder's name since format 2)."""
        try:
            self.bundle_path(v1_sha)
            v2 = (self.root / "v2" / v1_sha).read_text().strip()
        except (OSError, KernelServiceError):
            return None
        return v2 if self.read(v2) is not None else None

    def _write_atomic(self, path: Path, data: bytes) -> bool:
        """``data`` at ``path``, whole or not at all. A full or read-only disk costs the cache, never
        the call: logged, the partial file removed, False (the kernel is served from memory)."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, path)
            return True
        except OSError as err:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            log.warning("the kernel cache on disk was not written (%s: %s); the kernel is served from memory",
                        path.name, err.strerror or err)
            return False

    def store(self, bundle: dict, key: str, entry: dict) -> None:
        """The bundle, and the index entry of the request ``key`` it answers."""
        self.store_bundle(bundle)
        entry = {**entry, "sha256": bundle["sha256"], "tuned_shape": bundle["shape"]}
        self._write_atomic(self.root / "index" / f"{key}.json", json.dumps(entry, sort_keys=True).encode())

    def store_bundle(self, bundle: dict) -> None:
        """The verified bundle on disk under its sha256 (a bundle with binaries linked from its
        format-1 hash), so a later download is a 304."""
        path = self.bundle_path(bundle["sha256"])
        if self.read(bundle["sha256"]) is None:
            self._write_atomic(path, canonical_bytes(bundle))
        if bundle["format"] != bundle_v1(bundle)["format"]:  # with binaries: link it from its format-1 hash
            self._write_atomic(self.root / "v2" / bundle_v1(bundle)["sha256"], bundle["sha256"].encode())

    def from_index(self, key: str, allow_nearest: bool) -> dict | None:
        """The bundle the index names for the request ``key`` (a nearest shape's only with
        ``allow_nearest``), verified; None when there is none."""
        try:
            entry = json.loads((self.root / "index" / f"{key}.json").read_bytes())
        except (OSError, ValueError):
            return None
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
            return None
        if not entry.get("exact", False) and not allow_nearest:
            return None
        return self.read(entry["sha256"])

    # A tuned range: the index above is per exact request, so a range is stored as its own entry
    # naming every bucket's bundle, and a restart without the server serves every shape of it.
    def _range_prefix(self, req: KernelRequest) -> str:
        return hashlib.sha256(json.dumps([req.shash, dtype_text(req.ndtype), req.target]).encode()).hexdigest()[:16]

    def store_range(self, req: KernelRequest, shape: Mapping[str, Any], buckets: list[tuple[Any, str]]) -> None:
        folder = self.root / "ranges"
        entry = {"spec_hash": req.shash, "dtype": req.ndtype, "target": req.target, "shape": dict(shape),
                 "buckets": [{"shape": b, "sha256": sha} for b, sha in buckets]}
        digest = hashlib.sha256(json.dumps(dict(shape), sort_keys=True).encode()).hexdigest()[:16]
        path = folder / f"{self._range_prefix(req)}-{digest}.json"
        self._write_atomic(path, json.dumps(entry, sort_keys=True).encode())

    def ranges_holding(self, req: KernelRequest) -> Iterator[tuple[dict, list[dict]]]:
        """(range shape, every bucket's verified bundle, in the entry's order) of each stored
        range of ``req``'s spec, dtype and target that holds its shape and whose bundles are all
        on disk; a damaged entry is skipped."""
        for path in sorted((self.root / "ranges").glob(f"{self._range_prefix(req)}-*.json")):
            try:
                entry = json.loads(path.read_bytes())
                if (entry["spec_hash"], entry["target"]) != (req.shash, req.target) or entry["dtype"] != req.ndtype:
                    continue
                if pick_bucket(entry["shape"], req.cshape) is None:
                    continue
                bundles = []
                for b in entry["buckets"]:
                    bundle = self.read(b["sha256"])
                    if bundle is None or bundle["shape"] != b["shape"]:
                        break
                    bundles.append(bundle)
                else:
                    yield entry["shape"], bundles
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
