"""Bearer tokens: creation, revocation, verification, and who may do what.

**Tokens.** A secret is ``fw_`` + 43 URL-safe characters (256 random bits); the database keeps
only its sha256 (``ApiToken.token_hash``), so a leaked database leaks no usable token. A
presented token is looked up *by its hash* (an index lookup that reveals nothing about how
close a guess was), and the stored hash is compared again with :func:`hmac.compare_digest`.
``foldwise token create`` prints the secret once; it cannot be shown again.

**Scopes.** ``jobs:write`` (submit and cancel jobs), ``kernels:read`` (kernel lookups and
bundle downloads), ``admin`` (implies every scope).

**Policy** (docs/API.md says writes need a token; where it is silent, decided here):

- *open mode*: the server is bound to a loopback address **and** the database holds no token
  at all. Everything is open, so ``foldwise serve`` on a laptop just works.
- as soon as any token exists (even a revoked one: revoking the last token does not reopen
  the server), job submission/cancel needs ``jobs:write`` and kernel reads need
  ``kernels:read``;
- reads of job status (jobs, trials, specs, workers), ``POST /v1/derivations`` and
  ``POST /v1/backward`` (compute, store nothing) stay open on a loopback bind; on any other bind they need a valid token of
  any scope;
- ``/healthz``, ``/metrics``, ``/openapi.json``, the docs and the dashboard page are always open;
- a server bound to anything but loopback refuses to start without an active token
  (:func:`check_bind_allowed`, used by ``foldwise serve``);
- a token that is presented is always checked, even where none is needed: a wrong or revoked
  token is refused (401), never silently ignored.

401 means "who are you?" (missing, malformed, unknown or revoked token); 403 means "you may not"
(a valid token without the scope). Both answer ``WWW-Authenticate: Bearer ...`` (RFC 6750).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from service.store.models import SCOPES, ApiToken

TOKEN_PREFIX = "fw_"
MAX_TOKEN_CHARS = 256
MAX_NAME_CHARS = 200
LAST_USED_EVERY_S = 60.0  # last_used_at is a write: record it at most once a minute per token

__all__ = [
    "SCOPES", "AuthError", "AuthPolicy", "Principal", "check_bind_allowed", "create_token", "hash_token",
    "is_loopback", "list_tokens", "parse_scopes", "revoke_token",
]


class AuthError(Exception):
    """A refused request: ``status`` 401 (no valid credential) or 403 (lacks ``scope``)."""

    def __init__(self, status: int, message: str, *, scope: str | None = None):
        self.status, self.message, self.scope = status, message, scope
        super().__init__(message)

    @property
    def www_authenticate(self) -> str:
        if self.status == 403:
            return f'Bearer realm="foldwise", error="insufficient_scope", scope="{self.scope}"'
        return 'Bearer realm="foldwise"' + (', error="invalid_token"' if "token" in self.message else "")


@dataclass(frozen=True)
class Principal:
    """An authenticated token."""

    token_id: str
    name: str
    scopes: frozenset[str]

    def has(self, scope: str) -> bool:
        return "admin" in self.scopes or scope in self.scopes


def hash_token(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def parse_scopes(text: str | Iterable[str]) -> list[str]:
    """``"jobs:write,kernels:read"`` (commas or spaces) -> sorted distinct scopes; ValueError names a bad one."""
    items = text.replace(",", " ").split() if isinstance(text, str) else list(text)
    if not items:
        raise ValueError(f"no scopes given; choose from {', '.join(SCOPES)}")
    unknown = [s for s in items if s not in SCOPES]
    if unknown:
        raise ValueError(f"unknown scope {unknown[0]!r}; choose from {', '.join(SCOPES)}")
    return sorted(set(items))


def create_token(session: Session, name: str, scopes: str | Iterable[str]) -> tuple[ApiToken, str]:
    """Store a new token (its hash only) and return it with its secret, which is not kept."""
    name = name.strip()
    if not name or len(name) > MAX_NAME_CHARS:
        raise ValueError(f"name: must be 1 to {MAX_NAME_CHARS} characters")
    scope_list = parse_scopes(scopes)
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token = ApiToken(name=name, token_hash=hash_token(secret), scopes=" ".join(scope_list))
    session.add(token)
    session.commit()
    return token, secret


def revoke_token(session: Session, *, name: str | None = None, token_id: str | None = None) -> list[ApiToken]:
    """Revoke the active tokens with this name (or this id); returns those revoked (maybe none)."""
    if (name is None) == (token_id is None):
        raise ValueError("give exactly one of name or token_id")
    query = sa.select(ApiToken).where(ApiToken.revoked_at.is_(None))
    query = query.where(ApiToken.name == name) if name is not None else query.where(ApiToken.id == token_id)
    tokens = list(session.scalars(query))
    now = datetime.now(UTC)
    for token in tokens:
        token.revoked_at = now
    session.commit()
    return tokens


def list_tokens(session: Session) -> list[ApiToken]:
    return list(session.scalars(sa.select(ApiToken).order_by(ApiToken.created_at)))


def active_token_count(session: Session) -> int:
    return session.scalar(sa.select(sa.func.count()).select_from(ApiToken).where(ApiToken.revoked_at.is_(None))) or 0


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``; False for 0.0.0.0, :: and every other address."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost: it may resolve anywhere


def check_bind_allowed(session: Session, host: str) -> None:
    """Raise PermissionError when ``host`` is not loopback and the database has no active token."""
    if not is_loopback(host) and active_token_count(session) == 0:
        raise PermissionError(
            f"--host {host}: a server reachable from other machines needs API tokens, and this database has "
            "no active one; create one first with `foldwise token create --db URL --name NAME --scopes "
            "jobs:write,kernels:read`, or bind to 127.0.0.1")


_ANY_TOKEN = sa.select(ApiToken.id).limit(1)
_TOKEN_ROW = sa.select(ApiToken.id, ApiToken.name, ApiToken.token_hash, ApiToken.scopes, ApiToken.revoked_at) \
    .where(ApiToken.token_hash == sa.bindparam("digest"))


class TokenLookup:
    """The two reads auth needs, through a SQLAlchemy Session or Connection.

    service.api.fastpath gives a subclass that reads through the raw SQLite connection (the
    same statements, compiled once), for the bundle hot path."""

    def __init__(self, db: Any):
        self.db = db

    def any_token(self) -> bool:
        return self.db.execute(_ANY_TOKEN).first() is not None

    def token_row(self, digest: str) -> Any:
        """(id, name, token_hash, scopes, revoked_at) or None."""
        return self.db.execute(_TOKEN_ROW, {"digest": digest}).first()


def _lookup(db: Any) -> TokenLookup:
    return db if isinstance(db, TokenLookup) else TokenLookup(db)


class AuthPolicy:
    """Decides each request (see the module docstring). One per app; thread-safe.

    ``loopback``: the server's bind address is loopback. Once any token has been seen in the
    database the answer "tokens exist" is kept (tokens are revoked, never deleted), so open
    mode costs one cheap query per request only while it lasts. ``db`` arguments are a
    Session, a Connection or a :class:`TokenLookup`.
    """

    def __init__(self, *, loopback: bool, writer: Callable[[], Session] | None = None):
        self.loopback = loopback
        self.writer = writer  # sessions for the last_used_at bookkeeping (None: not recorded)
        self._tokens_exist = False
        self._last_used: dict[str, float] = {}
        self._lock = threading.Lock()

    def tokens_exist(self, db: Any) -> bool:
        if not self._tokens_exist:
            self._tokens_exist = _lookup(db).any_token()
        return self._tokens_exist

    def authenticate(self, db: Any, authorization: str | None) -> Principal | None:
        """The token's principal; None when no Authorization header was sent; AuthError(401) otherwise."""
        if authorization is None:
            return None
        scheme, _, secret = authorization.strip().partition(" ")
        secret = secret.strip()
        if scheme.lower() != "bearer" or not secret:
            raise AuthError(401, "the Authorization header must be 'Bearer <token>'")
        if len(secret) > MAX_TOKEN_CHARS or not secret.isascii():
            raise AuthError(401, "invalid token")
        digest = hash_token(secret)
        row = _lookup(db).token_row(digest)
        if row is None or not hmac.compare_digest(row[2], digest):
            raise AuthError(401, "invalid token")
        if row[4] is not None:
            raise AuthError(401, "this token was revoked")
        self._tokens_exist = True
        self._touch(row[0])
        return Principal(row[0], row[1], frozenset(row[3].split()))

    def _touch(self, token_id: str) -> None:
        """Record last_used_at, at most once a minute per token, off the request's path (a
        write on SQLite may wait for the lock; the request must not)."""
        if self.writer is None:
            return
        now = time.monotonic()
        with self._lock:
            if now - self._last_used.get(token_id, -1e9) < LAST_USED_EVERY_S:
                return
            self._last_used[token_id] = now
        threading.Thread(target=self._write_last_used, args=(token_id,), daemon=True).start()

    def _write_last_used(self, token_id: str) -> None:
        assert self.writer is not None
        try:
            with self.writer() as writer:
                writer.execute(sa.update(ApiToken).where(ApiToken.id == token_id)
                               .values(last_used_at=datetime.now(UTC)))
                writer.commit()
        except sa.exc.SQLAlchemyError:
            pass  # bookkeeping only

    def require(self, db: Any, authorization: str | None, scope: str | None) -> Principal | None:
        """Check one request. ``scope`` None: a status read (open on loopback, any valid token elsewhere)."""
        principal = self.authenticate(db, authorization)
        if principal is None:
            if self.loopback and (scope is None or not self.tokens_exist(db)):
                return None
            what = f"a token with the {scope} scope" if scope else "a token"
            raise AuthError(401, f"this request needs {what}: send 'Authorization: Bearer <token>'")
        if scope is not None and not principal.has(scope):
            raise AuthError(403, f"token {principal.name!r} lacks the {scope} scope", scope=scope)
        return principal
