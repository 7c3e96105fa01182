"""Signed bundles (issue 37, 4): a server with a signing key signs every served bundle's sha256
(``Foldwise-Signature``), and a client given trusted public keys loads only bundles one of them
signed, on download and from its disk cache (service/bundle/signing.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from tests.service.test_api import make_client, store_kernel
from tests.service.test_client import BASE, BUNDLE, SHAPE, SPEC, FakeServer, assert_runs

from service.bundle import BundleError
from service.bundle.signing import SIGNATURE_HEADER, Signer, TrustedKeys, new_private_key
from service.client import KernelCache, KernelIntegrityError


@pytest.fixture(scope="module")
def keys():
    pem, public = new_private_key()
    other_pem, other_public = new_private_key()
    return Signer.from_pem(pem), public, Signer.from_pem(other_pem), other_public


def test_a_signature_verifies_for_its_sha256_and_key_only(keys):
    signer, public, other, other_public = keys
    trust = TrustedKeys([public])
    sha = BUNDLE["sha256"]
    trust.verify(sha, signer.header(sha))
    changed = ("0" if sha[0] != "0" else "1") + sha[1:]
    for header, message in ((signer.header(changed), "does not verify for the bundle's sha256"),
                            (other.header(sha), f"by key {other.key_id}, which this client does not trust"),
                            (None, "signature: none"), ("ed25519 key=zz sig=abc", "signature: not 'ed25519")):
        with pytest.raises(BundleError, match=message):
            trust.verify(sha, header)
    TrustedKeys([public, other_public]).verify(sha, other.header(sha))  # any trusted key
    with pytest.raises(BundleError, match=r"^trusted_keys\[1\]: not the base64 of a 32-byte Ed25519 public key"):
        TrustedKeys([public, "bm90IGEga2V5"])
    with pytest.raises(ValueError, match="not an unencrypted PEM private key"):
        Signer.from_pem(b"-----BEGIN PRIVATE KEY-----\nnope\n-----END PRIVATE KEY-----\n")


class SigningServer(FakeServer):
    """The fake server, signing its bundle answers with ``signer`` (the real one's header)."""

    def __init__(self, signer, *bundles):
        super().__init__(*bundles)
        self.signer = signer

    def bundle(self, kid, request):
        answer = super().bundle(kid, request)
        etag = answer.headers["etag"].strip('"')
        return httpx.Response(answer.status_code, content=answer.content,
                              headers={**answer.headers, SIGNATURE_HEADER: self.signer.header(etag)})


def test_a_client_with_trusted_keys_runs_only_what_they_signed(keys, tmp_path):
    signer, public, other, _ = keys
    server = SigningServer(signer, BUNDLE)
    with KernelCache(BASE, cache_dir=tmp_path, transport=httpx.MockTransport(server), trusted_keys=[public]) as cache:
        assert_runs(cache.get(SPEC, SHAPE))
    assert (tmp_path / f"{BUNDLE['sha256']}.sig").exists()
    # from disk, offline: the kept signature is checked again
    server.offline = True
    with KernelCache(BASE, cache_dir=tmp_path, transport=httpx.MockTransport(server), trusted_keys=[public],
                     revalidate_after=None) as cache:
        assert_runs(cache.get(SPEC, SHAPE))
    # a server signing with another key: refused, nothing cached
    server = SigningServer(other, BUNDLE)
    with KernelCache(BASE, cache_dir=tmp_path / "b", transport=httpx.MockTransport(server),
                     trusted_keys=[public]) as cache:
        with pytest.raises(KernelIntegrityError, match="which this client does not trust"):
            cache.get(SPEC, SHAPE)
    assert not list((tmp_path / "b").glob("*.json"))
    # an unsigned server: refused where keys are trusted, served where none are (the sha256 is the check)
    unsigned = FakeServer(BUNDLE)
    with KernelCache(BASE, cache_dir=tmp_path / "c", transport=httpx.MockTransport(unsigned),
                     trusted_keys=[public]) as cache:
        with pytest.raises(KernelIntegrityError, match="signature: none"):
            cache.get(SPEC, SHAPE)
    with KernelCache(BASE, cache_dir=tmp_path / "c", transport=httpx.MockTransport(unsigned)) as cache:
        assert_runs(cache.get(SPEC, SHAPE))
    # that unsigned copy on disk is no trusted copy: with keys, it is downloaded again (and refused)
    with KernelCache(BASE, cache_dir=tmp_path / "c", transport=httpx.MockTransport(unsigned),
                     trusted_keys=[public]) as cache:
        with pytest.raises(KernelIntegrityError, match="signature: none"):
            cache.get(SPEC, SHAPE)


def test_the_server_signs_served_bundles_and_publishes_its_key(db_url, tmp_path, keys):
    key_file = tmp_path / "signing.pem"
    made = subprocess.run([sys.executable, "-m", "service.cli", "signing-key", "new", str(key_file)],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    public = made.stdout.strip()
    with make_client(db_url) as plain:
        assert plain.get("/v1/signing-key").status_code == 404
    from service.api import create_app
    from service.settings import get_settings
    from fastapi.testclient import TestClient

    settings = get_settings(db_url=db_url, signing_key_file=str(key_file))
    with TestClient(create_app(settings)) as http:
        kernel_id = store_kernel(http.app.state.ctx.sessions)
        info = http.get("/v1/signing-key").json()
        assert info["public_key"] == public and info["algorithm"] == "ed25519"
        for params in ({}, {"format": "2"}):
            r = http.get(f"/v1/kernels/{kernel_id}/bundle", params=params)
            sha = json.loads(r.content)["sha256"]
            assert r.headers["etag"] == f'"{sha}"'
            TrustedKeys([public]).verify(sha, r.headers[SIGNATURE_HEADER])
        again = http.get(f"/v1/kernels/{kernel_id}/bundle", params=params, headers={"If-None-Match": r.headers["etag"]})
        assert again.status_code == 304 and again.headers[SIGNATURE_HEADER] == r.headers[SIGNATURE_HEADER]
    with pytest.raises(ValueError, match="FOLDWISE_SIGNING_KEY_FILE: cannot read"):
        create_app(get_settings(db_url=db_url, signing_key_file=str(tmp_path / "missing.pem")))


def test_a_real_serve_signs_what_a_trusting_client_runs(tmp_path, monkeypatch):
    """`foldwise serve` itself (uvicorn, its event loop, the bundle fast path) with a signing key: a
    job tuned by its worker, downloaded by a client that trusts only the server's key."""
    import time

    from tests.e2e.test_serve_processes import start_serve

    key_file = tmp_path / "signing.pem"
    pem, public = new_private_key()
    key_file.write_bytes(pem)
    monkeypatch.setenv("FOLDWISE_SIGNING_KEY_FILE", str(key_file))
    server, base, _ = start_serve(tmp_path, 1)
    try:
        assert httpx.get(base + "/v1/signing-key", timeout=10).json()["public_key"] == public
        body = {"spec": "safe_softmax", "shape": {"m": 3, "n": 40}, "dtype": "float32", "target": "h100",
                "measurer": "model", "budget": {"trials": 2, "seconds": 300}}
        job = httpx.post(base + "/v1/jobs", json=body, timeout=60).json()
        deadline = time.monotonic() + 240
        while (view := httpx.get(f"{base}/v1/jobs/{job['id']}", timeout=10).json())["status"] in ("queued", "running"):
            assert time.monotonic() < deadline, view
            time.sleep(0.5)
        assert view["status"] == "succeeded", view
        with KernelCache(base, cache_dir=tmp_path / "client", trusted_keys=[public]) as cache:
            kernel = cache.get("safe_softmax", {"m": 3, "n": 40})
        assert list((tmp_path / "client").glob("*.sig"))  # its server's signature, kept beside it
        assert kernel.spec_hash == job["spec_hash"]
        _, other = new_private_key()
        with KernelCache(base, cache_dir=tmp_path / "other", trusted_keys=[other]) as cache:
            with pytest.raises(KernelIntegrityError, match="which this client does not trust"):
                cache.get("safe_softmax", {"m": 3, "n": 40})
    finally:
        server.terminate()
        server.wait(timeout=60)
