"""Signed bundles: who served the code a client runs (docs/API.md, "Signed bundles").

A bundle's sha256 says it was not changed on the way; it does not say who made it. A server
with a signing key (``FOLDWISE_SIGNING_KEY_FILE``: an Ed25519 private key, PEM; ``foldwise
signing-key new``) signs the sha256 of every bundle it serves, in the response header
``Foldwise-Signature: ed25519 key=<key id> sig=<base64>``; the sha256 covers every field, the
generated source and each compiled binary included. A client given trusted public keys
(``KernelCache(trusted_keys=[...])`` or ``FOLDWISE_TRUSTED_KEYS``) runs only bundles signed by
one of them: it checks the header on download and keeps it beside the bundle on disk, checked
again on every later read (offline too). The signed message is ``foldwise-bundle-sha256:`` and
the hex digest, so a signature can be checked for no other purpose.

Ed25519 through ``cryptography`` (pyca; the ``signing`` extra): a well-kept implementation,
imported only where a key is used (a client without trusted keys never needs it).

Example:
    >>> pem, public = new_private_key()
    >>> signer = Signer.from_pem(pem)
    >>> trust = TrustedKeys([public])
    >>> trust.verify("ab" * 32, signer.header("ab" * 32))
    >>> trust.verify("cd" * 32, signer.header("ab" * 32))
    Traceback (most recent call last):
    ...
    service.bundle.hashing.BundleError: signature: does not verify for the bundle's sha256 cdcdcdcdcdcdcdcd... under key ...
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

from service.bundle.hashing import BundleError

SIGNATURE_HEADER = "Foldwise-Signature"
ALGORITHM = "ed25519"
_HEADER = re.compile(r"ed25519 key=([0-9a-f]{16}) sig=([A-Za-z0-9+/]{86}==)\Z")


def _crypto() -> tuple[Any, Any]:
    """``cryptography``'s Ed25519 and serialization modules; ImportError saying what to install
    (the ``signing`` extra: only a signing server and a client with trusted keys need it)."""
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise ImportError("signed bundles need the cryptography package: pip install 'foldwise[signing]' "
                          "(or cryptography>=42)") from None
    return ed25519, serialization


def message(sha256: str) -> bytes:
    """What is signed for a bundle of hex digest ``sha256``."""
    return b"foldwise-bundle-sha256:" + sha256.encode("ascii")


def key_id(public_raw: bytes) -> str:
    """A public key's short name: the first 16 hex digits of the sha256 of its 32 raw bytes."""
    return hashlib.sha256(public_raw).hexdigest()[:16]


def _raw_public(public: Any) -> bytes:
    _, serialization = _crypto()
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def new_private_key() -> tuple[bytes, str]:
    """(a new Ed25519 private key as PEM, its public key as base64 of the 32 raw bytes)."""
    ed25519, serialization = _crypto()
    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    return pem, base64.b64encode(_raw_public(key.public_key())).decode("ascii")


class Signer:
    """A server's signing key: :meth:`header` for a served bundle's sha256."""

    def __init__(self, private_key: Any):
        self._key = private_key
        raw = _raw_public(private_key.public_key())
        self.public_key = base64.b64encode(raw).decode("ascii")  # what clients trust
        self.key_id = key_id(raw)
        self.header = lru_cache(maxsize=4096)(self._header)  # a served bundle is signed once per process

    @classmethod
    def from_pem(cls, pem: bytes, where: str = "signing key") -> Signer:
        """ValueError naming ``where`` unless ``pem`` is an unencrypted Ed25519 private key."""
        ed25519, serialization = _crypto()
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{where}: not an unencrypted PEM private key ({err})") from None
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise ValueError(f"{where}: a {type(key).__name__}, not an Ed25519 key (foldwise signing-key new makes one)")
        return cls(key)

    def _header(self, sha256: str) -> str:
        signature = self._key.sign(message(sha256))
        return f"{ALGORITHM} key={self.key_id} sig={base64.b64encode(signature).decode('ascii')}"


class TrustedKeys:
    """The public keys a client accepts bundles from (base64 of 32 raw Ed25519 bytes, as
    ``foldwise signing-key new`` and ``GET /v1/signing-key`` print them)."""

    def __init__(self, keys: Iterable[str]):
        ed25519, _ = _crypto()
        self._keys: dict[str, Any] = {}
        for i, text in enumerate(keys):
            try:
                raw = base64.b64decode(str(text).strip(), validate=True)
                public = ed25519.Ed25519PublicKey.from_public_bytes(raw)
            except (binascii.Error, ValueError):
                raise BundleError(f"trusted_keys[{i}]: not the base64 of a 32-byte Ed25519 public key") from None
            self._keys[key_id(raw)] = public
        if not self._keys:
            raise BundleError("trusted_keys: empty; give at least one public key, or none at all to trust hashes only")

    @property
    def key_ids(self) -> tuple[str, ...]:
        return tuple(self._keys)

    def verify(self, sha256: str, header: str | None) -> None:
        """:class:`BundleError` naming ``signature`` unless ``header`` signs ``sha256`` with a trusted key."""
        from cryptography.exceptions import InvalidSignature

        if not header:
            raise BundleError(f"signature: none; this client runs only bundles signed by {', '.join(self._keys)}")
        m = _HEADER.match(header.strip())
        if m is None:
            raise BundleError(f"signature: not '{ALGORITHM} key=<16 hex> sig=<base64>': {header.strip()[:120]!r}")
        kid, sig = m.groups()
        public = self._keys.get(kid)
        if public is None:
            raise BundleError(f"signature: by key {kid}, which this client does not trust ({', '.join(self._keys)})")
        try:
            public.verify(base64.b64decode(sig), message(sha256))
        except InvalidSignature:
            raise BundleError(f"signature: does not verify for the bundle's sha256 {sha256[:16]}... under key "
                              f"{kid}") from None
